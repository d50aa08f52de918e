"""Isolation from the operating system: each student's worker in a bubblewrap sandbox of its own.

The audit hook of ``sandbox`` is a tripwire inside the student's process; what keeps one
submission away from another's files, grades and processes is this: where bubblewrap (``bwrap``,
Flatpak's sandbox, Debian/Ubuntu's ``bubblewrap`` package) runs, the grader starts each worker
inside ``bwrap`` (it grades student after student there, each in a fresh child, the sandbox swept
between them: ``zygote``) with

- new PID, IPC, UTS, network and mount namespaces (and a user namespace where the grader is not
  root): no other process is visible, no network, nothing the grader did not put there;
- allow-lists, never the host's defaults: read-only, ``/usr``, four files of ``/etc`` (the loader's
  cache and configuration, the time zone), the Python installation, the environment (venv) and the
  course's package (not the checkout or the folder around it, not other ``sys.path`` entries), the
  course's notebooks with their solutions taken out (``stubs``), the corpora; a fresh ``/proc`` of the
  sandbox's PID namespace with the kernel's command line and symbol tables masked; an environment of
  a few variables (:func:`worker_environment`), given to ``bwrap`` as its own environment so that no
  value is ever on a command line (``ps`` shows command lines to every user);
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

__all__ = ["available", "status", "command", "worker_environment", "visible_folders", "SCRATCH_MB", "PROCESS_LIMIT", "BASE_UID", "NOT_ISOLATED"]

SCRATCH_MB = 512        # the sandbox's /tmp: the student's files, their scratch, each exercise's folder
PROCESS_LIMIT = 64      # processes and threads of the sandbox's user: the worker, a child, torch's threads
BASE_UID = 61000        # the sandbox's user when the grader is root: BASE_UID + slot
SANDBOX_DATA_DIR = "/course-data"   # where the corpora the grader found appear inside the sandbox
NOT_ISOLATED = ("not isolated: bubblewrap (bwrap) is not available here, so a hostile submission can read, "
                "and in part change, what the grader's user can reach (see INSTRUCTORS.md)")


# The few files of /etc that Python and torch read (the dynamic loader's cache, the time zone);
# nothing else of the host's /etc (users, hosts, the package manager's configuration) is there.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")
# What reads the host's kernel, or the other processes' view of it: an empty file in their place.
PROC_MASKED = ("cmdline", "config.gz", "kallsyms", "modules", "sched_debug", "timer_list")


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr", "--perms", "0755", "--dir", "/etc"]   # readable by the sandbox's user
    for name in ETC_FILES:
        if os.path.exists(os.path.join("/etc", name)):
            args += ["--ro-bind", os.path.realpath(os.path.join("/etc", name)), f"/etc/{name}"]
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


def _outside_system(path: str) -> bool:
    return os.path.isdir(path) and not path.startswith(("/usr/", "/etc", "/proc", "/dev")) \
        and path not in ("/", "/tmp", "/usr")


def visible_folders() -> list[str]:
    """The folders the worker needs, read-only: the Python installation, the environment (venv or
    conda) and the course's package. Not the folder the grader runs from, not the checkout around the
    package, not ``sys.path``'s other entries (a folder of the instructor's on PYTHONPATH)."""
    from ...course_files import PACKAGE_DIR
    found: set[str] = set()
    for path in {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, str(PACKAGE_DIR)}:
        for candidate in (os.path.abspath(path), os.path.realpath(path)):
            if _outside_system(candidate):
                found.add(candidate)
    # a folder inside another is mounted with it
    return sorted(p for p in found if not any(p != q and p.startswith(q + os.sep) for q in found))


def _inside(path: str, folders: Iterable[str]) -> bool:
    return any(path == f or path.startswith(f + os.sep) for f in folders)


def worker_environment(extra: dict[str, str]) -> dict[str, str]:
    """The whole environment of an isolated worker: an allow-list, never the grader's shell. It is
    handed to bubblewrap as its environment (which bwrap passes on), never on a command line."""
    from ...course_files import PACKAGE_DIR
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "PYTHONPATH": str(PACKAGE_DIR.parent), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if corpora_folder() is not None:
        env["COURSE_DATA_DIR"] = SANDBOX_DATA_DIR
    return {**env, **extra}


def command(argv: list[str], *, notebooks: str | None = None, scratch_mb: int = SCRATCH_MB) -> list[str]:
    """The ``bwrap`` command line that runs ``argv`` isolated (see the module docstring). It holds
    paths only: the environment is the process's own (:func:`worker_environment`). ``notebooks``:
    a folder of the course's notebooks with the solutions taken out (``stubs``), mounted where the
    package looks for its notebooks; None mounts none."""
    root = os.geteuid() == 0 if hasattr(os, "geteuid") else False
    # As root, no user namespace: the worker drops to an unprivileged user itself (CAP_SETUID, then
    # nothing), so that the kernel counts its processes. Otherwise a user namespace of its own.
    namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                  "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root \
        else ["--unshare-all"]
    args = ["bwrap", *namespaces, "--die-with-parent", "--new-session", *_system_binds(),
            "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(scratch_mb * 2 ** 20),
            "--tmpfs", "/tmp"]   # the scratch first: what is mounted below may lie inside /tmp
    for name in PROC_MASKED:
        if os.path.exists(f"/proc/{name}"):
            args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
    visible = visible_folders()
    parents = sorted({str(parent) for path in visible for parent in Path(path).parents
                      if str(parent) not in ("/", "/tmp")},   # the scratch keeps its 1777
                     key=lambda p: p.count(os.sep))
    for parent in parents:   # traversable by the sandbox's user (bwrap makes them 0700 otherwise)
        args += ["--perms", "0755", "--dir", parent]
    for path in visible:
        args += ["--ro-bind", path, path]
    if notebooks is not None:
        from ...course_files import CHECKOUT_DIR, PACKAGE_DIR, notebooks_dir
        where = notebooks_dir()
        if not _inside(str(where), visible):   # the checkout's notebooks/: a folder of its own there
            args += ["--perms", "0755", "--dir", str(where)]
            if (CHECKOUT_DIR / "pyproject.toml").is_file() and CHECKOUT_DIR != PACKAGE_DIR:
                args += ["--ro-bind", str(CHECKOUT_DIR / "pyproject.toml"), str(CHECKOUT_DIR / "pyproject.toml")]
        args += ["--ro-bind", notebooks, str(where)]
    data = corpora_folder()
    if data is not None:   # at a path of its own: the per-user data folder lies inside the masked home
        args += ["--ro-bind", data, SANDBOX_DATA_DIR]
    args += ["--chdir", "/tmp"]
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
    probe = command([sys.executable, "-c", drop if os.geteuid() == 0 else "pass"])
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60, env=worker_environment({}))
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


OWN_USER = [False]   # whether this worker runs as a user of the grader's own (BASE_UID + slot)


def enter_worker(uid: int | None) -> None:
    """First thing in an isolated worker, before it reads anything: drop to ``uid`` (the grader is
    root), limit the processes of this user, close every inherited descriptor but the standard ones."""
    import resource

    from . import keyrings
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)   # every capability goes with root
        OWN_USER[0] = True
        keyrings.clear_user_keyrings()   # this user's: what an earlier run left there
    keyrings.own_session_keyring()   # not the instructor's
    resource.setrlimit(resource.RLIMIT_NPROC, (PROCESS_LIMIT, PROCESS_LIMIT))
    os.closerange(3, 1 << 16)
