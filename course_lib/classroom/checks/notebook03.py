"""Exercises of notebook 03 (multi-head attention): 3.1 split_heads, 3.2 merge_heads,
3.3 MultiHeadMaskedAttention.

3.1 and 3.2 are declarations the engine runs (``engine.judge``) on inputs holding 0, 1, 2, ... plus a
third, so that every number has one place and none survives rounding; 3.3 runs through ``_attn_modules.ModuleCheck``. Hints are in
``classroom.exercises``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import attention as ref
from ..exercises import Mistake
from ..verdict import Failure, fail
from ._attn_hypotheses import merge_heads_as, split_heads_as
from ._attn_modules import (
    EMBED_DIM,
    MAX_TOKENS,
    ModuleCheck,
    check_on_device,
    check_other_shape,
    module_check,
    one_sequence_only,
)
from ._student_code import call_student, expect_callable, reraise_with, rounding_of
from .engine import Case, FunctionExercise, checker, function_example, judge, module_example
from .engine.function import Run
from .engine.probes import batch_mixing

__all__ = ["check_split_heads", "check_merge_heads", "check_multi_head_attention"]


# ============================================================================ 3.1 / 3.2 split and merge heads

def _arange(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def _distinct(*shape: int) -> torch.Tensor:
    """0, 1, 2, ... each plus a third: every number has one place, and none survives rounding (float16,
    bfloat16, float32 for float64 inputs, .round()), which whole numbers this small all do."""
    return _arange(*shape) + 1 / 3


def _rearranged(purpose: str, reference: Reference) -> Callable[[list[Run], Any], None]:
    """After the known layouts: the same numbers in other places are heads split wrongly, x's numbers rounded
    are a precision loss, others a mismatch."""
    def diagnose(runs: list[Run], fn: Any) -> None:
        run = runs[0]
        x = run.case.args[0]
        _sequences_mixed(run, fn, reference)
        got, wanted = run.out.flatten().sort().values, x.flatten().sort().values
        if torch.equal(got, wanted):
            fail("head_split", f"{run.case.what}: the right numbers end up in the wrong places. {purpose}")
        how = rounding_of(run.out, x)
        if how:
            fail("precision", f"{run.case.what}: your output holds x's numbers rounded (x holds 0.333..., 1.333..., "
                              f"...): something on the way {how}. Only rearrange x, in its dtype.")
        fail("mismatch", f"{run.case.what}: your output holds different numbers from x; {purpose}")
    return diagnose


Reference = Callable[..., torch.Tensor]


def _alone(case: Case, i: int, fn: Any, reference: Reference) -> tuple[Any, torch.Tensor]:
    """The student's output and the reference's on sequence i of the case's batch alone (a batch of one)."""
    x, *rest = case.args
    args = (x[i:i + 1], *rest)
    return call_student(fn, *args, what=case.what), reference(*args)


def _sequences_mixed(run: Run, fn: Any, reference: Reference) -> None:
    """``batch`` probe: every sequence right on its own, the batch together wrong, so the reshape reads across
    sequences (x's batch axis folded into the positions, or read as if sequence-first)."""
    x = run.case.args[0]
    if x.shape[0] < 2:
        return
    alone = []
    for i in range(x.shape[0]):
        out, expected = _alone(run.case, i, fn, reference)
        if not (isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.equal(out, expected)):
            return
        alone.append(out)
    batch_mixing(run.case.what, run.out, alone,
                 "its slots hold values from another sequence of the batch. Keep the batch axis first and apart: "
                 "never fold N into the positions (N*L) nor read x as (L, N, ...); reshape with N and L from x.shape "
                 "and move only the head axis.")


