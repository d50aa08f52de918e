"""Exercises of notebook 03 (multi-head attention): 3.1 split_heads, 3.2 merge_heads,
3.3 MultiHeadMaskedAttention.

The module check runs through ``_attn_modules.ModuleCheck``. Hints are in ``classroom.exercises``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import attention as ref
from ..verdict import fail
from ._attn_modules import EMBED_DIM, MAX_TOKENS, ModuleCheck, module_check
from ._gradients import check_function_gradients
from ._harness import checker
from ._student_code import call_student, expect_callable, expect_tensor

__all__ = ["check_split_heads", "check_merge_heads", "check_multi_head_attention"]


# ============================================================================ 3.1 / 3.2 split and merge heads

def _arange(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def _rearranged(out: torch.Tensor, x: torch.Tensor, alternatives: list[tuple[torch.Tensor, str]],
                what: str, purpose: str) -> None:
    """Say how a rearrangement of x went wrong (x holds 0, 1, 2, ... so every number has one place)."""
    for alternative, message in alternatives:
        if torch.equal(out, alternative):
            fail("head_split", f"{what}: {message}")
    if torch.equal(out.flatten().sort().values, x.flatten().sort().values):
        fail("head_split", f"{what}: the right numbers end up in the wrong places. {purpose}")
    fail("mismatch", f"{what}: your output holds different numbers from x; {purpose}")


@checker("3.1")
def check_split_heads(fn: Callable[..., Any]) -> str:
    """``fn(x (N, L, E), num_heads)`` -> (N, num_heads, L, E // num_heads)."""
    expect_callable(fn, "split_heads")
    for shape, heads in (((2, 3, 8), 2), ((2, 3, 8), 4), ((3, 5, 12), 3), ((1, 1, 8), 1), ((2, 4, 6), 1)):
        x = _arange(*shape)
        n, length, embed_dim = shape
        head_dim = embed_dim // heads
        what = f"split_heads(x, {heads}) with x of shape {shape}"
        out = call_student(fn, x.clone(), heads, what=what)
        if isinstance(out, torch.Tensor) and tuple(out.shape) == (n, length, heads, head_dim) and length != heads:
            fail("shape", f"{what} returned shape {tuple(out.shape)}, expected {(n, heads, length, head_dim)}: you "
                          f"split the features into heads but left the head axis after the sequence axis. "
                          f"Move it in front.")
        expect_tensor(out, (n, heads, length, head_dim), what, dtype=x.dtype)
        if not torch.equal(out, ref.split_heads(x, heads)):
            _rearranged(out, x, [
                (x.reshape(n, heads, length, head_dim),
                 "a reshape straight to (N, heads, L, head_dim) cuts the sequence, not the features, into "
                 "heads. Split the last axis into (heads, head_dim) first, then move the head axis forward."),
                (x.reshape(n, length, head_dim, heads).permute(0, 3, 1, 2),
                 "each head takes every num_heads-th feature instead of a block of head_dim neighbouring "
                 "features: split the last axis as (heads, head_dim), in that order."),
            ], what, "Head h should hold features h*head_dim ... (h+1)*head_dim - 1 of every position.")
    check_function_gradients(fn, ref.split_heads, torch.randn(2, 3, 8), 2, names=("x",),
                             what="split_heads(x, 2) with x of shape (2, 3, 8)")
    return "Right for 1 to 4 heads: each head holds its own block of features at every position."


@checker("3.2")
def check_merge_heads(fn: Callable[..., Any]) -> str:
    """``fn(x (N, heads, L, head_dim))`` -> (N, L, heads * head_dim)."""
    expect_callable(fn, "merge_heads")
    for shape in ((2, 2, 3, 4), (2, 4, 3, 2), (3, 3, 5, 4), (1, 1, 1, 8), (2, 1, 4, 4)):
        x = _arange(*shape)
        n, heads, length, head_dim = shape
        what = f"merge_heads(x) with x of shape {shape}"
        out = call_student(fn, x.clone(), what=what)
        if isinstance(out, torch.Tensor) and out.shape != (n, length, heads * head_dim):
            if tuple(out.shape) == (n, length, heads, head_dim):
                fail("shape", f"{what} returned shape {tuple(out.shape)}, expected {(n, length, heads * head_dim)}: "
                              f"the axes are in the right order; now flatten heads and head_dim into one axis.")
            if tuple(out.shape) == (n, heads * length, head_dim):
                fail("shape", f"{what} returned shape {tuple(out.shape)}, expected {(n, length, heads * head_dim)}: "
                              f"you stacked the heads along the sequence; they belong side by side along the "
                              f"features of each position.")
        expect_tensor(out, (n, length, heads * head_dim), what, dtype=x.dtype)
        if not torch.equal(out, ref.merge_heads(x)):
            _rearranged(out, x, [
                (x.reshape(n, length, heads * head_dim),
                 "a bare reshape of (N, heads, L, head_dim) to (N, L, E) mixes positions: swap the head and "
                 "sequence axes back first, then flatten."),
                (x.permute(0, 2, 3, 1).reshape(n, length, heads * head_dim),
                 "the heads' features are interleaved: flatten as (heads, head_dim), head after head."),
            ], what, "Position l of the output should hold head 0's features, then head 1's, and so on.")
    check_function_gradients(fn, ref.merge_heads, torch.randn(2, 2, 3, 4), names=("x",),
                             what="merge_heads(x) with x of shape (2, 2, 3, 4)")
    return "Right for 1 to 4 heads: merge_heads puts the heads side by side and undoes split_heads."


# ============================================================================ 3.3 multi-head attention

@checker("3.3")
def check_multi_head_attention(cls: Callable[..., Any]) -> str:
    """``cls(embed_dim, num_heads, max_tokens, dropout_rate)`` with Linear layers query, key, value, proj."""
    expect_callable(cls, "MultiHeadMaskedAttention", "class")
    check = ModuleCheck("MultiHeadMaskedAttention", lambda heads, p: cls(EMBED_DIM, heads, MAX_TOKENS, p),
                        lambda heads, p: ref.MultiHeadMaskedAttention(EMBED_DIM, heads, MAX_TOKENS, p),
                        heads=(2, 4, 1))
    return module_check(check, " with 1, 2 and 4 heads")
