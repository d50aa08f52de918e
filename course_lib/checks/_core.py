"""The machinery every checker shares: results, safe calls into student code, hints.

A checker never raises because of the student's code. Internally a checker stops at
the first problem by raising :class:`Failure`; the :func:`checker` decorator turns
that (and anything else that goes wrong) into a :class:`CheckResult`.
"""
from __future__ import annotations

import functools
import html
import importlib
import inspect
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

DIAGNOSES = (
    "not_implemented", "exception", "shape", "dtype", "nan", "softmax_dim", "scale",
    "normalization", "causal_mask", "head_split", "dropout", "residual", "norm_placement",
    "mismatch",
)


@dataclass
class CheckResult:
    """The verdict on one exercise: ``passed``, a ``diagnosis`` code and a ``message`` to act on."""

    exercise: str
    passed: bool
    diagnosis: str | None
    message: str
    details: dict[str, Any] = field(default_factory=dict, repr=False)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        mark = "PASSED" if self.passed else f"NOT YET ({self.diagnosis})"
        return f"Exercise {self.exercise}: {mark}. {self.message}"

    def _repr_html_(self) -> str:
        colour, border, mark = (("#e6f4ea", "#34a853", "&#10004; Passed") if self.passed
                                else ("#fce8e6", "#d93025", f"&#10008; Not yet: <code>{self.diagnosis}</code>"))
        return (f'<div style="background:{colour};border-left:4px solid {border};padding:6px 10px;'
                f'margin:4px 0;font-family:sans-serif;color:#202124">'
                f"<b>Exercise {html.escape(self.exercise)}</b> &mdash; {mark}<br>"
                f"{html.escape(self.message)}</div>")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


class Failure(Exception):
    """Raised inside a checker to stop at the first problem found."""

    def __init__(self, diagnosis: str, message: str, **details: Any):
        if diagnosis not in DIAGNOSES:
            raise ValueError(f"diagnosis: expected one of {DIAGNOSES}, got {diagnosis!r}")
        super().__init__(message)
        self.diagnosis = diagnosis
        self.message = message
        self.details = details


def fail(diagnosis: str, message: str, **details: Any) -> None:
    raise Failure(diagnosis, message, **details)


def _student_frame(exc: BaseException) -> str:
    """'line 12 in forward' for the innermost frame outside course_lib and torch, if any."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        name = frame.filename.replace("\\", "/")
        if "/course_lib/" not in name and "/torch/" not in name:
            return f" (line {frame.lineno}, in {frame.name})"
    return ""


def call(fn: Callable[..., Any], *args: Any, what: str = "your code", **kwargs: Any) -> Any:
    """Call student code; turn any exception it raises into a Failure with a readable message."""
    try:
        return fn(*args, **kwargs)
    except Failure:
        raise
    except NotImplementedError as exc:
        fail("not_implemented", f"{what} is not written yet ({exc or 'NotImplementedError'}). "
                                f"Replace the `raise NotImplementedError` with your solution, then run this cell again.")
    except Exception as exc:   # noqa: BLE001 - any student error becomes a message
        fail("exception", f"{what} raised {type(exc).__name__}{_student_frame(exc)}: {exc}")


def expect_tensor(value: Any, shape: tuple[int, ...], what: str, *,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """A returned value must be a tensor of the given shape (and dtype), with finite numbers."""
    if not isinstance(value, torch.Tensor):
        fail("dtype" if value is not None else "shape",
             f"{what} should return a torch.Tensor of shape {shape}, but returned "
             f"{'nothing (did you forget `return`?)' if value is None else type(value).__name__}.")
    if tuple(value.shape) != tuple(shape):
        fail("shape", f"{what} returned shape {tuple(value.shape)}, expected {tuple(shape)}.",
             got=tuple(value.shape), expected=tuple(shape))
    if dtype is not None and value.dtype != dtype:
        fail("dtype", f"{what} returned dtype {value.dtype}, expected {dtype}.")
    if value.is_floating_point() and not torch.isfinite(value).all():
        fail("nan", f"{what} returned NaN or infinite values. A softmax over a row whose entries are all "
                    f"-inf gives NaN: check that every query can attend to at least one key.")
    return value


def checker(exercise: str) -> Callable[[Callable[..., None]], Callable[..., CheckResult]]:
    """Decorate ``check(candidate, ...) -> str | None``: it returns a success message or raises Failure."""

    def wrap(body: Callable[..., str | None]) -> Callable[..., CheckResult]:
        @functools.wraps(body)
        def run(*args: Any, **kwargs: Any) -> CheckResult:
            # One thread: on tensors this small, waking a thread pool costs far more than it
            # saves (up to 50x on a busy machine), and a check should answer at once.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                with torch.random.fork_rng(devices=[]):
                    message = body(*args, **kwargs)
            except Failure as failure:
                return CheckResult(exercise, False, failure.diagnosis, failure.message, failure.details)
            except NotImplementedError as exc:
                return CheckResult(exercise, False, "not_implemented",
                                   f"Not written yet ({exc}). Replace the `raise NotImplementedError`, then re-run.")
            except Exception as exc:   # noqa: BLE001 - a checker never raises
                return CheckResult(exercise, False, "exception",
                                   f"Your code raised {type(exc).__name__}{_student_frame(exc)}: {exc}")
            finally:
                torch.set_num_threads(threads)
            return CheckResult(exercise, True, None, message or "Matches the reference implementation.")
        run.exercise = exercise   # type: ignore[attr-defined]
        return run
    return wrap


# ---------------------------------------------------------------- hints and solutions

@dataclass
class Exercise:
    exercise: str
    title: str
    hints: list[str]
    solution: str          # "module:qualified.name" of the reference in course_lib
    shown: int = 0


EXERCISES: dict[str, Exercise] = {}


def register(exercise: str, title: str, hints: list[str], solution: str) -> None:
    """Declare an exercise: its id ("2.1"), a title, two or three hints, and where the reference lives."""
    EXERCISES[exercise] = Exercise(exercise, title, list(hints), solution)


def _lookup(exercise: Any) -> Exercise:
    key = str(exercise)
    if key not in EXERCISES:
        raise ValueError(f"exercise_id: expected one of {sorted(EXERCISES)}, got {exercise!r}")
    return EXERCISES[key]


def hint(exercise_id: str) -> str:
    """The next hint for an exercise (each call goes one level deeper, never the full code)."""
    entry = _lookup(exercise_id)
    level = min(entry.shown, len(entry.hints) - 1)
    entry.shown += 1
    text = f"Hint {level + 1}/{len(entry.hints)} for exercise {entry.exercise} ({entry.title}): {entry.hints[level]}"
    print(text)
    return text


def show_solution(exercise_id: str) -> str:
    """Print the reference source from course_lib (for instructors, or after a real attempt)."""
    entry = _lookup(exercise_id)
    module_name, _, qualname = entry.solution.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    source = inspect.getsource(obj)
    print(f"# Reference for exercise {entry.exercise} ({entry.title}), from {module_name}\n{source}")
    return source
