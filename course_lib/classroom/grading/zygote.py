"""One sandbox, many students in turn: what the worker that forks them does before and between them.

An isolated worker imports torch and the course once, then forks a fresh child per student (the
zygote pattern): the child reads that student's job from stdin, grades it and exits. The worker
itself never reads a job or runs student code. Since the sandbox outlives one student, two things
must hold that a sandbox per student gave for free:

- nothing of one student reaches the next: before the grader may send the next job (``idle``), every
  process left in the sandbox but the worker is killed (the sandbox has a PID namespace of its own, so
  ``kill(-1)`` reaches exactly the students' processes, and none can fork while it runs) and every
  folder a student can write in the sandbox is brought back to what it held before the first student:
  the scratch ``/tmp`` (the student's folder, and anything planted there for the next one) and ``/dev``
  with ``/dev/shm`` (bubblewrap's own tmpfs, which a grader that is not root leaves writable), and every
  SysV shared-memory segment, message queue and semaphore set is removed;
- nothing a student did to the worker itself lasts: its resource limits, priority, scheduler, CPUs and OOM
  score (which every later student's process inherits, and which any process of the sandbox's user may
  lower) are compared after each student with what they were before the first; a change ends the sandbox;
- nothing of the worker is readable by a student: it is not dumpable (no ``/proc/PID/mem``, ``fd``,
  ``environ``, no ptrace, for any process of the sandbox's user), and no folder a student can write is
  on ``sys.path``.

:func:`alone_in_sandbox` decides whether the sweep may run at all: only in a fresh PID namespace that
holds nothing but bubblewrap's init and this process. Anywhere else the worker grades one student and
exits, as a sandbox per student did.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
import time

from . import isolation, keyrings, syscalls

__all__ = ["seal", "alone_in_sandbox", "sweep", "SWEEP_SECONDS"]

SWEEP_SECONDS = 10.0   # to end every process a student left, and empty the scratch; else the sandbox goes

_SKELETON: dict[str, set[str]] = {}   # per writable folder: what it held before the first student
_OWN_STATE: list[dict[str, object]] = []   # the worker's limits, priority, CPUs, OOM score before the first student
DEV = "/dev"   # a tmpfs of bubblewrap's: owned by the grader's own user where that is not root
SHM = "/dev/shm"


def seal() -> None:
    """Before any student: this process is not dumpable (inherited by every child it forks), and the
    working folder is off ``sys.path`` (``python -m`` put it first; isolated it is the scratch ``/tmp``,
    where a module one student planted would be imported by the next)."""
    syscalls.not_dumpable()
    here = os.path.realpath(os.getcwd())
    sys.path[:] = [entry for entry in sys.path if entry and os.path.realpath(entry) != here]


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def alone_in_sandbox() -> bool:
    """True when this process is alone in a fresh PID namespace (bubblewrap's init is 1, we are 2 or 3):
    only there does ``kill(-1)`` reach nothing but what the students started. Records the scratch's
    skeleton (see :func:`sweep`)."""
    try:
        alone = sys.platform.startswith("linux") and os.getpid() <= 3 and _pids() == {1, os.getpid()}
    except OSError:
        return False
    if alone:
        _OWN_STATE[:] = [_own_state()]
        scratch = tempfile.gettempdir()
        _SKELETON[scratch] = _skeleton(scratch)
        _SKELETON[DEV] = _skeleton(DEV) | _present(DEV)
        _SKELETON[SHM] = set()   # a mount of its own below /dev, which the walk of /dev leaves alone
    return alone


def _own_state() -> dict[str, object]:
    """What this process passes on to every process it forks and a process of the same user can lower from
    outside (prlimit, setpriority, sched_setaffinity, oom_score_adj)."""
    import resource
    state: dict[str, object] = {name: resource.getrlimit(getattr(resource, name))
                                for name in dir(resource) if name.startswith("RLIMIT_")}
    state["priority"] = os.getpriority(os.PRIO_PROCESS, 0)
    if hasattr(os, "sched_getaffinity"):
        state["cpus"] = os.sched_getaffinity(0)
        state["scheduler"] = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority   # SCHED_IDLE starves it
    try:
        with open("/proc/self/oom_score_adj", encoding="ascii") as score:
            state["oom_score_adj"] = score.read().strip()
    except OSError:
        pass
    return state


def _present(root: str) -> set[str]:
    """Every path below ``root`` now (device nodes, ``shm``, the ``fd`` link), not walking into mounts."""
    found, mounts = set(), _mount_points()
    for top, folders, files in os.walk(root):
        found.update(os.path.join(top, name) for name in folders + files)
        folders[:] = [name for name in folders if os.path.join(top, name) not in mounts]
    return found


def _mount_points() -> set[str]:
    """Every mount point of this process's mount namespace (``/proc/self/mountinfo``), files included."""
    points = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split()
            if len(fields) > 4:   # octal escapes: a space is \040
                points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def _skeleton(scratch: str) -> set[str]:
    """What the scratch holds that is not a student's: the mounts bubblewrap made inside it (a venv, the
    course or its notebooks under /tmp; folders and files) and the folders that lead to them."""
    kept = {path for path in _mount_points() if path.startswith(scratch + os.sep)}
    for path in list(kept):
        while (path := os.path.dirname(path)).startswith(scratch + os.sep):
            kept.add(path)
    return kept


def sweep() -> bool:
    """Between two students: kill every process in the sandbox but this one (the kernel spares the
    sandbox's init), reap them, and bring every folder a student can write (the scratch, ``/dev``) back
    to what it held before the first student. True when that is done; False
    (the worker then exits, and the sandbox with it) when a process or a file could not be removed."""
    me = os.getpid()
    deadline = time.monotonic() + SWEEP_SECONDS
    while True:
        try:
            os.kill(-1, signal.SIGKILL)   # every process of ours in this PID namespace, not us
        except ProcessLookupError:
            pass
        while True:   # reap what was re-parented to us (a subreaper)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        try:
            if not _pids() - {1, me}:
                break
        except OSError:
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    if _OWN_STATE and _own_state() != _OWN_STATE[0]:   # lowered from outside: every later student would inherit it
        return False
    if isolation.OWN_USER[0]:   # a key one student left in the user's keyrings must not reach the next
        keyrings.clear_user_keyrings()
    mounts = _mount_points()
    return _remove_ipc() and all(_restore(root, kept, mounts) for root, kept in _SKELETON.items()
                                 if os.path.isdir(root))


# SysV shared memory, message queues and semaphores outlive the process that made them (a segment holds its
# memory, past --memory-mb, until it is removed): the sandbox's IPC namespace of its own holds only students'
_IPC_TABLES = (("shm", "shmctl"), ("msg", "msgctl"), ("sem", "semctl"))
_IPC_RMID = 0


def _ipc_ids(kind: str) -> list[int]:
    """The ids of the SysV objects of one kind in this IPC namespace (/proc/sysvipc), none where it is absent."""
    try:
        with open(f"/proc/sysvipc/{kind}", encoding="ascii") as table:
            rows = table.read().splitlines()[1:]
    except OSError:
        return []
    return [int(row.split()[1]) for row in rows if len(row.split()) > 1]


def _remove_ipc() -> bool:
    """Remove every SysV object a student made; True when none is left."""
    if not any(_ipc_ids(kind) for kind, _ in _IPC_TABLES):
        return True
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
    except Exception:  # no libc to call: the worker exits and its sandbox with it
        return False
    for kind, call in _IPC_TABLES:
        for ident in _ipc_ids(kind):
            if kind == "sem":
                libc.semctl(ident, 0, _IPC_RMID)
            else:
                getattr(libc, call)(ident, _IPC_RMID, None)
    return not any(_ipc_ids(kind) for kind, _ in _IPC_TABLES)


def _restore(root: str, kept: set[str], mounts: set[str]) -> bool:
    """Remove everything below ``root`` that is not in ``kept``; True when only ``kept`` is left."""
    for top, folders, files in os.walk(root):
        for name in list(folders):
            path = os.path.join(top, name)
            if path in kept:   # a folder leading to a mount: walk it; a mount: leave it alone
                if path in mounts:
                    folders.remove(name)
                continue
            folders.remove(name)
            if os.path.islink(path):
                files.append(name)
            else:
                _remove_tree(path)
        for name in files:
            if os.path.join(top, name) in kept:
                continue
            try:
                os.unlink(os.path.join(top, name))
            except FileNotFoundError:
                pass
            except OSError:
                return False
    return _only_skeleton_left(root, kept, mounts)


def _only_skeleton_left(scratch: str, kept: set[str], mounts: set[str]) -> bool:
    for top, folders, files in os.walk(scratch):
        if any(os.path.join(top, name) not in kept for name in folders + files):
            return False
        folders[:] = [name for name in folders if os.path.join(top, name) not in mounts]
    return True


def _remove_tree(path: str) -> None:
    """Remove a folder a student left, one they made unreadable included (their own: they may)."""
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    for top, folders, _ in os.walk(path):   # top-down: each folder is opened up before it is walked
        for name in folders:
            try:
                os.chmod(os.path.join(top, name), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    shutil.rmtree(path, ignore_errors=True)
