"""Exercises of notebook 11 (what attention learns): 11.1 previous_token_score, 11.2 induction_score,
11.3 ablate_head.

11.1 and 11.2 are declarations the engine runs (``engine.judge``) on random causal attention weights, with the
slips of ``_heads_scores``; a score built from tensor operations stays differentiable, which is checked after.
11.3 is a procedure, judged in ``_heads_ablation``. Hints are in ``classroom.exercises``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import heads as ref
from ..exercises import Mistake
from ..verdict import fail
from . import _heads_scores as slips
from ._heads_ablation import ablation_example, judge_ablate_head
from ._student_code import call_student, close, max_diff
from ._student_files import exception_message, exception_name
from .engine import Case, FunctionExercise, checker, function_example, judge
from .engine.function import Run

__all__ = ["check_previous_token_score", "check_induction_score", "check_ablate_head"]


def _causal_weights(shape: tuple[int, int, int, int], generator: torch.Generator) -> torch.Tensor:
    """Attention weights as a causal head makes them: (N, heads, L, L), each row a softmax over keys 0 .. i."""
    length = shape[-1]
    scores = 2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)     # (N, heads, L, L)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)                  # (L, L): True above the diagonal
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1).float()


def _cases(name: str, sizes: Sequence[tuple[tuple[int, int, int, int], int | None]], decimals: int | None = None
           ) -> Callable[[], list[Case]]:
    """The cases of a score: random causal weights of each shape (and ``half``), from one seeded generator."""
    def cases() -> list[Case]:
        generator = torch.Generator().manual_seed(11)
        made = []
        for shape, half in sizes:
            weights = _causal_weights(shape, generator)
            weights = weights if decimals is None else weights.round(decimals=decimals)   # tiny: by hand
            made.append(Case((weights,) if half is None else (weights, half),
                             f"{name}(weights{'' if half is None else f', half={half}'}) with weights of shape {shape}"))
        return made
    return cases


def _one_per_head(case: Case, out: Any) -> None:
    """A score of another shape: name the axes it kept, before the generic shape message."""
    n, heads = case.args[0].shape[:2]
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else None
    if got is None or got == (heads,):
        return
    if heads == 1 and got == ():
        fail("shape", f"{case.what} returned a 0-d tensor, expected shape (1,): one score per head, and this model "
                      f"has one head. A .squeeze() (or .item(), or indexing [0]) drops the heads axis when it has "
                      f"size 1, as in the notebook's one-head model. Average over the batch and the queries only, "
                      f".mean(dim=(0, 2)), and keep the heads axis whatever its size.")
    hint = (" That is one number per sequence of the batch: weights are (N, heads, L, L), so average over the "
            "batch (axis 0) and the queries, and keep the heads (axis 1)." if got == (n,) and n != heads else
            " You kept the batch axis: average over the batch too, one number per head." if got == (n, heads) else
            " You averaged the heads together as well: keep one number per head." if got == () else
            " Keep one number per head: average over the batch (axis 0) and over the queries.")
    fail("score_axes" if out.dim() <= 2 else "shape",
         f"{case.what} returned shape {got}, expected ({heads},): one score per head.{hint}")


def _values(run: Run) -> str:
    return (f"{run.case.what} returned {[round(float(v), 4) for v in run.out.detach()]}, expected "
            f"{[round(float(v), 4) for v in run.expected]} (largest difference {max_diff(run.out, run.expected):.3g}).")


def _score(exercise_id: str, name: str, reference: Callable[..., torch.Tensor], arg_names: tuple[str, ...],
           sizes: Sequence[Any], tiny: Sequence[Any], mistakes: Sequence[Any], success: str) -> FunctionExercise:
    return FunctionExercise(exercise_id, name, reference, _cases(name, sizes), arg_names, success=success,
                            mismatch=_values, mistakes=mistakes, variant=slips.variant, each_case=True, dtype=False,
                            raw=_one_per_head, after=lambda runs, fn: _keeps_its_graph(reference, runs, fn),
                            probes=FunctionExercise.probes + ("device",),   # the text asks for the weights' device
                            examples=_cases(name, tiny, decimals=2))


def _keeps_its_graph(reference: Callable[..., torch.Tensor], runs: list[Run], fn: Any) -> None:
    """Right numbers must keep their graph: each score moves by 1/count when an entry it averages moves by 1."""
    for case in (run.case for run in runs):
        weights = case.args[0].clone().requires_grad_(True)
        out = call_student(fn, weights, *case.args[1:], what=case.what)
        if getattr(out, "grad_fn", None) is None:
            fail("gradient", f"{case.what} returned the right numbers, cut off from autograd (through .item(), "
                             f".tolist(), numpy, torch.tensor(...) of Python numbers, or .detach()). Build the "
                             f"score from tensor operations on `weights` (indexing, .diagonal, .mean), so that "
                             f"it can be differentiated like any other loss.")
        try:    # a backward through the student's graph: what fails there is theirs
            (grad,) = torch.autograd.grad(out.sum(), weights, allow_unused=True)
        except RuntimeError as exc:
            inplace = "modified by an inplace operation" in exception_message(exc)
            said = (exception_message(exc).splitlines() or [exception_name(exc)])[0]
            fail("mutation" if inplace else "gradient",
                 f"{case.what}: the right numbers, but the backward pass through your code fails "
                 f"({said})." + (" A tensor that autograd saved was changed in place "
                                                     "afterwards (x /= ..., x[...] = ..., .mul_): compute a new "
                                                     "tensor instead (x = x / ...)." if inplace else ""))
        expected = _reference_grad(reference, weights, case.args[1:])
        if grad is None or not close(grad, expected):
            fail("gradient", f"{case.what}: the right numbers, but their gradient with respect to the weights is "
                             f"wrong: each score should change by 1/count when one of the entries it averages "
                             f"changes by 1. Compute it from `weights` with tensor operations only.")


def _reference_grad(reference: Callable[..., torch.Tensor], weights: torch.Tensor, rest: tuple[Any, ...]
                    ) -> torch.Tensor:
    """The reference's gradient on a leaf of its own, under grad mode whatever the student's code left."""
    leaf = weights.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        return torch.autograd.grad(reference(leaf, *rest).sum(), leaf)[0]


# ============================================================================ 11.1 previous_token_score

PREVIOUS_TOKEN_SCORE = _score(
    "11.1", "previous_token_score", lambda weights: ref.previous_token_score(weights), ("weights",),
    [((3, 4, 7, 7), None), ((2, 5, 6, 6), None), ((4, 4, 5, 5), None), ((1, 2, 2, 2), None),
     ((2, 1, 6, 6), None)],   # one head, as the notebook's model has: a .squeeze() drops the heads axis
    [((1, 1, 2, 2), None), ((1, 2, 3, 3), None), ((2, 2, 4, 4), None)], slips.PREVIOUS_MISTAKES,
    "Right on batches of 1 to 4 sequences of 2 to 7 tokens, with 1 to 5 heads: the mean of the entries "
    "(i, i - 1) for i >= 1, per head, with its gradient.")


@checker("11.1", example=function_example(PREVIOUS_TOKEN_SCORE))
def check_previous_token_score(fn: Callable[..., Any]) -> str:
    """``fn(weights)`` -> (heads,): each head's mean attention from i to i - 1 over i = 1 .. L-1 and the batch."""
    return judge(PREVIOUS_TOKEN_SCORE, fn)


