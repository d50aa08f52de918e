"""The one harness every checker runs in: isolation, a time limit, and the result.

A checker never raises because of the student's code. Internally it stops at the first
problem by raising :class:`Failure`; :func:`checker` turns that, and anything else that
goes wrong, into a :class:`CheckResult`:

- the student's exception, ``SystemExit`` or an endless loop becomes a red box naming it;
- an exception raised by the checker itself (no student frame in its traceback) is reported
  as the checker's failure, with the exercise id, never blamed on the student;
- ``KeyboardInterrupt`` still interrupts (Ctrl-C must work in a notebook).

The one exception is grading: while nbgrader executes a notebook, a failed graded check raises,
so that its test cell scores zero (see ``_nbgrader``).

Isolation: a check leaves the interpreter as it found it (grad mode, anomaly detection, default
dtype and device, float32 matmul precision, RNG states, thread count, deterministic-algorithm
mode, the working directory, ``os.environ``, and the attributes of ``course_lib``'s modules and
classes). While a check runs, ``course_lib`` is put back to
the state it had when ``checks`` was imported, so a student's patch of a reference (say
``course_lib.attention.causal_mask = ...``) cannot make a wrong answer pass or a right
one fail; the student's patch is restored afterwards.

Time limit: where the platform can fork (Linux), the check runs in a forked child that the kernel
kills after :data:`TIME_LIMIT_S` seconds (``_watchdog``): no ``except:`` or ignored signal in the
student's code can outlast it. Elsewhere, where the platform has ``SIGALRM`` (macOS) and the check
runs on the main thread (a Jupyter kernel runs cells there), an interval timer raises
:class:`CheckTimeout` in the student's code, and again every 0.1 s should the code catch it. On
Windows, or from a worker thread, there is no limit: an endless loop hangs until the student
interrupts the kernel, which stops the check cleanly.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import random
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch

from ... import _validate as validate
from .. import progress, reference_guard
from ..verdict import CheckResult, Failure
from . import _counterexample, _nbgrader, _watchdog
from ._references import attributes, bind_references, install_references, restore_namespace
from ._student_code import raised_in_student_code, student_frame

TIME_LIMIT_S = float(os.environ.get("COURSE_CHECK_TIME_LIMIT", "60"))


class CheckTimeout(BaseException):
    """Raised by the alarm inside student code. A BaseException, so `except Exception:` in student
    code cannot swallow it."""



# ---------------------------------------------------------------- isolation

@dataclass
class _State:
    grad: bool
    dtype: torch.dtype
    device: Any
    threads: int
    deterministic: bool
    anomaly: tuple[bool, bool]
    matmul_precision: str
    cwd: str | None
    environ: dict[str, str]
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    python_rng: Any
    numpy_rng: Any
    attributes: dict[Any, dict[str, Any]]

    @classmethod
    def save(cls) -> _State:
        numpy = sys.modules.get("numpy")
        return cls(
            grad=torch.is_grad_enabled(), dtype=torch.get_default_dtype(),
            device=torch.get_default_device() if hasattr(torch, "get_default_device") else None,
            threads=torch.get_num_threads(), deterministic=torch.are_deterministic_algorithms_enabled(),
            anomaly=(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            matmul_precision=torch.get_float32_matmul_precision(),
            cwd=_cwd(), environ=dict(os.environ),
            torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None,
            python_rng=random.getstate(),
            numpy_rng=numpy.random.get_state() if numpy is not None else None,
            attributes=attributes(),
        )

    def restore(self) -> None:
        torch.set_grad_enabled(self.grad)
        torch.set_default_dtype(self.dtype)
        if self.device is not None:
            torch.set_default_device(self.device)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)
        if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != self.anomaly:
            torch.set_anomaly_enabled(*self.anomaly)
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if self.cwd is not None and _cwd() != self.cwd:
            try:
                os.chdir(self.cwd)
            except OSError:
                pass   # the folder is gone (the student's code deleted it): nothing to go back to
        if dict(os.environ) != self.environ:
            for name in [n for n in os.environ if n not in self.environ]:
                del os.environ[name]
            for name, value in self.environ.items():
                if os.environ.get(name) != value:
                    os.environ[name] = value
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        numpy = sys.modules.get("numpy")
        if self.numpy_rng is not None and numpy is not None:
            numpy.random.set_state(self.numpy_rng)
        for obj, saved in self.attributes.items():
            restore_namespace(obj, saved)


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:   # the working directory was deleted under us
        return None


# ---------------------------------------------------------------- time limit

class _Alarm:
    """SIGALRM after ``seconds`` on the main thread where the platform has it; otherwise nothing."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.armed = False

    def __enter__(self) -> _Alarm:
        usable = (hasattr(signal, "SIGALRM") and hasattr(signal, "setitimer") and self.seconds > 0
                  and threading.current_thread() is threading.main_thread()
                  and signal.getitimer(signal.ITIMER_REAL)[0] == 0)   # never override a timer already set
        if usable:
            self.previous = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, self.seconds, 0.1)   # again and again, should it be caught
            self.armed = True
        return self

    @staticmethod
    def _ring(signum: int, frame: Any) -> None:
        raise CheckTimeout

    def __exit__(self, *exc: Any) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


