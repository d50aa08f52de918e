"""Judging one exercise: the student's definition, then the course's check cell, in one namespace.

This runs inside the sandboxed child (``sandbox.enter`` was called before). The namespace is the
one every exercise cell sees in the course (torch, ``nn``, ``F``, ``math`` and the course's
building blocks: ``collect.course_namespace``, the one notebook 08 trains your parts in), with
the student's definition executed in it. Then the course's check cell runs there, statement by statement:
each ``checks.check_*(...)`` call is made by this module itself, with the course's checker taken before any
student code ran, and its verdict kept in a local variable of the function making the call. No object the
student's code can reach (the namespace, ``checks``, a closure, a module) ever holds a verdict, so code of theirs
that runs later (a finalizer, a signal handler, a thread) has nothing to change. The verdict is the first failing
check of the exercise, else its (last) pass.
"""
from __future__ import annotations

import _thread
import ast
import dataclasses
import gc
import importlib.util
import operator
import signal
import sys
import threading
from collections.abc import Callable
from types import FunctionType, ModuleType
from typing import Any

from .. import capstone
from ..checks._pinned import tables as pinned_tables
from ..checks._pinned import tables_intact as pinned_tables_intact
from ..checks._references import bind_references, install_references, is_submodule, pinned_state
from ..checks._student_files import claimed_files, exception_line, exception_message, exception_name, is_student_file
from ..checks.engine.run import (
    CallsReference,
    CheckNotPassed,
    Displayed,
    bound_to_course_work,
    is_reference,
    reference_message,
    reference_of,
)
from ..collect import GPT_EXERCISES, collect_student_parts, course_names, course_namespace, execute_student_source
from ..verdict import CheckResult
from .plan import CAPSTONE, ExercisePlan

__all__ = ["judge", "known_names", "CourseChecks", "hold_claims"]

from .grades import MESSAGE_LIMIT


def known_names(plans: dict[str, ExercisePlan]) -> set[str]:
    """Names every exercise finds provided by the course: never taken from the student's other code
    (the same names notebook 08's collection leaves to the course)."""
    return course_names() | {p.name for p in plans.values() if p.name}


class CourseChecks:
    """``checks`` where the student's own code calls it (9.6's cell before, yours or ours): each ``check_*`` is the
    course's checker as it was before any student code ran. The grader never reads what these calls return: the
    check cell's own calls are made by :func:`_run_check_cell`. Nothing can be set on it (empty ``__slots__``)."""

    __slots__ = ()

    def __new__(cls, checkers: dict[str, Callable[..., Any]]) -> CourseChecks:
        from .. import checks

        def lookup(self: CourseChecks, name: str) -> Any:
            return checkers[name] if name in checkers else getattr(checks, name)   # checks.hint(...) too

        # a class of its own per namespace, its one method closing over what it reads
        return object.__new__(type(cls.__name__, (cls,), {"__slots__": (), "__getattr__": lookup}))


def _course_checkers() -> dict[str, Callable[..., Any]]:
    """The course's checkers as they are now (taken before any code of the student's runs: an import after it would
    read sys.modules, where a submission can put a package of its own)."""
    from .. import checks
    return {name: getattr(checks, name) for name in dir(checks) if name.startswith("check_")}


# (namespace, name, value) of the course's names; (cell, contents) of its functions' closures; the pin tables;
# (namespace, its names, its module or None) of the course's modules, classes and frozen declarations (a name added
# shadows one looked up elsewhere: a field of an instance its class's method, a module's global a builtin);
# (a frozen declaration, a class or a module, its type); (a dict, list or set of the course's, what it held, whether
# it may grow); the course's functions and torch's pinned ones with their code, defaults, closure and globals
State = tuple[tuple[tuple[Any, str, Any], ...], tuple[tuple[Any, Any], ...], tuple[Any, ...],
              tuple[tuple[Any, frozenset[str], Any], ...], tuple[tuple[Any, type], ...],
              tuple[tuple[Any, tuple[Any, ...], bool], ...], tuple[tuple[Any, ...], ...]]
_MISSING = object()


def _inside(function: FunctionType) -> tuple[Any, ...]:
    """A function with what it runs: its code, defaults, closure and globals. Python refuses to rebind these for a
    submission (the sandbox's audit hook); a write to the function's memory (numpy over a raw address) does not
    ask, and a reference that runs the student's code gives their answer as the expected one."""
    return (function, function.__code__, function.__defaults__, function.__kwdefaults__, function.__closure__,
            function.__globals__)