# ============================================================================ 11.2 induction_score

# A fixed count of queries from the END (the diagonal's last `half` entries, or the last `half` rows): right when
# the second half is as long as the first, and brings in first-half queries when it is shorter (L < 2 * half).
_LAST_ENTRIES = Mistake(
    "score_positions", "you keep the LAST `half` entries of the diagonal ([..., -half:], or the last `half` queries, "
                       "weights[..., -half:, :]): that is the second half only when it is as long as the first. Here "
                       "L < 2 * half, so they start at query L - half, in the FIRST half. Keep the queries i = half .. "
                       "L-1: drop the diagonal's first entry, diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:].",
    output=lambda weights, half: slips.score(weights, half - 1, weights.shape[-1] - half))

INDUCTION_SCORE = _score(
    "11.2", "induction_score", lambda weights, half: ref.induction_score(weights, half), ("weights", "half"),
    [((3, 4, 12, 12), 6), ((2, 3, 10, 10), 5), ((4, 4, 8, 8), 4), ((1, 2, 6, 6), 3),
     ((2, 3, 9, 9), 5),     # a second half shorter than the first (L < 2 * half), as the reference allows
     ((2, 1, 8, 8), 4)],    # one head, as the notebook's model has: a .squeeze() drops the heads axis
    [((1, 1, 4, 4), 2), ((1, 2, 4, 4), 2), ((1, 2, 6, 6), 3)], (*slips.INDUCTION_MISTAKES, _LAST_ENTRIES),
    "Right for halves of 3 to 6 tokens (a shorter second half too) and 1 to 4 heads: the mean of the entries "
    "(i, i - half + 1) over the second half's queries, per head, with its gradient.")


@checker("11.2", example=function_example(INDUCTION_SCORE))
def check_induction_score(fn: Callable[..., Any]) -> str:
    """``fn(weights, half)`` -> (heads,): mean attention from i to i - half + 1 over i = half .. L-1."""
    return judge(INDUCTION_SCORE, fn)


# ============================================================================ 11.3 ablate_head

@checker("11.3", example=ablation_example)
def check_ablate_head(fn: Callable[..., Any]) -> str:
    """``fn(model, layer, head)``: a context manager that zeroes one head's output and restores the model."""
    return judge_ablate_head(fn)