# ---------------------------------------------------------------- the decorator

def _timed_out(exercise: str) -> CheckResult:
    return CheckResult(exercise, False, "timeout",
                       f"Your code did not finish within {TIME_LIMIT_S:g} seconds, so the check was "
                       f"stopped. Look for a loop that never ends (a `while` whose condition never "
                       f"changes), or work that grows with every step.")


def _internal(exercise: str, exc: BaseException) -> CheckResult:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {os.path.basename(where.filename)}:{where.lineno}" if where else ""
    return CheckResult(
        exercise, False, "checker_error",
        f"The checker for exercise {exercise} failed ({type(exc).__name__}{at}: {exc}). This is a bug in the "
        f"course, not necessarily in your code: please report it with this message. The cells below still "
        f"run with the course's reference.", {"exception": exc})


def _finish(result: CheckResult, graded: bool = True, subject: str | None = None) -> CheckResult:
    """Every verdict passes here on its way back to the notebook, after the student's state is restored:
    the place for what is done with a verdict besides showing it. ``graded`` is False for a check that
    does not test the student's work (a demonstration on planted buggy code, a re-check used as a condition);
    ``subject`` is the name of what was checked, for the live room."""
    if graded:
        progress.record(result, subject)   # the live room: a line when COURSE_PROGRESS_DIR is set; never raises
        _counterexample.remember(result)   # checks.hint follows the last verdict
    return _nbgrader.for_nbgrader(result, graded)   # last: under nbgrader a failed graded check raises


