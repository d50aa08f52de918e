"""The checkers of notebook 10 (exercises 10.1-10.3) against the references and a bank of student attempts."""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from bank.flash_bugs import BUGGY, CORRECT

from course_lib import flash
from course_lib.classroom import checks
from course_lib.classroom.checks import _flash_variants, notebook10
from course_lib.classroom.checks._flash_probe import Recorder

CHECKERS = {
    "10.1": checks.check_online_softmax,
    "10.2": checks.check_flash_attention,
    "10.3": checks.check_flash_backward,
}

REFERENCES = {
    "10.1": flash.online_softmax,
    "10.2": flash.flash_attention,
    "10.3": flash.FlashAttentionFunction,
}

# The mistakes the issue names, each with the diagnosis a bank attempt must get for it.
ISSUE_MISTAKES = {
    "the rescale forgotten when the maximum changes": ("10.1", "online_rescale"),
    "the maximum of the last block only": ("10.1", "running_max"),
    "normalising at every block instead of at the end": ("10.1", "early_normalization"),
    "overflow from no maximum at all": ("10.1", "overflow"),
    "a block boundary off by one": ("10.1", "block_bounds"),
    "materialised the full score matrix": ("10.2", "full_scores"),
    "the wrong block skipped": ("10.2", "block_skip"),
    "the diagonal block unmasked": ("10.2", "causal_mask"),
    "a rescale on the output accumulator forgotten": ("10.2", "online_rescale"),
    "1/sqrt(d) applied twice": ("10.2", "scale"),
    "padding of a last block smaller than the block size": ("10.2", "block_bounds"),
    "D computed from the wrong tensors": ("10.3", "backward_delta"),
    "the scale forgotten in dS": ("10.3", "scale"),
    "a transposed dV": ("10.3", "transposed"),
}

DIAGNOSES_ADDED_FOR_10 = ("online_rescale", "running_max", "overflow", "early_normalization", "block_bounds",
                          "block_skip", "full_scores", "not_tiled", "logsumexp", "backward_delta", "transposed")


def run(exercise, candidate):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CHECKERS[exercise](candidate)


@pytest.mark.parametrize("exercise", sorted(CHECKERS))
def test_reference_passes(exercise):
    result = run(exercise, REFERENCES[exercise])
    assert result.passed, result.message
    assert result.diagnosis is None and result.exercise == exercise


def test_bank_size_and_coverage():
    assert len(BUGGY) >= 40 and len(CORRECT) >= 8
    for exercise in CHECKERS:
        assert any(a.exercise == exercise for a in BUGGY), f"no buggy attempt at {exercise}"
        assert any(a.exercise == exercise for a in CORRECT), f"no correct attempt at {exercise}"
    got = {(a.exercise, a.expected) for a in BUGGY}
    missing = [mistake for mistake, key in ISSUE_MISTAKES.items() if key not in got]
    assert not missing, f"the bank has no attempt for: {missing}"
    codes = Counter(a.expected for a in BUGGY)
    assert all(codes[code] > 0 for code in DIAGNOSES_ADDED_FOR_10), \
        [code for code in DIAGNOSES_ADDED_FOR_10 if not codes[code]]
    assert sum(n for code, n in codes.items() if code != "mismatch") / len(BUGGY) >= 0.9
    assert len({a.id for a in BUGGY + CORRECT}) == len(BUGGY + CORRECT), "attempt names are unique"


def test_every_hypothesis_uses_a_diagnosis():
    assert set(DIAGNOSES_ADDED_FOR_10) <= set(checks.DIAGNOSES)
    codes = [m.code for m in _flash_variants.FORWARD_MISTAKES + _flash_variants.BACKWARD_MISTAKES
             + notebook10._SOFTMAX_MISTAKES + notebook10._LSE_MISTAKES]
    assert set(codes) <= set(checks.DIAGNOSES)


