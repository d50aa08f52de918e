"""checks.hint follows the last failed check (nudge, counter-example, then the spec); hint and
show_solution print once; show_solution waits for a checked attempt (or force=True)."""
from __future__ import annotations

import pytest
import torch
from bank.attention_bugs import BUGGY as ATTENTION_BUGGY
from bank.modern_bugs import BUGGY as MODERN_BUGGY

from course_lib import attention, flash, modern
from course_lib.classroom import checks
from course_lib.classroom.checks import _core

BY_ID = {a.id: a for a in ATTENTION_BUGGY + MODERN_BUGGY}
CHECKS = {"1.3": checks.check_scaled_dot_product_attention, "2.1": checks.check_causal_mask,
          "3.3": checks.check_multi_head_attention, "9.2": checks.check_apply_rotary,
          "9.5": checks.check_repeat_kv, "9.6": checks.check_grouped_query_attention}


def _reset(exercise):
    state = _core.hint_state(exercise)
    state.shown, state.step, state.followed = 0, 0, None


def test_hints_follow_the_last_failed_check_nudge_then_counterexample_then_spec(capsys):
    _reset("1.3")
    result = CHECKS["1.3"](BY_ID["1.3-sdpa_softmax_queries"].candidate)
    assert result.diagnosis == "softmax_dim"
    first, second, third = (checks.hint("1.3") for _ in range(3))
    assert "(softmax_dim)" in first and "which axis holds the keys" in first.lower()
    assert "counter-example" in second and "your output" in second and "the reference" in second
    assert "scores = q @ k^T" in second
    assert third.startswith("Hint 1/")
    printed = capsys.readouterr().out
    assert printed.count("The smallest input we found") == 1, "printed once"
    _reset("1.3")


def test_the_counterexample_is_real_and_small():
    """The numbers shown are the student's code and the reference on the shown input."""
    candidate = BY_ID["1.3-sdpa_softmax_queries"].candidate
    result = CHECKS["1.3"](candidate)
    example = result.details["counterexample"]
    q, k, v = (value for _, value in example.inputs[:3])
    assert q.shape[-2] <= 3 and q.shape[-1] <= 2
    assert torch.allclose(example.yours, candidate(q, k, v))
    assert torch.allclose(example.expected, attention.scaled_dot_product_attention(q, k, v))
    assert not torch.allclose(example.yours, example.expected, atol=1e-3)


def test_a_passed_check_gives_the_spec_hints_and_a_new_verdict_restarts():
    _reset("9.2")
    assert CHECKS["9.2"](modern.apply_rotary).passed
    assert checks.hint("9.2").startswith("Hint 1/")
    CHECKS["9.2"](BY_ID["9.2-rotary_sign_flipped"].candidate)
    assert "(rope_rotation)" in checks.hint("9.2")
    CHECKS["9.2"](BY_ID["9.2-rotary_ignores_offset"].candidate)
    assert "(rope_positions)" in checks.hint("9.2"), "a new verdict starts its own nudge"
    _reset("9.2")


def test_hint_and_solution_display_once_in_a_notebook():
    shown = checks.hint("2.1")
    assert isinstance(shown, _core.Shown) and shown._ipython_display_() is None
    _reset("2.1")


def test_show_solution_waits_for_an_attempt(capsys):
    before = checks.show_solution("9.5")
    assert "Try exercise 9.5" in before and "BEGIN SOLUTION" not in before
    assert "def repeat_kv" in checks.show_solution("9.5", force=True)
    checks.check_repeat_kv(BY_ID["9.5-repeat_kv_tiled"].candidate)
    assert "def repeat_kv" in checks.show_solution("9.5")
    assert capsys.readouterr().out.count("# Solution of exercise 9.5 (repeat_kv)") == 2


@pytest.mark.slow
def test_most_forward_mistakes_of_the_banks_get_a_counterexample():
    """Mistakes the outputs show (not crashes, gradients, devices or training-only slips)."""
    shown = ("softmax_dim", "scale", "causal_mask", "normalization", "head_split", "rope_layout", "rope_rotation",
             "rope_positions", "kv_grouping", "norm_statistic", "gating", "values")
    attempts = [a for a in ATTENTION_BUGGY + MODERN_BUGGY if a.exercise in CHECKS and a.expected in shown]
    found = [a.id for a in attempts if "counterexample" in CHECKS[a.exercise](a.candidate).details]
    assert len(attempts) >= 20 and len(found) >= 0.7 * len(attempts), (len(found), len(attempts))


def test_every_diagnosis_a_student_can_get_has_a_nudge_of_its_own():
    from course_lib.classroom.checks._nudges import NUDGES
    from course_lib.classroom.verdict import DIAGNOSES
    without = [code for code in DIAGNOSES if code not in NUDGES and code not in ("not_implemented", "checker_error")]
    assert not without, f"these diagnoses fall back to the generic nudge: {without}"
    promising = [code for code, text in NUDGES.items() if "next hint" in text]
    assert not promising, f"a nudge may not promise a counter-example that may not exist: {promising}"


# ---------------------------------------------------------------- issue 44: hints show what they promise

def _module_from_notes(module, notes):
    """Load the weights a counter-example shows (named self.<parameter> (...)) into a module of that kind."""
    with torch.no_grad():
        for label, value in notes:
            if label.startswith("self."):
                name = label.split(" ")[0][len("self."):]
                module.get_parameter(name).copy_(value)
    return module.eval()



