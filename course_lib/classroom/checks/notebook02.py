"""Exercises of notebook 02 (masking): 2.1 causal_mask, 2.2 MaskedAttention.

2.1 is a declaration the engine runs (``engine.judge``), compared bit for bit; 2.2 runs through the
attention modules' check (``_attn_modules.ModuleCheck``). Hints are in ``classroom.exercises``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import attention as ref
from ..exercises import Mistake
from ..verdict import fail
from ._attn_modules import EMBED_DIM, MAX_TOKENS, ModuleCheck, module_check
from ._model_common import copy_weights
from ._student_code import call, close, construct, expect_callable, max_diff, module_output
from .engine import Case, FunctionExercise, checker, function_example, judge, module_example
from .engine.function import Run

__all__ = ["check_causal_mask", "check_masked_attention"]


# ============================================================================ 2.1 causal mask

def _pattern(make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int], torch.Tensor | None]:
    """A wrong mask of n x n, built from the all-True one (None for n = 1, where the patterns coincide)."""
    return lambda n: make(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None


def _raw_mask(case: Case, out: Any) -> None:
    """A mask of the right size but not bool: an additive mask, or the right pattern in another dtype."""
    (n,) = case.args
    if isinstance(out, torch.Tensor) and tuple(out.shape) == (n, n) and out.dtype != torch.bool:
        if out.is_floating_point() and torch.isinf(out).any():
            fail("dtype", f"{case.what} returned a float mask with -inf in it (an additive mask). This course uses "
                          f"a bool mask, True where a position may attend; return dtype torch.bool.")
        if torch.equal(out != 0, ref.causal_mask(n)) and bool(((out == 0) | (out == 1)).all()):
            fail("dtype", f"{case.what} has the right pattern but dtype {out.dtype}: make it torch.bool, so that "
                          f"~mask and masked_fill work as intended (pass dtype= or call .bool()).")


def _first_wrong_entry(runs: list[Run], fn: Any) -> None:
    run = runs[0]
    i, j = (run.out != run.expected).nonzero()[0].tolist()
    fail("causal_mask", f"{run.case.what}: entry [{i}, {j}] should be {bool(run.expected[i, j])}: position i may "
                        f"attend to position j exactly when j <= i.")


CAUSAL_MASK = FunctionExercise(
    "2.1", "causal_mask", lambda n: ref.causal_mask(n), lambda: [Case((n,), f"causal_mask({n})") for n in (5, 1, 2, 8)],
    ("n",),
    success="Right for n = 1, 2, 5 and 8: True on and below the diagonal, dtype torch.bool.",
    mismatch=lambda run: "",   # _first_wrong_entry always decides
    mistakes=(
        Mistake("causal_mask", "Nothing is hidden: every position may attend to every other one, including the "
                               "future.", output=_pattern(lambda ones: ones)),
        Mistake("causal_mask", "Everything is hidden: no position may attend to anything. True means 'may "
                               "attend'.", output=_pattern(lambda ones: ~ones)),
        Mistake("causal_mask", "Your mask points the wrong way: True sits on and above the diagonal, so each "
                               "position sees the future. It should be on and below the diagonal (the past).",
                output=_pattern(lambda ones: ones.triu())),
        Mistake("causal_mask", "Your mask is inverted: you marked the positions to hide. In this course True means "
                               "'may attend': on and below the diagonal.", output=_pattern(lambda ones: ones.triu(1))),
        Mistake("causal_mask", "The diagonal is missing: each position must be allowed to attend to itself.",
                output=_pattern(lambda ones: ones.tril(-1))),
        Mistake("causal_mask", "Your mask is off by one: it also lets each position see the next one. Keep the "
                               "diagonal and below.", output=_pattern(lambda ones: ones.tril(1))),
    ),
    exact=True, each_case=True, raw=_raw_mask, diagnose=_first_wrong_entry,
    examples=lambda: [Case((n,), f"causal_mask({n})") for n in (1, 2, 3, 4)],
)


@checker("2.1", example=function_example(CAUSAL_MASK))
def check_causal_mask(fn: Callable[..., Any]) -> str:
    """``fn(n)`` -> bool (n, n), True on and below the diagonal."""
    return judge(CAUSAL_MASK, fn)


# ============================================================================ 2.2 masked attention

def _masked_example(cls: Any, *_: Any, **__: Any) -> Any:
    return module_example("MaskedAttention(2, 4, 0.0)", lambda: cls(2, 4, 0.0),
                          lambda: ref.MaskedAttention(2, 4, 0.0), 2)


@checker("2.2", example=_masked_example)
def check_masked_attention(cls: Callable[..., Any]) -> str:
    """``cls(embed_dim, max_tokens, dropout_rate)`` with Linear layers query, key, value, proj."""
    expect_callable(cls, "MaskedAttention", "class")
    check = ModuleCheck("MaskedAttention", lambda heads, p: cls(EMBED_DIM, MAX_TOKENS, p),
                        lambda heads, p: ref.MaskedAttention(EMBED_DIM, MAX_TOKENS, p), heads=(1,))
    success = module_check(check, f" at embed_dim={EMBED_DIM} and {_OTHER_WIDTH}")
    _check_other_width(cls, _OTHER_WIDTH)
    return success


_OTHER_WIDTH = 4   # one more embed_dim: a scale or size written for 16 shows here


def _check_other_width(cls: Any, width: int) -> None:
    """The module at another embed_dim, beside the reference with the same weights: every case above had 16."""
    what = f"MaskedAttention({width}, {MAX_TOKENS}, 0.0).forward(x) with x of shape (2, {MAX_TOKENS}, {width})"
    generator = torch.Generator().manual_seed(16)
    reference = ref.MaskedAttention(width, MAX_TOKENS, 0.0).eval()
    model = construct(cls, width, MAX_TOKENS, 0.0, what="MaskedAttention")
    copy_weights(reference, model, "your MaskedAttention")
    call(model.eval, what="MaskedAttention.eval()")
    x = torch.randn(2, MAX_TOKENS, width, generator=generator)
    out = module_output(model, x, what)
    with torch.no_grad():
        expected = reference(x)
        q, k, v = reference.query(x), reference.key(x), reference.value(x)
        scores = (q @ k.transpose(-2, -1) / EMBED_DIM ** 0.5).masked_fill(~ref.causal_mask(MAX_TOKENS), float("-inf"))
        written_in = reference.proj(scores.softmax(-1) @ v)        # the scale of embed_dim 16 at any width
    if close(out, expected):
        return
    if close(out, written_in):
        fail("scale", f"{what}: your scores are divided by sqrt({EMBED_DIM}) = {EMBED_DIM ** 0.5:g} at embed_dim="
                      f"{width}: the scale is a number written into your code. Divide by the square root of the "
                      f"module's own embed_dim (q.shape[-1] ** 0.5, or self.embed_dim).")
    fail("mismatch", f"{what} differs from the reference by up to {max_diff(out, expected):.3g}, though your "
                     f"module is right at embed_dim={EMBED_DIM}: most likely a size of 16 is written into your code. "
                     f"Take every size from the module (self.embed_dim) or from x.shape.")
