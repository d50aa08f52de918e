"""What the process that runs a student's code may do: limits, and a policy on what it touches.

:func:`enter` is called in a fresh child process (forked by the worker for one exercise) before
any of the student's code runs. It

- puts the child in its own process group, so the worker can kill it and anything it started;
- sets resource limits (Linux, macOS): address space (``memory_mb`` above what the child already
  maps: torch and the course, about 0.8 GB), CPU seconds (a backstop behind the worker's
  wall-clock limit), 64 MiB per written file, 1024 open descriptors (epoll's watches are kernel
  memory), no core dumps;
- points stdin, stdout and stderr at /dev/null and closes the worker's channel to the grader, so
  nothing the student prints or writes there can reach the grader;
- installs a Python audit hook (``sys.addaudithook``, which cannot be removed) that refuses, with
  a PermissionError the checker reports like any error of the student's code: writing outside the
  student's own working folder; reading or listing the other students' submissions, the report
  folder, the grader's working folders (other students' copies) and other processes' ``/proc``
  entries; starting processes (fork, exec, subprocess, os.system); signalling any process but
  itself; opening sockets to anything; loading or calling C functions through ctypes (or importing
  cffi, which calls them with no audit event); and raising its own resource limits;
- below Python, has the kernel refuse the calls that reach past those limits (``syscalls``: memory files,
  shared memory, sockets, new processes, keyrings, other processes' memory, namespaces, mounts, modules) for
  this process and the threads it starts.

An audit hook is a tripwire, not a wall: code determined to escape its own process (say, by
corrupting the interpreter's memory) can. What keeps the grades safe even then is the design
around it: the grader never imports student code, reads every submission into memory before
any student code runs, takes results only from the pipes of the processes it started, and
writes the report itself at the end (see ``course_lib.classroom.grading``).
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any

from . import keyrings, syscalls

__all__ = ["enter", "enter_inline", "install_policy", "bound_worker", "bound_memory", "SandboxRefused", "WORKER_MB"]

FILE_SIZE_LIMIT = 64 * 2 ** 20   # bytes per file the student's code writes
OPEN_FILES_LIMIT = 1024          # descriptors open at once in an exercise's process (so ~262k epoll watches)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_SPAWN_EVENTS = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                 "subprocess.Popen", "os.startfile", "pty.spawn")
_REFUSED_EVENTS = {
    **{event: "starting another process" for event in _SPAWN_EVENTS},
    "socket.connect": "network connections", "socket.bind": "network connections",
    "socket.sendto": "network connections", "socket.sendmsg": "network connections",
    "ctypes.dlopen": "loading C libraries through ctypes", "ctypes.dlsym": "C functions through ctypes",
    "ctypes.dlsym/handle": "C functions through ctypes", "ctypes.call_function": "C functions through ctypes",
    "resource.setrlimit": "changing the resource limits", "resource.prlimit": "changing the resource limits",
    # a trace function runs the student's code between the checker's return and the grader's record of it; an
    # audit hook at every audited event, and none can be removed (Python drops the new hook when this refuses)
    "sys.settrace": "trace functions (sys.settrace)", "sys.addaudithook": "audit hooks (sys.addaudithook)",
}
# Ways to a frame or to every object in memory. From there a submission reaches the grader's own state (the
# verdicts, the pipe and its token) through f_back and f_locals, which no event audits: refused when the student's
# code asks, or asks through a library that hands frames back (inspect.currentframe, inspect.stack).
_INTROSPECTION_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
                                   "gc.get_referents"})
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_FRAME_HANDING_MODULES = ("inspect.py", "traceback.py")
# Events whose first argument (or first two) is a path that is changed.
_WRITE_PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
                      "os.utime": 1, "os.truncate": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1,
                      "os.removexattr": 1, "shutil.rmtree": 1, "shutil.chown": 1, "os.rename": 2,
                      "os.link": 2, "shutil.copyfile": 2, "shutil.copymode": 2, "shutil.copystat": 2,
                      "shutil.copytree": 2, "shutil.move": 2}


class SandboxRefused(PermissionError):
    """What the student's code tried and the grader's sandbox does not allow."""


def _limit(resource_module: Any, which: str, soft: int, hard: int | None = None) -> None:
    kind = getattr(resource_module, which, None)
    if kind is None:
        return
    try:
        resource_module.setrlimit(kind, (soft, soft if hard is None else hard))
    except (ValueError, OSError):
        pass   # a platform that does not enforce this limit (macOS and RLIMIT_AS): the wall clock still does


def _mapped_bytes() -> int:
    """The address space this process maps now (Linux); 0 where /proc is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _bound(resource: Any, memory_mb: int | None, cpu_seconds: float | None, cpu_grace: int) -> None:
    """Address space: what this process maps now plus ``memory_mb``; CPU: ``cpu_seconds`` + 2 s, then
    SIGKILL ``cpu_grace`` seconds later (the hard limit)."""
    if memory_mb:
        mapped = _mapped_bytes()
        if mapped:
            _limit(resource, "RLIMIT_AS", mapped + memory_mb * 2 ** 20)
    if cpu_seconds:
        soft = int(cpu_seconds) + 2
        _limit(resource, "RLIMIT_CPU", soft, soft + cpu_grace)


