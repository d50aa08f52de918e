"""Isolation from the operating system: each student's worker in a bubblewrap sandbox of its own.

The audit hook of ``sandbox`` is a tripwire inside the student's process; what keeps one
submission away from another's files, grades and processes is this: where bubblewrap (``bwrap``,
Flatpak's sandbox, Debian/Ubuntu's ``bubblewrap`` package) runs, the grader starts a fresh worker
for each student inside ``bwrap`` with

- new PID, IPC, UTS, network and mount namespaces (and a user namespace where the grader is not
  root): no other process is visible, no network, nothing the grader did not put there;
- read-only: the system (``/usr``, ``/etc``), the Python installation and environment and the
  course (every folder on ``sys.path``), the corpora folder; masked (an empty folder in their place)
  wherever they lie inside those: the submissions, the report, the grader's working folder, home;
- its own scratch ``/tmp`` of ``SCRATCH_MB`` (a tmpfs: size-limited, gone when the sandbox ends),
  where the worker writes the student's files, received on stdin (no student's file is mounted);
- an unprivileged user: the worker drops to ``BASE_UID + slot`` itself first thing when the grader
  is root (one user per concurrent slot, so that each has its own process count), and caps the
  processes of that user (``RLIMIT_NPROC``, ``PROCESS_LIMIT``) before reading anything;
- ``--die-with-parent``, ``--new-session`` and the PID namespace: when the worker ends or is
  killed, or the grader dies, every process the student's code started is killed with it.

The worker sends grades on its stdout, a pipe that only this sandbox holds: a submission can at
worst forge its own grades (as it could without isolation), never another student's.

Where ``bwrap`` is missing or cannot create its namespaces (macOS, Windows, a container that
forbids them), grading runs with ``sandbox``'s protections only, and says so (:func:`status`).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["available", "status", "command", "SCRATCH_MB", "PROCESS_LIMIT", "BASE_UID", "NOT_ISOLATED"]

SCRATCH_MB = 512        # the sandbox's /tmp: the student's files, their scratch, each exercise's folder
PROCESS_LIMIT = 64      # processes and threads of the sandbox's user: the worker, a child, torch's threads
BASE_UID = 61000        # the sandbox's user when the grader is root: BASE_UID + slot
SANDBOX_DATA_DIR = "/course-data"   # where the corpora the grader found appear inside the sandbox
NOT_ISOLATED = ("not isolated: bubblewrap (bwrap) is not available here, so a hostile submission can read, "
                "and in part change, what the grader's user can reach (see INSTRUCTORS.md)")


def _system_binds() -> list[str]:
    args: list[str] = []
    for top in ("/usr", "/etc"):
        args += ["--ro-bind", top, top]
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


def _visible() -> list[str]:
    """The folders the worker needs, read-only: Python, the environment, the course, the corpora."""
    from ...course_files import PACKAGE_DIR
    # the package's parent: the checkout's root (pyproject.toml, notebooks/) or site-packages
    paths = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, str(PACKAGE_DIR.parent)}
    paths |= {entry for entry in sys.path if entry}
    from ...course_files import notebooks_dir
    paths.add(str(notebooks_dir()))
    found: set[str] = set()
    for path in filter(None, paths):
        for candidate in (os.path.abspath(path), os.path.realpath(path)):
            # a checkout or venv under /tmp is mounted inside the scratch /tmp; /tmp itself never is
            if os.path.isdir(candidate) and not candidate.startswith(("/usr", "/etc", "/proc", "/dev")) \
                    and candidate not in ("/", "/tmp"):
                found.add(candidate)
    # a folder inside another is mounted with it
    return sorted(p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found))


def _inside(path: str, folders: Iterable[str]) -> bool:
    return any(path == f or path.startswith(f + os.sep) for f in folders)


def command(argv: list[str], *, env: dict[str, str], masked: Iterable[str], scratch_mb: int = SCRATCH_MB
            ) -> list[str]:
    """The ``bwrap`` command line that runs ``argv`` isolated (see the module docstring); ``masked``:
    folders to hide (an empty folder in their place) where they lie inside what is mounted."""
    root = os.geteuid() == 0 if hasattr(os, "geteuid") else False
    # As root, no user namespace: the worker drops to an unprivileged user itself (CAP_SETUID, then
    # nothing), so that the kernel counts its processes. Otherwise a user namespace of its own.
    namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                  "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root \
        else ["--unshare-all"]
    args = ["bwrap", *namespaces, "--die-with-parent", "--new-session", *_system_binds(),
            "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(scratch_mb * 2 ** 20),
            "--tmpfs", "/tmp"]   # the scratch first: what is mounted below may lie inside /tmp
    visible = _visible()
    parents = sorted({str(parent) for path in visible for parent in Path(path).parents
                      if str(parent) not in ("/", "/tmp")},   # the scratch keeps its 1777
                     key=lambda p: p.count(os.sep))
    for parent in parents:   # traversable by the sandbox's user (bwrap makes them 0700 otherwise)
        args += ["--perms", "0755", "--dir", parent]
    for path in visible:
        args += ["--ro-bind", path, path]
    for path in sorted({os.path.realpath(p) for p in masked} | {os.path.expanduser("~")}):
        if _inside(path, visible) and os.path.isdir(path):
            args += ["--tmpfs", path]   # an empty folder where the submissions, the report ... were
    data = corpora_folder()
    if data is not None:   # at a path of its own: the per-user data folder lies inside the masked home
        args += ["--ro-bind", data, SANDBOX_DATA_DIR]
        env = {**env, "COURSE_DATA_DIR": SANDBOX_DATA_DIR}
    args += ["--chdir", "/tmp", "--clearenv"]
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    return args + ["--", *argv]


def corpora_folder() -> str | None:
    """The folder where the grader finds the corpora (COURSE_DATA_DIR, the per-user folder or the
    checkout's data/), so that 8.1's training finds them inside the sandbox too; None if none is here."""
    from ...corpora import CORPORA, locate_corpus
    found = [locate_corpus(name).path for name in CORPORA]
    folders = {os.path.realpath(path.parent) for path in found if path is not None}
    return sorted(folders)[0] if folders else None


@functools.lru_cache(maxsize=1)
def status() -> tuple[bool, str]:
    """Whether grading can be isolated here, and a line that says how (or why not)."""
    if not sys.platform.startswith("linux") or shutil.which("bwrap") is None:
        return False, NOT_ISOLATED
    drop = f"import os; os.setresgid(*[{BASE_UID}] * 3); os.setresuid(*[{BASE_UID}] * 3)"
    probe = command([sys.executable, "-c", drop if os.geteuid() == 0 else "pass"],
                    env={"PATH": "/usr/bin:/bin"}, masked=[])
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return False, f"{NOT_ISOLATED} (bwrap failed: {err})"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1][:200]
        return False, f"{NOT_ISOLATED} (bwrap cannot run here: {why})"
    return True, ("isolated: each student in a bubblewrap sandbox of their own (no network, no other process or "
                  f"submission visible, {SCRATCH_MB} MB scratch, {PROCESS_LIMIT} processes)")


def available() -> bool:
    """True where each student can be graded in a bubblewrap sandbox."""
    return status()[0]


def enter_worker(uid: int | None) -> None:
    """First thing in an isolated worker, before it reads anything: drop to ``uid`` (the grader is
    root), limit the processes of this user, close every inherited descriptor but the standard ones."""
    import resource
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)   # every capability goes with root
    resource.setrlimit(resource.RLIMIT_NPROC, (PROCESS_LIMIT, PROCESS_LIMIT))
    os.closerange(3, 1 << 16)
