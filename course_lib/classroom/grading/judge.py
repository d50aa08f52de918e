"""Judging one exercise: the student's definition, then the course's check cell, in one namespace.

This runs inside the sandboxed child (``sandbox.enter`` was called before). The namespace is the
one every exercise cell sees in the course (torch, ``nn``, ``F``, ``math`` and the course's
building blocks: ``collect.course_namespace``, the one notebook 08 trains your parts in), with
the student's definition executed in it; then the course's check cell runs there with ``checks``
standing for the course's checkers, whose verdicts are kept. The verdict is the first failing check of the exercise, else its (last) pass.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from ..checks._references import bind_references, install_references
from ..checks._student_files import student_frame
from ..collect import GPT_EXERCISES, course_names, course_namespace
from ..verdict import CheckResult
from .plan import CAPSTONE, ExercisePlan

__all__ = ["judge", "known_names", "RecordingChecks"]

from .grades import MESSAGE_LIMIT


def known_names(plans: dict[str, ExercisePlan]) -> set[str]:
    """Names every exercise finds provided by the course: never taken from the student's other code
    (the same names notebook 08's collection leaves to the course)."""
    return course_names() | {p.name for p in plans.values() if p.name}


class RecordingChecks:
    """Stands for ``checks`` in the course's check cell: each ``check_*`` call is the course's checker
    (taken when this object is made, before any student code runs), and its verdict is kept in a list the
    grader holds (``verdicts``), not on this object: nothing can be set on it (empty ``__slots__``), and the
    grader reads nothing back from it."""

    __slots__ = ()

    def __new__(cls, verdicts: list[CheckResult]) -> RecordingChecks:
        from .. import checks
        checkers = {name: getattr(checks, name) for name in dir(checks) if name.startswith("check_")}

        def recorded(name: str) -> Any:
            real = checkers[name]

            def run(*args: Any, **kwargs: Any) -> CheckResult:
                result = real(*args, **kwargs)
                if isinstance(result, CheckResult):
                    verdicts.append(result)
                return result
            return run

        def lookup(self: RecordingChecks, name: str) -> Any:
            return recorded(name) if name in checkers else getattr(checks, name)   # checks.hint(...) too

        # a class of its own per recorder, its one method closing over what it reads
        return object.__new__(type(cls.__name__, (cls,), {"__slots__": (), "__getattr__": lookup}))


class _Items(tuple):
    """A dict's items as they were, to compare key by key and value by value, by identity."""


def _held(recorder: RecordingChecks) -> list[tuple[Callable[[], Any], Any]]:
    """What the recorder holds, to compare once the check cell has run: its class and that class's lookup, and
    every closure cell reachable from the lookup with its contents (the checkers, the verdict list). A
    submission reaches all of it from ``checks`` by plain attribute access, so the grader looks afterwards.
    Each entry: how to read it again, and what it read now."""
    kind = type(recorder)
    lookup = kind.__dict__.get("__getattr__")
    held: list[tuple[Callable[[], Any], Any]] = [(lambda: type(recorder), kind),
                                                 (lambda: kind.__dict__.get("__getattr__"), lookup)]
    functions, seen = [lookup], set()
    while functions:
        function = functions.pop()
        if id(function) in seen or not isinstance(function, types.FunctionType):
            continue
        seen.add(id(function))
        for cell in function.__closure__ or ():
            value = cell.cell_contents
            held.append((lambda cell=cell: cell.cell_contents, value))
            if isinstance(value, dict):
                held.append((lambda value=value: _Items(value.items()), _Items(value.items())))
            functions.append(value)
    return held


def _tampered(held: list[tuple[Callable[[], Any], Any]], verdicts: list[CheckResult]) -> bool:
    """Whether anything the recorder held changed while the check cell ran (compared by identity), or the
    verdicts are not the checkers' own kind."""
    for read, value in held:
        try:
            now = read()
        except Exception:  # noqa: BLE001 - a cell emptied, a dict that no longer reads: changed
            return True
        if isinstance(value, _Items):   # a dict's items, each key and value by identity
            if len(now) != len(value) or any(a is not b or c is not d for (a, c), (b, d) in zip(now, value)):
                return True
        elif now is not value:
            return True
    return type(verdicts) is not list or any(type(result) is not CheckResult for result in verdicts)


_TAMPERED = ("Your code changed the grader's record of the checks (the `checks` object, its functions or what they "
             "hold) while the check ran, so no verdict of this exercise can be trusted.")


def _verdict(exercise: str, passed: bool, diagnosis: str | None, message: str) -> dict[str, Any]:
    return {"exercise": exercise, "passed": bool(passed), "diagnosis": diagnosis,
            "message": str(message)[:MESSAGE_LIMIT]}


def _raised(exercise: str, what: str, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, NotImplementedError):
        return _verdict(exercise, False, "not_implemented", f"{what} is not written yet ({exc}).")
    if isinstance(exc, SystemExit):
        return _verdict(exercise, False, "exception", f"{what} called sys.exit() (or exit()): that would stop "
                                                      f"the notebook's kernel.")
    return _verdict(exercise, False, "exception",
                    f"{what} raised {type(exc).__name__}{student_frame(exc)}: {exc}")


def _from_checks(plan: ExercisePlan, verdicts: list[CheckResult], error: BaseException | None) -> dict[str, Any]:
    mine = [r for r in verdicts if isinstance(r, CheckResult) and r.exercise == plan.id]
    failing = [r for r in mine if not r.passed]
    if failing:
        return _verdict(plan.id, False, failing[0].diagnosis, failing[0].message)
    if error is not None:
        return _raised(plan.id, "Your code", error)
    if mine:
        return _verdict(plan.id, True, None, mine[-1].message)
    return _verdict(plan.id, False, "checker_error", f"The course's check of exercise {plan.id} gave no verdict "
                                                     f"(a bug in the course, not in your code).")


def _judge_capstone(plan: ExercisePlan) -> dict[str, Any]:
    from .. import capstone
    from ..collect import collect_student_parts
    parts = collect_student_parts(".")
    not_yours = [f"{ex_id} ({parts.parts[ex_id].detail or parts.parts[ex_id].status})" for ex_id in GPT_EXERCISES
                 if not parts.parts[ex_id].is_yours]
    if not_yours:
        return _verdict(plan.id, False, "not_implemented",
                        f"8.1 trains the GPT built from your parts of notebooks 02-05, and these are not usable "
                        f"yet: {', '.join(not_yours)}.")
    verdicts: list[CheckResult] = []
    recorder = RecordingChecks(verdicts)
    held = _held(recorder)
    namespace = {"__name__": "course_check", "parts": parts, "capstone": capstone, "checks": recorder}
    error = None
    try:
        exec(compile(plan.check, f"<course check of exercise {plan.id}>", "exec"), namespace)
    except BaseException as exc:  # the student's parts train in here
        error = exc
    install_references()
    if _tampered(held, verdicts):
        return _verdict(plan.id, False, "patched", _TAMPERED)
    return _from_checks(plan, verdicts, error)


def _course_own(plan: ExercisePlan, defined: Any) -> dict[str, Any] | None:
    """The verdict when the student's name is bound to the course's own version (imported, assigned):
    ``calls_reference``; None when it is the student's own definition."""
    from ..checks.engine.run import CallsReference, is_reference, reference_message, reference_of
    reference = reference_of(plan.id)
    how = is_reference(defined, reference) if reference is not None else None
    if how is None:
        return None
    return _verdict(plan.id, False, "calls_reference", reference_message(CallsReference(plan.id, plan.name, how)))


def judge(plan: ExercisePlan, source: str | None) -> dict[str, Any]:
    """The verdict on ``source`` (the student's definition) for ``plan``, as a plain dict
    (exercise, passed, diagnosis, message). Never raises."""
    try:
        # the grader's own modules are pinned too, and put back before each of their functions is used below:
        # a submission's setattr(judge, "_from_checks", ...) cannot write its own verdict
        bind_references()
        if plan.id == CAPSTONE:
            return _judge_capstone(plan)
        namespace = course_namespace()
        verdicts: list[CheckResult] = []
        # the course's checkers, taken before any student code runs: a line of theirs may call one (9.6's cell
        # before: yours or ours), into a list of its own that the verdict never reads
        namespace["checks"] = RecordingChecks([])
        try:
            exec(compile(source or "", f"<your {plan.notebook}, Exercise {plan.id}>", "exec"), namespace)
        except BaseException as exc:  # the student's definition itself failed to run
            install_references()
            return _raised(plan.id, f"Defining {plan.name}", exc)
        install_references()   # first: the recorder takes the checkers as they are now, the course's again
        namespace["checks"] = recorder = RecordingChecks(verdicts)
        held = _held(recorder)
        refused = _course_own(plan, namespace.get(plan.name))
        if refused is not None:
            return refused
        error = None
        try:
            exec(compile(plan.check, f"<course check of exercise {plan.id}>", "exec"), namespace)
        except BaseException as exc:  # 1.1's cell calls the student's my_prediction() itself
            error = exc
        install_references()
        if _tampered(held, verdicts):
            return _verdict(plan.id, False, "patched", _TAMPERED)
        return _from_checks(plan, verdicts, error)
    except BaseException as exc:  # never let anything escape: the worker needs one verdict
        install_references()
        return _verdict(plan.id, False, "checker_error", f"The grader failed on exercise {plan.id} "
                                                         f"({type(exc).__name__}: {exc}).")