def _set_limits(memory_mb: int | None, cpu_seconds: float | None) -> None:
    try:
        import resource
    except ImportError:   # Windows: no resource limits (the grader still kills on its wall clock)
        return
    _bound(resource, memory_mb, cpu_seconds, 3)
    _limit(resource, "RLIMIT_FSIZE", FILE_SIZE_LIMIT)
    _limit(resource, "RLIMIT_CORE", 0)
    # each descriptor can watch and be watched in epoll instances, whose watches are kernel memory past the
    # address-space limit (5.5 million, 1.1 GB, with 8000); with OPEN_FILES_LIMIT, at most (limit / 2) ** 2
    _limit(resource, "RLIMIT_NOFILE", OPEN_FILES_LIMIT)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a too-large write fails (OSError), not kills


WORKER_MB = 256    # a worker's address space beyond the exercise's memory: parsing and writing the student's files


def bound_worker(memory_mb: int | None, cpu_seconds: float) -> None:
    """Bound the worker grading one student, and so every process it forks (limits are inherited and
    can only be lowered): its address space (what it maps now, plus ``memory_mb`` and ``WORKER_MB``;
    a notebook built to inflate when parsed fails with MemoryError, that student's verdict) and its
    own CPU seconds."""
    try:
        import resource
    except ImportError:
        return
    _bound(resource, memory_mb and memory_mb + WORKER_MB, cpu_seconds, 5)


def _quiet_standard_streams(close: Iterable[int]) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    for fd in close:
        try:
            os.close(fd)
        except OSError:
            pass


