"""Checks under nbgrader: a failed graded check fails its cell (so nbgrader scores it zero); a passed
one is displayed, not returned as a score; demonstrations, re-checks and 8.1 never fail a cell; and
outside nbgrader nothing changes."""
from __future__ import annotations

import types

import pytest
import torch

from course_lib.classroom import capstone, checks
from course_lib.classroom.checks.engine import checker, run
from course_lib.classroom.exercises import BY_ID, Exercise
from course_lib.classroom.verdict import fail


def _wrong_mask(n):
    return torch.ones(n, n, dtype=torch.bool).triu()   # the classic transposed mask


def _right_mask(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.fixture
def nbgrader_runs(monkeypatch):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")


@pytest.fixture(autouse=True)
def not_under_nbgrader_unless_asked(monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)


def test_outside_nbgrader_a_failed_check_returns_its_verdict():
    result = checks.check_causal_mask(_wrong_mask)
    assert not result.passed and result.diagnosis == "causal_mask"
    assert type(result) is checks.CheckResult


@pytest.mark.parametrize("mode", ["autograde", "validate"])
def test_under_nbgrader_a_failed_check_raises_its_verdict(monkeypatch, mode):
    monkeypatch.setenv("NBGRADER_EXECUTION", mode)
    expected = str(checks.check_causal_mask(_wrong_mask, graded=False))
    with pytest.raises(AssertionError) as raised:
        checks.check_causal_mask(_wrong_mask)
    assert isinstance(raised.value, run.CheckNotPassed)
    assert str(raised.value) == expected
    assert "Exercise 2.1" in expected and "(causal_mask)" in expected


def test_the_failed_cell_shows_the_verdict_not_our_frames(nbgrader_runs):
    with pytest.raises(run.CheckNotPassed) as raised:
        checks.check_causal_mask(_wrong_mask)
    shown = raised.value._render_traceback_()   # what IPython (and nbgrader's feedback) prints
    assert len(shown) == 1 and shown[0].endswith(str(raised.value))
    assert "CheckNotPassed" in shown[0] and "course_lib" not in shown[0]


def test_under_nbgrader_a_passed_check_is_displayed_not_returned_as_a_score(nbgrader_runs, monkeypatch):
    result = checks.check_causal_mask(_right_mask)
    assert isinstance(result, checks.CheckResult) and result.passed and bool(result)
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.append((objs, kw)))
    result._ipython_display_()   # IPython calls this instead of making the verdict the cell's Out[n]
    [((bundle,), options)] = shown
    assert options == {"raw": True}
    assert bundle == {"text/plain": str(result), "text/html": result._repr_html_()}
    assert "Passed" in bundle["text/html"]


def test_outside_nbgrader_a_passed_check_is_the_cell_result():
    result = checks.check_causal_mask(_right_mask)
    assert type(result) is checks.CheckResult and not hasattr(result, "_ipython_display_")


def test_graded_false_never_fails_a_cell(nbgrader_runs):
    result = checks.check_causal_mask(_wrong_mask, graded=False)
    assert not result.passed and result.diagnosis == "causal_mask"
    assert type(result) is checks.CheckResult


def test_an_exercise_without_a_solution_region_is_not_graded(nbgrader_runs, monkeypatch):
    assert BY_ID["8.1"].has_solution is False   # the capstone: nbgrader does not grade it
    monkeypatch.setitem(BY_ID, "99.1", Exercise("99.1", "assembled", "assembled", "check_assembled",
                                                has_solution=False, hints=("h", "i")))

    @checker("99.1")
    def check_assembled(candidate):
        fail("mismatch", "does not train like the reference")

    result = check_assembled(None)
    assert not result.passed and result.diagnosis == "mismatch"


def test_graded_must_be_a_bool():
    with pytest.raises(TypeError, match=r"graded: expected True or False, got 'no'"):
        checks.check_causal_mask(_right_mask, graded="no")


def test_the_students_state_is_restored_before_the_cell_fails(nbgrader_runs):
    def careless_mask(n):
        torch.set_grad_enabled(False)
        torch.manual_seed(123)
        return _wrong_mask(n)

    torch.manual_seed(0)
    rng = torch.get_rng_state().clone()
    with pytest.raises(run.CheckNotPassed):
        checks.check_causal_mask(careless_mask)
    assert torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_blame_runs_the_parts_checker_without_failing_the_cell(nbgrader_runs):
    collection = types.SimpleNamespace(parts={"2.1": types.SimpleNamespace(
        exercise=types.SimpleNamespace(name="causal_mask"))})
    result = capstone._checker_result(collection, "2.1", {"causal_mask": _wrong_mask})
    assert not result.passed and result.diagnosis == "causal_mask"


def test_an_empty_not_implemented_error_is_named():
    def stub(n):
        raise NotImplementedError()   # nbgrader's stub carries no message

    result = checks.check_causal_mask(stub)
    assert result.diagnosis == "not_implemented"
    assert "not written yet (NotImplementedError)" in result.message, result.message