# The containers the course itself changes as it checks: (module, name) -> whether their entries are only ever added
# (the pinned namespaces of a module imported since, the files of the student's code claimed as it runs: one taken
# away would be the student's) or change freely (caches, the last verdicts, hint states, a count of calls)
_GROWING = {("course_lib.classroom.checks._references", "_PRISTINE"): True,
            ("course_lib.classroom.checks._student_files", "_CLAIMED"): True,
            ("course_lib.classroom.checks.engine.run", "_LAST"): False,
            ("course_lib.classroom.checks._core", "_STATES"): False,
            ("course_lib.classroom.checks._student_code", "CALLS"): False,
            ("course_lib.corpora", "_SHA_CACHE"): False,
            ("course_lib.runtime", "_state"): False,
            # the pin tables: torch's own wrappers of a pinned function are pinned as they come, and _pinned's own
            # check compares the tables (``pinned_tables_intact``)
            ("course_lib.classroom.checks._pinned", "PINNED"): False,
            ("course_lib.classroom.checks._pinned", "_BY_SPACE"): False,
            ("course_lib.classroom.checks._pinned", "_CLASS_NAMES"): False}
_CONTAINERS = (dict, list, set)


def _held(container: Any) -> tuple[Any, ...]:
    """What a container holds, as objects compared by identity (no __eq__ or __hash__ of theirs runs): a dict's keys
    and values, a list's items in order, a set's items."""
    if isinstance(container, dict):
        return tuple(dict.items(container))
    return tuple(list.__iter__(container)) if isinstance(container, list) else tuple(set.__iter__(container))


def _holds(container: Any, held: tuple[Any, ...], growing: bool) -> bool:
    now = _held(container)
    if isinstance(container, dict):
        now, held = [item for pair in now for item in pair], [item for pair in held for item in pair]
    if isinstance(container, set) or (growing and isinstance(container, dict)):
        ids = {id(item) for item in now}
        return all(id(item) in ids for item in held) and (growing or len(now) == len(held))
    if growing:
        return list(map(id, now[:len(held)])) == list(map(id, held))
    return len(now) == len(held) and all(map(operator.is_, now, held))


def _course_state(checkers: dict[str, Callable[..., Any]]) -> State:
    """What the student's code could change in the course, taken before any of it runs: every name of the course's
    modules and classes as pinned (``_references``) and the course's entries of sys.modules; the fields of the frozen
    declarations they hold (an exercise's reference, its mistakes: ``object.__setattr__`` writes them); the closure
    cells of the course's functions and of the checkers (a cell's contents is writable); the names of the globals
    of its own that a class's method has (``CheckResult.__new__``'s ``_tuple_new``); the pin tables."""
    names, cells, seen, spaces, kinds, held = list(pinned_state()), [], set(), [], [], []
    insides: dict[int, tuple[Any, ...]] = {}
    modules = sys.modules
    course = [(name, module) for name, module in list(modules.items())
              if name == "course_lib" or name.startswith("course_lib.")]
    names += [(modules, name, module) for name, module in course]
    spaces += [(vars(module), frozenset(vars(module)), module) for _, module in course if isinstance(module, ModuleType)]
    # every module's class (one given a class of its own answers every name read from it: ``torch.equal``)
    kinds += [(module, type(module)) for module in list(modules.values()) if isinstance(module, ModuleType)]
    # the course's dicts, lists and sets at module level: the reference guard's counters, registries, tables (not a
    # library's that a course module names too, torch.library's kernels: the hooks above compare what matters there)
    found: dict[int, tuple[Any, bool | None]] = {}   # by the container: one imported under two names is one
    for name, module in course:
        for key, value in list(vars(module).items()) if isinstance(module, ModuleType) else ():
            if type(value) in _CONTAINERS:
                mode, then = _GROWING.get((name, key)), found.get(id(value), (value, None))[1]
                found[id(value)] = (value, False if False in (mode, then) else mode or then)
    libraries = {id(value) for name, module in list(modules.items()) if isinstance(module, ModuleType)
                 and not (name == "course_lib" or name.startswith("course_lib.")) for value in list(vars(module).values())
                 if id(value) in found}
    held += [(value, _held(value), mode is True) for key, (value, mode) in found.items()
             if mode is not False and key not in libraries]
    todo = [value for _, _, value in names] + list(checkers.values()) + \
        [item for container, contents, growing in held if not growing for item in contents]
    module_globals = {id(vars(module)) for module in list(modules.values()) if isinstance(module, ModuleType)}
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (staticmethod, classmethod)):
            todo.append(value.__func__)
        elif isinstance(value, property):
            todo += [part for part in (value.fget, value.fset, value.fdel) if part is not None]
        if isinstance(value, FunctionType):
            insides[id(value)] = _inside(value)
        if isinstance(value, FunctionType) and value.__closure__:
            for cell in value.__closure__:
                try:
                    cells.append((cell, cell.cell_contents))
                except ValueError:   # a cell not filled yet
                    continue
                todo.append(cell.cell_contents)
        elif isinstance(value, tuple | frozenset):
            todo += list(value)
        elif isinstance(value, type):   # a method made with globals of its own (a NamedTuple's __new__): its names
            if str(getattr(value, "__module__", "")).startswith("course_lib"):
                spaces.append((vars(value), frozenset(vars(value)), None))
                kinds.append((value, type(value)))   # its metaclass answers the names read from it
            for method in vars(value).values():
                method = getattr(method, "__func__", method)
                if isinstance(method, FunctionType) and id(method.__globals__) not in module_globals:
                    names += [(method.__globals__, name, field) for name, field in method.__globals__.items()]
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value).__dataclass_params__.frozen \
                and hasattr(value, "__dict__"):
            fields = vars(value)
            names += [(fields, name, field) for name, field in fields.items()]
            spaces.append((fields, frozenset(fields), None))
            kinds.append((value, type(value)))
            todo += list(fields.values())
    tables = pinned_tables()
    for _, _, value in tables[0].values():   # torch's functions the checks and the references run on, as pinned
        value = getattr(value, "__func__", value)
        if isinstance(value, FunctionType):
            insides.setdefault(id(value), _inside(value))
    return tuple(names), tuple(cells), tables, tuple(spaces), tuple(kinds), tuple(held), tuple(insides.values())