def _one_sequence(reference: Reference) -> Callable[[Failure, Case, Any, Any], None]:
    """``reword``: a failed call or shape on a batch of several, where a batch of one is right: written for one
    sequence."""
    def reword(failure: Failure, case: Case, out: Any, fn: Any) -> None:
        if case.args[0].shape[0] < 2:
            return
        try:
            got, expected = _alone(case, 0, fn, reference)
        except Failure:
            return
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and torch.equal(got, expected):
            reraise_with(failure, "shape", one_sequence_only("code"))
    return reword


def _split_layout(case: Case, out: Any) -> None:
    x, heads = case.args
    n, length, embed_dim = x.shape
    if isinstance(out, torch.Tensor) and tuple(out.shape) == (n, length, heads, embed_dim // heads) \
            and length != heads:
        fail("shape", f"{case.what} returned shape {tuple(out.shape)}, expected "
                      f"{(n, heads, length, embed_dim // heads)}: the head axis sits after the sequence axis. Reshape "
                      f"the last axis into (heads, head_dim), giving (N, L, heads, head_dim), then transpose(1, 2); "
                      f"a reshape straight to (N, heads, L, head_dim) would cut the sequence instead.")


def _split_cases() -> list[Case]:
    return [Case((_distinct(*shape), heads), f"split_heads(x, {heads}) with x of shape {shape}")
            for shape, heads in (((2, 3, 8), 2), ((2, 3, 8), 4), ((3, 5, 12), 3), ((1, 1, 8), 1), ((2, 4, 6), 1))]


SPLIT_HEADS = FunctionExercise(
    "3.1", "split_heads", lambda x, heads: ref.split_heads(x, heads), _split_cases, ("x", "num_heads"),
    success="Right for 1 to 4 heads: each head holds its own block of features at every position.",
    mismatch=lambda run: "",   # _rearranged always decides
    mistakes=(
        Mistake("head_split", "a reshape straight to (N, heads, L, head_dim) cuts the sequence, not the features, "
                              "into heads. Split the last axis into (heads, head_dim) first, then move the head axis "
                              "forward.",
                output=lambda x, h: split_heads_as(x, h, "no_transpose")),
        Mistake("head_split", "each head takes every num_heads-th feature instead of a block of head_dim "
                              "neighbouring features: split the last axis as (heads, head_dim), in that order.",
                output=lambda x, h: split_heads_as(x, h, "interleaved")),
    ),
    exact=True, each_case=True, finite=True, raw=_split_layout, reword=_one_sequence(ref.split_heads),
    diagnose=_rearranged("Head h should hold features h*head_dim ... (h+1)*head_dim - 1 of every position.",
                         lambda x, heads: ref.split_heads(x, heads)),
    gradients=lambda: [Case((torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)), 2),
                            "split_heads(x, 2) with x of shape (2, 3, 8)")],
    examples=lambda: [Case((_arange(1, length, 4), 2), "split_heads(x, 2)") for length in (1, 2, 3)],
    probes=FunctionExercise.probes + ("device", "bfloat16"),   # the text asks for x's device and dtype
)


@checker("3.1", example=function_example(SPLIT_HEADS))
def check_split_heads(fn: Callable[..., Any]) -> str:
    """``fn(x (N, L, E), num_heads)`` -> (N, num_heads, L, E // num_heads)."""
    return judge(SPLIT_HEADS, fn)


def _merge_layout(case: Case, out: Any) -> None:
    (x,) = case.args
    n, heads, length, head_dim = x.shape
    if isinstance(out, torch.Tensor) and out.shape != (n, length, heads * head_dim):
        if tuple(out.shape) == (n, length, heads, head_dim):
            fail("shape", f"{case.what} returned shape {tuple(out.shape)}, expected {(n, length, heads * head_dim)}: "
                          f"flatten heads and head_dim into one axis, after making sure this shape came from "
                          f"transpose(1, 2) of the input (a reshape alone to (N, L, heads, head_dim) mixes "
                          f"positions and heads).")
        if tuple(out.shape) == (n, heads * length, head_dim):
            fail("shape", f"{case.what} returned shape {tuple(out.shape)}, expected {(n, length, heads * head_dim)}: "
                          f"you stacked the heads along the sequence; they belong side by side along the "
                          f"features of each position.")


