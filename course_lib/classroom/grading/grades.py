"""One grade: a student's verdict on one exercise, as the report and the grader pass it around."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..verdict import DIAGNOSES
from .likeness import FLAG_SAME_AS_SOLUTION
from .text import from_student

FLAGS = (FLAG_SAME_AS_SOLUTION,)   # every flag the grader writes

__all__ = ["Grade", "grade_from_message", "MESSAGE_LIMIT"]

MESSAGE_LIMIT = 4000   # characters of a message kept


@dataclass(frozen=True)
class Grade:
    """``passed`` with no diagnosis, or not passed with a diagnosis code (see ``checks.DIAGNOSES``)."""

    student: str
    exercise: str
    passed: bool
    diagnosis: str | None
    message: str
    seconds: float
    flag: str = ""   # for the instructor, not a fail: "same as the course's solution" (``likeness``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def grade_from_message(student: str, exercise: str, message: Any, seconds: float, flag: Any = "") -> Grade | None:
    """A Grade from a worker's verdict for ``exercise``, or None when the message is not a well-formed
    verdict for that exercise (the caller then grades the exercise as crashed)."""
    if not isinstance(message, dict) or message.get("exercise") != exercise:
        return None
    passed, diagnosis, text = message.get("passed"), message.get("diagnosis"), message.get("message")
    if not isinstance(passed, bool) or not isinstance(text, str):
        return None
    if passed != (diagnosis is None) or (diagnosis is not None and diagnosis not in DIAGNOSES):
        return None
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds)):
        seconds = float("nan")
    flag = flag if flag in FLAGS else ""   # the grader's own words only: a worker's message is not trusted text
    return Grade(student, exercise, passed, diagnosis, from_student(text, MESSAGE_LIMIT), round(float(seconds), 3),
                 flag)
