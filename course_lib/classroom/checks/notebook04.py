"""Exercises of notebook 04 (the GPT model): 4.1 sinusoidal_table, 4.2 TransformerBlock, 4.3 GPT.

4.1 is a declaration the engine runs (``engine.judge``); 4.2 and 4.3 build a module beside the reference
and judge it with procedures of their own, their counter-examples from the engine (``module_example``).
Hints are in ``classroom.exercises``; the shared helpers are in ``_model_common``.
"""
from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import model as model_ref
from ..exercises import Mistake
from ..verdict import Failure, fail
from ._device_probe import probe_module
from ._gradients import check_module_gradients
from ._model_common import accepts, as_tensor, copy_weights, randomize_, same_when_called_twice
from ._student_code import (
    HALF_PRECISION,
    call,
    call_student,
    close,
    coarse_precision,
    construct,
    expect_callable,
    expect_tensor,
    max_diff,
    reraise_with,
)
from ._student_files import exception_message
from .engine import Case, FunctionExercise, checker, first_mistake, function_example, judge, module_example
from .engine.function import Run
from .engine.other_sizes import at_other_sizes
from .engine.probes import batch_mixing, module_in_float64

__all__ = ["check_sinusoidal_table", "check_transformer_block", "check_gpt"]


# ---------------------------------------------------------------- 4.1 sinusoidal_table

def _table(max_tokens: int, embed_dim: int, *, frequency: torch.Tensor | None = None, first: str = "sin",
           layout: str = "interleave", offset: int = 0, both: bool = False) -> torch.Tensor:
    """A family of tables: the reference and the ways students get it wrong (``both``: one function twice)."""
    half = embed_dim // 2
    if frequency is None:
        frequency = 10000.0 ** (-torch.arange(0, embed_dim, 2, dtype=torch.float64)[:half] / embed_dim)
    angles = (torch.arange(max_tokens, dtype=torch.float64)[:, None] + offset) * frequency   # (T, d/2)
    a, b = (angles.sin(), angles.cos()) if first == "sin" else (angles.cos(), angles.sin())
    b = a if both else b
    if layout == "interleave":
        return torch.stack([a, b], dim=-1).flatten(1)   # (T, d): a b a b ...
    return torch.cat([a, b], dim=-1)                    # (T, d): a a ... b b ...


# The wavelengths students get wrong: (the frequency of pair i for embed_dim d, why it is wrong).
_FREQUENCIES: tuple[tuple[Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], str], ...] = (
    (lambda pair, even, d: 10000.0 ** (-pair / d),
     "the exponent uses the pair index i over embed_dim; it should be the even dimension index 2i over "
     "embed_dim (i.e. step through 0, 2, 4, ... or multiply i by 2)"),
    (lambda pair, even, d: 10000.0 ** (-2 * even / d),
     "the exponent is twice what it should be, 4i/embed_dim for pair i where 2i/embed_dim is meant: either you "
     "step through the even indices (0, 2, 4, ...) and then multiply by 2 again, or you divide 2i by the number "
     "of pairs (embed_dim / 2) instead of by embed_dim (the two give the same numbers)"),
    (lambda pair, even, d: 10000.0 ** (even / d),
     "the frequencies grow with the dimension instead of shrinking: you multiply the position by 10000^(2i/d) "
     "where you should divide by it"),
    (lambda pair, even, d: 1000.0 ** (-even / d), "the base is 1000; the paper uses 10000"),
    (lambda pair, even, d: 100.0 ** (-even / d), "the base is 100; the paper uses 10000"),
    (lambda pair, even, d: math.e ** (-even / d),
     "the base is e: if you write it with exp(), remember the factor log(10000)"),
    (lambda pair, even, d: 10000.0 ** (-even / (d - 1 if d > 1 else 1)),
     "the exponent divides by embed_dim - 1; it should divide by embed_dim"),
    (lambda pair, even, d: torch.ones_like(pair),
     "every frequency is 1 (every pair has the angle pos): the exponent 2i / embed_dim is 0 for every pair, an "
     "integer division (two_i // embed_dim on integers, or the exponent cast to an integer with .long() or int()). "
     "Divide in floating point: 2i / embed_dim with / on a float tensor"),
)


def _wavelength(frequency: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], layout: str
                ) -> Callable[[int, int], torch.Tensor]:
    def table(max_tokens: int, embed_dim: int) -> torch.Tensor:
        pair = torch.arange(embed_dim // 2, dtype=torch.float64)   # i = 0, 1, ...
        return _table(max_tokens, embed_dim, frequency=frequency(pair, 2 * pair, embed_dim), layout=layout)
    return table


def _table_slip(first: str, layout: str, offset: int) -> Mistake:
    """One member of the family of layout slips (which function first, interleaved or concatenated) and position
    slips (counted from 1, or from -1): named ``sincos_layout`` when the layout is wrong, else ``positions``."""
    said = []
    if layout == "concat":
        order = ("sines", "cosines") if first == "sin" else ("cosines", "sines")
        said.append(f"you concatenated the halves: all the {order[0]} first, then all the {order[1]}. The table "
                    f"interleaves them: dimension 2i is the sine and dimension 2i+1 the cosine of the same angle. "
                    f"Fill the even and odd columns separately, or stack the two along a new last dimension and "
                    f"flatten.")
    elif first == "cos":
        said.append("sine and cosine are swapped. Even dimensions (0, 2, 4, ...) hold the sines and odd dimensions "
                    "the cosines, so row 0 (position 0) should read 0, 1, 0, 1, ...")
    if offset:
        said.append(f"your positions start at {offset} (arange(max_tokens) {'+' if offset > 0 else '-'} "
                    f"{abs(offset)}). Row 0 is position 0 (sin 0 = 0, cos 0 = 1).")
    message = said[0] + "".join(f" Also, {more}" for more in said[1:])
    return Mistake("sincos_layout" if layout == "concat" or first == "cos" else "positions", message,
                   output=lambda t, d: _table(t, d, first=first, layout=layout, offset=offset))


_TABLE_MISTAKES = (
    *(_table_slip(first, layout, offset) for offset in (0, 1, -1) for first in ("sin", "cos")
      for layout in ("interleave", "concat") if (first, layout, offset) != ("sin", "interleave", 0)),
    *(Mistake("scale", f"the wavelengths are wrong: {why}"
                       + ("." if layout == "interleave" else " (and the sines and cosines should interleave)."),
              output=_wavelength(frequency, layout))
      for frequency, why in _FREQUENCIES for layout in ("interleave", "concat")),
    *(Mistake("sincos_layout", f"every column holds the {name} of its angle: dimension 2i is the sine and "
                               f"dimension 2i+1 the COSINE of the same angle, so row 0 (position 0) reads 0, 1, 0, "
                               f"1, ...", output=lambda t, d, f=f: _table(t, d, first=f, layout="interleave",
                                                                           both=True))
      for name, f in (("sine", "sin"), ("cosine", "cos"))),
    Mistake("scale", "each column uses its own index j in the exponent, pos / 10000^(j/d): the two columns of a "
                     "pair share one angle, so dimensions 2i and 2i+1 both use 10000^(2i/d).",
            output=lambda t, d: _per_column(t, d)),
    Mistake("scale", "each column uses twice its own index in the exponent, pos / 10000^(2j/d) (the TensorFlow "
                     "tutorial's get_angles with 2 * i where 2 * (i // 2) is meant): the two columns of a pair share "
                     "one angle, so dimensions 2i and 2i+1 both use 10000^(2i/d).",
            output=lambda t, d: _per_column(t, d, doubled=True)),
)


def _per_column(max_tokens: int, embed_dim: int, doubled: bool = False) -> torch.Tensor:
    """Column j at the angle pos / 10000^(j/d) (its own index, not its pair's; 2j with ``doubled``): sine if j is
    even, else cosine."""
    j = torch.arange(embed_dim, dtype=torch.float64)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] / 10000.0 ** ((2 if doubled else 1) * j
                                                                                 / embed_dim)   # (T, d)
    return torch.where(j % 2 == 0, angles.sin(), angles.cos())


def _table_layout(case: Case, out: Any) -> None:
    max_tokens, embed_dim = case.args
    if isinstance(out, torch.Tensor) and tuple(out.shape) == (embed_dim, max_tokens) and max_tokens != embed_dim:
        fail("shape", f"{case.what} returned shape {tuple(out.shape)}: one row per dimension. The table has one "
                      f"row per position, (max_tokens, embed_dim): positions should run down the rows "
                      f"(a column of positions) and frequencies across the columns (a row of frequencies).")
    if isinstance(out, torch.Tensor) and tuple(out.shape) == (max_tokens, embed_dim) and not out.is_floating_point():
        fail("dtype", f"{case.what} returned dtype {out.dtype}; sines and cosines need a float tensor "
                      f"(start from torch.arange(..., dtype=torch.float32)).")


# (dtype, its unit roundoff): the precisions an angle pos * frequency may have been rounded to
_COARSE = (("float16", 2.0 ** -11), ("bfloat16", 2.0 ** -8))