def _grown(state: State) -> bool:
    """Whether a name was added to a namespace of the course (put back would delete it, and so hide it): but for a
    submodule Python bound as it imported it (``_references.is_submodule``)."""
    for namespace, known, module in state[3]:
        for name in [name for name in namespace if name not in known]:
            if module is None or not is_submodule(module, namespace.get(name), name):
                return True
    return False


_COURSE_CLAIMS = claimed_files()


def hold_claims(claims: set[str]) -> None:
    """Have every comparison of the course's state also ask that ``claims`` (the sandbox's own record of the files
    the student's code named its code after, kept where no code of theirs reaches it) are all in the course's
    record of them, which the checks read (``is_student_file``): one taken away there hides code of theirs."""
    _tampered.__kwdefaults__["claims"] = claims


def _tampered(state: State, missing: Any = _MISSING, *, claims: Any = frozenset(),
              course_claims: set[str] = _COURSE_CLAIMS) -> bool:
    """Whether anything of ``state`` is other than it was, once the course was put back: the student's code changed
    the course where its own restore (which that code can reach too: ``_references``) did not undo it. It reads the
    namespaces and cells themselves (a dict's own ``get``, a cell's contents), no function a submission could have
    rebound; the pin tables last, through _pinned's own check, once its names are known to be the course's."""
    names, cells, tables, _, kinds, held, insides = state
    if not all(map(course_claims.__contains__, claims)):
        return True
    for parts in insides:
        if any(map(operator.is_not, _inside(parts[0]), parts)):
            return True
    for thing, kind in kinds:
        if type(thing) is not kind:
            return True
    for container, contents, growing in held:
        if not _holds(container, contents, growing):
            return True
    for namespace, name, value in names:
        if namespace.get(name, missing) is not value:
            return True
    for cell, value in cells:
        try:
            if cell.cell_contents is not value:
                return True
        except ValueError:   # emptied
            return True
    return not pinned_tables_intact(tables)


_TRACE = sys.gettrace()   # this process's trace function before any student (None; a coverage tool's in tests)


Hooks = tuple[Any, ...]

