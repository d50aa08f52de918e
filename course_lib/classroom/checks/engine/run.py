"""One run of a check, from a notebook's ``checks.check_x(candidate)`` to its verdict: ``checker(id, example=...)``.

A checker never raises because of the student's code: its body returns a success message or raises
:class:`Failure`, and one run turns that, and anything else, into a :class:`CheckResult`, in this order:

1. options: the checker's own options (``norm_first``) are checked like the public API's arguments, their kind by
   the annotation and their range by the validator the checker declares (``options``), so that no value let
   through here is refused by an inner layer later (a ``checker_error``); the student's work (the parameters
   without a default) is judged, never refused.
2. time limit: where the platform can fork (Linux; not macOS, whose frameworks are unsafe after a fork; not
   once CUDA is initialised; not in a check's child; not in the grader's sandbox, which refuses to fork; not
   with ``COURSE_CHECK_IN_PROCESS=1``) the rest runs in a forked child, a copy of the kernel killed after
   :data:`TIME_LIMIT_S` (+ :data:`GRACE_S`): no ``except:`` or ignored signal outlasts it, and nothing the child
   changes reaches the kernel. In the child, and where there is no fork, SIGALRM (main thread only) raises
   :class:`CheckTimeout` in the student's code, again every 0.1 s should it be caught. On Windows or from a
   worker thread there is no limit; Ctrl-C (the stop button) always interrupts, except, where there is no
   fork, a loop of the student's that catches BaseException and goes on (then only restarting the kernel
   stops it; the grader's worker is killed from outside).
3. isolation: the check runs outside the cell's inference mode and autocast (``_plain_modes``); the interpreter
   is left as found (``_save``: settings, random states, warnings, sys.path, Ctrl-C's handler, the garbage
   collector ...), and course_lib is put back to the references
   pinned when ``checks`` was imported (``_references``): a student's patch of a reference can neither make
   a wrong answer pass nor a right one fail. torch's own functions replaced (``torch.equal = ...``), before
   the check or by the student's code during it, are the verdict ``patched`` (``pinned``).
4. the reference guard: the exercise's own reference doing the work is the verdict ``calls_reference``.
5. the verdict: a ``Failure`` gets its counter-example (``example``, for ``checks.hint``); the student's
   exception, ``sys.exit`` or endless loop is named; autograd refusing to walk back a graph once the student's
   code has run (a saved tensor changed in place, a result cut from its inputs) is ``mutation`` or
   ``gradient``, the cause named; any other exception raised by the checker itself (no student frame in its
   traceback) is ``checker_error``, never blamed on the student.
6. recording, unless ``graded=False`` (a demonstration on planted buggy code, a re-check used as a
   condition): the live room and the last verdict of each exercise (:func:`last`, for ``checks.hint`` and
   ``show_solution``). Under nbgrader (``NBGRADER_EXECUTION`` set) a failed graded check of an exercise with
   a solution region raises :class:`CheckNotPassed` so its test cell scores zero, and a passed one is
   displayed rather than returned, so nbgrader does not read the box as a partial score.
"""
from __future__ import annotations

import _thread
import contextlib
import dis
import functools
import gc
import importlib
import inspect
import itertools
import logging
import math
import numbers
import os
import pickle
import random
import select
import signal
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch

from .... import _validate as validate
from ... import progress
from ...exercises import BY_ID, EXERCISES
from ...verdict import CheckResult, Failure, fail
from .. import _pinned as pinned
from .._references import attributes, bind_references, install_references, pinned_attribute, restore_namespace
from .._student_code import CALLS as STUDENT_CALLS
from .._student_code import call as _call_student_code
from .._student_files import (
    exception_line,
    exception_message,
    exception_name,
    is_student_file,
    raised_in_student_code,
)
from .autograd_errors import named_cause
from .model_state import global_hooks_kept

__all__ = ["checker", "set_time_limit", "last", "forget", "CheckNotPassed", "CheckTimeout", "TIME_LIMIT_S", "can_fork",
           "CallsReference", "reference_of", "is_reference", "reference_message"]

_MOST_S = 86_400.0   # a day: past it the alarm's timestamps overflow, and no check needs it


def _time_limit(name: str, value: Any) -> float:
    """A limit in seconds, > 0 and at most a day (0, a negative number or NaN would switch it off)."""
    seconds = validate.positive_float(name, value, finite=True)
    if seconds > _MOST_S:
        raise ValueError(f"{name}: expected at most {_MOST_S:,.0f} seconds (a day), got {validate.describe(value)}")
    return seconds


def _time_limit_from_environment() -> float:
    text = os.environ.get("COURSE_CHECK_TIME_LIMIT", "60")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"COURSE_CHECK_TIME_LIMIT: expected a number of seconds > 0, got {text!r}") from None
    return _time_limit("COURSE_CHECK_TIME_LIMIT", value)


TIME_LIMIT_S = _time_limit_from_environment()
GRACE_S = 2.0      # after the child's own alarm should have rung, before the kill
_in_child = False  # True in a forked child: a check nested in a check runs in place
_LAST: dict[str, CheckResult] = {}
# Diagnoses with nothing to show side by side: no output, a crash, or a verdict about the course
_NO_EXAMPLE = ("not_implemented", "exception", "timeout", "checker_error", "missing", "crashed", "mutation",
               "patched")


def set_time_limit(seconds: float) -> None:
    """Give every later check ``seconds`` for the student's code (the grader sets it below its own kill)."""
    global TIME_LIMIT_S
    TIME_LIMIT_S = _time_limit("seconds", seconds)


def last(exercise: str) -> CheckResult | None:
    """The last graded verdict of ``exercise`` in this kernel (None before its first check)."""
    return _LAST.get(exercise)


def forget() -> None:
    """Forget every verdict, as a fresh kernel (tests)."""
    _LAST.clear()


class CheckTimeout(BaseException):
    """Raised by the alarm inside student code: a BaseException, so ``except Exception:`` cannot swallow it."""