MERGE_HEADS = FunctionExercise(
    "3.2", "merge_heads", lambda x: ref.merge_heads(x),
    lambda: [Case((_distinct(*shape),), f"merge_heads(x) with x of shape {shape}")
             for shape in ((2, 2, 3, 4), (2, 4, 3, 2), (3, 3, 5, 4), (1, 1, 1, 8), (2, 1, 4, 4))],
    ("x",),
    success="Right for 1 to 4 heads: merge_heads puts the heads side by side and undoes split_heads.",
    mismatch=lambda run: "",   # _rearranged always decides
    mistakes=(
        Mistake("head_split", "a bare reshape of (N, heads, L, head_dim) to (N, L, E) mixes positions: swap the head "
                              "and sequence axes back first, then flatten.",
                output=lambda x: merge_heads_as(x, "bare")),
        Mistake("head_split", "the heads' features are interleaved: flatten as (heads, head_dim), head after head.",
                output=lambda x: merge_heads_as(x, "interleaved")),
    ),
    exact=True, each_case=True, finite=True, raw=_merge_layout, reword=_one_sequence(ref.merge_heads),
    diagnose=_rearranged("Position l of the output should hold head 0's features, then head 1's, and so on.",
                         lambda x: ref.merge_heads(x)),
    gradients=lambda: [Case((torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(0)),),
                            "merge_heads(x) with x of shape (2, 2, 3, 4)")],
    examples=lambda: [Case((_arange(1, 2, length, 2),), "merge_heads(x)") for length in (1, 2, 3)],
    probes=FunctionExercise.probes + ("device", "bfloat16"),   # the text asks for x's device and dtype
)


@checker("3.2", example=function_example(MERGE_HEADS))
def check_merge_heads(fn: Callable[..., Any]) -> str:
    """``fn(x (N, heads, L, head_dim))`` -> (N, L, heads * head_dim)."""
    return judge(MERGE_HEADS, fn)


# ============================================================================ 3.3 multi-head attention

def _multi_head_example(cls: Any, *_: Any, **__: Any) -> Any:
    return module_example("MultiHeadMaskedAttention(4, 2, 4, 0.0)", lambda: cls(4, 2, 4, 0.0),
                          lambda: ref.MultiHeadMaskedAttention(4, 2, 4, 0.0), 4)


@checker("3.3", example=_multi_head_example)
def check_multi_head_attention(cls: Callable[..., Any]) -> str:
    """``cls(embed_dim, num_heads, max_tokens, dropout_rate)`` with Linear layers query, key, value, proj."""
    expect_callable(cls, "MultiHeadMaskedAttention", "class")
    check = ModuleCheck("MultiHeadMaskedAttention", lambda heads, p: cls(EMBED_DIM, heads, MAX_TOKENS, p),
                        lambda heads, p: ref.MultiHeadMaskedAttention(EMBED_DIM, heads, MAX_TOKENS, p),
                        heads=(2, 4, 1))
    success = module_check(check, " with 1, 2 and 4 heads")
    embed_dim, heads, max_tokens = _OTHER
    check_other_shape("MultiHeadMaskedAttention", lambda: cls(embed_dim, heads, max_tokens, 0.0),
                      lambda: ref.MultiHeadMaskedAttention(embed_dim, heads, max_tokens, 0.0),
                      f"MultiHeadMaskedAttention({embed_dim}, {heads}, {max_tokens}, 0.0)", heads,
                      f"embed_dim={EMBED_DIM} with 1, 2 and 4 heads")
    check_on_device(check)
    return success


# One more shape (embed_dim, num_heads, max_tokens): heads of 12, which no case above has (16, 8 and 4), at
# embed_dim 24 and max_tokens 11, so a size or a scale written for the cases above shows here.
_OTHER = (24, 2, 11)
