"""Exercises of notebook 02 (masking): 2.1 causal_mask, 2.2 MaskedAttention.

The module checks run through ``_attn_modules.ModuleCheck``. Hints are in ``classroom.exercises``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import attention as ref
from ..verdict import fail
from ._attn_modules import EMBED_DIM, MAX_TOKENS, ModuleCheck, module_check
from ._harness import checker
from ._student_code import call_student, expect_callable, expect_tensor

__all__ = ["check_causal_mask", "check_masked_attention"]


# ============================================================================ 2.1 causal mask

_MASK_PATTERNS = (
    (lambda m: m.all(), "Nothing is hidden: every position may attend to every other one, including the future."),
    (lambda m: not m.any(), "Everything is hidden: no position may attend to anything. True means 'may attend'."),
    (lambda m: torch.equal(m, torch.ones_like(m).triu()),
     "Your mask points the wrong way: True sits on and above the diagonal, so each position sees the "
     "future. It should be on and below the diagonal (the past)."),
    (lambda m: torch.equal(m, torch.ones_like(m).triu(1)),
     "Your mask is inverted: you marked the positions to hide. In this course True means 'may attend': "
     "on and below the diagonal."),
    (lambda m: torch.equal(m, torch.ones_like(m).tril(-1)),
     "The diagonal is missing: each position must be allowed to attend to itself."),
    (lambda m: torch.equal(m, torch.ones_like(m).tril(1)),
     "Your mask is off by one: it also lets each position see the next one. Keep the diagonal and below."),
)


@checker("2.1")
def check_causal_mask(fn: Callable[..., Any]) -> str:
    """``fn(n)`` -> bool (n, n), True on and below the diagonal."""
    expect_callable(fn, "causal_mask")
    for n in (5, 1, 2, 8):
        what = f"causal_mask({n})"
        out = call_student(fn, n, what=what)
        if isinstance(out, torch.Tensor) and tuple(out.shape) == (n, n) and out.dtype != torch.bool:
            expected = ref.causal_mask(n)
            if out.is_floating_point() and torch.isinf(out).any():
                fail("dtype", f"{what} returned a float mask with -inf in it (an additive mask). This course uses "
                              f"a bool mask, True where a position may attend; return dtype torch.bool.")
            if torch.equal(out != 0, expected) and bool(((out == 0) | (out == 1)).all()):
                fail("dtype", f"{what} has the right pattern but dtype {out.dtype}: make it torch.bool, so that "
                              f"~mask and masked_fill work as intended (pass dtype= or call .bool()).")
        expect_tensor(out, (n, n), what, dtype=torch.bool, finite=False)
        expected = ref.causal_mask(n)
        if not torch.equal(out, expected):
            for matches, message in _MASK_PATTERNS:
                if n > 1 and bool(matches(out)):
                    fail("causal_mask", f"{what}: {message}")
            i, j = (out != expected).nonzero()[0].tolist()
            fail("causal_mask", f"{what}: entry [{i}, {j}] should be {bool(expected[i, j])}: position i may "
                                f"attend to position j exactly when j <= i.")
    return "Right for n = 1, 2, 5 and 8: True on and below the diagonal, dtype torch.bool."


# ============================================================================ 2.2 masked attention

@checker("2.2")
def check_masked_attention(cls: Callable[..., Any]) -> str:
    """``cls(embed_dim, max_tokens, dropout_rate)`` with Linear layers query, key, value, proj."""
    expect_callable(cls, "MaskedAttention", "class")
    check = ModuleCheck("MaskedAttention", lambda heads, p: cls(EMBED_DIM, MAX_TOKENS, p),
                        lambda heads, p: ref.MaskedAttention(EMBED_DIM, MAX_TOKENS, p), heads=(1,))
    return module_check(check, "")