# The interpreter's getters and setters, and gc's own list of callbacks, taken when the grader is imported (before
# any student's code): a submission that rebinds threading.gettrace or gc.callbacks changes what these never read.
_GETTRACE, _GETPROFILE, _SETTRACE, _SETPROFILE = sys.gettrace, sys.getprofile, sys.settrace, sys.setprofile
_THREADING_HOOKS = threading.gettrace, threading.getprofile, threading.settrace, threading.setprofile
_GC_CALLBACKS, _GC_THRESHOLD, _SET_GC_THRESHOLD = gc.callbacks, gc.get_threshold, gc.set_threshold
_GC_ENABLED, _GC_ENABLE, _GC_DISABLE = gc.isenabled, gc.enable, gc.disable
_SWITCH_INTERVAL, _SET_SWITCH_INTERVAL, _THREADS = sys.getswitchinterval, sys.setswitchinterval, _thread._count
_GETFRAME = sys._getframe
# Signal handlers run between any two bytecodes, and interval timers make them ring on their own. (signal.signal
# itself is kept in _restore's defaults, not a module's name: see sandbox._guard_frame_givers.)
_GETSIGNAL = signal.getsignal
_GETITIMER, _SETITIMER = getattr(signal, "getitimer", None), getattr(signal, "setitimer", None)
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1", "SIGUSR2", "SIGIO")
                 if hasattr(signal, name))
_TIMERS = tuple(getattr(signal, name) for name in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF")
                if hasattr(signal, name)) if _GETITIMER else ()


# torch's own operators (the comparisons', the references'), and the keys of the kernels torch itself registers for
# them lazily while a student's code runs (vmap's batching rules, fake tensors' meta kernels), which compute nothing
# on a tensor: the sandbox refuses any other kernel for them to the student's code. Not ``prims``: importing
# torch._dynamo defines some of them, and no check computes with them.
TORCH_OWN_OPERATORS = frozenset({"aten"})
LAZY_KERNEL_KEYS = frozenset({"FuncTorchBatched", "FuncTorchBatchedDecomposition", "Meta"})
# torch's own registries of code that runs unasked: the module hooks every module runs (a forward hook rewrote the
# course's MaskedAttention's output into the student's), the Python dispatcher's switch (its py_impl kernels run
# while it is on) and the kernels registered for torch's own operators (a kernel of aten::equal answered True)
_TORCH_MODULE = sys.modules["torch.nn.modules.module"]
_HOOK_TABLES = tuple((name, table) for name, table in sorted(vars(_TORCH_MODULE).items())
                     if name.startswith("_global_") and isinstance(table, dict))
_TORCH_C, _TORCH_LIBRARY = sys.modules["torch._C"], sys.modules["torch.library"]
_PYTHON_DISPATCHER = _TORCH_C.DispatchKey.PythonDispatcher
_KERNELS = _TORCH_LIBRARY._impls


def _torch_hooks() -> tuple[Any, ...]:
    """(each hook table's name bound now, its items), the Python dispatcher's switch, torch's registered kernels
    of its own operators but those it registers lazily (``LAZY_KERNEL_KEYS``)."""
    names = vars(_TORCH_MODULE)
    tables = tuple((names.get(name), tuple(table.items())) for name, table in _HOOK_TABLES)
    kernels = vars(_TORCH_LIBRARY).get("_impls")
    own = frozenset(k for k in _KERNELS if k.partition("/")[0] in TORCH_OWN_OPERATORS
                    and k.rpartition("/")[2] not in LAZY_KERNEL_KEYS)
    return tables, bool(_TORCH_C._dispatch_tls_is_dispatch_key_included(_PYTHON_DISPATCHER)), kernels is _KERNELS, own


def _hooks() -> Hooks:
    """Every way code runs later without being called: trace and profile functions (this thread's and those
    new threads get), the garbage collector's callbacks and thresholds (a callback runs at every collection),
    the switch interval, the threads alive (``_thread`` counts those ``threading`` does not see), the handlers of
    the signals a timer or the process itself can send, and the interval timers (as floats: none runs)."""
    return (_GETTRACE(), _GETPROFILE(), _THREADING_HOOKS[0](), _THREADING_HOOKS[1](), tuple(_GC_CALLBACKS),
            _GC_THRESHOLD(), _GC_ENABLED(), _SWITCH_INTERVAL(), _THREADS(),
            tuple(_GETSIGNAL(number) for number in _SIGNALS), tuple(float(_GETITIMER(t)[0]) for t in _TIMERS),
            _torch_hooks())