def test_every_hypothesised_mistake_changes_what_the_checker_sees():
    """A hypothesis equal to the reference on every case could never be told apart: each must differ somewhere."""
    for spec in (mistake.spec for mistake in notebook10._SOFTMAX_MISTAKES):
        assert any(not torch.allclose(_flash_variants.softmax_variant(x, size, **spec).double(),
                                      torch.softmax(x.double(), -1), equal_nan=False)
                   for x, size in notebook10._SOFTMAX_CASES), spec
    for spec in (mistake.spec for mistake in _flash_variants.FORWARD_MISTAKES):
        if spec == {"skip": "none"}:
            continue
        assert any(not torch.allclose(_flash_variants.forward_variant(q, k, v, bq, bk, c, **spec)[0].double(),
                                      flash.naive_attention(q.double(), k.double(), v.double(), causal=c)[0])
                   for q, k, v, bq, bk, c in notebook10._FORWARD_CASES), spec


def test_the_reference_forward_variant_is_the_reference():
    for q, k, v, bq, bk, causal in notebook10._FORWARD_CASES:
        out, lse = _flash_variants.forward_variant(q, k, v, bq, bk, causal)
        right, right_lse = flash.naive_attention(q.double(), k.double(), v.double(), causal=causal)
        assert torch.allclose(out, right) and torch.allclose(lse, right_lse)


def test_recorder_sees_the_full_matrix_and_counts_score_blocks():
    q = torch.randn(1, 2, 64, 12)
    with Recorder(12) as recorder:
        flash.naive_attention(q, q, q)
    assert recorder.record.score_shaped(64, 64) is not None
    with Recorder(12) as recorder:
        flash.flash_attention(q, q, q, block_q=16, block_k=8, causal=True)
    needed, total = flash.causal_blocks(64, 16, 8)
    assert recorder.record.score_shaped(64, 64) is None
    assert recorder.record.score_elements == needed * 16 * 8 * 2
    assert recorder.record.largest_tile == (16, 8)


def test_a_check_runs_on_float64_defaults_and_leaves_grad_mode_alone():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            assert run("10.2", flash.flash_attention).passed
            assert run("10.3", flash.FlashAttentionFunction).passed
            assert not torch.is_grad_enabled()
    finally:
        torch.set_default_dtype(default)


# ---------------------------------------------------------------- issue 44: an off-by-one block bound is named

def _tiled_with_bounds(q, k, v, block_q, block_k, causal, key_stop):
    """The reference's loop with the key loop's stop written by the student (key_stop(lk, qe, causal))."""
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for ks in range(0, key_stop(lk, qe, causal), block_k):
            ke = min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal:
                future = torch.arange(ks, ke, device=q.device)[None, :] > torch.arange(qs, qe, device=q.device)[:, None]
                s = s.masked_fill(future, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l, acc, m = l * c + p.sum(-1), acc * c[..., None] + p @ v[..., ks:ke, :], m_new
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, -2), torch.cat(lses, -1)


def flash_causal_stop_plus_one(q, k, v, *, block_q, block_k, causal=False):
    # "stop the key loop before the first block that starts after qe - 1", read as qe + 1
    return _tiled_with_bounds(q, k, v, block_q, block_k, causal, lambda lk, qe, c: qe + 1 if c else lk)


