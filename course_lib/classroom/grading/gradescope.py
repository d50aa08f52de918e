"""Gradescope's ``results.json`` for one student: one test per exercise.

The format is Gradescope's autograder specification (gradescope-autograders.readthedocs.io,
"Autograder Specifications", output format): a top-level ``score``, ``execution_time`` (seconds),
``output`` and ``tests``; each test has ``name``, ``number``, ``score``, ``max_score``, ``status``
("passed" or "failed"), ``output`` and ``visibility``. Each exercise is worth one point; a test's
output is the diagnosis code and the checker's message, as the student would have seen it.

On Gradescope itself ``run_autograder`` grades the one submission in ``/autograder/submission``::

    python -m course_lib grade /autograder/submission --out /autograder/results --format gradescope

which writes ``/autograder/results/results.json`` (a folder holding the notebooks themselves is one
student). With several students, each gets ``REPORT/gradescope/<student>/results.json``.

``python -m course_lib autograder OUT.zip`` (``autograder.py``) writes the whole archive Gradescope asks
for, ``setup.sh`` and ``run_autograder`` included.
"""
from __future__ import annotations

from typing import Any

from .advice import exercise_title
from .grades import Grade

__all__ = ["results_json"]


def results_json(grades: list[Grade]) -> dict[str, Any]:
    """The ``results.json`` object for one student's grades (in exercise order)."""
    tests = []
    for grade in grades:
        title = exercise_title(grade.exercise)
        output = grade.message if grade.passed else f"Not yet ({grade.diagnosis}): {grade.message}"
        tests.append({"name": f"Exercise {grade.exercise}" + (f": {title}" if title else ""),
                      "number": grade.exercise, "score": 1.0 if grade.passed else 0.0, "max_score": 1.0,
                      "status": "passed" if grade.passed else "failed", "output": output,
                      "visibility": "visible"})
    passed = sum(g.passed for g in grades)
    return {"score": float(passed), "execution_time": round(sum(g.seconds for g in grades if g.seconds == g.seconds)),
            "output": f"{passed} of {len(grades)} exercises passed.", "visibility": "visible",
            "stdout_visibility": "hidden", "tests": tests}
