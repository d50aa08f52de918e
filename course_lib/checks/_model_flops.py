"""Checker for notebook 06: the FLOPs a training step needs per token, 6N + 12·L·H·Q·T."""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import torch

from ._core import call, checker, fail, register

__all__ = ["check_flops_per_token"]

# Sizes that differ in every factor, so that together they tell the slips below apart
# (the first has the baseline recipe's width and context).
_CONFIGS = (
    dict(vocab_size=65, max_tokens=64, embed_dim=128, num_heads=4, num_layers=2),
    dict(vocab_size=23, max_tokens=40, embed_dim=96, num_heads=3, num_layers=3),
    dict(vocab_size=11, max_tokens=128, embed_dim=64, num_heads=8, num_layers=1),
)


def _lhqt(config: Any) -> int:
    """L·H·Q·T: layers x heads x head size x context."""
    return config.num_layers * config.num_heads * config.head_dim * config.max_tokens


def _terms(config: Any, weights: int) -> tuple[float, float]:
    """(weights' FLOPs per token, attention's FLOPs per token) for a correct count."""
    return 6 * weights, 12 * _lhqt(config)


# Known slips: (name, what they compute, what to tell the student). The attention term is
# written from the parts of 12·L·H·Q·T so each slip changes exactly one thing.
_SLIPS: tuple[tuple[str, Callable[[Any, int], float], str], ...] = (
    ("forward only", lambda c, n: 2 * n + 4 * _lhqt(c),
     "you count the forward pass only (2N + 4·L·H·Q·T). Training also runs the backward pass, which needs two "
     "matrix multiplies for every one of the forward pass: three times the forward in all, so 6N and 12·L·H·Q·T."),
    ("weights forward only", lambda c, n: 2 * n + _terms(c, n)[1],
     "the weights' term counts only the forward pass (2N). Backward needs the gradient for the input and the "
     "gradient for the weight, 4N more: 6N in all."),
    ("4N", lambda c, n: 4 * n + _terms(c, n)[1],
     "the weights' term is 4N: forward (2N) plus only one of the two backward matrix multiplies. The backward "
     "pass computes both dL/dX and dL/dW, 2N each: 6N in all."),
    ("no attention", lambda c, n: 6 * n,
     "you count the weights (6N) but not attention. The scores QK^T and the weighted sum of the values multiply "
     "activations by activations, so they are not in N: add 12·L·H·Q·T."),
    ("attention forward only", lambda c, n: 6 * n + 4 * _lhqt(c),
     "the attention term counts only the forward pass (4·L·H·Q·T). Backward costs twice the forward here too: "
     "12·L·H·Q·T."),
    ("attention one product", lambda c, n: 6 * n + 6 * _lhqt(c),
     "the attention term counts one product per head. There are two: the scores (QK^T) and the weighted sum of "
     "the values, 2·Q·T FLOPs each per token in the forward pass, so 12·L·H·Q·T with the backward pass."),
    ("no heads", lambda c, n: 6 * n + 12 * c.num_layers * c.head_dim * c.max_tokens,
     "the attention term leaves out the number of heads: each of the H heads has its own scores and weighted "
     "sum. Use 12·L·H·Q·T (H·Q is embed_dim)."),
    ("embed_dim as head size", lambda c, n: 6 * n + 12 * c.num_layers * c.num_heads * c.embed_dim * c.max_tokens,
     "the attention term multiplies the number of heads by embed_dim. Q is the size of ONE head, "
     "config.head_dim = embed_dim // num_heads, so H·Q = embed_dim."),
    ("no layers", lambda c, n: 6 * n + 12 * c.num_heads * c.head_dim * c.max_tokens,
     "the attention term leaves out the number of layers: every block has its own attention. "
     "Multiply by L = config.num_layers."),
    ("T squared", lambda c, n: 6 * n + 12 * _lhqt(c) * c.max_tokens,
     "the attention term has T twice. Per token, its query meets T keys (and T values): T appears once. "
     "Per window of T tokens it is T², but this function counts per token."),
    ("per window", lambda c, n: (6 * n + _terms(c, n)[1]) * c.max_tokens,
     "the result is T = max_tokens times too large: that is the count for a whole window of T tokens. "
     "The function returns FLOPs per token."),
)


