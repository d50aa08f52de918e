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
from ..verdict import Failure, fail
from ._attn_modules import EMBED_DIM, MAX_TOKENS, ModuleCheck, check_on_device, check_other_shape, module_check
from ._student_code import call_student, expect_callable, reraise_with
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


# Past every context of the course (8 to 1024): a mask cut from one of a fixed size shows here.
_LONG = 1100


def _long_mask(runs: list[Run], fn: Any) -> None:
    """Once every case is right: causal_mask(_LONG), where a mask sliced from a fixed one comes back too small."""
    what = f"causal_mask({_LONG})"
    written = (" Every n up to 13 was right: a size is written into your code (a fixed mask sliced to [:n, :n]). "
               "Build the mask from n itself: torch.ones(n, n, dtype=torch.bool).tril().")
    try:
        out = call_student(fn, _LONG, what=what)
    except Failure as failure:
        reraise_with(failure, "shape", written)
    if isinstance(out, torch.Tensor) and tuple(out.shape) != (_LONG, _LONG):
        fail("shape", f"{what} returned shape {tuple(out.shape)}, expected {(_LONG, _LONG)}." + written)
    if not (isinstance(out, torch.Tensor) and torch.equal(out, ref.causal_mask(_LONG))):
        fail("causal_mask", f"{what} differs from the causal mask of {_LONG} x {_LONG}." + written)


CAUSAL_MASK = FunctionExercise(
    "2.1", "causal_mask", lambda n: ref.causal_mask(n),
    lambda: [Case((n,), f"causal_mask({n})") for n in (5, 1, 2, 8, 13)],   # 13: past the notebook's 8
    ("n",),
    success="Right for n = 1, 2, 5, 8 and 13: True on and below the diagonal, dtype torch.bool.",
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
    exact=True, each_case=True, raw=_raw_mask, diagnose=_first_wrong_entry, after=_long_mask,
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


# One more shape (embed_dim, max_tokens): every case of the module check has 16 and 8, so a size or a scale
# written for them shows here.
_OTHER = (4, 11)


@checker("2.2", example=_masked_example)
def check_masked_attention(cls: Callable[..., Any]) -> str:
    """``cls(embed_dim, max_tokens, dropout_rate)`` with Linear layers query, key, value, proj."""
    expect_callable(cls, "MaskedAttention", "class")
    check = ModuleCheck("MaskedAttention", lambda heads, p: cls(EMBED_DIM, MAX_TOKENS, p),
                        lambda heads, p: ref.MaskedAttention(EMBED_DIM, MAX_TOKENS, p), heads=(1,))
    success = module_check(check, f" at embed_dim={EMBED_DIM} and {_OTHER[0]}")
    check_other_shape("MaskedAttention", lambda: cls(*_OTHER, 0.0), lambda: ref.MaskedAttention(*_OTHER, 0.0),
                      f"MaskedAttention({_OTHER[0]}, {_OTHER[1]}, 0.0)", 1, f"embed_dim={EMBED_DIM}")
    check_on_device(check)
    return success

