"""The reference guard under a twelfth attack (2026-11-30): the course's answer called from C, where no frame of
the student's stands between it and the check; its source compiled again alone; a file named "<string>"; the
worked example's data changed in place; nbgrader's switch set by the notebook. Each passed or blamed the course."""
from __future__ import annotations

import contextlib
import functools
import inspect
import operator

import pytest
import torch

import course_lib.attention as attention
import course_lib.heads as heads
from course_lib.classroom import checks
from course_lib.classroom.checks import _gqa_variants
from course_lib.classroom.grading import grading_plan
from course_lib.classroom.grading.judge import judge


class _CallIsTheMask:
    __call__ = staticmethod(attention.causal_mask)   # called from C: no frame of the student's


class _MetaCallIsTheMask(type):
    __call__ = staticmethod(attention.causal_mask)


class _ClassIsTheMask(metaclass=_MetaCallIsTheMask):
    pass


def _compiled_alone():
    space = dict(vars(attention))
    exec(compile(inspect.getsource(attention.causal_mask), "<mine>", "exec"), space)
    return space["causal_mask"]


def _named_string():
    space = {"_allowed": _gqa_variants._allowed}
    exec(compile("def causal_mask(n):\n    return _allowed('ok', 0, n, n, None, 'ok', False)\n", "<string>", "exec"),
         space)
    return space["causal_mask"]


@pytest.mark.parametrize("candidate", [
    _CallIsTheMask(), _ClassIsTheMask, functools.partial(operator.call, attention.causal_mask), _compiled_alone(),
    _named_string(),
], ids=["a __call__ that is the answer", "a metaclass __call__", "partial(operator.call)",
        "its source compiled alone", "<string> and a model of the checks"])
def test_the_courses_mask_however_it_is_called_is_the_courses(candidate, check_process):
    result = checks.check_causal_mask(candidate, graded=False)
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result


class _NormWithTheCoursesForward(torch.nn.Module):
    """Not a subclass: the constructor as the exercise gives it, the course's forward copied in."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    from course_lib.modern import RMSNorm as _Course
    forward = _Course.forward
    del _Course


def test_a_class_given_the_courses_forward_is_the_courses(check_process):
    result = checks.check_rms_norm(_NormWithTheCoursesForward, graded=False)
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result


def test_the_courses_ablation_entered_by_hand_is_the_courses(check_process):
    def ablate_head(model, layer, head):
        return contextlib._GeneratorContextManager(heads.ablate_head.__wrapped__, (model, layer, head), {})
    result = checks.check_ablate_head(ablate_head, graded=False)
    assert (result.passed, result.diagnosis) == (False, "calls_reference"), result


def test_the_worked_examples_data_changed_in_place_does_not_move_the_answer():
    keys = attention.TOY_KEYS.clone()
    try:
        attention.TOY_KEYS.copy_(torch.tensor([[0.0, 100.0], [0.0, 0.0], [0.0, 0.0]]))
        result = checks.check_toy_prediction([1.0, 0.0, 0.0], 1.0, graded=False)
    finally:
        attention.TOY_KEYS.copy_(keys)
    assert (result.passed, result.diagnosis) == (False, "mismatch"), result


@pytest.mark.parametrize("code, passed", [("tril()", True), ("triu()", False)], ids=["right", "wrong"])
def test_nbgraders_switch_set_by_the_notebook_leaves_the_graders_verdict(code, passed, monkeypatch):
    """The check cell under nbgrader shows a pass as a display and raises on a failure: the grader records both."""
    monkeypatch.setenv("COURSE_CHECK_IN_PROCESS", "1")
    monkeypatch.setenv("NBGRADER_EXECUTION", "")   # recorded as unset, so that the notebook's setting is undone
    monkeypatch.delenv("NBGRADER_EXECUTION")
    source = ("import os\n\n\ndef causal_mask(n, _set=os.environ.__setitem__('NBGRADER_EXECUTION', 'autograde')):\n"
              f"    return torch.ones(n, n, dtype=torch.bool).{code}\n")
    verdict = judge(grading_plan(["2.1"])["2.1"], source)
    assert verdict["passed"] is passed and verdict["diagnosis"] != "checker_error", verdict
