"""Exercises of notebook 11 (what attention learns): 11.1 previous_token_score, 11.2 induction_score,
11.3 ablate_head.

The scores are judged on random causal attention weights against the slips of ``_heads_scores`` (and on
their gradients: a score built from tensor operations stays differentiable). The context manager is
judged in ``_heads_ablation``. Hints are in ``classroom.exercises``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import heads as ref
from ..verdict import fail
from . import _heads_scores as slips
from ._attn_hypotheses import first_match
from ._heads_ablation import judge_ablate_head
from ._student_code import call_student, close, expect_callable, expect_tensor, max_diff
from .engine import checker

__all__ = ["check_previous_token_score", "check_induction_score", "check_ablate_head"]


def _causal_weights(shape: tuple[int, int, int, int], generator: torch.Generator,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention weights as a causal head makes them: (N, heads, L, L), each row a softmax over keys 0 .. i."""
    length = shape[-1]
    scores = 2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)     # (N, heads, L, L)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)                  # (L, L): True above the diagonal
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(dtype)


def _axes_shape_hint(got: tuple[int, ...], n: int, heads: int) -> str:
    if got == (n,) and n != heads:
        return (" That is one number per sequence of the batch: weights are (N, heads, L, L), so average over the "
                "batch (axis 0) and the queries, and keep the heads (axis 1).")
    if got == (n, heads):
        return " You kept the batch axis: average over the batch too, one number per head."
    if got == ():
        return " You averaged the heads together as well: keep one number per head."
    return " Keep one number per head: average over the batch (axis 0) and over the queries."


def _hypothesis(weights: torch.Tensor, back: int, first: int) -> Callable[[int, dict[str, Any]], torch.Tensor]:
    return lambda _, spec: slips.compute(weights, back, first, spec)


def _judge_score(fn: Callable[..., Any], name: str, cases: list[tuple[tuple[int, int, int, int], int | None]],
                 reference: Callable[..., torch.Tensor], copy_offset: bool) -> None:
    expect_callable(fn, name)
    generator = torch.Generator().manual_seed(11)
    for shape, half in cases:
        n, heads, length, _ = shape
        weights = _causal_weights(shape, generator).requires_grad_(True)
        args = (weights,) if half is None else (weights, half)
        shown = f"{name}(weights{'' if half is None else f', half={half}'}) with weights of shape {shape}"
        out = call_student(fn, *args, what=shown)
        if isinstance(out, torch.Tensor) and tuple(out.shape) != (heads,):
            fail("score_axes" if out.dim() <= 2 else "shape",
                 f"{shown} returned shape {tuple(out.shape)}, expected ({heads},): one score per head."
                 + _axes_shape_hint(tuple(out.shape), n, heads))
        expect_tensor(out, (heads,), shown, finite=False)
        right = reference(weights.detach(), *args[1:])
        if not close(out, right):
            back, first = (1, 1) if half is None else (half - 1, half)
            found = first_match(slips.mistakes(back, first, copy_offset=copy_offset), [out.detach()],
                                _hypothesis(weights.detach(), back, first))
            if found is not None:
                fail(found.code, f"{shown}: {found.message}")
            fail("mismatch", f"{shown} returned {[round(float(v), 4) for v in out.detach()]}, expected "
                             f"{[round(float(v), 4) for v in right]} (largest difference {max_diff(out, right):.3g}).")
        if out.grad_fn is None:
            fail("gradient", f"{shown} returned the right numbers, cut off from autograd (through .item(), "
                                f".tolist(), numpy, torch.tensor(...) of Python numbers, or .detach()). Build the "
                                f"score from tensor operations on `weights` (indexing, .diagonal, .mean), so that "
                                f"it can be differentiated like any other loss.")
        (grad,) = torch.autograd.grad(out.sum(), weights, allow_unused=True)
        expected = torch.autograd.grad(reference(*((weights,) + args[1:])).sum(), weights)[0]
        if grad is None or not close(grad, expected):
            fail("gradient", f"{shown}: the right numbers, but their gradient with respect to the weights is "
                                f"wrong: each score should change by 1/count when one of the entries it averages "
                                f"changes by 1. Compute it from `weights` with tensor operations only.")


# ============================================================================ 11.1 previous_token_score

_PREVIOUS_CASES = [((3, 4, 7, 7), None), ((2, 5, 6, 6), None), ((4, 4, 5, 5), None), ((1, 2, 2, 2), None)]


@checker("11.1")
def check_previous_token_score(fn: Callable[..., Any]) -> str:
    """``fn(weights)`` -> (heads,): each head's mean attention from i to i - 1 over i = 1 .. L-1 and the batch."""
    _judge_score(fn, "previous_token_score", _PREVIOUS_CASES, ref.previous_token_score, copy_offset=False)
    return ("Right on batches of 1 to 4 sequences of 2 to 7 tokens, with 2 to 5 heads: the mean of the entries "
            "(i, i - 1) for i >= 1, per head, with its gradient.")


# ============================================================================ 11.2 induction_score

_INDUCTION_CASES = [((3, 4, 12, 12), 6), ((2, 3, 10, 10), 5), ((4, 4, 8, 8), 4), ((1, 2, 6, 6), 3)]


@checker("11.2")
def check_induction_score(fn: Callable[..., Any]) -> str:
    """``fn(weights, half)`` -> (heads,): mean attention from i to i - half + 1 over i = half .. L-1."""
    _judge_score(fn, "induction_score", _INDUCTION_CASES, ref.induction_score, copy_offset=True)
    return ("Right for halves of 3 to 6 tokens and 2 to 4 heads: the mean of the entries (i, i - half + 1) over "
            "the second half's queries, per head, with its gradient.")


# ============================================================================ 11.3 ablate_head

@checker("11.3")
def check_ablate_head(fn: Callable[..., Any]) -> str:
    """``fn(model, layer, head)``: a context manager that zeroes one head's output and restores the model."""
    return judge_ablate_head(fn)
