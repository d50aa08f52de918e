"""Behavioural probes shared by the attention checkers (notebooks 01-03): reading attention weights
back out of a student's code to say what is wrong with them. Calling the student's code, output
checks and comparisons are in ``_student_code``."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..verdict import fail
from ._student_code import matches, sums_to_one


def shape_str(shape: Iterable[int]) -> str:
    return str(tuple(shape))


def fit_scale(weights: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> float | None:
    """The factor s with weights ~ softmax(s * scores) over the allowed keys, or None when no s fits."""
    usable = allowed & (weights > 1e-9)
    logw = torch.where(usable, weights.clamp_min(1e-30).double().log(), torch.zeros((), dtype=torch.float64))
    s = torch.where(usable, scores.double(), torch.zeros((), dtype=torch.float64))
    count = usable.sum(-1, keepdim=True).clamp_min(1)
    # centre each row: softmax is shift-invariant, so the row constant drops out
    dl = torch.where(usable, logw - logw.sum(-1, keepdim=True) / count, torch.zeros((), dtype=torch.float64))
    ds = torch.where(usable, s - s.sum(-1, keepdim=True) / count, torch.zeros((), dtype=torch.float64))
    denom = float((ds * ds).sum())
    if denom < 1e-9:
        return None
    factor = float((dl * ds).sum()) / denom
    residual = float(((dl - factor * ds) ** 2).sum()) / max(float((dl * dl).sum()), 1e-12)
    return factor if residual < 1e-4 else None


def diagnose_weights(weights: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor | None,
                     expected_scale: float, *, key_axis: str = "the keys (dim=-1)",
                     hidden: str = "masked keys", scale_name: str = "1/sqrt(d)") -> None:
    """Raise the Failure that best explains wrong attention weights (..., Lq, Lk); do nothing if they look right.

    ``scores`` are the raw dot products q k^T (same shape), ``allowed`` which keys a query may see.
    """
    if not torch.isfinite(weights).all():
        return
    if not sums_to_one(weights, -1):
        for dim in range(weights.dim() - 1):
            if weights.shape[dim] > 1 and sums_to_one(weights, dim):
                axis = "the queries" if dim == weights.dim() - 2 else f"axis {dim}"
                fail("softmax_dim", f"Your attention weights sum to one over {axis}, not over {key_axis}: "
                                    f"the softmax runs along the wrong axis. Each query needs its own "
                                    f"distribution over the keys.")
        row = weights.sum(-1).flatten()
        fail("normalization", f"The attention weights of a query should sum to one, but yours sum to values "
                              f"like {float(row[0]):.3g} and {float(row[-1]):.3g}. Check that you take a "
                              f"softmax over the keys, and that nothing changes the weights after it.")
    if weights.min() < -1e-6:
        fail("normalization", "Some of your attention weights are negative: they should come out of a "
                              "softmax, which gives positive weights that sum to one.")
    if allowed is not None:
        leak = weights.masked_fill(allowed, 0.0).abs().max()
        if leak > 1e-5:
            fail("causal_mask", f"The {hidden} still get weight (up to {float(leak):.3g}). Set their scores to "
                                f"-inf before the softmax so their weight is exactly zero.")
    full = torch.ones_like(weights, dtype=torch.bool) if allowed is None else allowed.expand_as(weights)
    factor = fit_scale(weights, scores, full)
    if factor is not None and abs(factor - expected_scale) > 1e-2 * expected_scale:
        what = ("no scaling at all" if abs(factor - 1) < 1e-2 else f"a factor of {factor:.4g}")
        fail("scale", f"Your weights are a softmax of the scores with {what}; the expected factor is "
                      f"{scale_name} = {expected_scale:.4g}. Check how (and where) you scale the scores.")


def identity_values(k: torch.Tensor) -> torch.Tensor:
    """v = one-hot rows, so attention returns its own weights: out[..., i, j] = weight of key j for query i."""
    length = k.shape[-2]
    return torch.eye(length, dtype=k.dtype).expand(*k.shape[:-1], length).clone()   # (..., Lk, Lk)


def first_match(hypotheses: Iterable[Any], outputs: list[torch.Tensor],
                compute: Callable[[int, dict[str, Any]], torch.Tensor]) -> Any | None:
    """The first hypothesis whose output matches the student's output in every case (NaN matching NaN)."""
    for hypothesis in hypotheses:
        try:
            if all(matches(out, compute(i, hypothesis.spec)) for i, out in enumerate(outputs)):
                return hypothesis
        except (RuntimeError, ValueError):   # a hypothesis that does not apply to these shapes
            continue
    return None
