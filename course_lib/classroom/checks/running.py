"""What the grader needs from the way a check runs student code, under public names: the time
limit a check gives the student's code, and the line of the student's code an exception came from."""
from __future__ import annotations

from ... import _validate as validate
from . import _harness
from ._student_code import student_frame

__all__ = ["set_time_limit", "student_frame"]


def set_time_limit(seconds: float) -> None:
    """Give every later check ``seconds`` for the student's code (the grader sets it below its own kill)."""
    _harness.TIME_LIMIT_S = validate.positive_float("seconds", seconds)