def _as_number(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif type(value).__module__.startswith("numpy") and hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail("dtype", f"{what} should return a number of FLOPs (an int or a float), but returned "
                      f"{'nothing (did you forget `return`?)' if value is None else type(value).__name__}.")
    if not math.isfinite(value):
        fail("nan", f"{what} returned {value}; expected a finite number of FLOPs.")
    return float(value)


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


@checker("6.2")
def check_flops_per_token(fn: Callable[..., Any]) -> str:
    """fn(config, num_weights) -> training FLOPs per token (6N + 12·L·H·Q·T)."""
    from course_lib.model import GPT, GPTConfig

    if not callable(fn):
        fail("exception", f"Pass your function itself, flops_per_token, not {type(fn).__name__}.")
    cases = []   # (config, N, what, returned, expected)
    for sizes in _CONFIGS:
        config = GPTConfig(**sizes)
        weights = GPT(config).num_parameters(include_embeddings=False)
        what = (f"flops_per_token(config with L={config.num_layers} layers, H={config.num_heads} heads of "
                f"Q={config.head_dim}, T={config.max_tokens}; num_weights={weights:,})")
        got = _as_number(call(fn, config, weights, what=what), what)
        cases.append((config, weights, what, got, sum(_terms(config, weights))))
    wrong = [case for case in cases if not _same(case[3], case[4])]
    if not wrong:
        config, weights = cases[0][:2]
        share = _terms(config, weights)[0] / _terms(config, weights)[1]
        return (f"6N + 12·L·H·Q·T, right for every configuration tried. With embed {config.embed_dim} and a "
                f"context of {config.max_tokens} the weights' term is {share:.0f} times the attention term: "
                f"6N ≈ 72·L·E² against 12·L·E·T, so attention takes over once the context T is longer than "
                f"about 6 × embed_dim.")

    config, weights, what, got, expected = wrong[0]
    # A slip is named only when it explains every configuration: with L = 2, say, leaving out
    # the layers and counting one product per head give the same number.
    for _name, slip, advice in _SLIPS:
        if all(_same(c[3], slip(c[0], c[1])) for c in cases):
            fail("mismatch", f"{what} returned {got:,.0f}, expected {expected:,.0f}: {advice}")
    for unit, scale in (("GFLOPs", 1e9), ("MFLOPs", 1e6), ("kFLOPs", 1e3)):
        if all(_same(c[3] * scale, c[4]) for c in cases):
            fail("mismatch", f"{what} returned {got:g}, which is the right count in {unit}. Return plain "
                             f"FLOPs ({expected:,.0f}); divide only when you print.")
    other = _as_number(call(fn, config, weights + 1000, what=what), what)
    if _same(other, got):
        fail("mismatch", f"{what} returned {got:,.0f}, expected {expected:,.0f}, and gives the same number "
                         f"when num_weights changes: use the num_weights argument (N) for the 6N term.")
    fail("mismatch", f"{what} returned {got:,.0f}, expected {expected:,.0f} = 6·{weights:,} + "
                     f"12·{config.num_layers}·{config.num_heads}·{config.head_dim}·{config.max_tokens}.")


register("6.2", "flops_per_token", [
    "Two terms: the weights (6 FLOPs per weight per token) and attention (12·L·H·Q·T per token).",
    "Read the sizes from config: L = config.num_layers, H = config.num_heads, Q = config.head_dim, "
    "T = config.max_tokens. N is the num_weights argument.",
    "return 6 * num_weights + 12 * L * H * Q * T, with each letter taken from config.",
], solution="course_lib.train:flops_per_token")