def _changed(now: Hooks, clean: Hooks) -> bool:
    """Whether anything differs from ``clean``, each object by identity: a student's hook may define ``__eq__``
    to equal anything, so ``!=`` would run its code and believe it."""
    tables = [item for bound, items in now[11][0] for item in (bound, *(x for pair in items for x in pair))], \
        [item for bound, items in clean[11][0] for item in (bound, *(x for pair in items for x in pair))]
    functions = [*now[:4], *now[4], *now[9], *tables[0]], [*clean[:4], *clean[4], *clean[9], *tables[1]]
    return len(functions[0]) != len(functions[1]) or any(a is not b for a, b in zip(*functions)) \
        or tuple(map(int, now[5])) != tuple(map(int, clean[5])) or bool(now[6]) is not bool(clean[6]) \
        or float(now[7]) != float(clean[7]) or int(now[8]) != int(clean[8]) or now[10] != clean[10] \
        or now[11][1:3] != clean[11][1:3] or not now[11][3] <= clean[11][3]


_CHECK_CELL = "<course check of exercise "   # the file name the course's check cell runs under: not the student's


def _raised_in_student_code(exc: BaseException) -> bool:
    """Whether the exception that reached the grader's own code came through a frame of the student's: code of
    theirs ran where only the grader's should (a trace function, a finalizer), and what it did is not to trust."""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if is_student_file(name) and not name.startswith(_CHECK_CELL):
            return True
        tb = tb.tb_next
    return False


def _quiet_progress_bars() -> None:
    """tqdm starts a monitor thread with its first bar, which would count as a thread of the student's (a
    ``for i in tqdm(range(n))`` is honest code): where tqdm is installed, its monitor is off while grading."""
    if importlib.util.find_spec("tqdm") is not None:
        import tqdm
        tqdm.tqdm.monitor_interval = 0


def _restore(clean: Hooks, _setsignal: Callable[..., Any] = signal.signal) -> None:
    """Put back what ``_hooks`` read before any student code (a thread cannot be stopped: the verdict already
    says ``patched``, and the exercise's process ends with it)."""
    if _GETTRACE() is not clean[0]:   # each only where it changed: the sandbox refuses sys.settrace to anyone
        _SETTRACE(clean[0])
    if _GETPROFILE() is not clean[1]:
        _SETPROFILE(clean[1])
    _THREADING_HOOKS[2](clean[2])
    _THREADING_HOOKS[3](clean[3])
    _GC_CALLBACKS[:] = clean[4]
    _SET_GC_THRESHOLD(*clean[5])
    (_GC_ENABLE if clean[6] else _GC_DISABLE)()
    _SET_SWITCH_INTERVAL(clean[7])
    for (name, table), (_, items) in zip(_HOOK_TABLES, clean[11][0]):
        vars(_TORCH_MODULE)[name] = table
        table.clear()
        table.update(items)
    for timer in _TIMERS:   # first the timers, so that no handler rings while they are put back
        _SETITIMER(timer, 0)
    for number, handler in zip(_SIGNALS, clean[9]):
        if handler is not None:   # None: a handler not set from Python, which Python cannot put back
            _setsignal(number, handler)


_TAMPERED = ("Your code left code to run unasked over the grader's own (a trace or profile function, a garbage "
             "collector's callback or threshold, a thread still running, a signal handler or timer), so no verdict "
             "of this exercise can be trusted.")


_CHANGED_COURSE = ("Your code changed the course's own code (a function or table of the checks or the grader, or "
                   "its modules), so no verdict of this exercise can be trusted.")


def _verdict(exercise: str, passed: bool, diagnosis: str | None, message: str) -> dict[str, Any]:
    return {"exercise": exercise, "passed": bool(passed), "diagnosis": diagnosis,
            "message": str(message)[:MESSAGE_LIMIT]}


def _raised(exercise: str, what: str, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, NotImplementedError):
        return _verdict(exercise, False, "not_implemented", f"{what} is not written yet ({exception_message(exc)}).")
    if isinstance(exc, SystemExit):
        return _verdict(exercise, False, "exception", f"{what} called sys.exit() (or exit()): that would stop "
                                                      f"the notebook's kernel.")
    return _verdict(exercise, False, "exception",
                    f"{what} raised {exception_line(exc)}")


Record = tuple[tuple[str, bool, "str | None", str], ...]   # the verdicts, (exercise, passed, diagnosis, message)