class CheckNotPassed(AssertionError):
    """A graded check failed while nbgrader ran the notebook; the text is the verdict, ``result`` the verdict."""

    def __init__(self, result: CheckResult):
        super().__init__(str(result))
        self.result = result

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback (nbgrader's feedback too): the verdict, not our frames
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class Displayed(CheckResult):
    """A passed verdict under nbgrader: shown as a display, not as the cell result nbgrader reads as a score."""

    __slots__ = ()   # a tuple still: no attribute can be set on it either

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display({"text/plain": str(self), "text/html": self._repr_html_()}, raw=True)


# ---------------------------------------------------------------- the decorator

def checker(exercise: str, example: Callable[..., Any] | None = None,
            options: dict[str, Callable[[Any], Any]] | None = None
            ) -> Callable[[Callable[..., str | None]], Callable[..., CheckResult]]:
    """Decorate ``check(candidate, ...) -> str | None`` (a success message, or it raises Failure).
    ``example(candidate, ...)`` finds the counter-example of a failure (``engine.example``). ``options``: for an
    option whose annotation's kind lets through values the checker's inner layers refuse (a negative tolerance
    is a finite number), the inner layer's own validator (``validate(value)`` raises TypeError or ValueError
    naming the option), run here on any value but None. The decorated checker takes one more keyword, ``graded``
    (default True; see the module's docstring)."""
    validators = dict(options or {})

    def wrap(body: Callable[..., str | None]) -> Callable[..., CheckResult]:
        signature = inspect.signature(body)
        unknown = [name for name in validators if name not in signature.parameters
                   or signature.parameters[name].default is inspect.Parameter.empty]
        if unknown:
            raise ValueError(f"checker {exercise}: options {unknown} are not options of {body.__name__}")

        @functools.wraps(body)
        def check(*args: Any, graded: bool = True, **kwargs: Any) -> CheckResult:
            validate.boolean("graded", graded)
            _check_options(body.__name__, signature, args, kwargs, validators)
            judge = functools.partial(_judge, exercise, body, example, args, kwargs)
            forks = can_fork()
            if forks:
                reference_of(exercise), same_work_of(exercise)   # looked up here: a child's lookups die with it
            else:   # the kernel's own process (not the grader's sandbox: its judge compares torch's state)
                import_lazy_modules()   # before the time limit, which would otherwise cut them short
            modes = pinned.set_aside_modes()   # a torch mode of the kernel's would answer the check's comparisons
            try:
                result = _forked(judge, exercise) if forks else None   # None: this process may not fork
                result = judge() if result is None else result   # (a failed verdict is falsy)
            finally:
                pinned.restore_modes(modes)   # the kernel keeps its own, as it had them
            if not graded:
                return result
            if os.environ.get(progress.PROGRESS_DIR_ENV, "").strip():   # the live room, only where one is open
                progress.record(result, getattr(args[0], "__name__", None) if args else None)   # never raises
            _LAST[exercise] = result   # checks.hint follows the last verdict
            entry = BY_ID.get(exercise)
            if not os.environ.get("NBGRADER_EXECUTION") or (entry is not None and not entry.has_solution):
                return result
            if not result.passed:   # under nbgrader: the test cell scores zero
                raise CheckNotPassed(result)
            return Displayed(result.exercise, True, result.diagnosis, result.message, result.details)
        check.exercise = exercise   # type: ignore[attr-defined]
        check.example = example     # type: ignore[attr-defined]
        return check
    return wrap


# Modules torch imports lazily, the first time a check's code reaches them: torch._dynamo (with sympy under it) on
# the first optimizer step or autograd.Function. In the kernel's own process a time limit landing inside such an
# import left the package half-imported (sympy without sympy.core), and every later check was a checker_error until
# the kernel restarted. They are imported once, before the first check's time limit, where checks run in the
# kernel's process (about 2 s, which a later check would have spent anyway). A forked child's imports die with it.
LAZY_MODULES = ("torch._dynamo",)
_LAZY_DONE = [False]


def import_lazy_modules() -> None:
    """Import ``LAZY_MODULES`` once per process (a torch without one of them: nothing to do)."""
    if _LAZY_DONE[0]:
        return
    _LAZY_DONE[0] = True
    for name in LAZY_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


# What an option's annotation accepts, by its name: the words of the message, and the test.
_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "bool": ("True or False (a bool)", lambda v: isinstance(v, bool)),
    "int": ("an int", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
    "float": ("a finite number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
              and math.isfinite(v)),
    "str": ("a str", lambda v: isinstance(v, str)),
    "None": ("None", lambda v: v is None),
}


def _check_options(name: str, signature: inspect.Signature, args: tuple, kwargs: dict,
                   validators: dict[str, Callable[[Any], Any]] | None = None) -> None:
    """``name: option: expected ..., got ...`` for an option (a parameter with a default) of the wrong kind
    (TypeError), or of the right kind but a value its validator refuses (its error, the checker named)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        shown = ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                          for p in signature.parameters.values())
        raise TypeError(f"{name}: {exc}. Call it as {name}({shown}).") from None
    for option, value in bound.arguments.items():
        parameter = signature.parameters[option]
        if parameter.default is parameter.empty:
            continue
        hint = parameter.annotation if parameter.annotation is not parameter.empty else type(parameter.default)
        text = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
        kinds = [_KINDS[word.strip()] for word in text.split("|") if word.strip() in _KINDS]
        if kinds and not any(accepts(value) for _, accepts in kinds):
            raise TypeError(f"{name}: {option}: expected {' or '.join(w for w, _ in kinds)}, "
                            f"got {validate.describe(value)}")
        check_value = (validators or {}).get(option)
        if check_value is not None and value is not None:
            try:
                check_value(value)
            except (TypeError, ValueError) as exc:   # the inner layer's words: the option, what it takes, the value
                raise type(exc)(f"{name}: {exc}") from None


# ---------------------------------------------------------------- one run, in this process

def _judge(exercise: str, body: Callable[..., str | None], example: Callable[..., Any] | None,
           args: tuple, kwargs: dict) -> CheckResult:
    """Run ``body`` isolated, under the pinned references, the alarm and the guard: always a verdict. The run gives
    its fields (a tuple: no CheckResult is made while the student's code may have changed its class), and the
    verdict is made after the interpreter is put back: nothing left for the restore to run can change it."""
    state = _save()
    try:
        fields = _outcome(exercise, body, example, args, kwargs)
    finally:
        state()
        bind_references()   # modules first imported during this check (course_lib.hf)
    return CheckResult(*fields)


def _outcome(exercise: str, body: Callable[..., str | None], example: Callable[..., Any] | None,
             args: tuple, kwargs: dict) -> tuple[Any, ...]:
    """``_judge``'s run, before the interpreter is put back: the verdict's fields."""
    calls_before = STUDENT_CALLS[0]
    try:
        install_references()
        # One thread: on tensors this small, waking a thread pool costs far more than it saves (up to 50x
        # on a busy machine), and a check should answer at once.
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        if hasattr(torch, "set_default_device"):
            torch.set_default_device(None)   # inputs and references on the CPU, whatever the notebook set
        pinned.expect_unpatched(written=True)   # torch.equal replaced before the check: nothing can be compared
        # a check runs as a cell does outside any mode the notebook is in: under torch.inference_mode() nothing
        # it builds could be differentiated, and under autocast the reference would compute in half precision
        with _plain_modes(), _alarm(TIME_LIMIT_S), _guard(exercise, args), global_hooks_kept():
            try:
                message = body(*args, **kwargs)
                pinned.expect_unpatched()   # replaced by code the check ran outside _student_code.call
            except Failure as failure:   # the smallest input that shows the mistake, for checks.hint
                _attach(exercise, failure, args, kwargs, example)
                raise
        return _fields(exercise, True, None, message or "Matches the reference implementation.")
    except Failure as failure:
        return _fields(exercise, False, failure.diagnosis, failure.message, failure.details)
    except CallsReference as found:   # the exercise's own reference did the work
        return _fields(exercise, False, "calls_reference", reference_message(found))
    except CheckTimeout:
        return _timed_out_fields(exercise)
    except NotImplementedError as exc:
        if not raised_in_student_code(exc):   # torch, on an odd tensor the student's code returned
            return _fields(exercise, False, "dtype", f"What your code returned cannot be compared "
                                                         f"({(exception_message(exc).splitlines() or [exception_name(exc)])[0]}"
                                                         f"): return ordinary dense tensors.")
        return _fields(exercise, False, "not_implemented",
                           f"Not written yet ({exception_message(exc) or 'NotImplementedError'}). Replace the "
                           f"`raise NotImplementedError`, then re-run.")
    except SystemExit as exc:
        return _fields(exercise, False, "exception",
                           f"Your code called sys.exit({'' if exc.code is None else repr(exc.code)}) "
                           f"(or exit()): that would stop the kernel. Return a value instead.")
    except KeyboardInterrupt:   # the stop button: it must still stop
        raise
    except BaseException as exc:  # a checker never raises: GeneratorExit, BaseException subclasses too
        if raised_in_student_code(exc):
            return _fields(exercise, False, "exception",
                               f"Your code raised {exception_line(exc)}")
        broken_graph = _autograd_failure(exc) if STUDENT_CALLS[0] > calls_before else None
        if broken_graph is not None:   # autograd walked back through what the student's code returned
            return _fields(exercise, False, *broken_graph)
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {os.path.basename(where.filename)}:{where.lineno}" if where else ""
        return _checker_error_fields(exercise, f"{exception_name(exc)}{at}: {exception_message(exc)}",
                              " The cells below still run with the course's reference.", exc)


@contextlib.contextmanager
def _plain_modes() -> Any:
    """Inference mode and autocast off for the check, as they were after it (both are the thread's own)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        for device in ("cpu", "cuda"):
            if device == "cpu" or torch.cuda.is_available():
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _attach(exercise: str, failure: Failure, args: tuple, kwargs: dict,
            example: Callable[..., Any] | None) -> None:
    """Put the counter-example on ``failure`` (details["counterexample"]) when one is found: the exercise's own
    ``example(*args, **kwargs)``. Never raises but for Ctrl-C: a search that fails or runs out of time just
    finds none."""
    if failure.diagnosis in _NO_EXAMPLE or "counterexample" in failure.details or not args or example is None:
        return
    try:
        found = example(*args, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - the time limit, or anything else: no counter-example
        return
    if found is not None:
        failure.details["counterexample"] = found


def _autograd_failure(exc: BaseException) -> tuple[str, str] | None:
    """``(diagnosis, message)`` when ``exc`` is autograd refusing to walk back a graph (raised inside torch's
    ``backward`` or ``autograd.grad``, for a check that backpropagates through what the student's code
    returned): the student's verdict, with the cause named; None for anything else (the checker's own)."""
    if not isinstance(exc, RuntimeError):
        return None
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    torch_root = os.path.dirname(torch.__file__)
    if not any(f.filename.startswith(torch_root) and f.name in ("backward", "grad", "_engine_run_backward")
               for f in frames):
        return None
    text = str(exc)
    named = named_cause(text)
    if named is not None:
        return named[0], f"Backpropagating through your code failed: {named[1]}. (autograd: {text.splitlines()[0]})"
    return "gradient", f"Backpropagating through your code failed: {text.splitlines()[0] if text else type(exc).__name__}."


def _fields(exercise: str, passed: bool, diagnosis: str | None, message: str, details: Any = None
            ) -> tuple[Any, ...]:
    """A verdict's fields, as CheckResult takes them."""
    return exercise, passed, diagnosis, message, {} if details is None else details


def _timed_out_fields(exercise: str) -> tuple[Any, ...]:
    return _fields(exercise, False, "timeout", f"Your code did not finish within {TIME_LIMIT_S:g} seconds, so the "
                                               f"check was stopped. Look for a loop that never ends (a `while` whose "
                                               f"condition never changes), or work that grows with every step. "
                                               f"On a busy machine (other programs running, a shared server) right "
                                               f"code can take longer too: run the cell again when it is quieter, "
                                               f"or start Jupyter with COURSE_CHECK_TIME_LIMIT=120.")


def _timed_out(exercise: str) -> CheckResult:
    return CheckResult(*_timed_out_fields(exercise))


def _checker_error_fields(exercise: str, what: str, more: str = "", exc: BaseException | None = None
                          ) -> tuple[Any, ...]:
    return _fields(exercise, False, "checker_error",
                   f"The checker for exercise {exercise} failed ({what}). This is a bug in the course, not "
                   f"necessarily in your code: please report it with this message.{more}",
                   {"exception": exc} if exc is not None else {})


def _checker_error(exercise: str, what: str, more: str = "", exc: BaseException | None = None) -> CheckResult:
    return CheckResult(*_checker_error_fields(exercise, what, more, exc))


# Settings a check may change, as (read, write) taken when the course is imported (before any student's code
# runs): each is put back as it was. The number of threads is looked up by name when used: a forked child
# replaces torch.set_num_threads (and pins the replacement).
_SETTINGS = ((torch.is_grad_enabled, torch.set_grad_enabled), (torch.get_default_dtype, torch.set_default_dtype),
             *(((torch.get_default_device, torch.set_default_device),) if hasattr(torch, "get_default_device") else ()),
             (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
             (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
             (random.getstate, random.setstate))
_ANOMALY, _SET_ANOMALY = (torch.is_anomaly_enabled, torch.is_anomaly_check_nan_enabled), torch.set_anomaly_enabled
_GET_RNG, _SET_RNG, _GETCWD, _CHDIR, _ENVIRON = torch.get_rng_state, torch.set_rng_state, os.getcwd, os.chdir, \
    os.environ


def _save() -> Callable[[], None]:
    """Save the interpreter's state a check may change; the function returned puts it back, each part on its own
    (one that fails leaves the others to run, and the check's verdict stands) and with nothing the student's code
    could have replaced: the functions taken at import, the objects themselves."""
    numpy = sys.modules.get("numpy")
    settings = [(read, write, read()) for read, write in _SETTINGS]
    threads = torch.get_num_threads()
    anomaly = tuple(read() for read in _ANOMALY)
    cwd, spaces, rng = _cwd(), attributes(), _GET_RNG()
    environ = dict(_ENVIRON)
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    # numpy's own setter as the kernel has it now (numpy may be imported after the course)
    numpy_state = (numpy.random.set_state, numpy.random.get_state()) if numpy is not None else None
    functions = pinned.save()   # torch's functions as the kernel has them (replaced or not)
    interpreter = _interpreter_state()

    def environment() -> None:
        os.environ = _ENVIRON   # noqa: B003 - the object itself, which code may have replaced; its contents below
        if dict(_ENVIRON) != environ:
            for name in [n for n in _ENVIRON if n not in environ]:
                del _ENVIRON[name]
            _ENVIRON.update({n: v for n, v in environ.items() if _ENVIRON.get(n) != v})

    def steps() -> list[Callable[[], None]]:
        done = [functions, lambda: _restore_interpreter(interpreter)]
        # compared first (values of torch's and random's own types): setting a default device that is already
        # the default would still put a mode on torch's stack
        done += [lambda read=read, write=write, value=value: read() == value or write(value)
                 for read, write, value in settings]
        done += [lambda: torch.get_num_threads() == threads or torch.set_num_threads(threads),
                 lambda: _SET_ANOMALY(*anomaly), environment, lambda: _SET_RNG(rng)]
        if cwd is not None:
            done.append(lambda: _GETCWD() == cwd or _CHDIR(cwd))
        if cuda_rng is not None:
            done.append(lambda: torch.cuda.set_rng_state_all(cuda_rng))
        if numpy_state is not None:
            set_state, state = numpy_state
            done.append(lambda: set_state(state))
        done += [lambda obj=obj, saved=saved: restore_namespace(obj, saved) for obj, saved in spaces.items()]
        return done

    def restore() -> None:
        for step in steps():
            try:
                step()
            except Exception:  # noqa: BLE001 - the rest is still put back; the check's verdict stands
                pass
    return restore


# The interpreter's own setters and the objects they act on, taken when the course is imported (before any
# student's code runs): putting the interpreter back calls these, never what the modules hold by then.
_SET_RECURSION_LIMIT, _RECURSION_LIMIT = sys.setrecursionlimit, sys.getrecursionlimit
_GC_ENABLE, _GC_DISABLE, _GC_ENABLED = gc.enable, gc.disable, gc.isenabled
_MKLDNN_MODULE, _MKLDNN_ENABLED, _SET_MKLDNN = torch.backends.mkldnn, torch._C._get_mkldnn_enabled, \
    torch._C._set_mkldnn_enabled
# warnings' cache of "already shown" is told the filters changed (its name differs between Python versions)
_FILTERS_MUTATED = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held",
                                                                           lambda: None)
_GETSIGNAL = signal.getsignal   # (signal.signal itself in _restore_interpreter's defaults: no module's name holds it)
_LOGGER = logging.Logger


def _interpreter_state() -> dict[str, Any]:
    """What a student's code can switch in the interpreter while a check runs it in this process (a forked child
    takes its own copy): warnings, the recursion limit, sys.path, Ctrl-C's handler, the garbage collector,
    oneDNN, torch's print options, logging's switch. The objects themselves are kept too: code that replaces
    them (``sys.path = None``) gets them back as they were."""
    options = torch._tensor_str.PRINT_OPTS
    state = {"filters": (warnings.filters, list(warnings.filters)), "recursion": _RECURSION_LIMIT(),
             "path": (sys.path, list(sys.path)), "gc": _GC_ENABLED(), "mkldnn": _MKLDNN_ENABLED(),
             "print": (options, dict(vars(options))),
             "logging": (logging.root, _LOGGER.manager, _LOGGER.manager.disable)}
    if threading.current_thread() is threading.main_thread():
        state["sigint"] = _GETSIGNAL(signal.SIGINT)
    return state


def _restore_interpreter(state: dict[str, Any], _signal: Callable[..., Any] = signal.signal) -> None:
    """Every setting put back as saved, whatever it is now: nothing is compared or read that the student's code
    could have replaced (a value whose ``!=`` runs code), and a step that fails leaves the others to run."""
    def filters() -> None:
        kept, contents = state["filters"]
        warnings.filters = kept
        kept[:] = contents
        _FILTERS_MUTATED()

    def path() -> None:
        kept, contents = state["path"]
        sys.path = kept
        kept[:] = contents

    def options() -> None:
        kept, contents = state["print"]
        torch._tensor_str.PRINT_OPTS = kept
        vars(kept).update(contents)

    def logs() -> None:
        root, manager, disabled = state["logging"]
        logging.root = _LOGGER.root = root
        _LOGGER.manager = manager
        manager.disable = disabled
        loggers = vars(manager).get("loggerDict")
        for logger in [root, *(dict.values(loggers) if type(loggers) is dict else ())]:   # the levels they cached
            cache = vars(logger).get("_cache") if isinstance(logger, _LOGGER) else None
            if type(cache) is dict:
                cache.clear()

    def mkldnn() -> None:
        torch.backends.mkldnn = _MKLDNN_MODULE
        _SET_MKLDNN(state["mkldnn"])

    steps = [filters, path, options, logs, mkldnn, lambda: _SET_RECURSION_LIMIT(state["recursion"]),
             _GC_ENABLE if state["gc"] else _GC_DISABLE]
    if "sigint" in state:
        steps.append(lambda: _GETSIGNAL(signal.SIGINT) is state["sigint"] or _signal(signal.SIGINT, state["sigint"]))
    for step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - the rest is still put back; the check's verdict stands
            pass


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:   # the working directory was deleted under us
        return None


class _alarm:  # noqa: N801 - used as a context, like a function
    """SIGALRM after ``seconds`` on the main thread where the platform has it; otherwise nothing."""

    def __init__(self, seconds: float):
        self.seconds, self.armed = seconds, False

    def __enter__(self) -> None:
        if (hasattr(signal, "SIGALRM") and hasattr(signal, "setitimer") and self.seconds > 0
                and threading.current_thread() is threading.main_thread()
                and signal.getitimer(signal.ITIMER_REAL)[0] == 0):   # never override a timer already set
            self.previous = signal.signal(signal.SIGALRM, _ring)   # None: a handler not set from Python
            signal.setitimer(signal.ITIMER_REAL, self.seconds, 0.1)   # again and again, should it be caught
            self.armed = True
        self.interrupting = (threading.current_thread() is threading.main_thread()
                             and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self.interrupting:   # the same KeyboardInterrupt, told apart when it lands in the guard's hook
            signal.signal(signal.SIGINT, _interrupt)

    def __exit__(self, *exc: Any) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        if self.interrupting and signal.getsignal(signal.SIGINT) is _interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _ring(signum: int, frame: Any) -> None:
    _mark_unwinding(frame)
    raise CheckTimeout


def _interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C while a check runs: Python's own KeyboardInterrupt, marked when it lands in the guard's hook."""
    _mark_unwinding(frame)
    raise KeyboardInterrupt


def _mark_unwinding(frame: Any) -> None:
    """A signal landing in the guard's hook (even before its ``try``) makes Python unset it: the guard's own doing."""
    while frame is not None:
        if frame.f_code in _HOOK_CODES:
            _UNWINDING[0] = True
            return
        frame = frame.f_back


# ---------------------------------------------------------------- the reference guard
# While an exercise is checked, the course's own version of it (one name away in the notebook, which carries on
# with it) is out of the student's reach: a candidate that is it, wraps it (``def causal_mask(n, _c=causal_mask):
# return _c(n)``) or subclasses it and inherits the work is refused before the check; the reference's own code
# starting while the student's code is on the stack between it and the check (a profile hook that watches only
# the reference's code objects) ends it. Either way: ``calls_reference``. A subclass that writes its own forward
# on the constructor the exercise gives is judged like any code, and the checker's own calls of the reference
# (to compare) run as before. A guard against the easy ways, not a wall: a copy of the reference's text is
# flagged apart by the grader, which also refuses a student's name bound to the reference (``grading.judge``).

class CallsReference(BaseException):
    """The student's code handed the work to the course's own version of the exercise. A BaseException, so
    that ``except Exception`` in the student's code cannot swallow it."""

    def __init__(self, exercise: str, name: str, how: str, called: str = ""):
        self.exercise, self.name, self.how, self.called = exercise, name, how, called or name
        super().__init__(f"{how} the course's own {self.called}")


@functools.cache
def reference_of(exercise: str) -> Any:
    """The course's own object for ``exercise`` (a function or a class), where the table says it lives; or None.
    Only that one module is imported (a check forks, so whatever it imports is imported again in every child).
    Read as pinned: a notebook that rebinds the name before its first check must not become the reference."""
    return _course_object(next((e.reference for e in EXERCISES if e.id == exercise and e.has_solution), ""))


# The checks' own models of the answers: each is the course's answer with every slip switched off (by default), so
# that a student's code that calls one hands the work over as surely as a call of the reference does.
CHECKS_ANSWERS = ("classroom.checks._attn_hypotheses.sdpa_variant", "classroom.checks._attn_hypotheses.allowed_pattern",
                  "classroom.checks._attn_hypotheses.module_variant", "classroom.checks._flash_variants.softmax_variant",
                  "classroom.checks._flash_variants.forward_variant", "classroom.checks._flash_variants.backward_variant",
                  "classroom.checks._gqa_variants.rotary_variant", "classroom.checks._heads_scores.variant",
                  "classroom.checks.notebook04._table", "classroom.checks.notebook12._mla")


@functools.cache
def same_work_of(exercise: str) -> tuple[Any, ...]:
    """The course's other functions that do the exercise's whole work: the table's ``same_work``, and the checks'
    own models of the answers (``CHECKS_ANSWERS``)."""
    entry = BY_ID.get(exercise)
    named = entry.same_work if entry and entry.has_solution else ()
    found = (_course_object(where) for where in (*named, *(CHECKS_ANSWERS if entry and entry.has_solution else ())))
    return tuple(value for value in found if value is not None)


# The checks' own code that computes answers: their models of each exercise (the variants above and the helpers
# they are built from) and the declarations. The harness (calling the student, hooks, probes, pinned references)
# is left out: it runs beside the student's code by design.
_ANSWERING_MODULES = ("_attn_hypotheses", "_flash_variants", "_gqa_variants", "_heads_scores",
                      *(f"notebook{number:02d}" for number in range(1, 13)))


def _nested_codes(code: CodeType) -> list[CodeType]:
    return [code] + [inner for const in code.co_consts if isinstance(const, CodeType) for inner in _nested_codes(const)]


@functools.cache
def checks_answering_codes() -> frozenset[CodeType]:
    """Every function the checks' answering modules define at their top level (with the functions nested in it).
    Their classes are left out: those are objects a check hands to the student's code to use (9.6's cache whose
    ``append`` the student calls, 12.2's layer)."""
    codes: set[CodeType] = set()
    for name in _ANSWERING_MODULES:
        module = importlib.import_module(f"course_lib.classroom.checks.{name}")
        for value in vars(module).values():
            if isinstance(value, type) or getattr(value, "__module__", None) != module.__name__:
                continue
            code = _own_code(value)
            if code is not None:
                codes.update(inner for inner in _nested_codes(code) if not inner.co_name.startswith("__"))
    return frozenset(codes)


def bound_to_course_work(exercise: str, candidate: Any) -> CallsReference | None:
    """The verdict's exception when ``candidate`` (what the student's name is bound to) is one of the course's
    other functions that do the exercise's work (imported under the exercise's name, wrapped, copied)."""
    for value in same_work_of(exercise):
        how = is_reference(candidate, value)
        if how is not None:
            return CallsReference(exercise, BY_ID[exercise].name, how, getattr(value, "__name__", "function"))
    return None


def _course_object(where: str) -> Any:
    """The callable named ``"module.name"`` under course_lib, as pinned; None where there is none."""
    if not where:
        return None
    module_name, name = where.rsplit(".", 1)
    try:
        module = importlib.import_module(f"course_lib.{module_name}")
    except Exception:  # an optional module that cannot load here
        return None
    found = pinned_attribute(module, name)
    return found if callable(found) and getattr(found, "__module__", "").startswith("course_lib.") else None


def _own_code(value: Any) -> CodeType | None:
    """The code of a function (a method, property, staticmethod; under its decorators), if it is the course's."""
    value = getattr(value, "__func__", value)
    value = value.fget if isinstance(value, property) else value
    try:
        code = getattr(inspect.unwrap(value), "__code__", None)
    except ValueError:   # a cycle of __wrapped__
        return None
    if isinstance(code, CodeType) and "course_lib" in code.co_filename.replace("\\", "/").split("/"):
        return code
    return None


def _codes(reference: Any) -> dict[str, CodeType]:
    """The reference's own code by name: the function's, or the methods a class defines."""
    values = vars(reference).items() if isinstance(reference, type) else [("", reference)]
    return {name: code for name, value in values if (code := _own_code(value)) is not None}


# Instructions that say nothing of what a function computes, and the ones a compiler picks by context for the same
# source: the course's module (``from __future__ import annotations``) loads a method with LOAD_ATTR where the same
# text compiled alone uses LOAD_METHOD, and jumps land at other offsets.
_UNSAID = frozenset({"CACHE", "NOP", "RESUME", "EXTENDED_ARG", "PRECALL", "PUSH_NULL"})
_SAME_AS = {"LOAD_METHOD": "LOAD_ATTR"}
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


@functools.cache
def _print(code: CodeType) -> tuple:
    """What a code object computes, whatever its name, file and first line: its instructions with what they load
    and call by name or value (code among them by its own print). A copy made with ``code.replace(co_name=...)``,
    or compiled again from the course's source under another name or alone, has the print of the course's code."""
    def said(value: Any) -> Any:
        return _print(value) if isinstance(value, CodeType) else (type(value).__name__, repr(value))
    return tuple((_SAME_AS.get(i.opname, i.opname), None if i.opcode in _JUMPS else said(i.argval))
                 for i in dis.get_instructions(code) if i.opname not in _UNSAID)


def _is_course_work(code: CodeType | None, watched: frozenset[CodeType]) -> bool:
    """Whether ``code`` is one of ``watched`` or a copy of one (the same print)."""
    return code is not None and (code in watched or _print(code) in {_print(c) for c in watched})


def _work_names(reference: Any) -> frozenset[str]:
    """The names of the reference's methods that are the exercise's work. Of a module, ``forward``: the exercise
    cell gives the rest written out as the course writes it (the constructor, 9.6's ``new_cache``), so calling
    them is using what the cell gave. Of another class, every method but the constructor (10.3 asks for
    ``forward`` and ``backward``); of a function, itself."""
    codes = _codes(reference)
    if isinstance(reference, type) and issubclass(reference, torch.nn.Module):
        return frozenset({"forward"} & set(codes))
    return frozenset(set(codes) - {"__init__"})


def _watched(reference: Any) -> frozenset[CodeType]:
    """The code that is the reference's work (``_work_names``)."""
    work = _work_names(reference)
    return frozenset(code for name, code in _codes(reference).items() if name in work)


def is_reference(candidate: Any, reference: Any) -> str | None:
    """How ``candidate`` is the reference without being the student's code: "is", "subclasses", "wraps",
    "is a copy of", or None when it is not."""
    if candidate is reference:
        return "is"
    if isinstance(reference, type) and isinstance(candidate, type) and issubclass(candidate, reference):
        # A subclass that writes one of the reference's work methods is the student's code; its calls of the
        # reference run under the guard.
        work = _work_names(reference)
        above = candidate.__mro__[:candidate.__mro__.index(reference)]
        written = any(not _is_course_work(_any_code(vars(k)[n]), _watched(reference))
                      for k in above for n in work & set(vars(k)))
        return None if written else "subclasses"
    inner = candidate
    for _ in range(10):   # functools.partial, functools.wraps, bound methods
        inner = getattr(inner, "func", None) or getattr(inner, "__wrapped__", None) or getattr(inner, "__func__", None)
        if inner is reference:
            return "wraps"
        if inner is None:
            break
    code = _any_code(candidate) if callable(candidate) and not isinstance(candidate, type) else None
    return "is a copy of" if _is_course_work(code, _watched(reference)) else None


def _any_code(value: Any) -> CodeType | None:
    """The code of a function, whoever wrote it (a copy of the course's may say it was compiled elsewhere)."""
    try:
        code = getattr(inspect.unwrap(getattr(value, "__func__", value)), "__code__", None)
    except ValueError:   # a cycle of __wrapped__
        return None
    return code if isinstance(code, CodeType) else None


def reference_message(found: CallsReference) -> str:
    """The verdict's message: what the code did, and what the exercise asks for instead."""
    did = "is" if found.how == "is a copy of" else found.how if found.how in ("is", "subclasses", "wraps", "calls") \
        else "uses"
    # the exercise's name, not the reference's (7.2's reference is course_attention_forward, the student's
    # function attention_forward)
    asked = BY_ID[found.exercise].name if found.exercise in BY_ID else found.name
    return (f"Your code {did} the course's own {found.called} instead of doing the work itself. Exercise "
            f"{found.exercise} asks you to write {asked} yourself: replace the call with your own "
            f"computation, then re-run the check.")


_MANAGER_HELPER = contextlib.contextmanager(lambda: iter(())).__code__   # the one helper of every @contextmanager
# The frame in which the check calls the student's code (``_student_code.call``): the reference's code starting
# above it runs on the student's behalf, whether a frame of theirs or C (a ``__call__`` that is the reference, a
# metaclass's, ``operator.call``, torch calling a ``forward`` copied onto their class) called it.
_STUDENT_CALL = _call_student_code.__code__


def _course_made(fn: Any) -> bool:
    """Whether what ``_student_code.call`` was handed is the course's own (a check's lambda around the reference,
    the reference's module): then the reference runs at the check's request."""
    return _own_code(fn) is not None or getattr(type(fn), "__module__", "").startswith("course_lib.")
_GUARDED = [0]   # guards entered and not left: a checker the checker itself calls is not guarded again


# The guard's watch: what its watcher watches, as one exact tuple (``_guard._watch_of`` builds it). The student's code
# reaches the watcher through ``sys.getprofile()``; a tuple's items cannot be rebound and its class cannot be swapped,
# where an object's attributes could be (the reference's codes emptied while the student's code calls it).
# the watch's items, by position
(_CODES, _NAMESETS, _PRINTS, _ANSWERING, _MANAGER, _NAMES, _EXERCISE, _NAME, _LETS_REFERENCE, _STOP, _THREAD, _TRIPS,
 _FOUND, _IDS, _ANSWER_NAMES, _ANSWER_PLACES) = range(16)


def _trip(watch: tuple, code: CodeType, *, said: Callable[[CodeType], tuple] = _print) -> CallsReference:
    """Count a trip (a counter only counts up: no code of the student's can take one back) and say which function."""
    next(watch[_TRIPS])
    named = watch[_NAMES].get(code) or watch[_PRINTS].get(said(code)) or code.co_name
    return CallsReference(watch[_EXERCISE], watch[_NAME], "calls", named)


def _watch(watch: tuple, frame: FrameType, *, trip: Callable[..., CallsReference] = _trip,
           said: Callable[[CodeType], tuple] = _print, students: Callable[[str], bool] = is_student_file,
           made: Callable[[Any], bool] = _course_made, thread: Callable[[], int] = threading.get_ident) -> None:
    """Trip on a call of the reference (or an answer of the checks) made for the student's code; its helpers bound as
    defaults (see ``_hook``)."""
    code = frame.f_code
    codes, answering = watch[_CODES], watch[_ANSWERING]
    if code in answering:
        caller = frame.f_back
        if caller is not None and id(caller) != watch[_STOP] and \
                caller.f_code not in answering and students(caller.f_code.co_filename):
            raise trip(watch, code)
    if code not in codes and (code.co_names not in watch[_NAMESETS] or said(code) not in watch[_PRINTS]):
        return
    if code is _MANAGER_HELPER and frame.f_locals.get("func") is not watch[_MANAGER]:
        return   # another context manager made by @contextmanager
    if thread() != watch[_THREAD]:   # a thread the student's code started: nothing else runs one
        raise trip(watch, code)
    caller = frame.f_back
    while caller is not None and id(caller) != watch[_STOP]:
        if caller.f_code not in codes and (students(caller.f_code.co_filename) or (
                caller.f_code is _STUDENT_CALL and not watch[_LETS_REFERENCE]
                and not made(caller.f_locals.get("fn")))):
            raise trip(watch, code)
        caller = caller.f_back


def _hook(watch: tuple, frame: FrameType, event: str, arg: Any, watching: Callable[..., None] = _watch) -> None:
    """The guard's profile function, bound to its watch (``types.MethodType``, whose ``__self__`` is the tuple). Python
    calls it on every call and return, of C functions too (millions in a check whose code runs on meta, where torch's
    shape rules are Python): all but a call of code that might be watched return at once. The watched codes by their
    ids (held by the watch, so the ids are theirs); a copy of the reference's by the names it uses, as ``_watch``
    tells copies; a copy equal to an answer of the checks by its name and first line, which equal codes share.
    The watcher is bound as a default, not looked up: a name of the module could be rebound while the student's code
    runs and put back before the check ends (a default is a code attribute, which the grader's sandbox refuses).
    """
    if event != "call":
        return
    code = frame.f_code
    if id(code) not in watch[_IDS] and code.co_names not in watch[_NAMESETS] and not (
            code.co_name in watch[_ANSWER_NAMES] and (code.co_name, code.co_firstlineno) in watch[_ANSWER_PLACES]):
        return
    try:
        watching(watch, frame)
    except BaseException as exc:
        # Python unsets a profile function that raises: the trip below, or Ctrl-C and the time limit landing
        # while it runs. That one unset is the guard's own doing (_UNWINDING lets exactly it through); the
        # profiler is then off, which only the exception itself reaching __exit__ excuses.
        watch[_FOUND].append(exc)
        _UNWINDING[0] = True
        raise


class _guard:  # noqa: N801 - used as a context, like a function
    """Refuse a candidate (``args[0]``) that is the exercise's reference in disguise, then watch the reference's
    code while the check runs. The reference itself is let through: the course's tests and demonstrations
    check it as the known-good answer."""

    def __init__(self, exercise: str, args: tuple):
        # inside a check (a check the student's code calls) the outer guard holds, and this one does nothing at
        # all: were it to set the profiler back on leaving, it would cover for whatever switched it off inside
        self.nested = _GUARDED[0] > 0
        reference = reference_of(exercise) if not self.nested else None
        self.exercise, self.name = exercise, getattr(reference, "__name__", "reference")
        how = is_reference(args[0], reference) if args and reference is not None else None
        if how and how != "is":
            raise CallsReference(exercise, self.name, how)
        self.lets_reference = how == "is"   # the course's tests check the reference itself as the known-good answer
        bound = bound_to_course_work(exercise, args[0]) if args and reference is not None else None
        if bound is not None:
            raise bound
        self.codes = _watched(reference) if reference is not None else frozenset()
        # the course's functions that do the same work under another name, each named in the verdict
        same_work = same_work_of(exercise) if reference is not None else ()
        self.names = {code: value.__name__ for value in same_work for code in _watched(value)}
        self.codes = self.codes | frozenset(self.names)
        # a copy of that code (types.FunctionType(code.replace(co_name=...), ...), its source compiled again) is
        # watched by its print; the names it uses first, which a call of anything else fails at once
        self.namesets = frozenset(code.co_names for code in self.codes)
        self.prints = {_print(code): self.names.get(code, self.name) for code in self.codes}
        # A reference that is a context manager (11.3) does its work when the check enters it, after the student's
        # function returned it: its creation is the call to watch, contextlib's helper (shared by every
        # @contextmanager) with the reference's own generator function as its ``func``.
        wrapped = getattr(reference, "__wrapped__", None)
        self.manager = wrapped if getattr(reference, "__code__", None) is _MANAGER_HELPER else None
        if self.manager is not None:
            self.codes = self.codes | {_MANAGER_HELPER}
        # the checks' own answers, called straight from the student's code (a hook or probe of the checks runs
        # from torch's frames, never straight from the student's)
        self.answering = checks_answering_codes() if reference is not None else frozenset()

    def _watch_of(self, stop: int) -> tuple:
        """The watch, as an exact tuple (no attribute to rebind, no class to swap): what ``_hook`` reads. Mappings
        are read-only views; the trip counter only counts up; the list holds what went through the hook."""
        return tuple((self.codes, self.namesets, types.MappingProxyType(self.prints), self.answering, self.manager,
                      types.MappingProxyType(self.names), self.exercise, self.name, self.lets_reference, stop,
                      threading.get_ident(), itertools.count(), [], frozenset(map(id, self.codes | self.answering)),
                      frozenset(code.co_name for code in self.answering),
                      frozenset((code.co_name, code.co_firstlineno) for code in self.answering)))

    def __enter__(self) -> None:
        _GUARDED[0] += 1
        if self.nested:
            return
        self.previous = sys.getprofile()
        self.threading_previous = threading.getprofile()
        # the check's own frame, by its id (alive while the guard is: the id is its own), the student's code is what
        # runs above it; not the frame, which the guard's hook would hand to whoever reads sys.getprofile()
        self.watch = self._watch_of(id(sys._getframe(1)))
        self.trips = next(self.watch[_TRIPS])   # kept here, where the student's code does not reach
        if self.codes:
            self.watcher = types.MethodType(_hook, self.watch)   # one object, the same everywhere it is set and compared
            _own_setprofile(self.watcher)
            threading.setprofile(self.watcher)   # a thread the student's code starts is watched too
            _WATCHING[0] = self.watcher

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if self.nested:
            _GUARDED[0] -= 1
            return
        _WATCHING[0] = None
        found = list(self.watch[_FOUND])
        excused = exc is not None and any(exc is went for went in found)
        switched_off = bool(self.codes) and not excused and (
            sys.getprofile() is not self.watcher or threading.getprofile() is not self.watcher)
        _UNWINDING[0] = False
        _own_setprofile(self.previous)
        threading.setprofile(self.threading_previous)
        _GUARDED[0] -= 1
        tampered, _TAMPERED[0] = _TAMPERED[0] or switched_off, False
        if next(self.watch[_TRIPS]) != self.trips + 1:   # tripped (Python unset the hook that raised it)
            if isinstance(exc, CallsReference):
                return
            tripped = [went for went in found if isinstance(went, CallsReference)]
            raise tripped[-1] if tripped else CallsReference(self.exercise, self.name, "calls")
        if tampered and not isinstance(exc, (Failure, CheckTimeout, KeyboardInterrupt)):   # those are the verdict
            fail("patched", "Your code changed the profiler (sys.setprofile, or threading's) while the check ran: "
                            "the check watches which of the course's functions your code calls, so that the "
                            "course's own answer is not taken for yours. Remove that code, restart the kernel "
                            "(Kernel > Restart) and run the cells again.")


_HOOK_CODES = (_hook.__code__, _watch.__code__, _trip.__code__)   # the guard's watcher, where a signal may land

# The guard's profiler is the check's own: set by it, and by nothing the student's code runs while it watches.
_OWN_SETTING = [False]
_TAMPERED = [False]
_UNWINDING = [False]   # the guard's hook raised: Python's unset of it, the next sys.setprofile event, is let through
_WATCHING: list[Any] = [None]   # the hook of the guard that watches, while one does


def _own_setprofile(hook: Any) -> None:
    if sys._getframe(1).f_code.co_filename != __file__:   # the engine's own, not a student's way round the guard
        _TAMPERED[0] = True
        raise RuntimeError("sys.setprofile is not allowed while a check runs: the check watches which of the "
                           "course's functions your code calls")
    _OWN_SETTING[0] = True
    try:
        sys.setprofile(hook)
    finally:
        _OWN_SETTING[0] = False


def _refuse_profiler_changes(event: str, args: tuple) -> None:
    """Audit hook: while a check watches, sys.setprofile from anything but the guard is refused (and remembered)."""
    if event == "sys.setprofile" and _GUARDED[0] and not _OWN_SETTING[0]:
        if _UNWINDING[0]:   # Python unsetting the guard's hook that raised: once
            _UNWINDING[0] = False
            return
        if sys._getframe(1).f_code is _THREAD_START and getattr(threading, "_profile_hook", None) is _WATCHING[0]:
            return   # a new thread taking threading's hook, the guard's own
        _TAMPERED[0] = True
        raise RuntimeError("sys.setprofile is not allowed while a check runs: the check watches which of the "
                           "course's functions your code calls")


_THREAD_START = threading.Thread._bootstrap_inner.__code__   # type: ignore[attr-defined]
sys.addaudithook(_refuse_profiler_changes)

# Every thread started while a guard watches starts watched. threading.setprofile raises no audit event, and a
# thread started through _thread takes no profiler at all: either way the student's code could run the course's
# answer in a thread the guard never sees. Wrapped when the course is imported, before any student's code runs.
def _watched_threads(start_new_thread: Callable[..., int]) -> Callable[..., int]:
    """_thread's own starter, held in a closure rather than a name of this module: every thread it starts while a
    guard watches starts watched."""
    def start_watched(function: Callable[..., Any], args: tuple, *kwargs: Any) -> int:
        hook = _WATCHING[0]
        if hook is None:
            return start_new_thread(function, args, *kwargs)

        def watched(*a: Any, **k: Any) -> Any:
            _own_setprofile(hook)
            try:
                return function(*a, **k)
            except CallsReference:   # the guard has recorded it for the verdict: no traceback on the kernel's stderr
                return None
        return start_new_thread(watched, args, *kwargs)
    return start_watched


_thread.start_new_thread = _thread.start_new = threading._start_new_thread = _watched_threads(  # type: ignore
    _thread.start_new_thread)


# ---------------------------------------------------------------- one run, in a forked child

def can_fork() -> bool:
    """Whether checks can run in a forked child here (see the module's docstring for where not)."""
    if _in_child or not hasattr(os, "fork") or sys.platform == "darwin":
        return False
    if os.environ.get("COURSE_CHECK_IN_PROCESS") == "1":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_initialized())


def _forked(judge: Callable[[], CheckResult], exercise: str) -> CheckResult | None:
    """``judge()`` in a forked child, killed after the limit (+ a grace); None when this process may not fork.
    A child that dies without a verdict (``os._exit``, a signal, memory) is a verdict of its own, ``crashed``."""
    _flush()   # or the child would print the kernel's pending output a second time
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except (OSError, RuntimeError):   # the grader's sandbox refuses (its worker already isolates), or no memory
        os.close(read_end)
        os.close(write_end)
        return None
    if pid == 0:
        os.close(read_end)
        _child(judge, write_end)   # never returns
    os.close(write_end)
    deadline = time.monotonic() + TIME_LIMIT_S + GRACE_S if TIME_LIMIT_S > 0 else None
    data, late = b"", False
    try:
        while _message(data) is None:   # whole: a process the student's code left holding the pipe cannot stall it
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                late = True
                break
            if select.select([read_end], [], [], wait)[0]:
                chunk = os.read(read_end, 1 << 16)
                if not chunk:
                    break
                data += chunk
    except BaseException:   # Ctrl-C in the kernel: stop the child, then interrupt as usual
        late = True
        raise
    finally:
        if late:
            _kill(pid)
        status = _reap(pid)   # a child with its verdict sent ends by itself, its prints flushed
        _kill(pid)   # anything the child left in its group
        os.close(read_end)
    kind, value = _message(data) or (None, None)
    if late:
        return _timed_out(exercise)
    if kind == "result" and isinstance(value, CheckResult):
        return value
    if kind == "interrupted":
        raise KeyboardInterrupt
    if kind == "error":
        return _checker_error(exercise, value)
    return CheckResult(exercise, False, "crashed",
                       f"The process running your code {_died(status)} before the check finished: look for "
                       f"os._exit, os.kill or signal calls, or memory use far beyond what the exercise needs. "
                       f"Your notebook's kernel is unharmed.")


# Bound when the course is imported: the child's verdict is written by these, whatever the student's code replaced.
_DUMPS, _WRITE = pickle.dumps, os.write


def _child(judge: Callable[[], CheckResult], write_end: int) -> None:
    """In the forked child: judge, send the verdict, leave at once (no atexit, no kernel machinery)."""
    global _in_child
    _in_child = True
    code = 0
    try:
        try:
            os.setpgid(0, 0)   # its own group: the parent's kill reaches whatever it started
        except OSError:
            pass
        torch.set_num_threads(1)   # a thread pool copied by fork is not usable; one thread needs none
        # and stays at one: code that asks for more threads here would wake the copied pool and hang
        # (seen: set_num_threads(3) in a student's function, then a matmul, never returned)
        torch.set_num_threads = lambda threads: None
        pinned.accept(torch, "set_num_threads")   # the check's own replacement, not the student's
        try:
            payload = _portable(judge())
        except KeyboardInterrupt:
            payload = _DUMPS(("interrupted", None))
        except BaseException as exc:  # the run lets nothing else out; should it, say what
            payload = _DUMPS(("error", f"{type(exc).__name__}: {exc}"))
        view = memoryview(payload)
        while view:
            view = view[_WRITE(write_end, view):]
        _flush()   # what the student's code printed
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _portable(result: CheckResult) -> bytes:
    """The verdict as bytes for the pipe; a detail that cannot be pickled travels as its repr."""
    details = {}
    for key, value in result.details.items():
        try:
            _DUMPS(value)
            details[key] = value
        except Exception:  # a student's class defined in a function, a lambda, an open file in the details
            details[key] = repr(value)
    return _DUMPS(("result", CheckResult(result.exercise, result.passed, result.diagnosis, result.message,
                                               details)))


def _message(data: bytes) -> tuple[str, Any] | None:
    try:
        return pickle.loads(data) if data else None
    except Exception:
        return None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _kill(pid: int) -> None:
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _reap(pid: int) -> int | None:
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


def _died(status: int | None) -> str:
    if status is not None and os.WIFSIGNALED(status):
        try:
            return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        except ValueError:
            return f"was killed by signal {os.WTERMSIG(status)}"
    if status is not None and os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return "ended"
