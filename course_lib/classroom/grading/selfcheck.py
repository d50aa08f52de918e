"""Before grading anyone, the grader grades the course itself: never a class graded against a broken judge.

:func:`self_check` reads each graded exercise from the course's solution notebook and from its
learner copy (made in memory, as ``python -m course_lib student`` makes it) exactly as it reads a
student's notebook (``sources.student_part``), and judges both (``judge.judge``). Every solution
must pass and every blank exercise must fail; each that does not is a problem naming the exercise.
A worker runs this while it warms up, before it takes its first student; the grader stops the whole
run, with an error naming the exercises, if any problem is found (``pool.SelfCheckFailed``).

8.1 is left out: its check trains two models (17 s), and its parts are the exercises checked here.
"""
from __future__ import annotations

import time
from pathlib import Path

import nbformat

from .plan import CAPSTONE, ExercisePlan

__all__ = ["self_check", "course_texts"]


def course_texts(notebook: str) -> tuple[str, str]:
    """The text of the course's solution notebook ``notebook`` and of its learner copy."""
    from ...course_files import course_notebooks
    from ..assignments import learner_notebook
    path = next(p for p in course_notebooks() if p.name == notebook)
    learner, _ = learner_notebook(Path(path))
    return Path(path).read_text(encoding="utf-8"), nbformat.writes(learner)


def self_check(plans: dict[str, ExercisePlan], timeout: float | None = None) -> list[str]:
    """The problems found grading the course's solutions and learner copies on ``plans``: a solution
    that fails, a blank exercise that passes, or (``timeout``: the run's seconds per notebook) solutions
    that take longer here than a student is given. Empty when the judge is sound."""
    from .judge import judge, known_names
    from .sources import student_part
    known = known_names(plans)
    texts = {plan.notebook: course_texts(plan.notebook) for plan in plans.values() if plan.id != CAPSTONE}
    problems = []
    seconds: dict[str, float] = {}   # per notebook: what its solutions took here
    for plan in plans.values():
        if plan.id == CAPSTONE:
            continue
        solution, blank = texts[plan.notebook]
        for text, should_pass, what in ((solution, True, "the course's solution"),
                                        (blank, False, "the learner copy's blank exercise")):
            part = student_part(text, plan, known)
            start = time.monotonic()
            verdict = judge(plan, part.source) if part.source is not None else \
                {"passed": False, "diagnosis": part.diagnosis, "message": part.message}
            if should_pass:
                seconds[plan.notebook] = seconds.get(plan.notebook, 0.0) + time.monotonic() - start
            if verdict["passed"] != should_pass:
                got = "passed" if verdict["passed"] else f"failed ({verdict['diagnosis']}: {verdict['message'][:300]})"
                problems.append(f"exercise {plan.id} ({plan.name}): {what} {got}")
    problems += [f"timeout: the course's own solutions of {notebook} took {took:.1f} s here, more than the "
                 f"{timeout:g} s per notebook a student is given, so every student would run out of time; "
                 f"give a larger --timeout" for notebook, took in seconds.items()
                 if timeout is not None and took > timeout]
    return problems
