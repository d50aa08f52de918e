"""The engine's opt-in features, each on a small declaration of its own (checks/DESIGN.md): the ``after``
probes, placeholders in a mistake's message, ``quote=False`` for ``each_case``, and ``first_mistake``, the
one mistake loop a judge of its own uses too."""
from __future__ import annotations

import pytest
import torch

from course_lib.classroom.checks.engine import Case, FunctionExercise, fill, first_mistake, judge
from course_lib.classroom.exercises import Mistake
from course_lib.classroom.verdict import Failure, fail

X = torch.arange(6.0).reshape(2, 3)


def _double(**options) -> FunctionExercise:
    """x -> 2x on two inputs; its one known mistake is x -> 3x."""
    declared = dict(id="0.0", name="double", reference=lambda x: 2 * x, arg_names=("x",), success="right",
                    cases=lambda: (Case((X,), "double(x)"), Case((X[:1],), "double(x[:1])")),
                    mismatch=lambda run: f"{run.case.what} is wrong",
                    mistakes=(Mistake("scale", "tripled", output=lambda x: 3 * x),))
    return FunctionExercise(**{**declared, **options})


def _verdict(exercise: FunctionExercise, fn) -> tuple[str, str]:
    try:
        return "passed", judge(exercise, fn)
    except Failure as failure:
        return failure.diagnosis, failure.message


def test_after_runs_once_every_case_is_right_and_before_the_gradients():
    seen = []

    def after(runs, fn):
        seen.append([run.case.what for run in runs])
        if fn is refused:
            fail("values", "after says no")

    def refused(x):
        return 2 * x

    exercise = _double(after=after, gradients=lambda: (Case((X,), "double(x)"),))
    assert _verdict(exercise, lambda x: 3 * x) == ("scale", "tripled") and seen == []   # a wrong output: not run
    assert _verdict(exercise, refused) == ("values", "after says no")
    assert seen == [["double(x)", "double(x[:1])"]]
    # right numbers, no gradient: `after` has run, the gradient probe has the last word
    assert _verdict(exercise, lambda x: (2 * x).detach())[0] == "gradient" and len(seen) == 2
    assert _verdict(_double(), lambda x: 2 * x) == ("passed", "right")   # no hook: as before


def test_placeholders_are_filled_from_the_first_run_that_differs():
    mistakes = (Mistake("shape", "returned {got}, expected {expected}; {hint} {unknown}", output=lambda x: 2 * x + 1),)
    exercise = _double(mistakes=mistakes, values=lambda run: {"hint": run.case.what})
    diagnosis, message = _verdict(exercise, lambda x: 2 * x + 1)
    assert diagnosis == "shape"
    # a shape for a tensor of several numbers; a brace the exercise does not fill stays as written
    assert message == "returned (2, 3), expected (2, 3); double(x) {unknown}"
    one = _double(mistakes=(Mistake("scale", "{got:.1f} against {expected:.1f}", output=lambda x: 3 * x),),
                  cases=lambda: (Case((torch.tensor([2.0]),), "double(2)"),))
    assert _verdict(one, lambda x: 3 * x) == ("scale", "6.0 against 4.0")   # one number: its value
    assert fill("a {b} {{c}} {d!r}", {"d": "x"}) == "a {b} {{c}} 'x'"


def test_each_case_quotes_the_case_unless_told_not_to():
    assert _verdict(_double(each_case=True), lambda x: 3 * x) == ("scale", "double(x): tripled")
    assert _verdict(_double(each_case=True, quote=False), lambda x: 3 * x) == ("scale", "tripled")
    # without a known mistake the mismatch message is the exercise's own, quote or not
    assert _verdict(_double(each_case=True, quote=False), lambda x: 5 * x + 1) == ("mismatch", "double(x) is wrong")


def test_first_mistake_names_the_first_that_reproduces_and_passes_over_those_that_do_not_apply():
    mistakes = [Mistake("scale", "raises"), Mistake("values", "no"), Mistake("causal_mask", "first {n}"),
                Mistake("softmax_dim", "second")]
    answers = {"raises": IndexError, "no": False, "first {n}": True, "second": True}

    def reproduces(mistake):
        answer = answers[mistake.message]
        if answer is IndexError:
            raise IndexError("does not apply")
        return answer

    with pytest.raises(Failure) as found:
        first_mistake(mistakes, reproduces, "probe: ", n=1)
    assert (found.value.diagnosis, found.value.message) == ("causal_mask", "probe: first 1")
    assert first_mistake(mistakes[:2], reproduces) is None   # none reproduces: the caller goes on


def test_without_a_live_room_the_run_never_enters_progress(monkeypatch):
    """The check walk ends at the verdict in the run: the live room is written only where one is open."""
    from course_lib import attention
    from course_lib.classroom import checks, progress
    recorded = []
    monkeypatch.setattr(progress, "record", lambda result, subject=None: recorded.append((result, subject)))
    monkeypatch.delenv(progress.PROGRESS_DIR_ENV, raising=False)
    assert checks.check_causal_mask(attention.causal_mask).passed and recorded == []
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, "a room")
    assert checks.check_causal_mask(attention.causal_mask).passed
    assert [(r.exercise, subject) for r, subject in recorded] == [("2.1", "causal_mask")]


def test_wrong_outputs_before_a_call_that_raises_are_named_before_the_exception():
    """A mistake that shows on the first case and crashes on a later one is that mistake, not the crash: the
    crash is where the wrong numbers ended, and a reword about it would guess (12.2 said a size was written in)."""
    reworded = []

    def tripled_then_raises(x):
        if x.shape[0] == 1:
            raise IndexError("index 1 is out of bounds")
        return 3 * x

    exercise = _double(reword=lambda failure, case, out, fn: reworded.append(case.what))
    assert _verdict(exercise, tripled_then_raises) == ("scale", "tripled") and reworded == []

    def raises_first(x):   # nothing wrong before it: the exception, reworded
        raise IndexError("index 1 is out of bounds")

    assert _verdict(exercise, raises_first)[0] == "exception" and reworded == ["double(x)"]


def test_an_output_exactly_a_multiple_of_the_reference_names_the_factor():
    """No mistake of the table explains it, yet 8x for 2x is a factor the message can name (a sum for a mean)."""
    diagnosis, message = _verdict(_double(), lambda x: 8 * x)
    assert diagnosis == "scale" and "exactly 4 times the reference's" in message
    assert _verdict(_double(), lambda x: x / 2)[1].count("1/4 of the reference's") == 1


def test_a_result_kept_from_an_earlier_call_is_kept_state():
    """Right on every case, then wrong on the same tensor holding other numbers: a cache keyed on the shape."""
    kept: dict = {}
    diagnosis, message = _verdict(_double(), lambda x: kept.setdefault(tuple(x.shape), 2 * x))
    assert diagnosis == "kept_state" and "same shapes but other numbers" in message
