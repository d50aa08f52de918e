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
import stat
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable
from itertools import islice
from types import ModuleType
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
    # memory read or written at an address (from_address, from_buffer, string_at): frames and anything else
    "ctypes.cdata": "memory at an address through ctypes", "ctypes.cdata/buffer": "memory through ctypes",
    "ctypes.string_at": "memory at an address through ctypes", "ctypes.wstring_at": "memory at an address through ctypes",
    "resource.setrlimit": "changing the resource limits", "resource.prlimit": "changing the resource limits",
    # a trace function runs the student's code between the checker's return and the grader's record of it; an
    # audit hook at every audited event, and none can be removed (Python drops the new hook when this refuses)
    "sys.settrace": "trace functions (sys.settrace)", "sys.addaudithook": "audit hooks (sys.addaudithook)",
}
# Ways to a frame or to every object in memory. From there a submission reaches the grader's own state (the
# pipe and its token) through f_back and f_locals, which no event audits. Every thread's frames and the objects
# in memory are never the grader's need: refused outright. A frame (sys._getframe) is refused to the student's
# code, asked itself or through a function whose job is to hand frames or their locals back (``_FRAME_HANDERS``,
# walked past to whoever called them), and to a call composed in C (a finalizer, a map), which no Python code
# asked for; a library reading a frame for its own use (typing's module lookups, logging's caller) is let be.
# Frame attributes (a traceback's tb_frame, a generator's gi_frame), which any getattr reads, are refused while
# the student's code runs to all but a few readers that hand back neither frames nor locals (``_FRAME_READERS``).
_INTROSPECTION_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
                                   "gc.get_referents"})
_FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
# A function's defaults are read through an audited attribute (its closure is not): the grader's guards keep the
# originals they stand for there, and the course's functions their own references. No one but the course reads them
# while the student's code runs, and no one changes a course function's code or defaults then.
_HIDDEN_ATTRIBUTES = frozenset({"__defaults__", "__kwdefaults__"})
_MODULE_DICT = ModuleType.__dict__["__dict__"]
_CODE_ATTRIBUTES = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
_EVERYTHING_EVENTS = frozenset({"sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
# (the end of a file's path, its functions), looked up by name, so that a module imported afresh is read the same
_FRAME_HANDERS = (
    (os.path.join("", "inspect.py"), frozenset({"currentframe", "stack", "trace", "getouterframes", "getinnerframes"})),
    (os.path.join("", "traceback.py"), frozenset({"walk_stack"})),
    (os.path.join("logging", "__init__.py"), frozenset({"currentframe", "<lambda>"})),
    (os.path.join("asyncio", "base_tasks.py"), frozenset({"_task_get_stack", "_task_print_stack"})),
    (os.path.join("torch", "_jit_internal.py"), frozenset({"createResolutionCallbackFromFrame"})),
)
# libraries that read a frame's locals and hand back only a name found there (torch.jit.trace names its values)
_LOCALS_READERS = ((os.path.join("torch", "jit", "_trace.py"), frozenset({"_get_interpreter_name_for_var"})),)
# libraries the student's code calls that ask for a frame and keep only a module's name, a file and a line, or text
_GETFRAME_READERS = _LOCALS_READERS + (
    (os.path.join("collections", "__init__.py"), frozenset({"namedtuple"})),
    (os.path.join("", "typing.py"), frozenset({"_caller"})),
    (os.path.join("", "enum.py"), frozenset({"_create_"})),
    (os.path.join("", "warnings.py"), frozenset({"warn"})),
    (os.path.join("", "traceback.py"), frozenset({"print_stack", "format_stack", "extract_stack"})),
)
# libraries that read the locals of the frame that defines a class (pydantic's models resolve their annotations
# there): let be where that frame is the student's own code, whose locals are theirs already
_OWN_LOCALS_READERS = ((os.path.join("pydantic", "_internal", "_typing_extra.py"), frozenset({"parent_frame_namespace"})),)
_FRAME_READERS = (
    (os.path.join("", "traceback.py"), frozenset({"clear_frames"})),
    (os.path.join("", "inspect.py"), frozenset({"getgeneratorstate", "getcoroutinestate"})),
    (os.path.join("classroom", "checks", "_student_code.py"), frozenset({"raised_by_student"})),
)
# logging's currentframe asked for by its own findCaller (which keeps a file name and a line), and a traceback's
# walkers resumed by the summary that keeps no locals (capture_locals=False)
_LOGGING = os.path.join("logging", "__init__.py")
_TRACEBACK_WALKERS = frozenset({"walk_tb", "_walk_tb_with_full_positions"})
# Code the student's code makes takes the name it is given: code compiled or built by a student's frame is the
# student's, whatever file name it claims (a library's, to pass for it).
_CODE_NAMING_EVENTS = {"compile": 1, "code.__new__": 1}
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
    and away from ``deny``; returns the hook (for tests). The hook is this module's code run from a private copy
    of it (``_policy_copy``), so that nothing the student's code rebinds changes what it decides with."""
    return _policy_copy()._install_policy(home, deny)


def _load_copy(name: str, filename: str, own_builtins: dict[str, Any], package: str | None = None) -> Any:
    """The module in ``filename`` executed afresh under ``name`` (never put in sys.modules), its functions looking up
    the builtins in ``own_builtins``."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, filename)
    module = importlib.util.module_from_spec(spec)
    module.__dict__["__builtins__"] = own_builtins
    if package is not None:
        module.__package__ = package
    spec.loader.exec_module(module)
    return module


def _policy_copy() -> Any:
    """This module once more, for the policy alone, taken before any code of the student's runs: its functions look
    up the builtins, ``os`` (with a copy of ``os.path`` of its own, whose ``os`` and ``stat`` are copies too) and
    ``threading`` in namespaces no other code holds, and whose functions are those of now (C functions, which no one
    can change). A submission that rebinds ``builtins.isinstance``, ``os.path.realpath``, ``os.lstat`` or
    ``threading.get_ident``, or a course module's function, changes what its own code sees, never what the policy
    decides with; the copy is reachable only through the hook, which no code can reach."""
    import _thread
    import builtins
    import stat
    import types
    own_builtins = dict(vars(builtins))
    path = _load_copy("_sandbox_path", os.path.__file__, own_builtins)
    path.os, path.stat = types.SimpleNamespace(**vars(os)), types.SimpleNamespace(**vars(stat))
    copy = _load_copy(f"{__name__}_policy", __file__, own_builtins, package=__package__)
    copy.os = types.SimpleNamespace(**{**vars(os), "path": path, "fsdecode": copy._fsdecode})
    copy.threading = types.SimpleNamespace(get_ident=_thread.get_ident)
    copy.SandboxRefused = SandboxRefused
    # the guards it installs in modules are this module's: a function's __globals__ (which no event audits) would
    # lead from a guard defined in the copy to the copy's own tables and builtins
    copy._guard_frame_givers, copy._guard_dispatcher = _guard_frame_givers, _guard_dispatcher
    return copy


def _fsdecode(path: Any) -> str:
    """os.fsdecode with this module's own names (the policy's copy: see ``_policy_copy``)."""
    path = os.fspath(path)
    return path.decode(_FS_ENCODING, "surrogateescape") if isinstance(path, bytes) else path


_FS_ENCODING = sys.getfilesystemencoding()


def _install_policy(home: str, deny: Iterable[str]) -> Callable[[str, tuple], None]:
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
    # (and gc: afresh, its garbage is the collector's own list again, not the stand-in _guard_frame_givers puts)
    # (torch._C: afresh, an extension module is its first state again, the dispatcher's unguarded entry with it)
    closed_modules = frozenset(module for module, _, _ in _UNAUDITED_WAYS) - {"os", "signal"} | {"gc", "torch._C"}

    from ..checks import _student_files as files
    from .judge import hold_claims, judge
    claim_student_file = files.claim_student_file
    judge_code, judge_thread = judge.__code__, threading.get_ident()   # the policy is installed where the judge runs
    # the claims also kept here, where no code of the student's reaches them (the course's copy is a module's, which
    # the judge compares with this one)
    getframe, claimed, asking = sys._getframe, set(), set()   # asking: the threads inside asker() now
    hold_claims(claimed)
    # whose code a file is: the course's, torch's and the installed libraries' folders, as the checks read them now
    # (the checks' own is_student_file looks up names a submission can rebind: this is the policy's)
    outside_roots = files.OUTSIDE_STUDENT_ROOTS
    real_names: dict[str, str] = {}
    directory_flags = getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_PATH", 0)
    own_stat, is_directory = os.stat, stat.S_ISDIR

    def real_name(filename: str) -> str:
        known = real_names.get(filename)
        if known is None:
            known = real_names[filename] = os.path.realpath(filename).replace("\\", "/")
        return known

    def students(filename: str) -> bool:
        """Whether code from ``filename`` is the student's (``files.is_student_file``'s rule, with the policy's
        own claims): not the course's, torch's or an installed library's, or named by code the student's made."""
        if filename in claimed:
            return True
        if filename.startswith("<frozen"):
            return False
        return not (os.path.isabs(filename) and real_name(filename).startswith(outside_roots))

    course = files.COURSE_ROOT   # the course_lib folder
    paths = sysconfig.get_paths()
    stdlib_root = real_name(paths["stdlib"]) + "/"
    site_roots = tuple(real_name(paths[key]) + "/" for key in ("purelib", "platlib") if paths.get(key))

    grader = os.path.dirname(real_name(__file__)) + "/"

    def claim(filename: str) -> None:
        if real_name(filename).startswith(grader):
            return   # CPython's own traceback printer compiles the line it shows under its file's name
        claimed.add(filename)
        claim_student_file(filename)

    def own_frame(depth: int) -> Any:
        """The frame ``depth`` calls above the caller, for the policy's own use: the event this raises is let
        through (None when asked from inside that, the policy's own getframe)."""
        me = threading.get_ident()
        if me in asking:
            return None
        asking.add(me)
        try:
            return getframe(depth + 1)
        finally:
            asking.discard(me)

    def asker() -> Any:
        """The frame of the code that raised this event."""
        return own_frame(3)   # 0: asker, 1: the check, 2: the hook, 3: the code that asked

    def asked_near_student() -> bool:
        """Whether code other than the course's raised this event while the student's code runs."""
        caller = asker()
        return caller is not None and not real_name(caller.f_code.co_filename).startswith(course) \
            and students_on_stack(caller)

    def asked_by_student() -> bool:
        """Whether the code that raised this event is the student's."""
        caller = asker()
        return caller is not None and students(caller.f_code.co_filename)

    def class_swap_refused(target: Any) -> bool:
        """Whether ``target.__class__ = ...`` is refused: at any time for a class (its metaclass answers its
        lookups) and for the course's objects, and for a module but while its own file's top-level code runs (a
        library giving itself a class as it is imported: torch.utils.deterministic, torch's config modules); a
        finalizer or a C function makes the call with no frame of the student's. For torch's objects, when the
        student's code asks (torch's own parametrizations give a layer a class of their own)."""
        kind = type(target)   # not isinstance, which would ask the object's own __class__
        if issubclass(kind, type):
            return True
        caller = asker()
        if issubclass(kind, ModuleType):   # let through while the module's own file runs as it is imported
            space = _MODULE_DICT.__get__(target)   # ModuleType's own: no subclass's property
            while caller is not None and not (caller.f_code.co_name == "<module>" and caller.f_globals is space
                                              and not students(caller.f_code.co_filename)):
                caller = caller.f_back
            return caller is None
        owner = vars(kind).get("__module__")   # the class's own entry: no lookup a metaclass answers
        owner = owner if isinstance(owner, str) else ""
        return owner.startswith("course_lib") or (owner.startswith("torch") and caller is not None
                                                  and students(caller.f_code.co_filename))

    def made_by_student() -> bool:
        """Whether code is being made (compiled, built, given to a function) while the student's code runs, by
        anything but the import system (which compiles a library's own files, imported lazily)."""
        caller = asker()
        if caller is None or caller.f_code.co_filename.startswith("<frozen importlib"):
            return False
        if caller.f_code.co_filename.endswith(os.sep + "ast.py") and caller.f_code.co_name == "parse":
            return False   # a tree, not code (a traceback's text parses the line it shows)
        return students_on_stack(caller)

    def students_on_stack(frame: Any) -> bool:
        """Whether a frame of the student's is on the stack above the judge (what runs below it, the worker or a
        test's harness, is never the student's)."""
        while frame is not None and frame.f_code is not judge_code:
            if students(frame.f_code.co_filename):
                return True
            frame = frame.f_back
        return False

    def profiling_by_student() -> bool:
        """Whether a profile function is set while the student's code runs (directly or through a library, a
        finalizer's call), or by no Python code that names it (a call composed in C)."""
        caller = asker()
        if caller is None:
            return False
        names = caller.f_code.co_names
        if not any(name in names for name in ("setprofile", "_SETPROFILE", "_own_setprofile")):
            return True
        return students_on_stack(caller)

    def named(frame: Any, table: tuple[tuple[str, frozenset[str]], ...]) -> bool:
        code = frame.f_code
        return any(code.co_filename.endswith(end) and code.co_name in names for end, names in table)

    def called_by(frame: Any, end: str, name: str) -> bool:
        above = frame.f_back
        return above is not None and above.f_code.co_filename.endswith(end) and above.f_code.co_name == name

    def a_hander(frame: Any) -> bool:
        """Whether ``frame`` is a function that hands frames or their locals back: one of ``_FRAME_HANDERS``
        (logging's currentframe is not, when its own findCaller asks), or any that reads a frame's locals (what a
        library's "caller's namespace" helper returns)."""
        if "f_locals" in frame.f_code.co_names and not named(frame, _LOCALS_READERS):
            return True
        return named(frame, _FRAME_HANDERS) and not (
            frame.f_code.co_filename.endswith(_LOGGING) and called_by(frame, _LOGGING, "findCaller"))

    def a_reader(frame: Any) -> bool:
        """Whether ``frame`` reads a frame attribute and hands back neither frames nor locals."""
        if named(frame, _FRAME_READERS):
            return True
        if not (frame.f_code.co_filename.endswith("traceback.py") and frame.f_code.co_name in _TRACEBACK_WALKERS
                and called_by(frame, "traceback.py", "_extract_from_extended_frame_gen")):
            return False
        summary = frame.f_back.f_locals   # the walker is the generator it reads (not wrapped in a map of theirs)
        walked = summary.get("frame_gen")
        if type(walked) is islice:   # a limit (format_exc(limit=2)): the summary's own slice of the walker
            walked = islice.__reduce__(walked)[1][0]
        return not summary.get("capture_locals") and getattr(walked, "gi_code", None) is frame.f_code

    def introspected_by_student(event: str, args: tuple) -> bool:
        """Whether this way to a frame or to memory is the student's (see ``_INTROSPECTION_EVENTS``)."""
        if event in _EVERYTHING_EVENTS:
            return True
        caller = asker()
        if caller is None:
            return False
        wanted = ("_getframe", "_GETFRAME") if event == "sys._getframe" else (args[1],)   # (the judge's own, pinned)
        if not any(name in caller.f_code.co_names for name in wanted):   # no Python code asked: a call composed in C
            return True
        if event != "sys._getframe":   # a frame attribute
            return not a_reader(caller) and (threading.get_ident() != judge_thread or students_on_stack(caller))
        if caller.f_code.co_filename.endswith("traceback.py") and caller.f_code.co_name == "walk_stack":
            return students_on_stack(caller)   # a generator: whoever resumes it (a heapq, a summary) is no asker
        if named(caller, _OWN_LOCALS_READERS) and args and students(args[0].f_code.co_filename):
            return False   # a class's namespace read from the frame that defines it, the student's own
        while a_hander(caller) and caller.f_back is not None:   # to whoever asked the hander
            caller = caller.f_back
        if students(caller.f_code.co_filename) or a_hander(caller):
            return True
        # a library asking for itself: a reader known to keep only a name, a line or a module, or one the
        # student's code did not call (a library's "give me a frame" helper is a hander by another name)
        return not named(caller, _GETFRAME_READERS) and called_by_student(caller)

    def stdlib_module(filename: str) -> str | None:
        """The standard library's module (or package) a file is, None for any other file (site-packages' too)."""
        real = real_name(filename)
        if not real.startswith(stdlib_root) or real.startswith(site_roots):
            return None
        return real[len(stdlib_root):].split("/", 1)[0]

    def called_by_student(frame: Any) -> bool:
        """Whether the student's code called ``frame``'s function: directly, or through the standard library's other
        modules only (a finalizer's ``__call__``, a dispatch wrapper, a recursive repr: any of them may call what it
        is given and hand back what that returns). A call from the function's own module or from another library (a
        warning from deep inside matplotlib, typing called by rich) is not."""
        own, above = stdlib_module(frame.f_code.co_filename), frame.f_back
        # (typing passes nothing on: it calls typing_extensions' hooks of its own design, for code torch generates
        # under a made-up file name as much as for the student's)
        while above is not None and stdlib_module(above.f_code.co_filename) not in (None, own, "typing.py"):
            above = above.f_back
        return above is not None and students(above.f_code.co_filename)

    def course_function(value: Any) -> bool:
        code = getattr(value, "__code__", None)
        return isinstance(getattr(code, "co_filename", None), str) and real_name(code.co_filename).startswith(course)

    def inside(path: str, roots: tuple[str, ...]) -> bool:
        return any(path == root or path.startswith(root + os.sep) for root in roots)

    def outside_directory(real: str, flags: Any) -> bool:
        """Whether an open outside the working folder gives a descriptor of a folder: a path relative to it
        (``os.open(name, dir_fd=...)``, which the open event shows without the descriptor) escapes every rule."""
        if isinstance(flags, int) and flags & directory_flags:
            return True
        try:
            return is_directory(own_stat(real).st_mode)
        except (OSError, ValueError):
            return False

    def resolve(path: Any) -> str | None:
        if path is None or isinstance(path, int):
            return None   # an already open file descriptor was allowed when it was opened
        try:
            return os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return None

    def directory(path: Any) -> bool:
        real = resolve(path)
        return real is not None and os.path.isdir(real)

    def refuse(what: str) -> None:
        raise SandboxRefused(f"the grader's sandbox does not allow {what}")

    def check_read(path: Any, opened: bool = False, flags: Any = None) -> None:
        """``opened``: an open with ``flags`` (not a listing), whose descriptor must not be a folder's outside."""
        real = resolve(path)
        if real is None or inside(real, writable):
            return
        if inside(real, denied):
            refuse(f"reading {os.fsdecode(path)!s}: other submissions and the grader's files are off limits")
        if proc and real.startswith(proc) and real[len(proc):].split(os.sep)[0].isdigit() \
                and not inside(real, own_proc):
            refuse(f"reading {real}: other processes are off limits")
        if proc and real.startswith(proc) and os.path.basename(real) in ("mem", "pagemap", "environ"):
            refuse(f"reading {real}: this process's memory is the grader's too")
        if opened and outside_directory(real, flags):
            refuse(f"opening the folder {real}: only the working folder's own folders may be opened")

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
            check_write(path) if writes else check_read(path, opened=True, flags=flags)
        elif event in ("os.listdir", "os.scandir", "os.chdir"):
            check_read(args[0] if args else None)
            if event == "os.chdir":
                real = resolve(args[0] if args else None)
                if real is not None and not inside(real, writable):
                    refuse("leaving the submission's working folder (os.chdir)")
        elif event in ("os.rename", "os.replace") and args and directory(args[0]):
            # none of a folder: one renamed back and forth by a thread while a path through it is opened (`d/../..`
            # checked inside, walked by the kernel after the move) leads out, as a flipped link did
            refuse("renaming folders (a path through one can change between the sandbox's check and the open)")
        elif event in write_path_events:
            for path in args[:next(count for name, count in write_path_counts if name == event)]:
                check_write(path)
        elif event == "os.symlink":
            # none at all: a link into a library's folder passed its code for the library's, and one flipped by a
            # thread between the check of a path and its open (both targets inside) made ``link/../..`` lead out
            refuse("symbolic links (a path through one can change between the sandbox's check and the open)")
        elif event in ("os.kill", "os.killpg"):
            target = args[0]
            if event == "os.kill" and target not in (own_pid, 0, -own_group):
                refuse(f"signalling process {target}: a submission may only signal itself")
            if event == "os.killpg" and target not in (own_group, 0):
                refuse(f"signalling process group {target}: a submission may only signal itself")
        elif event in refused_events:
            refuse(next(words for name, words in refused_words if name == event))
        elif (event in _INTROSPECTION_EVENTS or (event == "object.__getattr__" and len(args) > 1
                                                 and args[1] in _FRAME_ATTRIBUTES)) \
                and introspected_by_student(event, args):
            refuse("frames or the objects in memory (sys._getframe, inspect.currentframe, a traceback's tb_frame, "
                   "gc.get_objects): they lead to the grader's own records")
        elif event == "sys.setprofile" and profiling_by_student():
            refuse("profile functions (sys.setprofile, a profiler): they are handed the grader's frames")
        elif event == "marshal.loads" and asked_by_student():
            refuse("code objects made from bytes (marshal.loads)")
        elif event in _CODE_NAMING_EVENTS and len(args) > 1 and isinstance(args[1], str) and made_by_student():
            claim(args[1])
        elif event == "object.__getattr__" and len(args) > 1 and args[1] in _HIDDEN_ATTRIBUTES \
                and course_function(args[0]) and asked_near_student():
            refuse("reading the course's own functions' defaults (where the grader keeps what it needs)")
        elif event == "object.__setattr__" and len(args) > 1 and args[1] in _CODE_ATTRIBUTES \
                and course_function(args[0]) and made_by_student():
            refuse("changing the course's own functions (their code or defaults)")
        elif event == "object.__setattr__" and len(args) > 1 and args[1] == "__class__" and class_swap_refused(args[0]):
            refuse("changing the class of a module, of a class, or of the course's or torch's objects (__class__ = "
                   "...): the new class answers every lookup the grader makes there")
        elif event == "object.__setattr__" and len(args) > 2 and args[1] == "__code__" \
                and isinstance(getattr(args[2], "co_filename", None), str) and made_by_student():
            claim(args[2].co_filename)
        elif event == "import" and args and args[0] in closed_modules:
            refuse(f"importing {args[0]} again (its functions go past this sandbox's audit)")
        elif event == "import" and args and args[0].partition(".")[0] in _UNAUDITED_PACKAGES:
            refuse(f"importing {args[0]} (it calls C functions past this sandbox's audit)")

    def student_runs() -> bool:
        return students_on_stack(own_frame(2))   # 0: this, 1: the guard, 2: its caller

    def student_calls() -> bool:
        caller = own_frame(2)
        return caller is not None and (students(caller.f_code.co_filename) or called_by_student(caller))

    sys.addaudithook(hook)
    _guard_frame_givers(student_runs, refuse)
    _guard_dispatcher(student_runs, student_calls, refuse)
    return hook


# The guards below keep what they stand for in their keyword defaults, which only an audited attribute reads (the
# policy refuses it near the student's code), never in a closure, which any code reads through __closure__.
def _guard_frame_givers(student_runs: Callable[[], bool], refuse: Callable[[str], None]) -> None:
    """Ways to a frame that no event audits, replaced in their modules: a signal handler is handed the frame the
    signal interrupts, and gc's DEBUG_SAVEALL keeps dead frames (and the objects they held) in gc.garbage. Refused
    while the student's code runs; the grader's own calls (its pinned signal.signal) go through. Beneath it, the
    kernel refuses a new handler to the process (``syscalls``), and gc.garbage is a stand-in: the collector keeps
    what DEBUG_SAVEALL saves in its own list, which no name reaches (importing gc afresh is refused)."""
    import _signal
    import gc

    for module in (_signal, signal):
        def guarded(number: Any, handler: Any, *, _original: Callable[..., Any] = module.signal,
                    _student_runs: Callable[[], bool] = student_runs, _refuse: Callable[[str], None] = refuse,
                    _callable: Callable[[Any], bool] = callable) -> Any:
            if _callable(handler) and _student_runs():
                _refuse("signal handlers: they are handed the frame the signal interrupts")
            return _original(number, handler)
        module.signal = guarded

    def debug(flags: int, *, _set_debug: Callable[[int], None] = gc.set_debug,
              _student_runs: Callable[[], bool] = student_runs, _refuse: Callable[[str], None] = refuse) -> None:
        if flags and _student_runs():
            _refuse("the garbage collector's debug flags (DEBUG_SAVEALL keeps dead frames in gc.garbage)")
        _set_debug(flags)
    gc.set_debug = debug
    gc.garbage = []


def _guard_dispatcher(student_runs: Callable[[], bool], student_calls: Callable[[], bool],
                      refuse: Callable[[str], None]) -> None:
    """torch's dispatcher takes new kernels for its operators from Python (``torch.library``, and the C call beneath
    it; an operator's ``py_impl``, which runs while the Python dispatcher is on): a submission's own CPU kernel for
    ``aten::equal`` makes every comparison answer True, with torch's functions untouched. Refused: the Python
    dispatcher at any time (only compilers and tracers switch it on, neither of which grading runs), a library
    of kernels that the student's code asks for itself, and one for torch's own operators (``aten``) while
    the student's code runs, but for the keys torch registers lazily. Every name torch bound them to is replaced,
    not only ``torch._C``'s (``torch._dispatch.python.enable_python_dispatcher`` is the same class)."""
    from .judge import LAZY_KERNEL_KEYS, TORCH_OWN_OPERATORS
    torch = sys.modules.get("torch")
    messages = "kernels of its own for torch's operators (torch.library, the Python dispatcher): every comparison " \
               "would run them"

    for name in ("_dispatch_library", "_EnablePythonDispatcher"):
        original = getattr(getattr(torch, "_C", None), name, None)
        if original is None:
            continue
        if name == "_dispatch_library":
            def guarded(kind: Any, namespace: Any = None, key: Any = "", *args: Any, _original: Any = original,
                        _student_runs: Callable[[], bool] = student_runs,
                        _student_calls: Callable[[], bool] = student_calls, _refuse: Callable[[str], None] = refuse,
                        _own: frozenset[str] = TORCH_OWN_OPERATORS, _lazy: frozenset[str] = LAZY_KERNEL_KEYS,
                        _words: str = messages, **kwargs: Any) -> Any:
                if _student_calls() or (namespace in _own and str(key) not in _lazy and _student_runs()):
                    _refuse(_words)
                return _original(kind, namespace, key, *args, **kwargs)
        else:   # never, in an exercise's process: a finalizer of the student's switched it on with no frame of theirs
            def guarded(*args: Any, _original: Any = original, _refuse: Callable[[str], None] = refuse,
                        _words: str = messages, **kwargs: Any) -> Any:
                _refuse(_words)
                return _original(*args, **kwargs)
        for module in list(sys.modules.values()):   # every name torch bound it to at import
            if isinstance(module, type(sys)) and module.__name__.partition(".")[0] == "torch":
                for alias, value in list(vars(module).items()):
                    if value is original:
                        setattr(module, alias, guarded)


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
    _audit_torch_files()
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
    syscalls.not_dumpable()   # before the policy, which refuses ctypes; isolated, the zygote already is
    _work_in(home)
    _set_limits(memory_mb, cpu_seconds)
    _quiet_standard_streams(close)
    syscalls.refuse_escapes()   # before the policy, which refuses ctypes: the kernel's own wall behind it
    install_policy(home, deny)
    _close_unaudited_ways()
    _audit_torch_files()
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


def _audit_torch_files() -> None:
    """torch opens some files in C++, past the open event the policy reads: ``torch.from_file`` and a storage's
    ``from_file`` (a notebook of another student's read, a file written outside with ``shared=True``), and the
    archive writer and reader ``torch.save`` and ``torch.load`` use with a file name. Each now raises the open event
    for its file first (read, or read and write), so that the policy's path rules hold there too."""
    torch = sys.modules.get("torch")
    if torch is None:
        return

    def audited(original: Any, mode: Callable[..., str]) -> Callable[..., Any]:
        def opened(*args: Any, _original: Any = original, _mode: Callable[..., str] = mode,
                   _audit: Callable[..., None] = sys.audit, **kwargs: Any) -> Any:
            path = args[0] if args else kwargs.get("filename")
            if isinstance(path, (str, bytes, os.PathLike)):
                _audit("open", path, _mode(*args, **kwargs), 0)
            return _original(*args, **kwargs)
        return opened

    def shared(*args: Any, **kwargs: Any) -> str:
        return "r+b" if (args[1:2] or [kwargs.get("shared", False)])[0] else "rb"

    torch.from_file = audited(torch.from_file, shared)
    storage = torch.UntypedStorage.from_file
    torch.UntypedStorage.from_file = staticmethod(audited(storage, shared))
    for name, mode in (("PyTorchFileWriter", "wb"), ("PyTorchFileReader", "rb")):
        if hasattr(torch._C, name):
            setattr(torch._C, name, audited(getattr(torch._C, name), lambda *_, _m=mode, **__: _m))
    from ..checks import _pinned  # the checks take a torch function other than the pinned one for a student's patch
    for space, name in ((torch, "from_file"), (torch.UntypedStorage, "from_file"), (torch._C, "PyTorchFileWriter"),
                        (torch._C, "PyTorchFileReader")):
        _pinned.accept(space, name)


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

    def set_eval_frame(callback: Any, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
        if callback is not None:
            raise SandboxRefused(f"the grader's sandbox does not allow {_NO_COMPILE}")
        return _original(callback, *args, **kwargs)

    frames.set_eval_frame = set_eval_frame
    python_side = sys.modules.get("torch._dynamo.eval_frame")   # already imported: it holds the original by name
    if python_side is not None:
        for name in ("set_eval_frame", "_maybe_set_eval_frame"):
            if getattr(python_side, name, None) is original:
                setattr(python_side, name, set_eval_frame)