def install_policy(home: str, deny: Iterable[str]) -> Callable[[str, tuple], None]:
    """Install (for good) the audit hook that keeps this process's reads and writes to ``home``
    and away from ``deny``; returns the hook (for tests)."""
    home_dir = os.path.realpath(home)
    denied = tuple(os.path.realpath(os.fspath(path)) for path in deny)
    # the policy as immutable values the hook closes over: a submission that empties the module's tables
    # (_REFUSED_EVENTS.clear()) changes nothing here
    refused_events = frozenset(_REFUSED_EVENTS)
    refused_words = tuple(_REFUSED_EVENTS.items())
    write_path_events, write_path_counts = frozenset(_WRITE_PATH_EVENTS), tuple(_WRITE_PATH_EVENTS.items())
    write_flags = _WRITE_FLAGS
    writable = (home_dir,)
    own_pid = os.getpid()
    own_group = os.getpgid(0) if hasattr(os, "getpgid") else own_pid
    proc = os.path.realpath("/proc") + os.sep if os.path.isdir("/proc") else None
    own_proc = (f"{proc}{own_pid}", f"{proc}self", f"{proc}thread-self") if proc else ()
    # the modules whose unaudited functions _close_unaudited_ways replaces: imported afresh they are whole again
    closed_modules = frozenset(module for module, _, _ in _UNAUDITED_WAYS) - {"os", "signal"}   # pure Python

    from ..checks._student_files import is_student_file
    getframe, student_files, asking = sys._getframe, {}, [False]

    def students(filename: str) -> bool:
        known = student_files.get(filename)
        if known is None:
            known = student_files[filename] = is_student_file(filename)
        return known

    def introspected_by_student() -> bool:
        """Whether the code that raised this event is the student's, or a frame-handing library they called."""
        if asking[0]:   # the getframe below raises this event too
            return False
        asking[0] = True
        try:
            caller = getframe(2)   # 0: this function, 1: the hook, 2: the code that asked
        finally:
            asking[0] = False
        # past inspect's and traceback's own frames, to the code that called them: the student's, or a library's
        # (torch's lazy CUDA set-up formats the stack; the course's checks read tracebacks)
        while caller is not None and caller.f_code.co_filename.endswith(_FRAME_HANDING_MODULES):
            caller = caller.f_back
        return caller is not None and students(caller.f_code.co_filename)

    def inside(path: str, roots: tuple[str, ...]) -> bool:
        return any(path == root or path.startswith(root + os.sep) for root in roots)

    def resolve(path: Any) -> str | None:
        if path is None or isinstance(path, int):
            return None   # an already open file descriptor was allowed when it was opened
        try:
            return os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None

    def refuse(what: str) -> None:
        raise SandboxRefused(f"the grader's sandbox does not allow {what}")

    def check_read(path: Any) -> None:
        real = resolve(path)
        if real is None or inside(real, writable):
            return
        if inside(real, denied):
            refuse(f"reading {os.fsdecode(path)!s}: other submissions and the grader's files are off limits")
        if proc and real.startswith(proc) and real[len(proc):].split(os.sep)[0].isdigit() \
                and not inside(real, own_proc):
            refuse(f"reading {real}: other processes are off limits")

    def check_write(path: Any) -> None:
        real = resolve(path)
        if real is None or real == os.devnull or inside(real, writable):
            return
        refuse(f"writing {os.fsdecode(path)!s}: only the submission's own working folder is writable")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and bool(flags & write_flags))
            check_write(path) if writes else check_read(path)
        elif event in ("os.listdir", "os.scandir", "os.chdir"):
            check_read(args[0] if args else None)
            if event == "os.chdir":
                real = resolve(args[0] if args else None)
                if real is not None and not inside(real, writable):
                    refuse("leaving the submission's working folder (os.chdir)")
        elif event in write_path_events:
            for path in args[:next(count for name, count in write_path_counts if name == event)]:
                check_write(path)
        elif event == "os.symlink":
            check_write(args[1])
        elif event in ("os.kill", "os.killpg"):
            target = args[0]
            if event == "os.kill" and target not in (own_pid, 0, -own_group):
                refuse(f"signalling process {target}: a submission may only signal itself")
            if event == "os.killpg" and target not in (own_group, 0):
                refuse(f"signalling process group {target}: a submission may only signal itself")
        elif event in refused_events:
            refuse(next(words for name, words in refused_words if name == event))
        elif (event in _INTROSPECTION_EVENTS or (event == "object.__getattr__" and len(args) > 1
                                                 and args[1] in _FRAME_ATTRIBUTES)) and introspected_by_student():
            refuse("frames or the objects in memory (sys._getframe, inspect.currentframe, a traceback's tb_frame, "
                   "gc.get_objects): they lead to the grader's own records")
        elif event == "import" and args and args[0] in closed_modules:
            refuse(f"importing {args[0]} again (its functions go past this sandbox's audit)")
        elif event == "import" and args and args[0].partition(".")[0] in _UNAUDITED_PACKAGES:
            refuse(f"importing {args[0]} (it calls C functions past this sandbox's audit)")

    sys.addaudithook(hook)
    return hook


def _work_in(home: str) -> None:
    os.chdir(home)
    tmp = os.path.join(home, ".tmp")
    os.makedirs(tmp, exist_ok=True)
    os.environ["TMPDIR"] = tmp
    import tempfile
    tempfile.tempdir = tmp


def bound_memory(memory_mb: int) -> None:
    """Only the memory limit a student's check runs under (the self-check holds the course's solutions to it)."""
    try:
        import resource
    except ImportError:
        return
    _bound(resource, memory_mb, None, 0)


def enter_inline(home: str, deny: Iterable[str], *, memory_mb: int | None) -> None:
    """The sandbox where a worker grades one student in its own process (no fork: Windows, ``--inline``):
    the folder and the policy, the memory limit where the platform has one; the streams stay."""
    _work_in(home)
    _set_limits(memory_mb, None)
    syscalls.refuse_escapes()
    install_policy(home, deny)
    _close_compilation()


def enter(home: str, deny: Iterable[str], *, memory_mb: int | None, cpu_seconds: float | None,
          close: Iterable[int] = ()) -> None:
    """Turn this (freshly forked) process into the sandbox for one student's exercise.

    ``home``: the student's working folder (made the current folder, the only writable one);
    ``deny``: folders it may not read; ``close``: descriptors of the worker's to close.
    """
    if hasattr(os, "setpgid"):
        try:
            os.setpgid(0, 0)
        except OSError:
            pass   # already a group leader
    keyrings.own_session_keyring()   # the grader's session keyring (the instructor's keys) is not the student's
    _work_in(home)
    _set_limits(memory_mb, cpu_seconds)
    _quiet_standard_streams(close)
    syscalls.refuse_escapes()   # before the policy, which refuses ctypes: the kernel's own wall behind it
    install_policy(home, deny)
    _close_unaudited_ways()
    _close_compilation()