def _from_checks(plan: ExercisePlan, record: Record, error: BaseException | None) -> dict[str, Any]:
    mine = [r for r in record if r[0] == plan.id]
    failing = [r for r in mine if not r[1]]
    if failing:
        return _verdict(plan.id, False, failing[0][2], failing[0][3])
    if error is not None:
        return _raised(plan.id, "Your code", error)
    if mine:
        return _verdict(plan.id, True, None, mine[-1][3])
    return _verdict(plan.id, False, "checker_error", f"The course's check of exercise {plan.id} gave no verdict "
                                                     f"(a bug in the course, not in your code).")


def _judge_capstone(plan: ExercisePlan, clean: Hooks, checkers: dict[str, Callable[..., Any]],
                    state: State) -> dict[str, Any]:
    parts = collect_student_parts(".")
    not_yours = [f"{ex_id} ({parts.parts[ex_id].detail or parts.parts[ex_id].status})" for ex_id in GPT_EXERCISES
                 if not parts.parts[ex_id].is_yours]
    if not_yours:
        return _verdict(plan.id, False, "not_implemented",
                        f"8.1 trains the GPT built from your parts of notebooks 02-05, and these are not usable "
                        f"yet: {', '.join(not_yours)}.")
    install_references()   # collecting ran the student's parts: the checkers are the course's again
    if _changed(_hooks(), clean):   # defining the parts left code that runs unasked
        _restore(clean)
        return _verdict(plan.id, False, "patched", _TAMPERED)
    namespace = {"__name__": "course_check", "parts": parts, "capstone": capstone, "checks": CourseChecks(checkers)}
    return _run_check_cell(plan, namespace, checkers, clean, state)


def _checker_call(node: ast.stmt) -> tuple[ast.Call, str | None] | None:
    """``node`` as a call of a course checker, ``checks.check_*(...)``, shown or assigned to one name (and that
    name); None for any other statement, which runs as written."""
    target = node.targets[0].id if isinstance(node, ast.Assign) and len(node.targets) == 1 \
        and isinstance(node.targets[0], ast.Name) else None
    call = node.value if isinstance(node, ast.Expr) or target is not None else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr.startswith("check_") \
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "checks" \
            and not any(isinstance(arg, ast.Starred) for arg in call.args) and all(k.arg for k in call.keywords):
        return call, target
    return None


# What the check cell is read and run with, taken when this module is imported (before any student's code): a
# rebound ast.parse handed the checker the course's own function, a rebound compile or eval could do the same.
_PARSE, _COMPILE, _EVAL, _EXEC = ast.parse, compile, eval, exec
_MODULE, _EXPRESSION = ast.Module, ast.Expression


def _run_check_cell(plan: ExercisePlan, namespace: dict[str, Any], checkers: dict[str, Callable[..., Any]],
                    clean: Hooks, state: State, tampered: Callable[[State], bool] = _tampered,
                    put_back: Callable[[], None] = install_references,
                    grown: Callable[[State], bool] = _grown) -> dict[str, Any]:
    """Run the course's check cell in a copy of ``namespace``, statement by statement, each checker call made here
    with ``checkers`` (the course's, taken before the student's code could change them) and its verdict kept in
    this frame's own list, which no object the student's code can reach holds. ``patched`` when the student's code
    left anything that runs code unasked (``_hooks``, compared with ``clean``, read before the student's
    definition ran): it would have run between the checker's return and here; ``patched`` too when the course is not
    as ``state`` (read before any student code) once put back, or was not just before or just after any checker
    call (a change undone before the end, by a finalizer or the student's own last call, would pass the last look
    alone): ``tampered`` and its defaults are taken when this module is defined, so that no rebinding reaches them.
    A checker handed the course's own version of the exercise (the course's tests call it so) is the course's
    work, not the student's: ``calls_reference``. Else the verdict of the checks."""
    cell, filename = dict(namespace), f"{_CHECK_CELL}{plan.id}>"
    record: list[tuple[str, bool, str | None, str]] = []
    error, traced, changed = None, False, False
    reference = reference_of(plan.id)
    try:
        for node in _PARSE(plan.check).body:
            found = _checker_call(node)
            if found is None:   # 1.1's cell calls the student's my_prediction() itself; 8.1's parts train here
                _EXEC(_COMPILE(_MODULE([node], type_ignores=[]), filename, "exec"), cell)
                continue
            call, target = found
            value = lambda expr: _EVAL(_COMPILE(_EXPRESSION(expr), filename, "eval"), cell)  # noqa: E731, B023
            args, kwargs = [value(arg) for arg in call.args], {k.arg: value(k.value) for k in call.keywords}
            changed = grown(state)
            put_back()
            changed = changed or tampered(state)
            if changed:
                break
            ours = next((how for how in (is_reference(a, reference) for a in args) if how), None) \
                if reference is not None else None
            if ours is not None:
                message = reference_message(CallsReference(plan.id, plan.name, ours))
                record.append((plan.id, False, "calls_reference", message))
                break
            try:
                result = checkers[call.func.attr](*args, **kwargs)
            except CheckNotPassed as refused:   # nbgrader's way, where the notebook set NBGRADER_EXECUTION
                result = refused.result
            traced = _GETTRACE() is not _TRACE or _GETFRAME().f_trace is not None or _changed(_hooks(), clean)
            if traced:
                break
            changed = grown(state)
            put_back()
            changed = changed or tampered(state)
            if changed:
                break
            if type(result) in (CheckResult, Displayed):   # the tuple's own items: no attribute of the class is read
                record.append(tuple.__getitem__(result, slice(0, 4)))
            if target is not None:
                cell[target] = result
    except BaseException as exc:  # noqa: BLE001 - the student's code raised in the cell: the verdict says so
        error = exc
    traced = traced or _changed(_hooks(), clean)   # no function of the student's runs past here
    if traced:
        _restore(clean)
    changed = changed or grown(state)
    put_back()
    if changed or tampered(state):   # first: the functions below are the course's only if it holds
        return {"exercise": plan.id, "passed": False, "diagnosis": "patched", "message": _CHANGED_COURSE}
    if traced:
        return _verdict(plan.id, False, "patched", _TAMPERED)
    return _from_checks(plan, tuple(record), error)


