"""checks.hint follows the last failed check (nudge, counter-example, then the spec); hint and
show_solution print once; show_solution waits for a checked attempt (or force=True)."""
from __future__ import annotations

import torch
from bank.attention_bugs import BUGGY as ATTENTION_BUGGY
from bank.modern_bugs import BUGGY as MODERN_BUGGY

from course_lib import attention, modern
from course_lib.classroom import checks
from course_lib.classroom.checks import _core

BY_ID = {a.id: a for a in ATTENTION_BUGGY + MODERN_BUGGY}
CHECKS = {"1.3": checks.check_scaled_dot_product_attention, "2.1": checks.check_causal_mask,
          "3.3": checks.check_multi_head_attention, "9.2": checks.check_apply_rotary,
          "9.5": checks.check_repeat_kv, "9.6": checks.check_grouped_query_attention}


def _reset(exercise):
    entry = _core.EXERCISES[exercise]
    entry.shown, entry.step, entry.followed = 0, 0, None


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
    assert "BEGIN SOLUTION" in checks.show_solution("9.5", force=True)
    checks.check_repeat_kv(BY_ID["9.5-repeat_kv_tiled"].candidate)
    assert "BEGIN SOLUTION (Exercise 9.5" in checks.show_solution("9.5")
    assert capsys.readouterr().out.count("BEGIN SOLUTION (Exercise 9.5") == 2


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
