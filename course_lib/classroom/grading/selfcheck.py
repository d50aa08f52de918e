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

import json
import os
import time
from pathlib import Path
from typing import Any

import nbformat

from .plan import CAPSTONE, ExercisePlan
from .sources import StudentPart

__all__ = ["self_check", "course_texts"]


def course_texts(notebook: str) -> tuple[str, str]:
    """The text of the course's solution notebook ``notebook`` and of its learner copy."""
    from ...course_files import course_notebooks
    from ..assignments import learner_notebook
    path = next(p for p in course_notebooks() if p.name == notebook)
    learner, _ = learner_notebook(Path(path))
    return Path(path).read_text(encoding="utf-8"), nbformat.writes(learner)


def _judged(plan: ExercisePlan, part: StudentPart) -> dict[str, Any]:
    from .judge import judge
    if part.source is None:
        return {"passed": False, "diagnosis": part.diagnosis, "message": part.message}
    return judge(plan, part.source)


def _judged_within(memory_mb: int | None, parts: list[tuple[ExercisePlan, StudentPart]]
                   ) -> list[tuple[dict[str, Any], float]]:
    """Each part's verdict and seconds, judged one after the other in one forked child under the memory limit
    a student's code runs under (``memory_mb``; as ``--isolation off`` grades a student, all in one process):
    a limit the course's own solutions cannot run in would fail every student, so the self-check must meet it."""
    def judge_all() -> list[tuple[dict[str, Any], float]]:
        verdicts = []
        for plan, part in parts:
            start = time.monotonic()
            verdicts.append((_judged(plan, part), time.monotonic() - start))
        return verdicts
    if not memory_mb or not hasattr(os, "fork"):
        return judge_all()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: it never returns
        try:
            os.close(read_end)
            from .sandbox import bound_memory
            bound_memory(memory_mb)
            try:
                data = json.dumps(judge_all()).encode()
            except BaseException as exc:  # noqa: BLE001 - said to the parent, as the reason there is no verdict
                data = json.dumps(f"{type(exc).__name__}: {exc}"[:500]).encode()
            with os.fdopen(write_end, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        data = answer.read()
    _, status = os.waitpid(pid, 0)
    answer: Any = None
    try:
        answer = json.loads(data)
        return [(verdict, seconds) for verdict, seconds in answer]
    except (ValueError, TypeError):
        why = answer if isinstance(answer, str) else f"wait status {status}"
        died = {"passed": False, "diagnosis": "crashed", "message": f"the process judging the course's solutions "
                f"under --memory-mb {memory_mb} ended without a verdict ({why}): give more memory"}
        return [(died, 0.0) for _ in parts]


def self_check(plans: dict[str, ExercisePlan], timeout: float | None = None,
               memory_mb: int | None = None) -> list[str]:
    """The problems found grading the course's solutions and learner copies on ``plans``: a solution
    that fails, a blank exercise that passes, or (``timeout``: the run's seconds per notebook) solutions
    that take longer here than a student is given. The solutions run under the run's own memory limit
    (``memory_mb``), as a student's code does. Empty when the judge is sound."""
    from .judge import known_names
    from .sources import student_part
    known = known_names(plans)
    graded = [plan for plan in plans.values() if plan.id != CAPSTONE]
    texts = {plan.notebook: course_texts(plan.notebook) for plan in graded}
    solutions = [(plan, student_part(texts[plan.notebook][0], plan, known)) for plan in graded]
    problems = []
    seconds: dict[str, float] = {}   # per notebook: what its solutions took here
    for (plan, part), (verdict, took) in zip(solutions, _judged_within(memory_mb, solutions)):
        seconds[plan.notebook] = seconds.get(plan.notebook, 0.0) + took
        if not verdict["passed"]:
            # the limit's doing only if the solution passes without it
            limit = f" under --memory-mb {memory_mb} (it passes without: give more memory)" \
                if memory_mb and _judged(plan, part)["passed"] else ""
            problems.append(f"exercise {plan.id} ({plan.name}): the course's solution failed{limit} "
                            f"({verdict['diagnosis']}: {verdict['message'][:300]})")
    for plan in graded:
        verdict = _judged(plan, student_part(texts[plan.notebook][1], plan, known))
        if verdict["passed"]:
            problems.append(f"exercise {plan.id} ({plan.name}): the learner copy's blank exercise passed")
    problems += [f"timeout: the course's own solutions of {notebook} took {took:.1f} s here, more than the "
                 f"{timeout:g} s per notebook a student is given, so every student would run out of time; "
                 f"give a larger --timeout" for notebook, took in seconds.items()
                 if timeout is not None and took > timeout]
    return problems