def flash_key_loop_one_block_too_far(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_with_bounds(q, k, v, block_q, block_k, causal,
                              lambda lk, qe, c: (min(lk, qe) if c else lk) + block_k)


def flash_bounds_right(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_with_bounds(q, k, v, block_q, block_k, causal, lambda lk, qe, c: min(lk, qe) if c else lk)


@pytest.mark.parametrize("candidate", [flash_causal_stop_plus_one, flash_key_loop_one_block_too_far])
def test_a_loop_bound_one_block_too_far_is_named_not_an_exception(candidate):
    """The student's code raises inside torch (amax over an empty dim); the verdict names the bound instead."""
    result = checks.check_flash_attention(candidate)
    assert not result.passed and result.diagnosis == "block_bounds", result
    assert "empty block" in result.message and "range(0, min(Lk, qe), block_k)" in result.message
    assert "amax" not in result.message and "non-zero size" not in result.message


def test_the_same_loop_with_the_right_bounds_passes_and_other_exceptions_stay_exceptions():
    assert checks.check_flash_attention(flash_bounds_right).passed

    def raises_elsewhere(q, k, v, *, block_q, block_k, causal=False):
        raise IndexError("a slip of the student's own")
    result = checks.check_flash_attention(raises_elsewhere)
    assert result.diagnosis == "exception" and "IndexError" in result.message


# ---------------------------------------------------------------- issue 43: the saved_tensors probe

class _Double(torch.autograd.Function):
    """y = 2 x, saving x: the smallest Function whose backward can touch a saved input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class _DoubleScalingX(_Double):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.mul_(0.5)                 # scratch use of the saved input: the gradient is still right
        return 2 * grad


class _DoubleSavingOut(_Double):
    @staticmethod
    def forward(ctx, x):
        y = 2 * x
        ctx.save_for_backward(x, y, y.sum(-1))
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y, total = ctx.saved_tensors
        total.zero_()
        return 2 * grad


def _probe(cls):
    from course_lib.classroom.checks.engine.saved_tensors import forward_backward
    from course_lib.classroom.verdict import Failure
    x, grad = torch.randn(3, 4), torch.randn(3, 4)
    try:
        out, grads = forward_backward(cls, (x,), grad, names=("x",), what="_Double.apply(x)")
    except Failure as failure:
        return failure
    return out, grads, x, grad


def test_the_saved_tensors_probe_passes_a_clean_function_and_gives_its_gradients():
    out, (dx,), x, grad = _probe(_Double)
    assert torch.equal(out, 2 * x) and torch.equal(dx, 2 * grad)


@pytest.mark.parametrize("cls, named", [(_DoubleScalingX, "changed x in place"),
                                        (_DoubleSavingOut, "position 3 of ctx.save_for_backward")])
def test_the_saved_tensors_probe_names_what_the_backward_changed(cls, named):
    """Right gradients, but an input or a tensor saved for backward changed: the verdict is mutation, named."""
    failure = _probe(cls)
    assert failure.diagnosis == "mutation" and named in failure.message, failure.message


def test_10_3_declares_the_saved_tensors_probe():
    assert "saved_tensors" in notebook10.FLASH_BACKWARD.probes


# ---------------------------------------------------------------- issue 43: magnitudes and messages

def softmax_clamped(x, block_size):
    """Right for every score within +-200 (all the well-scaled cases), wrong beyond: only magnitudes show it."""
    x = x.clamp(-200.0, 200.0)
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def test_a_softmax_wrong_only_at_large_magnitudes_gets_the_engines_verdict():
    result = run("10.1", softmax_clamped)
    assert not result.passed and result.diagnosis == "magnitude", result
    assert "well-scaled" in result.message and "scores scaled to about" in result.message


def test_the_magnitude_cases_are_beyond_what_exp_survives_in_float32():
    """Each magnitude case of 10.1 and 10.2 holds scores exp cannot take unshifted (above 88 or below -104)."""
    for case in notebook10._softmax_magnitudes():
        x = case.args[0]
        assert float(x.abs().max()) > 104, case.what
    for case in notebook10._forward_magnitudes():
        q, k, _, _, _, causal = case.args
        scores = notebook10._scores(q, k, causal)
        assert float(scores[scores.isfinite()].abs().max()) > 104, case.what


def test_a_never_written_row_is_named_not_quoted_from_uninitialised_memory():
    def drops_last_query_block(q, k, v, *, block_q, block_k, causal=False):
        out, lse = flash_bounds_right(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        out[..., -1, :] = 6.6e33                    # what torch.empty may hold where nothing was written
        return out, lse
    result = run("10.2", drops_last_query_block)
    assert result.diagnosis == "block_bounds" and "never written" in result.message, result
    assert "e+33" not in result.message


def test_a_mismatch_counts_garbage_apart_from_the_difference():
    expected = torch.randn(2, 5)
    out = expected.clone()
    out[0, 1], out[1, 2], out[1, 3] = 6.6e33, float("nan"), out[1, 3] + 0.5
    said = notebook10._by_up_to(out, expected)
    assert "2 entries" in said and "up to 0.5" in said and "never written" in said and "torch.zeros" not in said
    assert notebook10._by_up_to(expected + 0.25, expected) == "by up to 0.25"