def _accepts(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` fits the annotation ``hint`` (None: the hint says nothing checkable)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    if get_origin(hint) in (Union, UnionType):
        verdicts = [_accepts(value, arg) for arg in get_args(hint)]
        return None if None in verdicts and not any(verdicts) else any(v for v in verdicts)
    if hint is NoneType:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    return None


def _expected(hint: Any) -> str:
    if get_origin(hint) in (Union, UnionType):
        return " or ".join(_expected(arg) for arg in get_args(hint))
    return {bool: "True or False (a bool)", int: "an int", float: "a finite number", str: "a str",
            NoneType: "None"}.get(hint, getattr(hint, "__name__", str(hint)))


def _validate_options(name: str, signature: inspect.Signature, hints: dict[str, Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
    """A checker's own options (its parameters with a default, such as ``norm_first``) are validated like the
    public API's arguments; the student's work (the parameters without a default) is judged, never rejected."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        shown = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                          for p in signature.parameters.values())
        raise TypeError(f"{name}: {exc}. Call it as {name}({shown}).") from None
    for option, value in bound.arguments.items():
        parameter = signature.parameters[option]
        if parameter.default is inspect.Parameter.empty or parameter.kind in (parameter.VAR_POSITIONAL,
                                                                             parameter.VAR_KEYWORD):
            continue
        hint = hints.get(option, inspect.Parameter.empty)
        if hint is inspect.Parameter.empty and parameter.default is not None:
            hint = type(parameter.default)
        if _accepts(value, hint) is False:
            raise TypeError(f"{name}: {option}: expected {_expected(hint)}, got {validate.describe(value)}")


def checker(exercise: str, example: Callable[..., Any] | None = None
            ) -> Callable[[Callable[..., str | None]], Callable[..., CheckResult]]:
    """Decorate ``check(candidate, ...) -> str | None``: it returns a success message or raises Failure.
    ``example(candidate, ...)`` finds the counter-example of a failure (``engine.example``).

    The decorated checker takes one more keyword, ``graded`` (default True): see ``_nbgrader``."""

    def wrap(body: Callable[..., str | None]) -> Callable[..., CheckResult]:
        signature = inspect.signature(body)
        try:
            hints = get_type_hints(body)
        except Exception:  # an annotation that cannot be resolved: validate by the defaults' types only
            hints = {}

        @functools.wraps(body)
        def run(*args: Any, graded: bool = True, **kwargs: Any) -> CheckResult:
            validate.boolean("graded", graded)
            _validate_options(body.__name__, signature, hints, args, kwargs)
            subject = getattr(args[0], "__name__", None) if args else None
            return _finish(_judge(*args, **kwargs), graded, subject)

        def _judge(*args: Any, **kwargs: Any) -> CheckResult:
            if _watchdog.available():
                forked = _watchdog.run(lambda: _judge_here(*args, **kwargs), exercise, TIME_LIMIT_S,
                                       lambda: _timed_out(exercise))
                if forked is not None:
                    return forked
            return _judge_here(*args, **kwargs)

        def _judge_here(*args: Any, **kwargs: Any) -> CheckResult:
            state = _State.save()
            try:
                install_references()
                # One thread: on tensors this small, waking a thread pool costs far more than it
                # saves (up to 50x on a busy machine), and a check should answer at once.
                torch.set_num_threads(1)
                torch.set_grad_enabled(True)
                if hasattr(torch, "set_default_device"):
                    torch.set_default_device(None)   # inputs and references on the CPU, whatever the notebook set
                with _Alarm(TIME_LIMIT_S), reference_guard.guard(exercise, args, kwargs):
                    try:
                        message = body(*args, **kwargs)
                    except Failure as failure:   # the smallest input that shows the mistake, for checks.hint
                        _counterexample.attach(exercise, failure, args, kwargs, example)
                        raise
            except Failure as failure:
                return CheckResult(exercise, False, failure.diagnosis, failure.message, failure.details)
            except reference_guard.CallsReference as found:   # the exercise's own reference did the work
                return CheckResult(exercise, False, "calls_reference", reference_guard.message(found))
            except CheckTimeout:
                return _timed_out(exercise)
            except NotImplementedError as exc:
                return CheckResult(exercise, False, "not_implemented",
                                   f"Not written yet ({str(exc) or 'NotImplementedError'}). Replace the "
                                   f"`raise NotImplementedError`, then re-run.")
            except SystemExit as exc:
                return CheckResult(exercise, False, "exception",
                                   f"Your code called sys.exit({'' if exc.code is None else repr(exc.code)}) "
                                   f"(or exit()): that would stop the kernel. Return a value instead.")
            except KeyboardInterrupt:   # the stop button: it must still stop
                raise
            except BaseException as exc:  # a checker never raises: GeneratorExit, BaseException subclasses too
                if not raised_in_student_code(exc):
                    return _internal(exercise, exc)
                return CheckResult(exercise, False, "exception",
                                   f"Your code raised {type(exc).__name__}{student_frame(exc)}: {exc}")
            finally:
                state.restore()
                bind_references()   # modules first imported during this check (course_lib.hf)
            return CheckResult(exercise, True, None, message or "Matches the reference implementation.")
        run.exercise = exercise   # type: ignore[attr-defined]
        run.example = example     # type: ignore[attr-defined]   # its counter-example searcher, if declared
        return run
    return wrap
