"""A checker's options (the parameters with a default: 4.2's norm_first, 8.1's tolerance) are checked at the
boundary (``engine.run._check_options``), their kind and their range, so that no value let through there is refused
by an inner layer later, which the student would read as "a bug in the course" (checker_error)."""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from bank import search31c_bugs
from bank.attempts import Attempt
from test_checks_bank import CORRECT, judged

from course_lib.classroom import checks
from course_lib.classroom.exercises import EXERCISES

_REF = search31c_bugs._REF
_YOURS = search31c_bugs._run("yours", [2.41, 2.01], not_yours=())


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")


@pytest.mark.parametrize("tolerance, error, says", [
    (-0.1, ValueError, "expected a finite number >= 0 (the course uses 0.02), got -0.1 (float)"),
    (-1, ValueError, "expected a finite number >= 0 (the course uses 0.02), got -1 (int)"),
    (np.float64(-1e-9), ValueError, "expected a finite number >= 0"),
    ("0.05", TypeError, "expected a finite number or None, got '0.05' (str)"),
    (float("nan"), TypeError, "expected a finite number or None, got nan"),
    (float("-inf"), TypeError, "expected a finite number or None, got -inf"),
    (True, TypeError, "expected a finite number or None, got True"),
])
def test_a_tolerance_8_1_cannot_take_is_refused_at_the_boundary(tolerance, error, says):
    with pytest.raises(error) as raised:
        checks.check_trains_like_reference(_YOURS, _REF, tolerance=tolerance)
    message = str(raised.value)
    assert message.startswith("check_trains_like_reference: tolerance: "), message
    assert says in message, message


@pytest.mark.parametrize("tolerance", [None, 0, 0.0, -0.0, 0.05, 1, np.float32(0.5), 1e300])
def test_a_tolerance_the_boundary_takes_gets_a_verdict(tolerance):
    result = checks.check_trains_like_reference(_YOURS, _REF, tolerance=tolerance)
    assert result.diagnosis != "checker_error", result


# Values of each kind an annotation accepts, the edges included: the boundary must refuse each one an inner layer
# would, so whatever it lets through gets a verdict.
_EDGES = {
    "bool": (True, False),
    "float": (0, 0.0, -0.0, -1e-12, -0.1, -1, 1, 0.5, 1e300, -1e300, 5e-324, np.float64(-2.0), np.float32(0.25)),
    "int": (0, -1, 1, 10 ** 12, np.int64(-3)),
    "str": ("", "x"),
    "None": (None,),
}


def _options():
    for exercise in EXERCISES:
        check = getattr(checks, exercise.checker, None)
        if check is None:
            continue
        body = inspect.unwrap(check)
        for parameter in inspect.signature(body).parameters.values():
            if parameter.default is parameter.empty:
                continue
            text = parameter.annotation if isinstance(parameter.annotation, str) else type(parameter.default).__name__
            kinds = [word.strip() for word in text.split("|") if word.strip() in _EDGES]
            attempt = next((a for a in CORRECT if a.exercise == exercise.id and parameter.name not in a.kwargs), None)
            for value in dict.fromkeys((v for kind in kinds for v in _EDGES[kind]), None):
                yield pytest.param(exercise.id, attempt, parameter.name, value,
                                   id=f"{exercise.id}-{parameter.name}={value!r}")


OPTIONS = list(_options())


def test_every_option_of_every_checker_is_tried():
    assert {(p.values[0], p.values[2]) for p in OPTIONS} >= {("4.2", "norm_first"), ("8.1", "tolerance")}


@pytest.mark.parametrize("exercise, attempt, option, value", OPTIONS)
def test_an_option_the_boundary_lets_through_is_never_a_checker_error(exercise, attempt, option, value):
    assert attempt is not None, f"{exercise}: no right attempt in the banks to try {option} on"
    tried = Attempt(exercise, attempt.name, attempt.candidate, None, kwargs={**attempt.kwargs, option: value})
    try:
        result = judged(tried)
    except (TypeError, ValueError) as exc:   # refused at the boundary: by name, with what it takes and was given
        message = str(exc)
        assert message.startswith(f"{inspect.unwrap(getattr(checks, _checker(exercise))).__name__}: {option}: "
                                  f"expected "), message
        assert "got " in message, message
        return
    assert result.diagnosis != "checker_error", f"{exercise} {option}={value!r}: {result}"
    if isinstance(value, float) and not math.isfinite(value):
        pytest.fail(f"{exercise} {option}={value!r} was not refused")


def _checker(exercise_id):
    return next(e.checker for e in EXERCISES if e.id == exercise_id)