# Ways out that raise no audit event: starting a program through the C helper subprocess uses (and
# multiprocessing's spawnv_passfds), and memory outside the address-space limit (memfd, POSIX shared memory).
_UNAUDITED_PROCESSES = (("_posixsubprocess", "fork_exec", "starting another process"),
                        ("subprocess", "_fork_exec", "starting another process"))
_UNAUDITED_MEMORY = (("os", "memfd_create", "memory files (memfd_create)"),
                     ("posix", "memfd_create", "memory files (memfd_create)"),   # os's own, under its C name
                     ("_posixshmem", "shm_open", "POSIX shared memory"))
# and signals through a process descriptor, which the audit hook's os.kill rule never sees
_UNAUDITED_SIGNALS = (("os", "pidfd_open", "signalling other processes (pidfd_open)"),
                      ("posix", "pidfd_open", "signalling other processes (pidfd_open)"),
                      ("signal", "pidfd_send_signal", "signalling other processes (pidfd_send_signal)"),
                      ("_signal", "pidfd_send_signal", "signalling other processes (pidfd_send_signal)"))
_UNAUDITED_WAYS = _UNAUDITED_PROCESSES + _UNAUDITED_MEMORY + _UNAUDITED_SIGNALS
# Packages that call C functions with no audit event at all, as ctypes does with one (the kernel calls that
# matter are refused underneath by ``syscalls`` anyway)
_UNAUDITED_PACKAGES = frozenset({"cffi", "_cffi_backend"})


def _close_unaudited_ways() -> None:
    """Replace each of ``_UNAUDITED_WAYS`` (processes, memory, signals) in this process with a refusal
    (importing their modules afresh is refused by the policy; a submission would have to dig the original out
    of the garbage collector: the deliberate effort the policy does not claim to stop). Inside bubblewrap too:
    a process started past the audit hook runs free of the policy while it lives, and can change the limits,
    the priority or the CPUs of the sandbox's other processes (the zygote every later student is forked from)."""
    import importlib
    for module_name, name, what in _UNAUDITED_WAYS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:   # a platform without it
            continue
        if hasattr(module, name):
            def refused(*_: Any, what: str = what, **__: Any) -> None:
                raise SandboxRefused(f"the grader's sandbox does not allow {what}")
            setattr(module, name, refused)


_NO_COMPILE = ("torch.compile: the code it compiles runs past the checks' guard on the course's own functions, so "
               "torch.compile is not available while grading (call your function directly)")


def _close_compilation() -> None:
    """Refuse torch.compile in this process. Dynamo runs rewritten bytecode that fires no call event, so the course's
    reference compiled passed the reference guard. Importing torch._dynamo cannot be refused (torch's optimizers
    import it to run without it), nor torch.compile replaced (the checks take a replaced torch function for the
    student's patch): what is refused, beneath every entry of dynamo's (torch.compile, torch._dynamo.optimize, a
    decorator), is installing a frame-evaluation callback (``set_eval_frame``) when a compiled function is called;
    clearing it (None: what torch's own "run without dynamo" wrappers do) still works."""
    torch = sys.modules.get("torch")
    frames = sys.modules.get("torch._C._dynamo.eval_frame")
    if torch is None:
        return
    if frames is None:
        try:
            import torch._C._dynamo.eval_frame as frames  # noqa: PLC0415
        except ImportError:   # a torch without dynamo: nothing to compile with
            return
    original = frames.set_eval_frame

    def set_eval_frame(callback: Any, *args: Any, **kwargs: Any) -> Any:
        if callback is not None:
            raise SandboxRefused(f"the grader's sandbox does not allow {_NO_COMPILE}")
        return original(callback, *args, **kwargs)

    frames.set_eval_frame = set_eval_frame
    python_side = sys.modules.get("torch._dynamo.eval_frame")   # already imported: it holds the original by name
    if python_side is not None:
        for name in ("set_eval_frame", "_maybe_set_eval_frame"):
            if getattr(python_side, name, None) is original:
                setattr(python_side, name, set_eval_frame)