def _course_own(plan: ExercisePlan, defined: Any) -> dict[str, Any] | None:
    """The verdict when the student's name is bound to the course's own version (imported, assigned):
    ``calls_reference``; None when it is the student's own definition."""
    reference = reference_of(plan.id)
    how = is_reference(defined, reference) if reference is not None else None
    if how is not None:
        return _verdict(plan.id, False, "calls_reference", reference_message(CallsReference(plan.id, plan.name, how)))
    bound = bound_to_course_work(plan.id, defined) if reference is not None else None
    return None if bound is None else _verdict(plan.id, False, "calls_reference", reference_message(bound))


def judge(plan: ExercisePlan, source: str | None) -> dict[str, Any]:
    """The verdict on ``source`` (the student's definition) for ``plan``, as a plain dict
    (exercise, passed, diagnosis, message). Never raises."""
    try:
        # the grader's own modules are pinned too, and put back before each of their functions is used below:
        # a submission's setattr(judge, "_from_checks", ...) cannot write its own verdict
        bind_references()
        _quiet_progress_bars()
        clean = _hooks()   # before any code of the student's: a hook set while defining must not count as given
        # the checkers, the course as pinned and this module's own functions, before any code of the student's runs
        checkers, run_check_cell = _course_checkers(), _run_check_cell
        state = _course_state(checkers)
        if plan.id == CAPSTONE:
            return _judge_capstone(plan, clean, checkers, state)
        namespace = course_namespace()
        namespace["checks"] = CourseChecks(dict(checkers))
        try:
            execute_student_source(source or "", namespace, f"<your {plan.notebook}, Exercise {plan.id}>")
        except BaseException as exc:  # the student's definition itself failed to run
            install_references()
            return _raised(plan.id, f"Defining {plan.name}", exc)
        if _changed(_hooks(), clean):   # defining a function left code that runs unasked (a default argument's call)
            _restore(clean)
            install_references()
            return _verdict(plan.id, False, "patched", _TAMPERED)
        if _grown(state):   # a name added to the course (put back below would delete it unseen)
            install_references()
            return _verdict(plan.id, False, "patched", _CHANGED_COURSE)
        install_references()   # first: the checkers taken below are the course's again
        refused = _course_own(plan, namespace.get(plan.name))
        if refused is not None:
            return refused
        return run_check_cell(plan, namespace, checkers, clean, state)
    except BaseException as exc:  # never let anything escape: the worker needs one verdict
        install_references()
        if _raised_in_student_code(exc):   # a trace function or finalizer of theirs ran in the grader's own code
            return _verdict(plan.id, False, "patched", _TAMPERED)
        return _verdict(plan.id, False, "checker_error", f"The grader failed on exercise {plan.id} "
                                                         f"({exception_name(exc)}: {exception_message(exc)}).")