def _angles_rounded(run: Run) -> None:
    """``precision``: every value within a few roundings of float16 (or bfloat16) of its angle, an error that grows
    with the angle: the positions, frequencies or angles were computed in that dtype."""
    (max_tokens, embed_dim), got = run.case.args, run.out.double()
    expected = _table(max_tokens, embed_dim)
    frequency = 10000.0 ** (-torch.arange(0, embed_dim, 2, dtype=torch.float64)[:embed_dim // 2] / embed_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * frequency                # (T, d/2)
    angles = angles.repeat_interleave(2, dim=1)                                                 # (T, d)
    error = (got - expected).abs()
    for dtype, unit in _COARSE:
        if bool((error <= 3 * unit * (angles + 1)).all()):
            pos, dim = divmod(int(error.argmax()), embed_dim)
            fail("precision", f"{run.case.what}: your table is right only to the rounding of {dtype}, off by up to "
                              f"{float(error.max()):.3g} at position {pos}, dimension {dim}, more the larger the angle: "
                              f"the positions, frequencies or angles are computed in {dtype} (or cast to it before "
                              f"sin and cos). Compute them in float32 (torch.arange(..., dtype=torch.float32)).")


def _table_angles(runs: list[Run], fn: Any) -> None:
    """sin and cos of one angle per pair, starting at angle 0, but other angles: the frequencies are off."""
    run = runs[0]
    _angles_rounded(run)
    (max_tokens, embed_dim), got = run.case.args, run.out.double()
    if embed_dim >= 2 and max_tokens >= 2:
        even, odd = got[:, 0:2 * (embed_dim // 2):2], got[:, 1:2 * (embed_dim // 2):2]
        on_circle = torch.allclose(even ** 2 + odd ** 2, torch.ones_like(even))
        starts_at_zero = torch.allclose(even[0], torch.zeros_like(even[0]))
        if on_circle and starts_at_zero:
            fail("scale", f"{run.case.what}: every pair of dimensions holds the sine and cosine of one angle, but "
                          f"the angles are wrong: the angle of pair i at position pos is pos / 10000^(2i/embed_dim), "
                          f"with pos = 0, 1, 2, ... one step apart. Check the positions, the base, the exponent and "
                          f"that you divide the position by it.")


def _table_mismatch(run: Run) -> str:
    (max_tokens, embed_dim), got = run.case.args, run.out.double()
    expected = _table(max_tokens, embed_dim)
    off = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-5)                       # (T, d): the entries that differ
    pos, dim = divmod(int(off.flatten().nonzero()[0]) if bool(off.any()) else int((got - expected).abs().argmax()),
                      embed_dim)                                                    # the first, row by row
    return (f"{run.case.what}: values differ from the reference, first at position {pos}, dimension {dim} "
            f"(got {got[pos, dim]:.4f}, expected {expected[pos, dim]:.4f}). Even dimension 2i holds "
            f"sin(pos / 10000^(2i/d)), odd dimension 2i+1 the cosine.")


# Calls that reuse one argument of a case with the other changed: (12, 8)'s length with (40, 16)'s width, then
# (12, 8)'s width, longer. A table cached under a key that leaves out one of them comes back from the earlier call.
_REUSED = ((12, 16), (20, 8))


def _table_kept(runs: list[Run], fn: Any) -> None:
    """``kept_state``: every case right, then the calls of ``_REUSED``; one that returns the table of an earlier call
    sharing one argument with it is a cache keyed by that argument alone (the other named). Another wrong result
    there gets the check's verdict on that call alone."""
    for size in _REUSED:
        case = Case(size, f"sinusoidal_table{size}")
        out = as_tensor(call_student(fn, *size, what=case.what))
        expected = model_ref.sinusoidal_table(*size)
        if isinstance(out, torch.Tensor) and out.shape == expected.shape and close(out, expected):
            continue
        for run in runs:
            shared = [name for name, a, b in zip(("max_tokens", "embed_dim"), run.case.args, size) if a == b]
            if shared and isinstance(out, torch.Tensor) and out.shape == run.out.shape and close(out, run.expected):
                left_out = "embed_dim" if shared == ["max_tokens"] else "max_tokens"
                fail("kept_state", f"{case.what} returned the table of an earlier call, {run.case.what}, of shape "
                                   f"{tuple(out.shape)}: your code caches the table under a key that leaves out "
                                   f"{left_out} (keyed by {shared[0]} alone). Look at the line that reads or fills "
                                   f"the cache: key it by everything the table depends on, (max_tokens, embed_dim), "
                                   f"or build the table at each call.")
        judge(replace(SINUSOIDAL_TABLE, cases=lambda case=case: [case], after=None), fn)   # its verdict on this call


SINUSOIDAL_TABLE = FunctionExercise(
    "4.1", "sinusoidal_table", lambda max_tokens, embed_dim: model_ref.sinusoidal_table(max_tokens, embed_dim),
    lambda: [Case(size, f"sinusoidal_table{size}") for size in ((12, 8), (5, 6), (1, 4), (40, 16))],
    ("max_tokens", "embed_dim"),
    success="Sines on the even dimensions, cosines on the odd ones, wavelengths from 2π to 10000·2π.",
    mismatch=_table_mismatch, mistakes=_TABLE_MISTAKES, each_case=True, dtype=False, finite=True, numpy_ok=True,
    raw=_table_layout, diagnose=_table_angles, after=_table_kept,
    examples=lambda: [Case(size, f"sinusoidal_table{size}") for size in ((1, 2), (2, 2), (3, 2), (2, 4), (3, 4))],
)


@checker("4.1", example=function_example(SINUSOIDAL_TABLE))
def check_sinusoidal_table(fn: Callable[..., Any]) -> str:
    """fn(max_tokens, embed_dim) -> (max_tokens, embed_dim), as ``course_lib.model.sinusoidal_table``."""
    return judge(SINUSOIDAL_TABLE, fn)


# ---------------------------------------------------------------- 4.2 TransformerBlock

_EMBED, _HEADS, _MAX_TOKENS, _DROPOUT = 16, 4, 8, 0.1
_SHAPES = ((2, 5), (1, 1), (3, 8))   # (batch, length): batch > 1, shorter than max_tokens, length 1, full


def _residual_of_normalised(x, a, m, l1, l2):
    x = l1(x)
    x = x + a(x)
    x = l2(x)
    return x + m(x)


_NORMS_SAID = {  # the choices of (attention's norm, feed-forward's norm) students make, in their words
    ("ln2", "ln1"): "ln1 and ln2 are swapped: ln1 goes with the attention sublayer, ln2 with the feed-forward one "
                    "(each LayerNorm has its own learned scale and shift).",
    ("ln1", "ln1"): "you use ln1 for both sublayers; ln2 belongs to the feed-forward sublayer.",
    ("ln2", "ln2"): "you use ln2 for both sublayers; ln1 belongs to the attention sublayer.",
    (None, None): "the LayerNorms ln1 and ln2 are never applied; each sublayer needs its own.",
    ("bare", "bare"): "your LayerNorms leave out ln1's and ln2's learned weight and bias (a plain F.layer_norm(x, "
                      "(E,)) normalises, but neither scales nor shifts): they are 1 and 0 only at initialisation, "
                      "and training moves them. Call self.ln1(x) and self.ln2(x) (or pass weight= and bias= of each).",
}
# A norm without its learned weight and bias: what F.layer_norm(x, (E,)) computes (the eps of the norm it replaces)
_BARE = lambda ln: lambda t: F.layer_norm(t, ln.normalized_shape, eps=ln.eps)


def _norm_choices(right: Callable[..., Any]) -> list[Mistake]:
    """The family of norm choices: each sublayer gets ln1, ln2 or no LayerNorm (the right block otherwise),
    built on the student's own weights; every choice but (ln1, ln2) is ``norm_placement``."""
    def said(choice: tuple[str | None, str | None]) -> str:
        if choice in _NORMS_SAID:
            return _NORMS_SAID[choice]
        parts = [f"the {sublayer} sublayer " + ("has no LayerNorm" if used is None else
                                                 f"normalises without {wanted}'s learned weight and bias (a plain "
                                                 f"F.layer_norm)" if used == "bare" else f"uses {used}")
                 + ("" if used == "bare" else f" where {wanted} belongs") for sublayer, used, wanted in
                 zip(("attention", "feed-forward"), choice, ("ln1", "ln2")) if used != wanted]
        return "; ".join(parts) + ". Each sublayer has its own LayerNorm: ln1 with self.attn, ln2 with self.mlp."

    def output(choice: tuple[str | None, str | None]) -> Callable[..., Any]:
        def block(x, a, m, l1, l2):
            norms = {"ln1": l1, "ln2": l2, None: nn.Identity()}
            return right(x, a, m, *(_BARE(own) if used == "bare" else norms[used]
                                    for used, own in zip(choice, (l1, l2))))
        return block
    choices = [(first, second) for first in ("ln1", "ln2", None, "bare") for second in ("ln1", "ln2", None, "bare")]
    return [Mistake("norm_placement", said(choice), output=output(choice))
            for choice in sorted(choices, key=lambda c: c not in _NORMS_SAID) if choice != ("ln1", "ln2")]


def _norm_epsilons(right: Callable[..., Any]) -> list[Mistake]:
    """Both LayerNorms with another epsilon than nn.LayerNorm's 1e-5 (an F.layer_norm or a LayerNorm of one's
    own): a small but structural difference, told apart here from a rounding of the same size."""
    def output(eps: float) -> Callable[..., Any]:
        def block(x, a, m, l1, l2):
            with_eps = lambda ln: lambda t: F.layer_norm(t, ln.normalized_shape, ln.weight, ln.bias, eps)
            return right(x, a, m, with_eps(l1), with_eps(l2))
        return block
    return [Mistake("epsilon", f"your LayerNorms add an epsilon of {eps:g} to the variance, not nn.LayerNorm's "
                               f"1e-5: use self.ln1 and self.ln2 as given (or eps=1e-5 in your own).",
                    output=output(eps)) for eps in (1e-3, 1e-2, 1e-1, 1.0)]


def _missing_sublayers(right: Callable[..., Any]) -> list[Mistake]:
    """The family of dropped sublayers: self.attn or self.mlp adds nothing (its LayerNorm dropped with it, or
    still applied where it sits on the residual stream, post-norm)."""
    nothing, same = (lambda h: 0), nn.Identity()
    return [
        *(Mistake("sublayer_missing", "the feed-forward sublayer (self.mlp) is never applied, or its result is "
                                      "dropped; the block is attention, then feed-forward.",
                  output=lambda x, a, m, l1, l2, keep=keep: right(x, a, nothing, l1, l2 if keep else same))
          for keep in (False, True)),
        *(Mistake("sublayer_missing", "the attention sublayer (self.attn) is never applied, or its result is "
                                      "dropped; the block is attention, then feed-forward.",
                  output=lambda x, a, m, l1, l2, keep=keep: right(x, nothing, m, l1 if keep else same, l2))
          for keep in (False, True)),
    ]


def _block_variants(norm_first: bool) -> list[Mistake]:
    """The mistakes we have seen; each output is f(x, attn, mlp, ln1, ln2)."""
    def pre(x, a, m, l1, l2):
        h = x + a(l1(x))
        return h + m(l2(h))

    def post(x, a, m, l1, l2):
        h = l1(x + a(x))
        return l2(h + m(h))

    right = pre if norm_first else post
    kind = "pre-norm (GPT-2)" if norm_first else "post-norm (the 2017 paper)"
    common = [
        *_missing_sublayers(right),
        *_norm_epsilons(right),
        *_norm_choices(right),
        Mistake("norm_placement", f"you normalise both before the sublayers and after the residual additions; this "
                                  f"block is {kind}, so each LayerNorm is used once.",
                output=lambda x, a, m, l1, l2: l2((h := l1(x + a(l1(x)))) + m(l2(h)))),
        Mistake("norm_placement", "you apply each LayerNorm to the sublayer's OUTPUT (x + ln1(attn(x))). A "
                                  "LayerNorm there undoes the sublayer's scale, so the block can no longer learn "
                                  "how much each sublayer adds. "
                                  + ("Pre-norm normalises the sublayer's INPUT: x + attn(ln1(x))."
                                     if norm_first else "Post-norm normalises the SUM: ln1(x + attn(x))."),
                output=lambda x, a, m, l1, l2: (h := x + l1(a(x))) + l2(m(h))),
        Mistake("residual", "the feed-forward sublayer reads the block's input x instead of the output of the "
                            "attention step (the two sublayers run in parallel). Feed the updated x forward.",
                output=(lambda x, a, m, l1, l2: x + a(l1(x)) + m(l2(x))) if norm_first
                else (lambda x, a, m, l1, l2: l2(l1(x + a(x)) + m(x)))),
        Mistake("residual", "the feed-forward's output is added to the block's input x, not to the output of the "
                            "attention step, so the attention's update is lost. Add each sublayer's output to the "
                            "x it updates: x = x + attn(...), then x = x + mlp(...).",
                output=(lambda x, a, m, l1, l2: x + m(l2(x + a(l1(x))))) if norm_first
                else (lambda x, a, m, l1, l2: l2(x + m(l1(x + a(x)))))),
        Mistake("residual", "the feed-forward reads the attention's output alone, not the updated x (the input "
                            "plus the attention's output). Each sublayer reads the residual stream.",
                output=(lambda x, a, m, l1, l2: (h := a(l1(x))) + x + m(l2(h))) if norm_first
                else (lambda x, a, m, l1, l2: l2(l1(x + (h := a(x))) + m(h)))),
    ]
    if norm_first:
        return [
            Mistake("norm_placement", "you normalise after adding the residual (post-norm, as in the 2017 paper). This"
                                      " block is pre-norm (GPT-2): apply ln1 to the input of the attention and ln2 to "
                                      "the input of the feed-forward, and leave the residual stream itself "
                                      "un-normalised.",
                    output=post),
            Mistake("residual", "the attention sublayer has no residual connection: add its output to its input "
                                "(the un-normalised x) instead of replacing x.",
                    output=lambda x, a, m, l1, l2: (h := a(l1(x))) + m(l2(h))),
            Mistake("residual", "the feed-forward sublayer has no residual connection: add its output to x instead of "
                                "replacing x.",
                    output=lambda x, a, m, l1, l2: m(l2(x + a(l1(x))))),
            Mistake("residual", "neither sublayer has a residual connection: each should add its output to x, not "
                                "replace x.",
                    output=lambda x, a, m, l1, l2: m(l2(a(l1(x))))),
            Mistake("residual", "your residual adds the normalised x: you overwrite x with ln1(x) (and ln2(x)) before "
                                "adding. The residual stream carries the un-normalised x; normalise only what goes "
                                "into each sublayer.",
                    output=_residual_of_normalised),
            Mistake("norm_placement", "ln2 normalises the block's output instead of the feed-forward's input: in "
                                      "pre-norm each LayerNorm sits inside its sublayer, x + mlp(ln2(x)), and the "
                                      "block returns the sum un-normalised.",
                    output=lambda x, a, m, l1, l2: l2((h := x + a(l1(x))) + m(h))),
            Mistake("norm_placement", "ln2 is applied twice: to the feed-forward's input, as it should be, and "
                                      "again to the block's output. In pre-norm each LayerNorm sits inside its "
                                      "sublayer, x + mlp(ln2(x)), and the block returns that sum un-normalised (the "
                                      "GPT's own final LayerNorm, ln_f, comes after the last block).",
                    output=lambda x, a, m, l1, l2: l2((h := x + a(l1(x))) + m(l2(h)))),
        ] + common
    return [
        Mistake("norm_placement", "you normalise the input of each sublayer (pre-norm, GPT-2). This block is post-norm "
                                  "(the 2017 paper): add the sublayer's output to x first, then apply the LayerNorm "
                                  "to the sum.",
                output=pre),
        Mistake("residual", "the attention sublayer has no residual connection: normalise x plus the attention "
                            "output, not the attention output alone.",
                output=lambda x, a, m, l1, l2: l2((h := l1(a(x))) + m(h))),
        Mistake("residual", "the feed-forward sublayer has no residual connection: normalise the sum of its input and "
                            "its output, not its output alone.",
                output=lambda x, a, m, l1, l2: l2(m(l1(x + a(x))))),
        Mistake("residual", "neither sublayer has a residual connection: each LayerNorm should see x plus the "
                            "sublayer's output.",
                output=lambda x, a, m, l1, l2: l2(m(l1(a(x))))),
        Mistake("norm_placement", "you add the sublayer's output to the NORMALISED input (ln1(x) + attn(x)). "
                                  "Post-norm adds first and normalises the sum: x = ln1(x + attn(x)), then "
                                  "ln2(x + mlp(x)).",
                output=lambda x, a, m, l1, l2: l2(h := l1(x) + a(x)) + m(h)),
        Mistake("norm_placement", "both LayerNorms are applied at the end, one after the other. Post-norm "
                                  "normalises after each sublayer: x = ln1(x + attn(x)), then ln2(x + mlp(x)).",
                output=lambda x, a, m, l1, l2: l2(l1((h := x + a(x)) + m(h)))),
        *_sums_not_normalised(),
    ] + common


# How a post-norm step ln(x + f(x)) is written with its sum never normalised: the sublayer added to ln(x), reading
# x or ln(x).
_POST_STEPS = {
    "right": lambda t, f, ln: ln(t + f(t)),
    "added": lambda t, f, ln: ln(t) + f(t),
    "normed": lambda t, f, ln: (g := ln(t)) + f(g),
}


def _sums_not_normalised() -> list[Mistake]:
    """The family of post-norm blocks where one step or both add the sublayer's output to the NORMALISED x (ln(x) +
    f(x), or x = ln(x) then x + f(x)): that sum is never normalised. Single steps first."""
    def said(step: str, how: str, ln: str, f: str) -> str:
        reads = f"{f}(x)" if how == "added" else f"{f}({ln}(x))"
        return f"the {step} step returns {ln}(x) + {reads}, the sublayer added to the normalised x"

    def output(first: str, second: str) -> Callable[..., Any]:
        return lambda x, a, m, l1, l2: _POST_STEPS[second](_POST_STEPS[first](x, a, l1), m, l2)
    hows = [(first, second) for first in _POST_STEPS for second in _POST_STEPS
            if (first, second) not in (("right", "right"), ("added", "added"))]
    hows.sort(key=lambda pair: "right" not in pair)
    return [Mistake("norm_placement", "; ".join(said(step, how, ln, f) for step, how, ln, f in
                                                 zip(("attention", "feed-forward"), pair, ("ln1", "ln2"),
                                                     ("attn", "mlp")) if how != "right")
                    + ": the sum is never normalised. Post-norm adds first and normalises the sum: x = ln1(x + "
                      "attn(x)), then ln2(x + mlp(x)).", output=output(*pair)) for pair in hows]


def _build_block(cls: Any, norm_first: bool, sizes: tuple[int, int, int] = (_EMBED, _HEADS, _MAX_TOKENS)
                 ) -> tuple[nn.Module, nn.Module]:
    generator = torch.Generator().manual_seed(42)
    reference = randomize_(model_ref.TransformerBlock(*sizes, _DROPOUT, norm_first=norm_first), generator)
    kwargs = {"norm_first": norm_first} if accepts(cls, "norm_first") else {}
    candidate = construct(cls, *sizes, _DROPOUT, what=getattr(cls, "__name__", "cls"), **kwargs)
    for name in ("ln1", "attn", "ln2", "mlp"):
        if not isinstance(getattr(candidate, name, None), nn.Module):
            fail("mismatch", f"your block has no sublayer `self.{name}`. Keep the constructor as given: it "
                             f"builds ln1, attn, ln2 and mlp, and forward uses them.")
    copy_weights(reference, candidate, "your block")
    return reference.eval(), candidate.eval()


def _inputs(generator: torch.Generator, batch: int, length: int, embed_dim: int = _EMBED) -> torch.Tensor:
    # an offset and a spread per position, so that LayerNorm has something to undo
    x = torch.randn(batch, length, embed_dim, generator=generator)
    return 1.5 * x + torch.randn(batch, length, 1, generator=generator)


def _with_weight(weight: torch.Tensor, value: torch.Tensor, rerun: Callable[[], Any]) -> Any:
    """The student's output with ``weight`` set to ``value`` for one call (restored afterwards, even on a failure)."""
    saved = weight.clone()
    weight.copy_(value)
    try:
        return rerun()
    finally:
        weight.copy_(saved)


def _silenced(block: nn.Module, run: Callable[[], Any]) -> Any:
    """``run()`` with the block's self.attn and self.mlp answering zeros (forward hooks, removed afterwards): what
    is left is the residual stream alone, x in a pre-norm block, ln2(ln1(x)) in a post-norm one."""
    quiet = lambda module, inputs, output: torch.zeros_like(output) if isinstance(output, torch.Tensor) else output
    handles = [sublayer.register_forward_hook(quiet) for sublayer in (block.attn, block.mlp)
               if isinstance(sublayer, nn.Module)]
    try:
        return run()
    finally:
        for handle in handles:
            handle.remove()


def _stream_said(got: torch.Tensor, wanted: torch.Tensor, x: torch.Tensor, block: nn.Module) -> str:
    """What a block whose sublayers say nothing returns, in words."""
    for name, value in (("x", x), ("the residual stream", wanted)):
        ratio = float((got * value).sum() / (value * value).sum().clamp_min(1e-12))
        if abs(ratio - 1) > 1e-3 and close(got, ratio * value):
            return f"{ratio:.3g} times {name}"
    for name in ("ln1", "ln2"):
        norm = getattr(block, name, None)
        if isinstance(norm, nn.Module) and close(got, call(norm, x, what=f"self.{name}")):
            return f"{name}(x), x normalised"
    return f"something else (off by up to {max_diff(got, wanted):.3g})"


def _future_leak(candidate: nn.Module, x: torch.Tensor, got: torch.Tensor, what: str,
                 changed_from: Callable[[torch.Tensor, int], torch.Tensor]) -> str | None:
    """Where the future leaks into the past: for k = L-1 down to 1, the input changed at positions k.. alone
    (``changed_from(x, k)``); the first k whose change moves an output before k, in words, or None. The last
    position first (a leak from the end, the usual one), then earlier ones (a leak that stops short of the end)."""
    length = x.shape[1]
    for k in range(length - 1, 0, -1):
        later = call(candidate, changed_from(x, k), what=what)
        if isinstance(later, torch.Tensor) and later.shape == got.shape and not close(later[:, :k], got[:, :k]):
            return f"position {k} (the last)" if k == length - 1 else f"positions {k} to {length - 1}"
    return None


def _noised_from(x: torch.Tensor, k: int) -> torch.Tensor:
    """x with random noise (a fixed draw) added to its positions k.. alone. Noise, not a constant shift: a
    LayerNorm removes a shift (and a scale) of a whole position, so a leak behind ln1 or ln2 would not move."""
    noise = torch.randn(x[:, k:].shape, generator=torch.Generator().manual_seed(35), dtype=x.dtype)   # (N, L-k, E)
    changed = x.clone()
    changed[:, k:] += 2.0 * noise.to(x.device)
    return changed


def _tokens_changed_from(vocab_size: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """idx with its tokens at positions k.. replaced by the next token of the vocabulary (the earlier ones kept)."""
    def changed_from(idx: torch.Tensor, k: int) -> torch.Tensor:
        changed = idx.clone()
        changed[:, k:] = (changed[:, k:] + 1) % vocab_size
        return changed
    return changed_from


def _sequences_alone(candidate: nn.Module, reference: nn.Module, x: torch.Tensor, got: torch.Tensor, what: str,
                     thing: str) -> None:
    """``batch_mixing`` (once the batch's output is wrong): each sequence of the batch run alone, a batch of one,
    is right, and the batch together is not. Every row equal to row 0's own output: row 0's work broadcast."""
    if x.shape[0] < 2 or not isinstance(got, torch.Tensor) or got.shape[:1] != x.shape[:1]:
        return
    alone = []
    for i in range(x.shape[0]):
        one = x[i:i + 1]   # (1, L, ...): sequence i alone
        try:
            out = call(candidate, one, what=what)
        except Failure:
            return
        if not close(out, reference(one)):
            return
        alone.append(out)
    said = (f"each sequence run alone (a batch of one) is right, but in a batch of {x.shape[0]} your {thing} "
            f"mixes the sequences")
    if all(close(got[i], alone[0][0]) for i in range(len(alone))):
        fail("batch_mixing", f"{what}: every sequence of the batch gets the output of the FIRST sequence: {said}. "
                             f"Something works on the first row only (x[:1], x[0], idx[:1]) and is copied over the "
                             f"batch (expand, broadcasting). Work on the whole batch: no [0] or [:1] on the batch "
                             f"axis.")
    batch_mixing(what, got, alone, f"{said}: something works on the first row only (x[:1], x[0]) and is broadcast "
                                   f"over the others, or takes a mean, a sum or a reshape across the batch axis. "
                                   f"Every step acts on each sequence on its own: keep the batch axis first and "
                                   f"untouched.")


@torch.no_grad()
def _diagnose_block(candidate: nn.Module, reference: nn.Module, x: torch.Tensor, got: torch.Tensor,
                    norm_first: bool, what: str) -> None:
    r = reference
    first_mistake(_block_variants(norm_first), lambda m: close(got, m.output(x, r.attn, r.mlp, r.ln1, r.ln2)),
                  f"{what}: ")
    expected = reference(x)
    # behaviour probes, for mistakes we did not list: the sequences of a batch, then the positions of one; both
    # before the rounding's size, which a small leak would otherwise seem to be
    _sequences_alone(candidate, reference, x, got, what, "block")
    leak = _future_leak(candidate, x, got, what, _noised_from)
    if leak:
        fail("causal_mask", f"{what}: when only x at {leak} changed, the outputs at earlier positions "
                            f"changed too: an earlier position's output depends on a later position's input, so "
                            f"the future leaks into the past. Let self.attn do all the mixing between positions "
                            f"(it applies the causal mask); the LayerNorms, the feed-forward and the residual act on "
                            f"each position alone (no mean, sum, cumsum, roll or shift along the sequence axis, "
                            f"dim 1).")
    if coarse_precision(got, expected):   # a rounding's size (LayerNorm's eps was a listed mistake above)
        fail("precision", f"{what}: {HALF_PRECISION} (Off by up to {max_diff(got, expected):.3g}.)")
    rerun = lambda: call(candidate, x, what=what)
    for name in ("attn", "mlp"):
        proj = getattr(getattr(candidate, name), "proj", None)
        if isinstance(proj, nn.Linear) and close(_with_weight(proj.weight, proj.weight * 2.0, rerun), got):
            # doubling self.{name}'s output projection changed nothing: ignored, or only its scale lost?
            other = _with_weight(proj.weight, torch.flip(proj.weight, dims=(0,)), rerun)   # other directions
            if isinstance(other, torch.Tensor) and other.shape == got.shape and not close(other, got):
                fail("norm_placement", f"{what}: your block is blind to the SCALE of self.{name} (doubling its "
                                       f"output changes nothing), though not to its direction: a LayerNorm sits on "
                                       f"the sublayer's output. Normalise the sublayer's input (pre-norm) or the "
                                       f"residual sum (post-norm), never the sublayer's output alone.")
            fail("sublayer_missing", f"{what}: the output does not depend on self.{name}; make sure its result "
                                     f"goes into what forward returns.")
    # the residual stream alone: with both sublayers answering zeros, what the block adds to them
    silent, wanted = _silenced(candidate, rerun), _silenced(reference, lambda: reference(x))
    if isinstance(silent, torch.Tensor) and silent.shape == wanted.shape and not close(silent, wanted):
        fail("residual", f"{what}: with self.attn and self.mlp both answering zeros your block returns "
                         f"{_stream_said(silent, wanted, x, candidate)}, where the reference returns "
                         + ("x itself: each sublayer's output is added to the residual stream, x = x + "
                            "attn(ln1(x)), and nothing else changes the stream (not doubled, not averaged, not "
                            "normalised)." if norm_first else
                            "ln2(ln1(x)): each sublayer's output is added to its input, then normalised, "
                            "x = ln1(x + attn(x)), and nothing else changes the stream."))
    fail("mismatch", f"{what}: the output differs from the reference {('pre' if norm_first else 'post')}-norm "
                     f"block (largest difference {max_diff(got, expected):.3g}). Check the order: "
                     + ("x + attn(...) of ln1(x), then the same with ln2 and mlp."
                        if norm_first else "ln1 of (x + attention of x), then ln2 of (x + mlp of x)."))


class _PassThrough(nn.Module):
    """A course part's stand-in in the device probe: its input back, on the device it came on."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def _course_parts_passed(module: nn.Module, *names: str) -> nn.Module | None:
    """A copy of the student's module whose parts ``names``, the course's own (self.attn and self.mlp, the GPT's
    blocks; the student writes none of them), return their input: the device probe runs only the student's lines
    on meta, where the course's attention and feed-forward cost ten times theirs. A CPU tensor that would have met
    a part's weights meets the next meta operation instead. None when it cannot be copied (inconclusive)."""
    try:
        probed = copy.deepcopy(module)
    except Exception:  # noqa: BLE001 - a module that cannot be copied is judged elsewhere
        return None
    for name in names:
        part = getattr(probed, name, None)
        if isinstance(part, nn.ModuleList):
            setattr(probed, name, nn.ModuleList(_PassThrough() for _ in part))
        elif isinstance(part, nn.Module):
            setattr(probed, name, _PassThrough())
    return probed


def _block_example(cls: Any, norm_first: bool = True, **_: Any) -> Any:
    kwargs = {"norm_first": norm_first} if accepts(cls, "norm_first") else {}
    return module_example(f"{getattr(cls, '__name__', 'TransformerBlock')}(4, 2, 4, 0.0, norm_first={norm_first})",
                          lambda: cls(4, 2, 4, 0.0, **kwargs),
                          lambda: model_ref.TransformerBlock(4, 2, 4, 0.0, norm_first=norm_first), 4)


@checker("4.2", example=_block_example)
def check_transformer_block(cls: Any, norm_first: bool = True) -> str:
    """cls(embed_dim, num_heads, max_tokens, dropout_rate) with ln1, attn, ln2, mlp; pre- or post-norm."""
    expect_callable(cls, "TransformerBlock", "class")
    reference, candidate = _build_block(cls, norm_first)
    generator = torch.Generator().manual_seed(0)
    kind = "pre-norm" if norm_first else "post-norm"
    for batch, length in _SHAPES:
        x = _inputs(generator, batch, length)
        what = f"your block on x of shape {tuple(x.shape)}"
        with torch.no_grad():
            got = expect_tensor(call(candidate, x, what=what), tuple(x.shape), what)
            if not same_when_called_twice(lambda x=x, what=what: call(candidate, x, what=what)):
                fail("dropout", f"{what}: two calls in eval mode gave different outputs, so dropout is active "
                                f"when it should be off. Use the dropout inside self.attn and self.mlp (they "
                                f"follow model.eval()); F.dropout(...) without training=self.training is "
                                f"always on.")
            if not close(got, reference(x)):
                _diagnose_block(candidate, reference, x, got, norm_first, what)
    x = _inputs(generator, 2, _MAX_TOKENS)
    check_module_gradients(candidate, reference, x, what=f"your block on x of shape {tuple(x.shape)}")
    candidate.train()
    x = _inputs(generator, 2, _MAX_TOKENS)
    with torch.no_grad():
        no_dropout = same_when_called_twice(lambda: call(candidate, x, what="your block in training mode"))
    if no_dropout:
        fail("dropout", f"In training mode (dropout_rate={_DROPOUT}) your block gives the same output twice, so "
                        f"no dropout happens. Call the sublayers self.attn and self.mlp: they carry the dropout.")
    reference.train()
    with torch.no_grad():
        seeded = _after_one_seed(candidate, x, "your block in training mode"), _after_one_seed(reference, x)
    if not close(*seeded):
        fail("dropout", f"In training mode (dropout_rate={_DROPOUT}) your block differs from the reference block "
                        f"given the same random draws, though it matches in eval mode: dropout is applied "
                        f"somewhere else or twice, or a sublayer is kept in eval mode. self.attn and self.mlp "
                        f"carry the block's dropout: call each once, and add no dropout of your own.")
    # No magnitude probe: the block's only softmax is inside self.attn, which the exercise builds from the course's
    # MultiHeadMaskedAttention (the student writes none); LayerNorm's own scale is torch's.
    x = _inputs(generator, 2, 5)
    module_in_float64(lambda: _build_block(cls, norm_first)[::-1], x, f"your block on x of shape {tuple(x.shape)}")
    _check_other_block(cls, norm_first, generator)
    # the block copied to the meta device, in eval then training mode, its sublayers passed through: a tensor made
    # on the CPU (a buffer without device=) or a result copied there shows (the text asks for x's device)
    candidate.eval()
    probed = _course_parts_passed(candidate, "attn", "mlp")
    if probed is not None:
        probe_module(probed, x, f"your block on x of shape {tuple(x.shape)}")
    return f"Same outputs as the reference {kind} block, with residuals around both sublayers."


# One more block: every case above has embed_dim 16, 4 heads and max_tokens 8, so a size written for them shows
# only here.
_OTHER_BLOCK = (12, 3, 11)


def _check_other_block(cls: Any, norm_first: bool, generator: torch.Generator) -> None:
    reference, candidate = _build_block(cls, norm_first, _OTHER_BLOCK)
    x = _inputs(generator, 2, _OTHER_BLOCK[2], _OTHER_BLOCK[0])
    what = f"your block built with ({', '.join(map(str, _OTHER_BLOCK))}, {_DROPOUT}) on x of shape {tuple(x.shape)}"
    with torch.no_grad():
        at_other_sizes(lambda: expect_tensor(call(candidate, x, what=what), tuple(x.shape), what), lambda: reference(x),
                       what, f"with embed_dim={_EMBED}, {_HEADS} heads and max_tokens={_MAX_TOKENS}",
                       "Take every size from the sublayers or from x.shape.")


# ---------------------------------------------------------------- 4.3 GPT

def _gpt_config(**overrides: Any):
    values = dict(vocab_size=13, max_tokens=8, embed_dim=16, num_heads=2, num_layers=2, dropout_rate=0.1)
    values.update(overrides)
    return model_ref.GPTConfig(**values)


def _gpt_variants(ref: nn.Module) -> list[Mistake]:
    """The GPT's known mistakes, each the reference's forward with one thing changed, on the student's weights:
    the positions (left out, from 1), the embeddings' scale, the chain of blocks, the final LayerNorm."""
    def run(idx, *, start=0, positions=True, ln_f=True, scale=1.0, both=False, blocks=None, summed=False,
            reverse=False, tied=False):
        x = ref.token_embedding(idx) * scale
        table = ref.position_encoding(idx.shape[1], start) if positions else None
        if positions is True:   # else "after" the blocks (before ln_f), or before "every" block
            x = x + (table.flip(0) if reverse else table) * (scale if both else 1.0)
        if ln_f == "first":   # the final LayerNorm before the blocks, none after
            x = ref.ln_f(x)
        if summed:   # every block reads the embeddings, their outputs added up
            x = sum(block(x) for block in ref.blocks)
        for block in (ref.blocks if blocks is None else blocks):
            x = block(x + table if positions == "every" else x)
            x = ref.ln_f(x) if ln_f == "every" else x   # the final LayerNorm after each block
        x = x + table if positions == "after" else x
        x = ref.ln_f(x) if ln_f is True else _BARE(ref.ln_f)(x) if ln_f == "bare" else x
        return x @ ref.token_embedding.weight.T if tied else ref.head(x)

    def outputs(code, *rows):   # (why, run's switches): one mistake each, in order
        return [Mistake(code, why, output=lambda idx, switches=switches: run(idx, **switches))
                for why, switches in rows]

    blocks, root = list(ref.blocks), math.sqrt(ref.config.embed_dim)
    positions = outputs(
        "positions",
        ("the positions are missing: you never add the position encodings, so the model cannot tell where a token "
         "sits. Add self.position_encoding(...) to the token embeddings.", dict(positions=False)),
        ("the positions are missing and the final LayerNorm ln_f is not applied.", dict(positions=False, ln_f=False)),
        ("your positions start at 1: the first token sits at position 0, self.position_encoding(L) (or start=0).",
         dict(start=1)),   # raises (passed over) at the full length
        ("your positions run backwards (the last token gets position 0): token l gets the encoding of position l, "
         "self.position_encoding(L) row by row as it is.", dict(reverse=True)),
        ("you add the position encodings after the blocks (before ln_f), so no block knows where a token sits: add "
         "them once, to the token embeddings, before the first block.", dict(positions="after")),
        ("you add the position encodings again before every block: add them once, to the token embeddings, before "
         "the first block; each block then takes the previous one's output as it is.", dict(positions="every")))
    final_norms = outputs(
        "final_norm",
        ("the final LayerNorm self.ln_f is missing: apply it after the last block, before the output head.",
         dict(ln_f=False)),
        ("your final norm leaves out self.ln_f's learned weight and bias (a plain F.layer_norm(x, (E,)) normalises, "
         "but neither scales nor shifts; they are 1 and 0 only at initialisation): apply self.ln_f(x) itself after "
         "the last block.", dict(ln_f="bare")),
        ("the final LayerNorm self.ln_f is applied before the blocks, not after them: the blocks run on the "
         "embeddings, then ln_f, then the head.", dict(ln_f="first")))
    scales = outputs(
        "scale",
        ("you scale the token embeddings by sqrt(embed_dim) (as in the 2017 paper); this GPT adds token and position "
         "embeddings as they are.", dict(scale=root)),
        ("you scale the sum of token and position embeddings by sqrt(embed_dim); this GPT adds them as they are, "
         "unscaled.", dict(scale=root, both=True)),
        ("you divide the token embeddings by sqrt(embed_dim); this GPT adds token and position embeddings as they "
         "are.", dict(scale=1 / root)))
    chains = outputs(
        "block_chain",
        ("the blocks run in reverse order; go through self.blocks first to last.", dict(blocks=blocks[::-1])),
        ("only the first block is applied; every block in self.blocks should transform x in turn, each one taking "
         "the previous block's output.", dict(blocks=blocks[:1])),
        ("only the last block's output is kept; each block should take the previous block's output, not the "
         "embeddings.", dict(blocks=blocks[-1:])),
        ("the last block is never applied; every block in self.blocks should transform x in turn (loop over the "
         "blocks themselves, not a range that stops one short).", dict(blocks=blocks[:-1])),
        ("every block reads the embeddings and you add up their outputs; each block should take the previous "
         "block's output instead (x = block(x), in turn).", dict(blocks=[], summed=True)))
    return [*positions[:1], *final_norms,
            Mistake("norm_placement", "the final LayerNorm self.ln_f is applied after every block (x = "
                                      "self.ln_f(block(x)) in the loop): it comes once, after the last block, before "
                                      "the head. Each block normalises its own sublayers' inputs already.",
                    output=lambda idx: run(idx, ln_f="every")),
            *positions[1:], *scales, *chains,
            Mistake("mismatch", "your logits come from the token embedding (ln_f(x) @ token_embedding.weight.T, a "
                                "tied head); this GPT has an output layer of its own: self.head(self.ln_f(x)).",
                    output=lambda idx: run(idx, tied=True))]


@torch.no_grad()
def _diagnose_gpt(candidate: nn.Module, reference: nn.Module, idx: torch.Tensor, got: torch.Tensor,
                  what: str) -> None:
    if bool((got >= 0).all()) and close(got.sum(-1), torch.ones(got.shape[:-1])):
        fail("logits", f"{what}: every row is non-negative and sums to 1, so you return probabilities. "
                         f"Return logits, not probabilities: the loss (cross-entropy) and the sampler apply "
                         f"the softmax themselves.")
    if close(got.exp().sum(-1), torch.ones(got.shape[:-1])):
        fail("logits", f"{what}: you return log-probabilities (a log_softmax of the logits). Return logits, "
                         f"not probabilities: cross-entropy applies the log-softmax itself.")
    first_mistake(_gpt_variants(reference), lambda mistake: close(got, mistake.output(idx)), f"{what}: ")
    _sequences_alone(candidate, reference, idx, got, what, "GPT")
    length = idx.shape[1]
    if length > 1:
        leak = _future_leak(candidate, idx, got, what, _tokens_changed_from(reference.config.vocab_size))
        if leak:
            fail("causal_mask", f"{what}: when only the tokens of idx at {leak} changed, the logits at earlier "
                                f"positions changed too: an earlier position's output depends on a later token, so "
                                f"the future leaks into the past. Only the attention layers inside the blocks mix "
                                f"positions, and they apply the causal mask; the embeddings, positions, ln_f and the "
                                f"head act on each position alone (no mean, sum, cumsum, roll or shift along dim 1).")
        same = torch.full((1, length), 3, dtype=torch.long)
        flat = call(candidate, same, what=what)
        if isinstance(flat, torch.Tensor) and flat.dim() == 3 and close(flat[0, :1].expand_as(flat[0]), flat[0]):
            fail("positions", f"{what}: the same token at different positions gets the same logits: every "
                             f"position gets the same encoding, or none. Add self.position_encoding(L), one row "
                             f"per position 0 .. L-1, to the token embeddings.")
    ln_f = candidate.ln_f.weight
    if close(_with_weight(ln_f, ln_f * 2.0 + 0.5, lambda: call(candidate, idx, what=what)), got):
        fail("final_norm", f"{what}: the output does not depend on the final LayerNorm self.ln_f; apply it "
                           f"after the last block, before the head.")
    fail("mismatch", f"{what}: the logits differ from the reference (largest difference "
                     f"{(got - reference(idx)).abs().max():.3g}). The recipe: token embeddings plus position "
                     f"encodings, dropout, every block in turn, ln_f, then the head.")


def _step_from_position_zero(reference: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The reference's logits of idx's last token fed with a cache of the others, but encoded at position 0."""
    cache = reference.new_cache()
    reference(idx[:, :-1], cache)
    x = reference.token_embedding(idx[:, -1:]) + reference.position_encoding(1, 0)
    for block, layer_cache in zip(reference.blocks, cache):
        x = block(x, layer_cache)
    return reference.head(reference.ln_f(x))[:, 0]


def _check_cache_path(candidate: nn.Module, reference: nn.Module, idx: torch.Tensor) -> str:
    """If forward uses its cache argument, positions must continue after the cached tokens."""
    from course_lib.attention import KVCache

    if not accepts(candidate.forward, "cache"):
        return ""
    config = reference.config
    make = getattr(candidate, "new_cache", None)
    cache = make() if callable(make) else [KVCache(config.max_tokens) for _ in range(config.num_layers)]
    what = "your forward with a KV cache"
    try:
        first = call(candidate, idx[:, :3], cache=cache, what=what)
    except Failure as failure:
        if failure.diagnosis != "exception" or not cache or getattr(cache[0], "length", 0):
            raise
        # refused before anything reached the cache: left out, as the text allows
        return " (Your forward refuses a cache for now; notebook 06 comes back to it.)"
    if not cache or getattr(cache[0], "length", 0) == 0:
        return " (Your forward does not use its cache argument yet; notebook 06 comes back to it.)"
    step = call(candidate, idx[:, 3:4], cache=cache, what=what)
    full = reference(idx[:, :4])
    expect_tensor(first, (idx.shape[0], 3, config.vocab_size), what)
    expect_tensor(step, (idx.shape[0], 1, config.vocab_size), what)
    if not close(step[:, 0], full[:, 3]):
        if close(step[:, 0], _step_from_position_zero(reference, idx[:, :4])):
            fail("positions", "With a KV cache, the logits of a new token differ from a full forward pass: the new "
                              "token is encoded at position 0. Its positions must continue after the tokens already "
                              "in the cache: start at cache[0].length, not at 0.")
        fail("mismatch", "With a KV cache, the logits of a new token differ from a full forward pass. Its "
                         "positions must continue after the tokens already in the cache (start at "
                         "cache[0].length, not at 0), and every block needs its own cache.")
    return " The cached path gives the same logits too."


def _check_gpt_training(candidate: nn.Module, reference: nn.Module, idx: torch.Tensor, rate: float) -> None:
    """Training mode, by behaviour: finite logits, no dropout on the logits, dropout after the embeddings and
    only there (with the blocks in eval mode and one seed, the reference's dropout zeroes the same numbers)."""
    what = f"your GPT in training mode (dropout_rate={rate}) on idx of shape {tuple(idx.shape)}"
    with torch.no_grad():
        eval_logits = call(candidate, idx, what=what.replace("training", "eval"))
        call(candidate.train, what="your GPT's train()")
        try:
            logits = call(candidate, idx, what=what)
            if not isinstance(logits, torch.Tensor) or not torch.isfinite(logits).all():
                fail("nan", f"{what}: the logits are not finite numbers in training mode. Apply dropout to "
                            f"activations (after the embeddings), never to scores that hold -inf.")
            # dense logits are never exactly zero unless dropout zeroed them
            if float((logits == 0).double().mean()) > rate / 3:
                fail("dropout", f"{what}: {float((logits == 0).double().mean()):.0%} of the logits are exactly "
                                f"zero: dropout is applied to the logits. It belongs after the embeddings "
                                f"(self.dropout(tokens + positions)); the head's output is never dropped.")
            # with the blocks in eval mode, only the embedding dropout can make training differ from eval
            blocks = getattr(candidate, "blocks", None)
            if isinstance(blocks, nn.Module):
                blocks.eval()
                try:
                    without_blocks = call(candidate, idx, what=what)
                finally:
                    blocks.train()
            if isinstance(blocks, nn.Module) and torch.equal(without_blocks, eval_logits):
                fail("dropout", f"{what}: no dropout after the embeddings: x = self.dropout(token embeddings + "
                                f"positions) before the first block.")
            if isinstance(blocks, nn.Module):
                _embedding_rate(candidate, blocks, idx, rate, what)
            if isinstance(blocks, nn.Module) and not close(_seeded(candidate, idx, what), _seeded(reference, idx)):
                fail("dropout", f"{what}: with the blocks in eval mode and one random seed, your dropout zeroes "
                                f"other numbers than the reference's: it is applied somewhere else, or twice. It "
                                f"acts once, on the sum x = self.dropout(token embeddings + positions), before the "
                                f"first block: not on the token embeddings alone, not between or after the blocks.")
        finally:
            candidate.eval()
            reference.eval()


def _embedding_rate(candidate: nn.Module, blocks: nn.Module, idx: torch.Tensor, rate: float, what: str) -> None:
    """The first block's input in training mode (the blocks in eval mode) over the one in eval mode: a dropout keeps
    each number scaled by 1/(1 - p), so one factor on every kept number is a dropout of rate p. Another p than the
    config's (and not the config's applied twice) is a rate written into the code."""
    try:
        first = next(iter(blocks))
    except (TypeError, StopIteration):
        return
    seen: list[torch.Tensor] = []
    hook = first.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()) if args else None)
    try:
        candidate.eval()
        call(candidate, idx, what=what.replace("training", "eval"))
        candidate.train()
        blocks.eval()
        call(candidate, idx, what=what)
    finally:
        hook.remove()
        blocks.train()
    if len(seen) != 2 or seen[0].shape != seen[1].shape:
        return
    before, after = seen
    kept = (after != 0) & (before.abs() > 1e-6)
    factors = (after[kept] / before[kept]).double()
    if factors.numel() == 0 or not bool(((factors - factors[0]).abs() <= 1e-4 * factors[0].abs()).all()):
        return
    factor = float(factors.mean())
    twice = any(abs(factor * (1 - rate) ** k - 1) < 1e-4 for k in (1, 2, 3))
    if factor <= 1 or twice:
        return
    p = 1 - 1 / factor
    fail("dropout", f"{what}: your dropout after the embeddings has a rate of {p:.2g} (it drops about {p:.0%} and "
                    f"scales the kept numbers by 1/(1 - {p:.2g})), not the config's {rate}: a rate is written into your "
                    f"code. Use config.dropout_rate: self.dropout (the nn.Dropout(config.dropout_rate) the "
                    f"constructor builds), or F.dropout(x, self.config.dropout_rate, self.training).")


def _after_one_seed(module: nn.Module, x: torch.Tensor, what: str = "") -> Any:
    """The module's output after one fixed seed, in the modes it is in: two modules that drop the same tensors,
    in the same order, give the same output (the caller's random streams are left as they were)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return call(module, x, what=what) if what else module(x)


def _seeded(model: nn.Module, idx: torch.Tensor, what: str = "") -> Any:
    """The model's logits in training mode with its blocks in eval mode, after one fixed seed: only the
    dropout outside the blocks draws, so two models that drop the same tensor give the same logits."""
    model.train()
    model.blocks.eval()
    return _after_one_seed(model, idx, what)


# One more configuration: every case above has vocab 13, max_tokens 8, embed_dim 16, 2 heads and 2 layers, so a
# size written for them shows only here; max_tokens 70 is past a limit of 64 written in too.
_OTHER_CONFIG = dict(vocab_size=7, max_tokens=70, embed_dim=12, num_heads=3, num_layers=3)


# A message that says what to do about too long an idx: names the limit (or the number), or a way under it.
_SAYS_WHAT_TO_DO = re.compile(r"crop|truncat|shorten|\bcut|trim|slic|drop|\bkeep|fewer|less|reduc|split|\bmax|at most|"
                              r"limit|context|block.?size|allow|up to|exceed|larger than|longer than|more than", re.I)


def _check_other_config(cls: Any, generator: torch.Generator) -> None:
    """A GPT of other sizes beside the reference: its logits must match, and its limit move with max_tokens."""
    config = _gpt_config(**_OTHER_CONFIG)
    candidate, reference = _build_gpt(cls, config, generator)
    sizes = ", ".join(f"{key}={value}" for key, value in _OTHER_CONFIG.items())
    for length in (5, config.max_tokens):
        idx = torch.randint(0, config.vocab_size, (2, length), generator=generator)
        what = f"your GPT with GPTConfig({sizes}) on idx of shape (2, {length})"

        def logits(idx: torch.Tensor = idx, what: str = what) -> torch.Tensor:
            try:
                got = call(candidate, idx, what=what)
            except Failure as failure:
                if idx.shape[1] == config.max_tokens and isinstance(failure.__context__, ValueError):
                    fail("context_limit", f"{failure.message.rstrip('.')}; yet {idx.shape[1]} tokens fit its "
                                          f"max_tokens: your limit is a number. Compare the length with "
                                          f"self.config.max_tokens.")
                raise
            return expect_tensor(got, (2, idx.shape[1], config.vocab_size), what)
        with torch.no_grad():
            at_other_sizes(logits, lambda idx=idx: reference(idx), what,
                           "with vocab_size=13, max_tokens=8, embed_dim=16, 2 heads and 2 layers",
                           "Take every size from self.config (or from idx.shape).",
                           diagnose=lambda got, idx=idx, what=what: _diagnose_gpt(candidate, reference, idx, got, what))


# The constructor picks the parts from the config: the cases above use learned positions and pre-norm blocks, so a
# forward that reaches inside one kind of part, or branches on the config, shows only with the other kinds.
_OTHER_PARTS = ((dict(positional="sinusoidal"), "sinusoidal positions (GPTConfig(positional='sinusoidal'))"),
                (dict(norm_first=False), "post-norm blocks (GPTConfig(norm_first=False))"))


def _check_other_parts(cls: Any, generator: torch.Generator) -> None:
    """A GPT with the other position encoding and the other blocks: the same three lines give its logits."""
    for overrides, parts in _OTHER_PARTS:
        config = _gpt_config(**overrides)
        candidate, reference = _build_gpt(cls, config, generator)
        idx = torch.randint(0, config.vocab_size, (2, 5), generator=generator)
        what = f"your GPT with {parts} on idx of shape (2, 5)"
        with torch.no_grad():
            try:
                got = call(candidate, idx, what=what)
            except Failure as failure:
                if failure.diagnosis != "exception":
                    raise
                reraise_with(failure, "exception", " It ran with learned positions and pre-norm blocks: your forward "
                                                   "reaches inside one kind of part (self.position_encoding.embedding"
                                                   " or .table, a block's attribute) or branches on the config. "
                                                   "The positions come from self.position_encoding(L, start) "
                                                   "whatever the config, and each block is called as it is.")
            got = expect_tensor(got, (2, 5, config.vocab_size), what)
            if not close(got, reference(idx)):
                _diagnose_gpt(candidate, reference, idx, got, what)
                fail("mismatch", f"{what}: the logits differ from the reference's, though they matched with "
                                 f"learned positions and pre-norm blocks. forward is the same three lines whatever "
                                 f"parts the constructor chose: self.position_encoding(L) added to the token "
                                 f"embeddings (never its table read directly), every block, then ln_f and the head; "
                                 f"no branch on the config.")


def _full_length_call(candidate: nn.Module, idx: torch.Tensor, max_tokens: int, what: str) -> Any:
    """The GPT on idx; raising on exactly max_tokens tokens (the shorter shapes ran first) is the limit off by one."""
    try:
        return call(candidate, idx, what=what)
    except Failure as failure:
        if failure.diagnosis != "exception" or idx.shape[1] != max_tokens:
            raise
        fail("context_limit", f"{what}: your GPT raised on exactly max_tokens={max_tokens} tokens, though shorter "
                              f"sequences ran. max_tokens tokens fit (positions 0 .. {max_tokens - 1}); refuse only "
                              f"a longer sequence (L > max_tokens, not >=). {failure.message}")


def _gpt_example(cls: Any, *_: Any, **__: Any) -> Any:
    sizes = dict(vocab_size=5, max_tokens=4, embed_dim=4, num_heads=2, num_layers=1, dropout_rate=0.0)
    config = _gpt_config(**sizes)
    shown = f"{getattr(cls, '__name__', 'GPT')}(GPTConfig({', '.join(f'{k}={v}' for k, v in sizes.items())}))"
    return module_example(shown, lambda: cls(config),
                          lambda: model_ref.GPT(config), 4,
                          inputs=lambda generator, length: torch.randint(0, 5, (1, length), generator=generator))


def _build_gpt(cls: Any, config: Any, generator: torch.Generator) -> tuple[nn.Module, nn.Module]:
    """(the student's GPT, the reference) with the same random weights, in eval mode. No magnitude probe for the
    GPT: its softmax is inside the blocks, which the exercise builds from the course's TransformerBlock."""
    reference = randomize_(model_ref.GPT(config), generator).eval()
    candidate = construct(cls, config, what=getattr(cls, "__name__", "cls"))
    copy_weights(reference, candidate, "your GPT")
    candidate.eval()
    return candidate, reference


_TRAIN_DROPOUT = 0.2


def _right_on_a_new_gpt(cls: Any, config: Any, idx: torch.Tensor, failure: Failure | None, what: str) -> None:
    """``kept_state`` where a call that failed (``failure``, or returned the wrong shape: None) after earlier calls
    is right on a new GPT with the same weights: what broke it the model kept from an earlier call."""
    if failure is not None and failure.diagnosis not in ("exception", "shape"):
        return
    candidate, reference = _build_gpt(cls, config, torch.Generator().manual_seed(7))   # the check's own weights
    try:
        got = _full_length_call(candidate, idx, config.max_tokens, what)
    except Failure:
        return
    if isinstance(got, torch.Tensor) and got.shape == (*idx.shape, config.vocab_size) and close(got, reference(idx)):
        fail("kept_state", f"{what} {'raised an error' if failure is not None else 'returned the wrong shape'}, yet "
                           f"a new GPT with the same weights is right on it: your GPT keeps something from an earlier "
                           f"call (positions or a table of one length stored on self) and reuses it on inputs it does "
                           f"not fit. Compute the positions from each call's idx: torch.arange(L, device=idx.device).")


def _length_from_batch(candidate: nn.Module, reference: nn.Module, idx: torch.Tensor, failure: Failure,
                       what: str) -> None:
    """``positions``: a call that raised on idx (N, L) with N != L but is right on a square idx (L, L): the length
    comes from the batch axis (idx.shape[0], len(idx))."""
    n, length = idx.shape
    if failure.diagnosis != "exception" or n == length:
        return
    square = idx[:1].repeat(length, 1)
    try:
        got = call(candidate, square, what=what)
    except Failure:
        return
    if close(got, reference(square)):
        fail("positions", f"{failure.message.rstrip('.')}. Yet on idx of shape ({length}, {length}) your GPT is right: "
                          f"it takes the length from the batch axis, idx.shape[0] (len(idx) too, or length, n = "
                          f"idx.shape). idx is (N, L), batch first: the positions are "
                          f"self.position_encoding(idx.shape[1]).")


@checker("4.3", example=_gpt_example)
def check_gpt(cls: Any) -> str:
    """cls(config) with token_embedding, position_encoding, dropout, blocks, ln_f, head; forward -> logits."""
    expect_callable(cls, "GPT", "class")
    config = _gpt_config()
    generator = torch.Generator().manual_seed(7)
    candidate, reference = _build_gpt(cls, config, generator)
    vocab = config.vocab_size
    for batch, length in _SHAPES:
        idx = torch.randint(0, vocab, (batch, length), generator=generator)
        what = f"your GPT on idx of shape {tuple(idx.shape)}"
        with torch.no_grad():
            try:
                got = _full_length_call(candidate, idx, config.max_tokens, what)
            except Failure as failure:
                _length_from_batch(candidate, reference, idx, failure, what)
                if (batch, length) != _SHAPES[0]:   # after an earlier call
                    _right_on_a_new_gpt(cls, config, idx, failure, what)
                raise
            if isinstance(got, torch.Tensor) and tuple(got.shape) != (batch, length, vocab) and \
                    (batch, length) != _SHAPES[0]:
                _right_on_a_new_gpt(cls, config, idx, None, what)
            if isinstance(got, tuple) and got and isinstance(got[0], torch.Tensor):
                fail("dtype", f"{what} returned a tuple of {len(got)}; return only the logits tensor "
                              f"(N, L, vocab_size). The loss is computed outside the model, by lm_loss.")
            if isinstance(got, torch.Tensor) and tuple(got.shape) == (batch, length, config.embed_dim):
                fail("shape", f"{what} returned shape {tuple(got.shape)}: hidden states, not logits. Finish "
                              f"with the output head self.head, which maps embed_dim to vocab_size.")
            expect_tensor(got, (batch, length, vocab), what)
            if not same_when_called_twice(lambda idx=idx, what=what: call(candidate, idx, what=what)):
                fail("dropout", f"{what}: two calls in eval mode gave different logits, so dropout is on when it "
                                f"should be off. Use self.dropout (an nn.Dropout follows model.eval()).")
            if not close(got, reference(idx)):
                _diagnose_gpt(candidate, reference, idx, got, what)
    idx = torch.randint(0, vocab, (2, config.max_tokens), generator=generator)
    check_module_gradients(candidate, reference, idx, what=f"your GPT on idx of shape {tuple(idx.shape)}")
    # in training mode at another rate than the cases' 0.1: a rate written into the code shows
    trained = _build_gpt(cls, _gpt_config(dropout_rate=_TRAIN_DROPOUT), torch.Generator().manual_seed(8))
    _check_gpt_training(*trained, torch.randint(0, vocab, (4, config.max_tokens), generator=generator), _TRAIN_DROPOUT)
    too_long = torch.randint(0, vocab, (1, config.max_tokens + 1), generator=generator)
    try:
        with torch.no_grad():
            candidate(too_long)
    except Failure:
        raise
    except ValueError as error:   # what the text asks for, with words that say what to do (the words are theirs)
        said = exception_message(error)
        if not (_SAYS_WHAT_TO_DO.search(said) or re.search(rf"(?<!\d){config.max_tokens}(?!\d)", said)):
            fail("context_limit", f"Your GPT raised a ValueError for {config.max_tokens + 1} tokens with "
                                  f"max_tokens={config.max_tokens}, but its message ({said.strip()[:80]!r}) says "
                                  f"nothing of what to do. Name the limit and the way under it: for example, that the model "
                                  f"takes at most max_tokens tokens, so crop the input (idx[:, -max_tokens:]).")
    except Exception as error:   # refused, but not as the text asks
        # an IndexError may be a table read past its end, where a table of one kind of part is read directly:
        # that mistake first (the sinusoidal config), with a generator of its own
        _check_other_parts(cls, torch.Generator().manual_seed(9))
        fail("context_limit", f"Your GPT raised {type(error).__name__} for {config.max_tokens + 1} tokens with "
                              f"max_tokens={config.max_tokens}. Raise a ValueError that says how to crop the input "
                              f"(idx[:, -max_tokens:]): a caller catches ValueError for a bad argument, and an assert "
                              f"is skipped altogether under python -O.")
    else:
        fail("context_limit", f"Your GPT accepted {config.max_tokens + 1} tokens with max_tokens={config.max_tokens}. "
                         f"It has no positions beyond max_tokens: raise a ValueError that says so (and how to "
                         f"crop) instead of returning something.")
    _check_other_config(cls, generator)
    _check_other_parts(cls, generator)
    module_in_float64(lambda: _build_gpt(cls, config, torch.Generator().manual_seed(7)), too_long[:, :5],
                      "your GPT on idx of shape (1, 5): the logits")
    try:
        with torch.no_grad():
            note = _check_cache_path(candidate, reference, torch.randint(0, vocab, (2, 6), generator=generator))
    except Failure as failure:
        if failure.diagnosis != "not_implemented":
            raise
        note = " (The cache path of your forward is not written yet; notebook 06 comes back to it.)"
    # the GPT copied to the meta device with meta ids (integers still: an embedding takes them), in eval then
    # training mode, its blocks passed through: a tensor made on the CPU or a result copied there shows (the text
    # asks for idx's device). A forward that reads the ids' numbers (that they lie in the vocabulary) cannot run
    # there: inconclusive.
    probed = _course_parts_passed(candidate, "blocks")
    if probed is not None:
        probe_module(probed, too_long[:, :5], "your GPT on idx of shape (1, 5)")
    return "Logits match the reference GPT for every batch size and length." + note
