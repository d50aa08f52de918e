"""How every checker compares numbers: one tolerance, derived from the dtype in one place.

``close`` is the only tensor comparison the checkers use; ``matches`` and ``sums_to_one`` are
built on it. Tolerances that are not about float noise (a prediction rounded by hand in 1.1,
a FLOP count in 6.1) stay with their exercise, with their reason.
"""
from __future__ import annotations

import torch

# Why 1e-3 relative (1e-4 absolute) for float32 and float64 alike: the student's code and the
# reference compute the same thing in a different order (another reduction order, softmax written
# out, a float32 constant in a float64 notebook), which moves float32 results by up to ~1e-5
# relative after softmax, layer norm and gradients. The mistakes the checkers diagnose (a missing
# scale, a leaked mask, a wrong axis) move outputs by 1e-2 or more, so 1e-3 sits safely between.
# Half precision rounds far more coarsely, so the tolerance grows with the dtype's resolution.
_FLOOR_RTOL = 1e-3
_EPS_FACTOR = 8          # a few roundings of the coarsest dtype in the comparison


def tolerance(*tensors: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol) for comparing these tensors: from the coarsest floating dtype among them."""
    eps = max((torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point()), default=0.0)
    rtol = max(_FLOOR_RTOL, _EPS_FACTOR * eps)
    return rtol, rtol / 10


def close(a: object, b: object, *, nan_ok: bool = False) -> bool:
    """Both tensors, same shape, same numbers up to :func:`tolerance` (NaN matches NaN only when ``nan_ok``)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return False
    rtol, atol = tolerance(a, b)
    return bool(torch.allclose(a.detach().double().cpu(), b.detach().double().cpu(), rtol=rtol, atol=atol,
                               equal_nan=nan_ok))


def matches(out: torch.Tensor, hypothesis: torch.Tensor) -> bool:
    """Does the student's output match a mistake's output? Where the mistake leaves a query with no key
    at all its output is undefined (NaN here, zeros from F.scaled_dot_product_attention): either counts."""
    if out.shape != hypothesis.shape:
        return False
    undefined = torch.isnan(hypothesis)
    loose = out[undefined]
    if not bool((torch.isnan(loose) | (loose == 0)).all()):
        return False
    return close(out[~undefined], hypothesis[~undefined])


def sums_to_one(w: torch.Tensor, dim: int) -> bool:
    """Whether the weights along ``dim`` sum to one (attention weights, probabilities)."""
    total = w.sum(dim)
    return close(total, torch.ones_like(total))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest finite difference, for messages."""
    diff = (a.double() - b.double()).abs()
    diff = diff[torch.isfinite(diff)]
    return float(diff.max()) if diff.numel() else float("nan")