@pytest.mark.parametrize("attempt_id, make, check", [
    ("9.3-RMSNormNoWeight", lambda: modern.RMSNorm, lambda: checks.check_rms_norm),
    ("9.3-RMSNormCentred", lambda: modern.RMSNorm, lambda: checks.check_rms_norm),
    ("9.4-SwiGLUSiluOnUp", lambda: modern.SwiGLU, lambda: checks.check_swiglu),
    ("9.4-SwiGLUNoActivation", lambda: modern.SwiGLU, lambda: checks.check_swiglu),
])
def test_a_modules_counterexample_shows_every_weight_needed_to_redo_it(attempt_id, make, check, capsys):
    """With only x shown, a student cannot redo RMSNorm or SwiGLU by hand: the weights must be there, and be
    the ones used (the reference and the student's module, rebuilt from what is printed, give both outputs)."""
    attempt = BY_ID[attempt_id]
    result = check()(attempt.candidate)
    example = result.details["counterexample"]
    shown = {label.split(" ")[0] for label, _ in example.notes}
    reference_cls = make()
    sizes = (2, 3) if reference_cls is modern.SwiGLU else None
    x = dict(example.inputs)["x"]
    if sizes is None:
        sizes = (x.shape[-1],)
    reference = reference_cls(*sizes)
    assert shown == {f"self.{name}" for name, _ in reference.named_parameters()}, shown
    _module_from_notes(reference, example.notes)
    student = _module_from_notes(attempt.candidate(*sizes), example.notes)
    with torch.no_grad():
        assert torch.allclose(reference(x), example.expected, atol=1e-6)
        assert torch.allclose(student(x), example.yours, atol=1e-6)
    # printed with every digit they have: two decimals, shown with three
    for _, value in example.notes:
        assert torch.equal(value, value.round(decimals=2))
    exercise = attempt.exercise
    _reset(exercise)
    texts = [checks.hint(exercise) for _ in range(2)]
    assert "counter-example" in texts[1] and ("self.weight" in texts[1] or "self.gate.weight" in texts[1])
    assert "from the inputs and weights above" in texts[1]
    _reset(exercise)


def _flash_mismatch(q, k, v, *, block_q, block_k, causal=False):
    """A forward whose output is wrong in a way no named mistake explains: a plain mismatch."""
    out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
    return out + 0.05, lse   # (not a multiple: an output exactly c times the reference's is named a factor)


class _BackwardMismatch(flash.FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        dq, dk, dv, *rest = flash.FlashAttentionFunction.backward(ctx, grad_out)
        return (dq * 1.01, dk, dv, *rest)


@pytest.mark.parametrize("exercise, check, candidate", [
    ("10.2", lambda: checks.check_flash_attention, _flash_mismatch),
    ("10.3", lambda: checks.check_flash_backward, _BackwardMismatch),
])
def test_a_plain_mismatch_of_the_flash_exercises_shows_a_counterexample(exercise, check, candidate, unguarded):
    """10.2 and 10.3 take their counter-example from the engine: a tiny case, the student's value beside the
    reference's, and the hint ladder offers it before the spec's hints."""
    _reset(exercise)
    result = check()(candidate)
    assert result.diagnosis == "mismatch", result
    example = result.details["counterexample"]
    assert example.yours.shape == example.expected.shape and not torch.allclose(example.yours.double(), example.expected.double())
    assert max(value.numel() for _, value in example.inputs) <= 5 * 2, "tiny inputs a student can follow"
    texts = [checks.hint(exercise) for _ in range(2)]
    assert "counter-example" in texts[1], texts[1]
    _reset(exercise)


def test_the_mismatch_nudge_promises_a_counterexample_only_where_one_is_shown():
    from course_lib.classroom.checks._nudges import nudge
    assert "smallest input where they differ" in nudge("mismatch", example=True)
    assert "smallest input where" not in nudge("mismatch", example=False)
    assert "smallest input where" not in nudge("no_such_diagnosis", example=False)


@pytest.mark.parametrize("exercise", ["1.2", "2.2", "9.3", "10.1", "10.2", "11.3"])
def test_show_solution_prints_the_code_without_the_markers(exercise, capsys):
    from course_lib.classroom.notebook_reader import looks_like_marker
    shown = checks.show_solution(exercise, force=True)
    printed = capsys.readouterr().out
    assert shown.strip() == printed.strip()
    for line in printed.splitlines():
        assert looks_like_marker(line) is None, f"a solution marker was printed: {line!r}"
    assert "SOLUTION" not in printed
    # the code itself is all there: every line of the solution cell but the two markers
    cell = _core.solution_source(exercise).splitlines()
    kept = [line for line in cell if looks_like_marker(line) is None]
    assert len(kept) == len(cell) - 2 and "\n".join(kept).strip() in printed
    header = printed.splitlines()[0]
    assert header.startswith(f"# Solution of exercise {exercise} (")


def test_an_exercise_whose_mistake_shares_a_diagnosis_gets_its_own_question():
    """7.1's split_transpose is Conv1D's (in, out) layout, not a head axis left behind (3.x, 12.2)."""
    from bank.model_bugs import BUGGY as MODEL_BUGGY
    layout = next(a for a in MODEL_BUGGY if a.exercise == "7.1" and a.expected == "split_transpose")
    _reset("7.1")
    result = checks.check_split_c_attn(layout.candidate)
    assert result.diagnosis == "split_transpose"
    first = checks.hint("7.1")
    assert "Conv1D" in first and "heads" not in first
    _reset("7.1")
