"""Exercises of notebook 09 (modern attention): 9.1 rope_tables, 9.2 apply_rotary, 9.3 RMSNorm,
9.4 SwiGLU, 9.5 repeat_kv, 9.6 GroupedQueryAttention. 9.3 and 9.6 judge a module beside the reference with
procedures of their own; RoPE's and grouped-query attention's mistakes are in ``_gqa_variants``.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import modern as ref
from ...attention import KVCache
from ..exercises import Mistake
from ..verdict import Failure, fail
from . import _gqa_variants as variants
from ._attn_hypotheses import first_match, shape_str
from ._counterexample import first_difference
from ._device_probe import probe_module
from ._gqa_variants import CACHED, FULL_PASS, Setup, simulate
from ._gradients import check_module_gradients
from ._model_common import accepts, as_tensor, as_values, copy_weights
from ._student_code import (
    call,
    call_student,
    close,
    construct,
    expect_callable,
    expect_finite,
    expect_tensor,
    max_diff,
    reraise_with,
    rounding_of,
)
from ._student_files import is_student_file
from .engine import Case, FunctionExercise, ScaleFit, checker, first_mistake, function_example, judge, module_example
from .engine.example import SEEDS, tiny
from .engine.function import UNEXPLAINED, Afresh, Run
from .engine.other_sizes import at_other_sizes
from .engine.probes import (
    IN_TURN,
    batch_mixing,
    called_in_bfloat16,
    called_in_turn,
    copy_of,
    dtypes_met,
    expect_dtype_in_bfloat16,
    generations_with_fresh_caches,
    gradient_probe,
    in_turn_beside_a_new_copy,
    module_in_float64,
    random_or_kept,
)
from .engine.scale_fit import fitted_scale

__all__ = ["check_rope_tables", "check_apply_rotary", "check_rms_norm", "check_swiglu", "check_repeat_kv",
           "check_grouped_query_attention"]


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


# ============================================================================ 9.1 rope_tables

def _two_tables(result: Any, what: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tables returns (cos, sin): a pair (a tensor of two stacked tables unpacks the same way)."""
    if isinstance(result, torch.Tensor) and result.dim() == 3 and result.shape[0] == 2:
        result = tuple(result)
    result = as_values(result, 2)   # a generator of the two unpacks as `cos, sin = ...` does
    if not isinstance(result, (tuple, list)):
        if isinstance(result, torch.Tensor) or result is None:
            got = "nothing" if result is None else f"one tensor of shape {_shape(result)}"
            fail("shape", f"{what} returned {got}; it should return two tables, `return cos, sin`, each of "
                          f"shape {shape}.")
        fail("dtype", f"{what} returned a {type(result).__name__}; it should return two tensors, `return cos, sin`.")
    if len(result) != 2:
        fail("shape", f"{what} returned {len(result)} values; it should return two, the cosines and the sines: "
                      f"`return cos, sin`.")
    tables = [as_tensor(t) for t in result]
    head_dim = shape[1]
    for name, table in zip(("cos", "sin"), tables):
        if isinstance(table, torch.Tensor) and _shape(table) == (shape[0], head_dim // 2) and head_dim > 1:
            fail("shape", f"{what} returned a {name} table of shape {_shape(table)}, expected {shape}: one angle per "
                          f"pair of dimensions, but each row needs them for all head_dim dimensions. Repeat the "
                          f"head_dim/2 angles as two halves, torch.cat([angles, angles], dim=-1), before cos and sin.")
        if isinstance(table, torch.Tensor) and _shape(table) == shape[::-1] and shape[0] != shape[1]:
            fail("shape", f"{what} returned a {name} table of shape {_shape(table)}, expected {shape}: one row per "
                          f"position, one column per dimension (positions down, frequencies across).")
        expect_tensor(table, shape, f"{what} (its {name} table)")
        if not table.is_floating_point():
            fail("dtype", f"{what} returned a {name} table of dtype {table.dtype}; cosines and sines need floats.")
        if table.dtype not in (torch.float32, torch.get_default_dtype()):
            fail("dtype", f"{what} returned a {name} table of dtype {table.dtype}, expected torch.float32: the "
                          f"model's queries and keys are float32, and float64 tables would turn them into float64. "
                          f"Compute in float64 if you like, then .float() the tables.")
    return tables[0], tables[1]


def _diagnose_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, max_tokens: int, theta: float,
                     what: str, defaulted: bool) -> None:
    """Raise the Failure that names the mistake in tables (cos, sin) that differ from the reference."""
    pair = (cos.double(), sin.double())
    right = variants.tables(head_dim, max_tokens, theta)
    if close(pair[0], right[1]) and close(pair[1], right[0]):
        fail("rope_rotation", f"{what}: sin and cos are swapped: return the cosines first, `return cos, sin`. "
                              f"Row 0 (position 0) of cos is all ones, of sin all zeros.")
    if close(pair[0], right[0]) and not close(pair[1], right[1]):
        if close(pair[1], right[0]):
            fail("rope_rotation", f"{what}: your cos table is right, but the second table is the cosines again: "
                                  f"return the sines as the second table, `return angles.cos(), angles.sin()`.")
        if close(pair[1], -right[1]):
            fail("rope_rotation", f"{what}: your cos table is right, but your sines have the wrong sign (sin of "
                                  f"minus the angle): every pair would turn backwards. Take sin of m * w_i, with "
                                  f"positive angles.")
    default = " (This call left theta at its default: the default in your signature should be 10000.0.)" \
        if defaulted else ""
    for code, why, kwargs in ((m.code, m.message, m.spec) for m in variants.table_mistakes(theta)):
        for layout in ("half", "interleaved"):
            if layout == "interleaved" and kwargs.get("layout"):
                continue
            mistaken = variants.tables(head_dim, max_tokens, theta, **dict(kwargs, layout=kwargs.get("layout", layout)))
            if close(pair[0], mistaken[0]) and close(pair[1], mistaken[1]):
                extra = ("" if layout == "half" else
                         " Also, the angles should be repeated as two halves, cat([angles, angles], dim=-1), "
                         "not element by element.")
                fail(code, f"{what}: {why}.{extra}{default if code == 'rope_frequencies' else ''}")
    half = head_dim // 2
    if head_dim > 1 and all(close(table[:, :half], good[:, :half]) for table, good in zip(pair, right)):
        fail("rope_layout", f"{what}: the first head_dim/2 columns of both tables are right, the second half is not. "
                            f"The half-split layout repeats the same head_dim/2 angles: column j + head_dim/2 is "
                            f"column j again, torch.cat([angles, angles], dim=-1), then cos and sin.")
    if close(pair[0], right[0]) and close(pair[1].abs(), right[1].abs()):
        never_negative = bool((pair[1] >= 0).all())
        fail("rope_rotation", f"{what}: your cos table is right and your sines have the right size, but not always "
                              f"the right sign"
                              + (" (a sine from sqrt(1 - cos^2) is never negative)" if never_negative else
                                 " (some are negated, and those pairs would turn backwards)")
                              + ": take the sine of the angles themselves, angles.sin().")
    _pairs_at_wrong_speed(pair, right, head_dim, max_tokens, what, default)
    off_by = max(max_diff(pair[0], right[0]), max_diff(pair[1], right[1]))
    if off_by < 0.05:
        fail("precision", f"{what}: your tables are right to about {off_by:.2g} but not to 1e-3: the angles (or the frequencies) are "
                          f"rounded too coarsely, e.g. computed in float16 or bfloat16. Compute the angles in "
                          f"float32 or float64 (torch.arange(..., dtype=torch.float64)), then cast the tables.")
    on_circle = close(pair[0] ** 2 + pair[1] ** 2, torch.ones_like(pair[0]))
    starts_at_zero = close(pair[1][0], torch.zeros_like(pair[1][0])) and close(pair[0][0], torch.ones_like(pair[0][0]))
    if on_circle and starts_at_zero and max_tokens > 1:
        fail("rope_frequencies", f"{what}: each entry is the cosine and sine of one angle, starting from 0 at "
                                 f"position 0, but the angles are wrong: position m turns pair i by "
                                 f"m * theta^(-2i/head_dim). Check the base, the exponent and the positions.{default}")
    cos_diff, sin_diff = (pair[0] - right[0]).abs(), (pair[1] - right[1]).abs()
    name, index = ("cos", 0) if float(cos_diff.max()) >= float(sin_diff.max()) else ("sin", 1)
    pos, dim = divmod(int((cos_diff if index == 0 else sin_diff).argmax()), head_dim)
    fail("mismatch", f"{what}: the tables differ from the reference, most at position {pos}, dimension {dim} of "
                     f"the {name} table ({name} {float(pair[index][pos, dim]):.4f}, expected "
                     f"{float(right[index][pos, dim]):.4f}). Entry (m, j) is the cos (and sin) of "
                     f"m * theta^(-2i/head_dim) with i = j mod head_dim/2.")


def _turned(table: tuple[torch.Tensor, torch.Tensor], pair: int, last: int) -> float:
    """The angle pair ``pair`` of the tables has turned through from position 0 to ``last``, followed position by
    position (each step read between -pi and pi), so a pair that turns faster than asked is not read around the
    circle."""
    angles = torch.atan2(table[1][:last + 1, pair], table[0][:last + 1, pair])          # (last + 1,), wrapped
    steps = torch.remainder(angles.diff() + math.pi, 2 * math.pi) - math.pi           # (last,)
    return float(steps.sum())


def _pairs_at_wrong_speed(pair: tuple[torch.Tensor, torch.Tensor], right: tuple[torch.Tensor, torch.Tensor],
                          head_dim: int, max_tokens: int, what: str, default: str) -> None:
    """Tables of angles (on the circle, 0 at position 0) where some pairs turn at another speed than theta^(-2i/d):
    a frequency mistake (scaled slow frequencies, as Llama 3's), not a rounding, which moves every angle by a
    relative 1e-3 at most. One factor shared by every pair, pair 0 (theta^0 = 1 for any theta) included, is the
    positions'; every pair at one speed is an exponent that does not change with i. Each pair's speed is read at the
    latest position whose right angle is below 1.5 radians."""
    half = head_dim // 2
    if max_tokens < 2 or half < 1 or not close(pair[0] ** 2 + pair[1] ** 2, torch.ones_like(pair[0])) or not (
            close(pair[1][0], torch.zeros_like(pair[1][0])) and close(pair[0][0], torch.ones_like(pair[0][0]))):
        return
    ratios, speeds, rights = [], [], []
    for i in range(half):
        speed = float(torch.atan2(right[1][1, i], right[0][1, i]))            # the right angle per position
        if speed <= 0:
            return
        m = max(1, min(max_tokens - 1, int(1.5 / speed)))
        speeds.append(_turned(pair, i, m) / m)
        rights.append(speed)
        ratios.append(speeds[-1] / speed)
    wrong = [i for i, ratio in enumerate(ratios) if abs(ratio - 1) > 0.05]
    if not wrong:
        return
    if max(ratios) - min(ratios) < 1e-3 * max(abs(r) for r in ratios):
        factor = ratios[0]
        if half > 1 and abs(factor - rights[1]) < 1e-3 * rights[1]:   # theta^(-2/d): every pair one pair along
            fail("rope_frequencies", f"{what}: every pair turns at the speed of the pair after it (pair 0 at "
                                     f"theta^(-2/head_dim) = {factor:.4g} radians per position, not 1): your pairs "
                                     f"are counted from 1 (torch.arange(1, head_dim // 2 + 1), or 2 * (i + 1)). Pair "
                                     f"i, counted from 0, turns by w_i = theta^(-2i/head_dim): "
                                     f"torch.arange(0, head_dim, 2) / head_dim as the exponent.{default}")
        why = ("torch.linspace(0, max_tokens, max_tokens) steps by max_tokens/(max_tokens-1), not 1"
               if abs(factor - max_tokens / (max_tokens - 1)) < 1e-3 else
               "RoPE counts positions in whole tokens, not as fractions of the length"
               if any(abs(factor - 1 / n) < 1e-4 for n in (max_tokens, max_tokens - 1)) else
               f"position m counts as {factor:.4g} * m")
        fail("rope_positions", f"{what}: every pair, pair 0 included, turns {factor:.4g} times as far as it should "
                               f"at every position. Pair 0 turns by 1 radian per position whatever theta is, so one "
                               f"factor on every angle comes from your positions ({why}): row m is position m, "
                               f"torch.arange(max_tokens), 0 .. max_tokens-1 (or a factor on every frequency).")
    if half > 1 and max(speeds) - min(speeds) < 1e-3 * max(abs(s) for s in speeds):
        one = abs(speeds[0] - 1) < 1e-3
        fail("rope_frequencies", f"{what}: every pair turns by the same {speeds[0]:.4g} radian{'' if one else 's'} per position: "
                                 f"your exponent does not change with the pair i"
                                 + (", every frequency is theta^0 = 1. An integer division does that: "
                                    "arange(0, head_dim, 2) // head_dim (or 2 * i // head_dim) is 0 for every pair; "
                                    "divide as floats, 2 * i / head_dim" if one else "")
                                 + f". Pair i turns by w_i = theta^(-2i/head_dim).{default}")
    others = "; the other pairs are right" if all(abs(ratios[i] - 1) < 1e-3 for i in range(half) if i not in wrong) \
        and len(wrong) < half else ""
    shown = ", ".join(f"pair {i}: {ratios[i]:.3g} times its speed" for i in wrong[:4]) + \
        (", ..." if len(wrong) > 4 else "")
    fail("rope_frequencies", f"{what}: some pairs turn at the wrong speed ({shown}){others}. This is not a "
                             f"rounding (that moves every angle by a relative 1e-3 at most). Every pair i turns by "
                             f"w_i = theta^(-2i/head_dim) per position, with no scaling of the slow frequencies (no "
                             f"Llama 3 rope scaling, NTK or context-extension factor here).{default}")


def _default_theta_wrong(fn: Callable[..., Any]) -> bool:
    """Whether fn's signature gives theta a default other than 10000 (the note on defaults is only for that)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    named = [p for p in parameters if p.name == "theta"] or parameters[2:3]
    default = named[0].default if named else inspect.Parameter.empty
    return default is not inspect.Parameter.empty and default != 10000.0


def _table_case(head_dim: int, max_tokens: int, theta: float | None = None) -> Case:
    """theta None leaves it at the student's default."""
    args = (head_dim, max_tokens) if theta is None else (head_dim, max_tokens, theta)
    return Case(args, f"rope_tables({head_dim}, {max_tokens}" + ("" if theta is None else f", theta={theta:g}") + ")")


def _stacked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The student's rope_tables as one tensor, its two tables stacked (2, max_tokens, head_dim), once the
    pair it returns is judged; its signature is the student's (the default of theta is read from it)."""
    @functools.wraps(fn)
    def tables(head_dim: int, max_tokens: int, *theta: float) -> torch.Tensor:
        shown = _table_case(head_dim, max_tokens, *theta).what
        return torch.stack(_two_tables(fn(head_dim, max_tokens, *theta), shown, (max_tokens, head_dim)))
    return tables


def _table_diagnosis(runs: list[Run], fn: Any) -> None:
    (head_dim, max_tokens, *theta), what = runs[0].case.args, runs[0].case.what
    if theta and theta[0] != 10000.0 and close(runs[0].out.double(), torch.stack(
            variants.tables(head_dim, max_tokens, 10000.0))):
        # the tables of the default theta: kept from the call of these sizes before, if new sizes take theta
        fresh = call(fn, 10, 7, theta[0], what=f"rope_tables(10, 7, theta={theta[0]:g})")   # (2, 7, 10): stacked
        if close(fresh.double(), torch.stack(variants.tables(10, 7, theta[0]))):
            fail("kept_state", f"{what} returned the tables of theta=10000, which rope_tables({head_dim}, "
                               f"{max_tokens}) returned before, while rope_tables(10, 7, theta={theta[0]:g}) is "
                               f"right: your function keeps the tables of an earlier call of the same sizes (a "
                               f"cache whose key leaves theta out). Key it on every argument, or compute the tables "
                               f"at every call.")
    _diagnose_tables(*runs[0].out, head_dim, max_tokens, *(theta or [10000.0]), what,
                     not theta and _default_theta_wrong(fn))


ROPE_TABLES = FunctionExercise(
    "9.1", "rope_tables", lambda head_dim, max_tokens, theta=10000.0: torch.stack(
        ref.rope_tables(head_dim, max_tokens, theta)),
    # small head_dims with several theta, so every slip of the frequencies moves some entry past the tolerance
    # head_dim 8 again with more positions, and (8, 12) again with another theta: tables kept from an earlier call
    # (keyed on some of the arguments only) are a slip too
    lambda: [_table_case(8, 12), _table_case(4, 5), _table_case(16, 40, 500000.0), _table_case(6, 9, 100.0),
             _table_case(2, 1), _table_case(8, 20), _table_case(8, 12, 500.0)],
    ("head_dim", "max_tokens", "theta"),
    success="Both tables right for head_dim 2 to 16 and several theta: pair (i, i + head_dim/2) turns by "
            "theta^(-2i/head_dim) per position.",
    mismatch=lambda run: "",   # _diagnose_tables always decides
    each_case=True, dtype=False, diagnose=_table_diagnosis,
    examples=lambda: [Case(case.args, f"{case.what}  (cos table first, then sin)") for case in (
        _table_case(2, 2), _table_case(4, 2), _table_case(4, 3), _table_case(4, 3, 100.0), _table_case(8, 3, 100.0))],
)


def _tables_example(fn: Callable[..., Any], *_: Any, **__: Any) -> Any:
    """The counter-example shows whatever came back, the pair stacked (wrong shapes included)."""
    def stacked(*args: Any) -> Any:
        tables = as_values(fn(*args), 2)
        return torch.stack([as_tensor(t) for t in tables]) if isinstance(tables, (tuple, list)) else tables
    return function_example(ROPE_TABLES)(stacked)


@checker("9.1", example=_tables_example)
def check_rope_tables(fn: Callable[..., Any]) -> str:
    """``fn(head_dim, max_tokens, theta=10000.0)`` -> (cos, sin), each (max_tokens, head_dim), half-split."""
    expect_callable(fn, "rope_tables")
    return judge(ROPE_TABLES, _stacked(fn))


# ============================================================================ 9.2 apply_rotary

# (x shape (N, heads, L, head_dim), table rows, theta, offset, dtype). heads != L everywhere, so positions
# read along the wrong axis show; the offset-0 cases come first, so an offset slip is told apart.
_ROTARY_CASES = (
    ((2, 3, 5, 8), 12, 10000.0, 0, torch.float32),
    ((1, 2, 7, 4), 12, 100.0, 0, torch.float32),
    ((2, 3, 5, 8), 12, 10000.0, 4, torch.float32),
    ((1, 4, 1, 8), 14, 10000.0, 9, torch.float32),    # one new token during cached decoding
    ((2, 2, 6, 16), 16, 500000.0, 2, torch.float64),
    ((2, 3, 5, 8), 12, 10.0, 1, torch.float16),       # a half-precision model: tables in x's dtype too
)

def _rotary_case(generator: torch.Generator, shape: tuple[int, ...], rows: int, theta: float, offset: int,
                 dtype: torch.dtype) -> Case:
    cos, sin = ref.rope_tables(shape[-1], rows, theta, dtype=dtype)
    x = torch.randn(shape, generator=generator).to(dtype)
    return Case((x, cos, sin, offset), f"apply_rotary(x, cos, sin{f', offset={offset}' if offset else ''}) with x "
                                       f"of shape {shape}{'' if dtype == torch.float32 else f' ({dtype})'} and "
                                       f"tables of {rows} rows")


def _offset_by_keyword(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The student's apply_rotary called as the notebook calls it: offset by keyword, and only when not 0."""
    return lambda x, cos, sin, offset: fn(x, cos, sin, offset=offset) if offset else fn(x, cos, sin)


def _rotary_reword(failure: Failure, case: Case, out: Any, fn: Any) -> None:
    """A call or shape that fails only with an offset, or a dtype lost only in half precision, says so."""
    cases = APPLY_ROTARY.cases()
    earlier = cases[:next(i for i, c in enumerate(cases) if c.what == case.what)]

    def right(c: Case) -> bool:
        try:
            return close(call_student(fn, *c.given(), what=c.what), APPLY_ROTARY.reference(*c.args))
        except Failure:
            return False
    x, offset = case.args[0], case.args[3]
    if offset and failure.diagnosis in ("exception", "shape") and all(right(c) for c in earlier if not c.args[3]):
        reraise_with(failure, "rope_positions", " Your function works with offset=0 but not with "
                     f"offset={offset}: take the table rows offset .. offset+L-1, cos[offset:offset + L] "
                     f"with L = x.shape[-2].")
    if x.dtype != torch.float32 and failure.diagnosis == "dtype" and all(right(c) for c in earlier):
        reraise_with(failure, "dtype", " Keep x's dtype: the tables here are already in it, so do not "
                     "build new float32 tensors (or .float() x) on the way.")


def _rotary_offsets(runs: list[Run], fn: Any) -> None:
    # judged in full precision: a half-precision case that differs by its rounding is no evidence about the offset
    full = [run for run in runs if run.case.args[0].dtype in (torch.float32, torch.float64)]
    wrong = [run for run in full if not close(run.out, run.expected)]
    if not wrong:
        run = next(run for run in runs if not close(run.out, run.expected))
        fail("precision", f"apply_rotary is right in float32 and float64, but with x in {run.case.args[0].dtype} it "
                          f"differs by up to {max_diff(run.out, run.expected):.3g}: use the tables as they are, x * cos "
                          f"+ rotate_half(x) * sin in x's dtype; a detour (angles recovered from the tables, another "
                          f"dtype on the way) rounds differently.")
    if wrong[0].case.args[3] and all(close(run.out, run.expected) for run in full if not run.case.args[3]):
        fail("rope_positions", f"apply_rotary is right with offset=0 but not with offset={wrong[0].case.args[3]}: the "
                               f"rows of the tables for x are offset .. offset+L-1, cos[offset:offset + L] with L = "
                               f"x.shape[-2].")
    _sequences_alone(wrong[0], fn, APPLY_ROTARY.reference)


def _sequences_alone(run: Run, fn: Any, reference: Callable[..., Any]) -> None:
    """``batch_mixing`` where each sequence of x's batch is right on its own and the batch together is not (the
    engine's batch probe slices every tensor argument along the batch; 9.2's tables have no batch axis)."""
    x, *rest = run.case.args
    if x.shape[0] < 2 or not (isinstance(run.out, torch.Tensor) and run.out.shape == run.expected.shape):
        return
    alone = []
    for i in range(x.shape[0]):
        args = (x[i:i + 1], *rest)
        try:
            out = call_student(fn, *Case(args, run.case.what).given(), what=run.case.what)
        except Failure:
            return
        if not (isinstance(out, torch.Tensor) and close(out, reference(*args))):
            return
        alone.append(out)
    if all(close(run.out[i], alone[0][0]) for i in range(len(alone))):
        fail("batch_mixing", f"{run.case.what}: every sequence of the batch gets the result of the FIRST "
                             f"sequence: each sequence alone is right, but your code works on x[0] (or x[:1]) and "
                             f"copies it over the batch (expand, [None], broadcasting). Work on the whole x, batch "
                             f"axis first: no x[0], no N written as 1.")
    batch_mixing(run.case.what, run.out, alone, "your code mixes the sequences of the batch (an axis taken for "
                                                "another, a reshape across the batch). Keep the batch axis first "
                                                "and apart.")


def _rotary_mismatch(run: Run) -> str:
    x, _, _, offset = run.case.args
    return (f"apply_rotary with x of shape {_shape(x)} and offset={offset} differs from the reference by up "
            f"to {max_diff(run.out, run.expected):.3g}. It should return x * cos + rotate_half(x) * sin, with the "
            f"table rows offset .. offset+L-1 and rotate_half(x) = cat(-x2, x1) of the two halves.")


def _rotary_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(9)
    cases = [_rotary_case(generator, *case) for case in _ROTARY_CASES]
    # as 9.6 hands it over, split into heads: a transposed view, not contiguous (x.view(...) raises on it)
    x = torch.randn(2, 5, 3, 8, generator=generator).transpose(1, 2)          # (N, heads, L, head_dim), strided
    cos, sin = ref.rope_tables(8, 7, 10000.0)
    return cases + [Case((x, cos, sin, 0), "apply_rotary(x, cos, sin) with x of shape (2, 3, 5, 8) split into heads "
                                           "(a transposed view, not contiguous) and tables of 7 rows")]


def _rotary_examples() -> list[Case]:
    cases = []
    for (length, d, offset), seed in [(size, seed) for size in ((1, 2, 0), (2, 2, 0), (1, 2, 1), (2, 4, 0), (2, 4, 1))
                                      for seed in SEEDS]:
        x, (cos, sin) = tiny(torch.Generator().manual_seed(seed), 1, 1, length, d), ref.rope_tables(d, 4, 10.0)
        cases.append(Case((x, cos, sin, offset), f"apply_rotary(x, cos, sin, offset={offset}) with the tables of "
                                                 f"rope_tables({d}, 4, theta=10)"))
    return cases


APPLY_ROTARY = FunctionExercise(
    "9.2", "apply_rotary", lambda x, cos, sin, offset: ref.apply_rotary(x, cos, sin, offset=offset), _rotary_cases,
    ("x", "cos", "sin", "offset"),
    success="Right for offsets 0 to 9, one to four heads and float16 to float64 (also with float32 tables), and "
            "gradients flow back to x: pair (i, i + head_dim/2) of each token turns to the token's position.",
    mismatch=_rotary_mismatch,
    mistakes=variants.ROTARY, variant=variants.rotary_variant, finite=True, reword=_rotary_reword,
    diagnose=_rotary_offsets, examples=_rotary_examples,
    probes=FunctionExercise.probes + ("device", "bfloat16"),   # the text asks for x's device and dtype
)


@checker("9.2", example=lambda fn, *_, **__: function_example(APPLY_ROTARY)(_offset_by_keyword(fn)))
def check_apply_rotary(fn: Callable[..., Any]) -> str:
    """``fn(x (N, heads, L, head_dim), cos, sin, offset=0)`` -> x turned to positions offset .. offset+L-1.
    The declaration, then x's dtype kept with float32 tables, the gradient reaching x, the device."""
    expect_callable(fn, "apply_rotary")
    message = judge(APPLY_ROTARY, _offset_by_keyword(fn))
    _rotary_keeps_dtype(fn)
    x, cos, sin, offset = APPLY_ROTARY.cases()[2].args
    what = f"apply_rotary(x, cos, sin, offset={offset}) with x of shape {_shape(x)}"
    gradient_probe(_offset_by_keyword(fn), APPLY_ROTARY.reference, (x, cos, sin, offset), ("x",), what)
    return message


def _rotary_keeps_dtype(fn: Callable[..., Any]) -> None:
    """A float16 model keeps float32 tables as buffers: the text says the result stays in x's dtype."""
    shape, rows, theta, offset, dtype, table_dtype = (2, 3, 5, 8), 12, 10.0, 1, torch.float16, torch.float32
    cos, sin = ref.rope_tables(shape[-1], rows, theta, dtype=table_dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(92)).to(dtype)
    shown = (f"apply_rotary(x, cos, sin, offset={offset}) with x of shape {shape} in {dtype} and {table_dtype} "
             f"tables")
    try:
        out = call_student(fn, x.clone(), cos, sin, what=shown, offset=offset)
    except Failure as failure:
        said = dtypes_met(failure, shown) if failure.diagnosis == "exception" else None
        if said is None:
            raise
        raise Failure("dtype", f"{shown} raised {said}: the float32 table rows meet x's float16 in your code. Keep "
                               f"x's dtype: cast the rows you take, cos[...].to(x.dtype), before they meet x.",
                      **failure.details) from None
    if isinstance(out, torch.Tensor) and _shape(out) == shape and out.dtype != dtype:
        fail("dtype", f"{shown} returned {out.dtype}: the float32 table rows promote the product. Keep x's dtype: "
                      f"cast the rows you take, cos[...].to(x.dtype) (or the result, .to(x.dtype)).")
    expect_tensor(out, shape, shown, dtype=dtype)
    if not close(out, ref.apply_rotary(x, cos, sin, offset=offset)):
        fail("precision", f"{shown}: your result is wrong here though right when x and the tables share a dtype. "
                          f"Cast the table rows to x's dtype, then turn: x * cos + rotate_half(x) * sin.")


# ============================================================================ 9.3 RMSNorm

# (dim, eps or None for the default, x shape, scale of the rows); the last case runs in float16.
_NORM_CASES = (
    (16, None, (2, 5, 16), "mixed"),     # some rows tiny: the default eps (1e-6) changes them
    (8, 0.1, (3, 8), "normal"),          # a large eps: inside or outside the square root differs
    (8, 0.1, (4, 8), "mixed"),           # some rows' root mean square below eps: added or clamped at differs
    (8, None, (2, 3, 4, 8), "normal"),   # (N, heads, L, head_dim), as QK-norm calls it
    (8, None, (8,), "normal"),           # one vector: (..., dim) with no leading axis
)


def _norm_input(shape: tuple[int, ...], kind: str, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=generator) * 1.5 + 0.5          # a mean, so centring shows
    if kind == "mixed":
        rows = torch.rand((*shape[:-1], 1), generator=generator)
        x = x * torch.where(rows < 0.4, torch.full_like(rows, 1e-3), torch.ones_like(rows))
    return x


def _rms(x: torch.Tensor, eps: float, dim: Any = -1) -> torch.Tensor:
    return (x.pow(2).mean(dim=dim, keepdim=True) + eps).sqrt()


def _norm_mistakes(x: torch.Tensor, w: torch.Tensor, eps: float) -> dict[str, Mistake]:
    """Each known slip of RMSNorm.forward and what it outputs for x (float64) with weight w and self.eps,
    keyed, so the same slip can be followed from one input to the next."""
    ms, mean_abs = x.pow(2).mean(-1, keepdim=True), x.abs().mean(-1, keepdim=True)
    centred = x - x.mean(-1, keepdim=True)
    fixed = [
        Mistake("epsilon", "epsilon is missing: x / sqrt(mean(x^2)) blows up for rows near zero. Add self.eps "
                           "inside the square root: x / sqrt(mean(x^2) + eps).", output=x / ms.sqrt() * w),
        Mistake("epsilon", "epsilon is outside the square root: x / (sqrt(mean(x^2)) + eps). It belongs inside: "
                           "x / sqrt(mean(x^2) + eps) (or x * rsqrt(mean(x^2) + eps)).",
                output=x / (ms.sqrt() + eps) * w),
        Mistake("epsilon", "the square root is taken of mean(x^2) and of eps apart and then added: sqrt(mean(x^2)) + "
                           "sqrt(eps) is not sqrt(mean(x^2) + eps). Add eps inside one square root: x / "
                           "sqrt(mean(x^2) + eps).", output=x / (ms.sqrt() + eps ** 0.5) * w),
        Mistake("epsilon", "you clamp the root mean square at eps (clamp_min or max(rms, eps)) instead of adding "
                           "eps inside the square root: a row's scale then jumps where it crosses eps. Add it: x / "
                           "sqrt(mean(x^2) + eps).", output=x / ms.sqrt().clamp_min(eps) * w),
        Mistake("epsilon", "you clamp mean(x^2) at eps (clamp_min or max) instead of adding eps to it: x / "
                           "sqrt(mean(x^2) + eps).", output=x / ms.clamp_min(eps).sqrt() * w),
        Mistake("norm_weight", "the learned weight is missing: multiply the normalised x by self.weight.",
                output=x / _rms(x, eps)),
        Mistake("norm_weight", "you multiply by (1 + weight), Gemma's convention; here the weight starts at one "
                               "and multiplies directly: normalised x * self.weight.", output=x / _rms(x, eps) * (1 + w)),
        Mistake("norm_weight", "you add self.weight; it multiplies: normalised x * self.weight.",
                output=x / _rms(x, eps) + w),
        Mistake("norm_weight", "you multiply by self.weight before normalising, so the weight is divided out "
                               "again: normalise x first, then multiply the result by self.weight.",
                output=(x * w) / _rms(x * w, eps)),
        Mistake("epsilon", "you add self.eps squared (eps ** 2) inside the square root; add self.eps itself: "
                           "x / sqrt(mean(x^2) + eps).", output=x / _rms(x, eps ** 2) * w),
        Mistake("epsilon", "you add self.eps to the SUM of the squares and then divide by dim, which adds eps / dim: "
                           "add self.eps to the mean itself, x / sqrt(sum(x^2) / dim + eps).",
                output=x / _rms(x, eps / x.shape[-1]) * w),
        Mistake("norm_statistic", "you subtract the mean first, as LayerNorm does. RMSNorm does not centre: divide "
                                  "x itself by sqrt(mean(x^2) + eps).",
                output=centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w),
        Mistake("norm_statistic", "you divide by the variance (x.var), which subtracts the mean. RMSNorm uses the "
                                  "mean of the squares, x.pow(2).mean(-1, keepdim=True).",
                output=x / (x.var(-1, keepdim=True) + eps).sqrt() * w),
        Mistake("norm_statistic", "you divide by the (biased) variance, which subtracts the mean. RMSNorm uses the "
                                  "mean of the squares, x.pow(2).mean(-1, keepdim=True).",
                output=x / (x.var(-1, keepdim=True, unbiased=False) + eps).sqrt() * w),
        Mistake("norm_statistic", "you divide by the norm of x, sqrt(sum(x^2)), not by its root mean square "
                                  "sqrt(mean(x^2)): the result is sqrt(dim) times too small. Use the mean, or "
                                  "divide the norm by sqrt(dim).", output=x / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt() * w),
        Mistake("norm_statistic", "you divide by the norm of x, not by its root mean square sqrt(mean(x^2)): the "
                                  "result is sqrt(dim) times too small.",
                output=x / (x.pow(2).sum(-1, keepdim=True).sqrt() + eps) * w),
        *(Mistake("norm_statistic", "you divide by the mean absolute value, mean(|x|); RMSNorm divides by the "
                                    "root mean square, sqrt(mean(x^2) + eps).", output=x / d * w)
          for d in (mean_abs + eps, (mean_abs + eps).sqrt(), mean_abs)),   # with eps, under a root, bare
        Mistake("norm_statistic", "you divide by the mean of the squares itself; take its square root: "
                                  "x / sqrt(mean(x^2) + eps).", output=x / (ms + eps) * w),
        Mistake("norm_statistic", "you multiply by the root mean square; divide by it (or multiply by rsqrt).",
                output=x * _rms(x, eps) * w),
        Mistake("norm_statistic", "you take the mean over every element of x, not over each vector: pass "
                                  "dim=-1, keepdim=True to .mean().", output=x / _rms(x, eps, None) * w),
        Mistake("norm_statistic", "you normalise with the standard deviation (x.std), which subtracts the mean; "
                                  "RMSNorm uses sqrt(mean(x^2) + eps).",
                output=x / (x.std(-1, keepdim=True) + eps) * w),
    ]
    out = {f"fixed{i}": m for i, m in enumerate(fixed)}
    # eps scaled with the row: x divided first by a size of its own (its largest |value|, its norm, its mean |x|)
    # and eps then added to the mean of the squares of that scaled vector, which is eps·size² on x's scale
    for key, said, size in (("max", "its largest absolute value (x.abs().amax(-1))", x.abs().amax(-1, keepdim=True)),
                            ("norm", "its norm (x.norm(dim=-1))", x.pow(2).sum(-1, keepdim=True).sqrt()),
                            ("mean_abs", "its mean absolute value", mean_abs)):
        out[f"scaled_eps_{key}"] = Mistake(
            "epsilon", f"you divide x by {said} first and add eps to the mean of the squares of the scaled vector: "
                       f"on x's own scale that adds eps·{key.replace('_', ' ')}², not eps, so epsilon grows and "
                       f"shrinks with each row (rows far from 1 are normalised wrongly). Add self.eps to the mean of "
                       f"the squares of x itself: x / sqrt(mean(x^2) + eps). Scaling x first changes nothing in the "
                       f"result, so it is not needed; if you keep it, add eps / {key.replace('_', ' ')}² to the scaled "
                       f"vector's mean of squares instead.",
            output=x / (ms + eps * size.pow(2)).sqrt() * w)
    # the sum of the squares divided by another axis's length than the features' (x.shape[1] in a 3-D x is L)
    dim = x.shape[-1]
    for axis in range(x.dim() - 1):
        for index in (axis, axis - x.dim()):
            if x.shape[axis] != dim:
                out[f"count{index}"] = Mistake(
                    "norm_statistic", f"you divide the sum of the squares by x.shape[{index}] (here {x.shape[axis]}), "
                                      f"the length of axis {index}, not by the number of features dim = x.shape[-1] "
                                      f"(here {dim}): the mean of the squares is over the last axis only, per token. "
                                      f"Use x.pow(2).mean(-1, keepdim=True) (or divide the sum by x.shape[-1]).",
                    output=x / (x.pow(2).sum(-1, keepdim=True) / x.shape[axis] + eps).sqrt() * w)
    # one mean of the squares over several axes together (the tokens and the features, every axis but the batch)
    every = tuple(range(x.dim()))
    for size in range(2, x.dim()):
        for axes in itertools.combinations(every, size):
            shown = ", ".join(str(a) for a in axes)
            mistake = lambda said, axes=axes: Mistake(
                "norm_statistic", f"you take one mean of the squares over {said} together, so every vector in it "
                                  f"shares one statistic: RMSNorm normalises each token's vector on its own, so the "
                                  f"mean of the squares is over the last axis only, per token: "
                                  f"x.pow(2).mean(dim=-1, keepdim=True), whatever the number of axes.",
                output=x / _rms(x, eps, axes) * w)
            out[f"axes{axes}"] = mistake(f"axes ({shown}) (dim=({shown}))")
            negative = tuple(a - x.dim() for a in axes)
            out[f"axes{negative}"] = mistake(f"axes {negative} (dim={negative})")
            if axes == every[1:]:
                out["axes_but_batch"] = mistake("every axis but the batch (axes 1 to the last)")
    for axis in range(x.dim() - 1):
        out[f"axis{axis}"] = Mistake("norm_statistic", f"you take the mean over axis {axis}, not over the features: "
                                                       f"RMSNorm normalises each vector on its own, over the last axis "
                                                       f"(dim=-1, also for 4-D inputs such as (N, heads, L, head_dim)).",
                                     output=x / _rms(x, eps, axis) * w)
    for constant in (1e-5, 1e-6, 1e-8):
        if constant != eps:
            out[f"eps{constant}"] = Mistake("epsilon", f"you use the constant {constant:g} instead of self.eps (here "
                                                       f"{eps:g}): the module was built with its own eps.",
                                            output=x / _rms(x, constant) * w)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):   # F.rms_norm / nn.RMSNorm with eps=None
        default = torch.finfo(dtype).eps
        if default != eps:
            out[f"finfo{dtype}"] = Mistake(
                "epsilon", f"you use torch's default epsilon, torch.finfo({dtype}).eps = {default:.3g} (what "
                           f"F.rms_norm(x, shape, weight) and nn.RMSNorm take when eps is left out or None), not "
                           f"self.eps (here {eps:g}): pass eps=self.eps.", output=x / _rms(x, default) * w)
    return out


def _known_norm_mistake(runs: list[tuple[torch.Tensor, nn.Module, torch.Tensor, torch.Tensor, str]]) -> None:
    """The first mistake whose output the student's matches in every run where it is defined, if one does."""
    per_run = [_norm_mistakes(x.double(), reference.weight.detach().double(), reference.eps)
               for x, reference, _, _, _ in runs]
    first = next(i for i, (_, _, out, expected, _) in enumerate(runs) if not close(out, expected))
    for key, mistake in per_run[first].items():
        if all(key not in mistakes or close(out, mistakes[key].output)
               for (_, _, out, _, _), mistakes in zip(runs, per_run)):
            fail(mistake.code, f"{runs[first][4]}: {mistake.message}")


def _diagnose_norm(runs: list[tuple[torch.Tensor, nn.Module, torch.Tensor, torch.Tensor, str]]) -> None:
    """The first mistake whose output the student's matches in every run where it is defined, else mismatch."""
    _known_norm_mistake(runs)
    first = next(i for i, (_, _, out, expected, _) in enumerate(runs) if not close(out, expected))
    _, _, out, expected, shown = runs[first]
    if _statistic_rounded([(out, expected) for _, _, out, expected, _ in runs if not close(out, expected)]):
        fail("precision", f"{shown}: your output is the right one with each row scaled by a factor within a few "
                          f"thousandths of one (off by up to {max_diff(out, expected):.3g}): the statistic is "
                          f"rounded, mean(x^2) taken in float16 or bfloat16. Compute it in float32 (x.float()), "
                          f"then cast the result back to x's dtype.")
    fail("mismatch", f"{shown}: the output differs from x / sqrt(mean(x^2) + eps) * weight by up to "
                     f"{max_diff(out, expected):.3g} (mean over the last axis, eps = self.eps).")


def _row_factors(out: torch.Tensor, expected: torch.Tensor) -> torch.Tensor | None:
    """The factor of each row (last axis) where ``out`` is ``expected`` with each row times a factor of its own within
    1% of one; None where it is not."""
    if out.shape != expected.shape or not out.is_floating_point():
        return None
    got, want = out.detach().double(), expected.detach().double()
    largest = want.abs().argmax(-1, keepdim=True)
    factor = got.gather(-1, largest) / want.gather(-1, largest)                  # (..., 1): each row's factor
    if not bool(torch.isfinite(factor).all()) or not bool(((factor - 1).abs() < 1e-2).all()) or \
            not close(got, factor * want):
        return None
    return factor.flatten()


def _statistic_rounded(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every (output, expected) pair is off by a factor per row (``_row_factors``), some above one and some
    below: a per-row statistic rounded (a mistake of structure, a wrong eps, moves every row the same way)."""
    factors = [_row_factors(out, expected) for out, expected in pairs]
    if not factors or any(f is None for f in factors):
        return False
    every = torch.cat(factors)
    return float(every.max()) > 1 + 1e-5 and float(every.min()) < 1 - 1e-5


def _build_norm(cls: Any, dim: int, eps: float | None, generator: torch.Generator) -> tuple[nn.Module, nn.Module]:
    shown = f"RMSNorm({dim}" + ("" if eps is None else f", eps={eps:g}") + ")"
    kwargs = {} if eps is None else {"eps": eps}
    candidate = construct(cls, dim, what="RMSNorm", shown=shown, **kwargs)
    reference = ref.RMSNorm(dim, **kwargs)
    with torch.no_grad():
        reference.weight.copy_(1.0 + 0.5 * torch.randn(dim, generator=generator))
    copy_weights(reference, candidate, "your RMSNorm")
    return candidate, reference


def _norm_call(module: nn.Module, x: torch.Tensor, shown: str) -> Any:
    """The student's forward on a copy of x, under no_grad (a weight changed in place is ``mutation`` there)."""
    with torch.no_grad():
        return call_student(module, x.clone(), what=shown)


# The mutation probe's weight: signs, a zero and sizes far from one, as a trained RMSNorm's weight may hold, so a
# forward that clamps, takes the absolute value of or rescales its weight in place changes it.
_SIGNED_WEIGHT = (-1.5, -0.25, 0.0, 0.5, 1.0, 2.0, 7.5, -3.0)


def _check_weight_left_alone(cls: Any, generator: torch.Generator) -> None:
    candidate, reference = _build_norm(cls, len(_SIGNED_WEIGHT), None, generator)
    with torch.no_grad():
        for module in (candidate, reference):
            for p in module.parameters():
                if p.shape == (len(_SIGNED_WEIGHT),):
                    p.copy_(torch.tensor(_SIGNED_WEIGHT, dtype=p.dtype))
    x = _norm_input((2, 3, len(_SIGNED_WEIGHT)), "normal", generator)
    shown = f"RMSNorm({len(_SIGNED_WEIGHT)}) with the weight {list(_SIGNED_WEIGHT)} on x of shape {tuple(x.shape)}"
    _norm_call(candidate, x, shown)


def _norm_example(cls: Any, *_: Any, **__: Any) -> Any:
    return first_difference([lambda dim=dim: module_example(f"RMSNorm({dim})", lambda: cls(dim), lambda: ref.RMSNorm(dim),
                                                            dim, (1, 2)) for dim in (2, 3, 4)])


@checker("9.3", example=_norm_example)
def check_rms_norm(cls: Any) -> str:
    """``cls(dim, eps=1e-6)`` with ``weight``; forward -> x / sqrt(mean(x^2) + eps) * weight, in x's dtype."""
    expect_callable(cls, "RMSNorm", "class")
    generator = torch.Generator().manual_seed(3)
    runs = []
    for dim, eps, shape, kind in _NORM_CASES:
        candidate, reference = _build_norm(cls, dim, eps, generator)
        x = _norm_input(shape, kind, generator)
        shown = f"RMSNorm({dim}{'' if eps is None else f', eps={eps:g}'}) on x of shape {shape}"
        with torch.no_grad():
            try:
                out = expect_tensor(_norm_call(candidate, x, shown), shape, shown, dtype=x.dtype)
            except Failure as failure:
                if failure.diagnosis in ("exception", "shape") and runs and \
                        not all(close(o, e) for _, _, o, e, _ in runs):
                    _known_norm_mistake(runs)   # a wrong statistic named on the inputs it ran on, else its error
                if failure.diagnosis in ("exception", "shape") and x.dim() != 3 and runs and \
                        all(close(o, e) for _, _, o, e, _ in runs):
                    reraise_with(failure, "norm_statistic", f" Your forward works for (N, L, dim) inputs but not "
                                 f"for {x.dim()}-D ones: normalise over the last axis, dim=-1 with keepdim=True, "
                                 f"whatever the number of axes (QK-norm calls it on (N, heads, L, head_dim)).")
                if failure.diagnosis == "exception" and "must match the size of tensor" in failure.message:
                    reraise_with(failure, "exception", " Tip: keep the averaged axis, .mean(dim=-1, keepdim=True), "
                                 "so the (..., 1) root mean square broadcasts against x (..., dim).")
                raise
            expected = reference(x)
        runs.append((x, reference, out, expected, shown))
    if not all(close(out, expected) for _, _, out, expected, _ in runs):
        _diagnose_norm(runs)
    _check_weight_left_alone(cls, torch.Generator().manual_seed(11))
    x, reference, _, _, shown = runs[0]
    candidate, reference = _build_norm(cls, x.shape[-1], None, generator)
    _module_probes(candidate, reference, x, shown)
    # the text has no training mode for a norm: a statistic kept in training and used in eval (BatchNorm's) shows
    # on one layer trained on x, then judged in eval mode on another input of its shape
    other = _norm_input(tuple(x.shape), "normal", torch.Generator().manual_seed(7))

    def in_mode(training: bool, given: torch.Tensor) -> Any:
        call(candidate.train, training, what=f"{shown}: model.train({training})")
        return _norm_call(candidate, given, shown)
    called_in_turn([(f"{shown} in {mode} mode", lambda given=given, mode=mode: in_mode(mode == "training", given),
                     lambda given=given: reference(given).detach())
                    for mode, given in (("training", x), ("eval", other), ("eval", x))], thing="norm",
                   step=(candidate, reference))
    _check_magnitude(cls, torch.Generator().manual_seed(5))
    _check_half_precision(cls, generator)
    module_in_float64(lambda: _build_norm(cls, x.shape[-1], None, torch.Generator().manual_seed(3)), x, shown)
    _norm_in_bfloat16(cls)
    return ("Right in float32 and float16, for 1-D to 4-D inputs and any eps: x / sqrt(mean(x^2) + eps) * weight "
            "over the last axis.")


def _module_probes(model: nn.Module, reference: nn.Module, x: torch.Tensor, what: str,
                   cache: Callable[[], Any] | None = None) -> None:
    """One backward pass beside the reference's (every parameter must learn), then the module on meta (with
    ``cache``, its cached path too)."""
    check_module_gradients(model, reference, x, what=what)
    probe_module(model, x, what, cache)


# The magnitude probe: in one batch, rows from 1e-4 (eps = 1e-6 then outweighs the mean of the squares) to 1e15
# (squares of 1e30: finite in float32, far past float16's 65504).
_MAGNITUDE_SCALES = (1e-4, 1e-2, 1.0, 1e2, 1e4, 1e15)


def _check_magnitude(cls: Any, generator: torch.Generator) -> None:
    """Each vector is normalised by its own root mean square, whatever its scale: a statistic shared by the rows,
    eps outside the square root, a clamp or squares taken in float16 show on rows of very different scales."""
    candidate, reference = _build_norm(cls, 16, None, generator)
    scales = torch.tensor(_MAGNITUDE_SCALES)
    x = _norm_input((2, len(scales), 16), "normal", generator) * scales[:, None]   # (2, 6, 16): row t at scale t
    shown = (f"RMSNorm(16) on x of shape {tuple(x.shape)} whose rows range from {min(_MAGNITUDE_SCALES):g} to "
             f"{max(_MAGNITUDE_SCALES):g}")
    with torch.no_grad():
        out = expect_tensor(_norm_call(candidate, x, shown), tuple(x.shape), shown, dtype=x.dtype, finite=False)
        expected = reference(x)
    if close(out, expected):
        return
    mistakes = _norm_mistakes(x.double(), reference.weight.detach().double(), reference.eps)
    first_mistake(mistakes.values(), lambda m: close(out, m.output), f"{shown}: ")
    advice = ("Normalise each vector by its own root mean square, over the last axis only, with eps inside the "
              "square root (x / sqrt(mean(x^2) + eps)), in x's dtype (float32 at least): no clamp, no float16 step.")
    if not bool(torch.isfinite(out).all()):
        fail("overflow", f"{shown}: your output holds NaN or inf where the reference's is finite, although it is "
                         f"right on ordinary inputs: a square or a sum overflows. {advice}")
    fail("magnitude", f"{shown}: your output differs from the reference's by up to {max_diff(out, expected):.3g}, "
                      f"although it is right on ordinary inputs. {advice}")


def _norm_in_bfloat16(cls: Any) -> None:
    """The bfloat16 probe (the text asks for x's dtype back): a bfloat16 layer on bfloat16 x must return bfloat16, a
    result cast with .half() or .float() shows; its values are not judged (float32, float16 and float64 did)."""
    candidate, _ = _build_norm(cls, 16, None, torch.Generator().manual_seed(19))
    candidate = candidate.to(torch.bfloat16)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(19)).to(torch.bfloat16)
    shown = "RMSNorm(16) in bfloat16 (model.to(torch.bfloat16)) on bfloat16 x of shape (2, 4, 16)"
    made = ("Your result is cast to a dtype of its own (.half() for any two-byte input, .float()), or made from a "
            "float32 tensor: cast it back with .to(x.dtype) or .type_as(x).")
    out = called_in_bfloat16(lambda: _norm_call(candidate, x, shown), shown, made)
    if out is not None:
        expect_dtype_in_bfloat16(expect_tensor(out, _shape(x), shown, finite=False), shown, made)


def _check_half_precision(cls: Any, generator: torch.Generator) -> None:
    """A float16 model: the squares of activations of a few hundred overflow float16 (max 65504)."""
    candidate, reference = _build_norm(cls, 16, None, generator)
    candidate, reference = candidate.half(), reference.half()
    x = (torch.randn(2, 4, 16, generator=generator) * 300).half()
    shown = "RMSNorm(16) in float16 (model.half()) on x of shape (2, 4, 16) with values of a few hundred"
    with torch.no_grad():
        out = call_student(candidate, x.clone(), what=shown)
        if isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == torch.float32:
            fail("dtype", f"{shown} returned float32: computing in float32 is right, but cast the result back to "
                          f"x's dtype (.to(x.dtype) or .type_as(x)) so the rest of the model stays in float16.")
        expect_tensor(out, _shape(x), shown, dtype=torch.float16, finite=False)
        expected = reference(x)
    if not close(out, expected):
        fail("precision", f"{shown}: your output is wrong in float16 (it is right in float32). x**2 overflows "
                          f"float16 (largest value 65504) for x of a few hundred: compute in float32 "
                          f"(x.float()), then cast the result back with .to(x.dtype).")
    # the same float16 layer called in turn, then after a weight step: what a half-precision path keeps shows
    other = (torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(17)) * 300).half()

    def half_call(given: torch.Tensor) -> Any:
        return _norm_call(candidate, given, shown)
    called_in_turn([(shown, lambda: half_call(x), lambda: reference(x).detach()),
                    ("the same float16 RMSNorm(16) on another x of shape (2, 4, 16)", lambda: half_call(other),
                     lambda: reference(other).detach())], thing="norm", step=(candidate, reference))
    probed = [(candidate, x, shown)]
    # the weight in one dtype, x in another (a float32 residual stream into a float16 layer; float16 activations
    # into a float32 layer, as under mixed precision): the result follows x, not the weight (Hugging Face's
    # `self.weight * h.to(x.dtype)` follows whichever is wider)
    for weight, given in ((torch.float16, torch.float32), (torch.float32, torch.float16)):
        layer = _build_norm(cls, 16, None, generator)[0].to(weight)
        pristine = copy_of(layer)
        shown = f"RMSNorm(16) with a {str(weight)[6:]} weight on {str(given)[6:]} x of shape (2, 4, 16)"
        with torch.no_grad():
            out = call_student(layer, (x.float() / 300).to(given), what=shown)
        if isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype != given:
            fail("dtype", f"{shown} returned {str(out.dtype)[6:]}: the text asks for x's dtype back, whatever the "
                          f"weight's. Cast the result with .to(x.dtype) (or .type_as(x)), after the multiplication "
                          f"by the weight.")
        # and in turn, beside a new copy of the same layer (its roundings are the ones to match here)
        def run(module: nn.Module, given: torch.Tensor, what: str) -> Any:
            with torch.no_grad():
                return call_student(module, given.clone(), what=what)
        in_turn_beside_a_new_copy(layer, pristine, [(shown, (x.float() / 300).to(given)),
                                                    (shown.replace(" on ", " on another ", 1),
                                                     (other.float() / 300).to(given))], run, thing="norm")
        probed.append((layer, (x.float() / 300).to(given), shown))
    # last, each layer moved to another device after those calls: a weight it cast or copied once for float16 (on
    # itself, in a global or an lru_cache) stays behind on the CPU
    for probed_layer, probed_x, probed_what in probed:
        probe_module(probed_layer, probed_x, probed_what)


# ============================================================================ 9.4 SwiGLU

# (embed_dim, hidden_dim): two sizes, so that widths written into the code show; the first is the one the probes use
_SWIGLU_SIZES = ((16, 40), (8, 24))
_SWIGLU_SHAPES = ((2, 5), (1, 1), (3, 4))   # (N, L) of x (N, L, E), as asked


# the activations students put on the gate branch instead of SiLU, in their words
_OTHER_ACTIVATIONS = (("GELU", F.gelu), ("GELU (tanh approximation)", lambda z: F.gelu(z, approximate="tanh")),
                      ("ReLU", F.relu), ("Hardswish", F.hardswish), ("Mish", F.mish), ("tanh", torch.tanh),
                      ("softplus", F.softplus), ("ELU", F.elu), ("SELU", F.selu), ("leaky ReLU", F.leaky_relu),
                      ("ReLU²", lambda z: F.relu(z) ** 2), ("Swish with beta = 2", lambda z: z * torch.sigmoid(2 * z)),
                      ("quick GELU, z * sigmoid(1.702 z)", lambda z: z * torch.sigmoid(1.702 * z)))


def _swiglu_mistakes() -> list[Mistake]:
    """What each slip outputs, as f(x, gate, up, down) with the reference's Linear layers."""
    silu, sigmoid = F.silu, torch.sigmoid
    return [
        Mistake("gating", "SiLU is on the wrong branch: it goes on self.gate(x), and self.up(x) stays linear: "
                          "down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: d(g(x) * silu(u(x)))),
        Mistake("gating", "there is no SiLU: the gate branch goes through SiLU before the product, "
                          "down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: d(g(x) * u(x))),
        Mistake("gating", "the gate is missing: SiLU of self.up(x) alone is an ordinary MLP. SwiGLU multiplies "
                          "silu(gate(x)) by up(x), element by element.", output=lambda x, g, u, d: d(silu(u(x)))),
        Mistake("gating", "the up branch is missing: SwiGLU multiplies silu(gate(x)) by up(x), element by "
                          "element, before down.", output=lambda x, g, u, d: d(silu(g(x)))),
        Mistake("gating", "you use the sigmoid as the activation; SiLU is x * sigmoid(x) (F.silu): "
                          "down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: d(sigmoid(g(x)) * u(x))),
        Mistake("gating", "you gate gate(x) with a sigmoid of up(x), as F.glu does with its two halves (the first "
                          "times the sigmoid of the second): that is GLU, not SwiGLU. SwiGLU puts SiLU on the gate "
                          "branch itself and multiplies by the linear up branch: down(silu(gate(x)) * up(x)).",
                output=lambda x, g, u, d: d(g(x) * sigmoid(u(x)))),
        *(Mistake("gating", f"you use {name}; SwiGLU's activation is SiLU (F.silu), on the gate branch.",
                  output=lambda x, g, u, d, act=act: d(act(g(x)) * u(x)))
          for name, act in _OTHER_ACTIVATIONS),
        Mistake("gating", "SiLU is applied to x before the projections; it goes on the gate branch's output: "
                          "down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: d(g(silu(x)) * u(x))),
        Mistake("gating", "SiLU is applied to x before the projections; it goes on the gate branch's output, "
                          "and up(x) stays linear: down(silu(gate(x)) * up(x)).",
                output=lambda x, g, u, d: d(g(silu(x)) * u(silu(x)))),
        Mistake("gating", "SiLU comes after the product; it goes on the gate branch alone: "
                          "down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: d(silu(g(x) * u(x)))),
        Mistake("gating", "SiLU is on both branches; only the gate branch goes through it.",
                output=lambda x, g, u, d: d(silu(g(x)) * silu(u(x)))),
        Mistake("gating", "you add the two branches; the gate multiplies: silu(gate(x)) * up(x).",
                output=lambda x, g, u, d: d(silu(g(x)) + u(x))),
        Mistake("gating", "your gate is sigmoid(g)², not g * sigmoid(g): an in-place sigmoid (g.sigmoid_()) "
                          "overwrote g before it was multiplied. Use F.silu(g), or an out-of-place sigmoid.",
                output=lambda x, g, u, d: d(sigmoid(g(x)) ** 2 * u(x))),
        Mistake("gating", "you project each branch down and multiply the results; multiply first, then project "
                          "once: down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: d(silu(g(x))) * d(u(x))),
        Mistake("gating", "SiLU comes after self.down; it goes on the gate branch, before the product: "
                          "down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: silu(d(g(x) * u(x)))),
        Mistake("gating", "you apply SiLU again after self.down; SwiGLU ends with the linear down projection: "
                          "down(silu(gate(x)) * up(x)).", output=lambda x, g, u, d: silu(d(silu(g(x)) * u(x)))),
        Mistake("residual", "you add x to the output. The residual connection belongs to the block around the "
                            "MLP (x = x + mlp(norm(x))), not inside SwiGLU.",
                output=lambda x, g, u, d: x + d(silu(g(x)) * u(x))),
    ]


def _build_swiglu(cls: Any, generator: torch.Generator, embed: int, hidden: int) -> tuple[nn.Module, nn.Module]:
    """(the student's SwiGLU, the reference) with the same random weights."""
    shown = f"SwiGLU({embed}, {hidden})"
    candidate = construct(cls, embed, hidden, what="SwiGLU", shown=shown)
    reference = ref.SwiGLU(embed, hidden)
    with torch.no_grad():
        for p in reference.parameters():   # weights large enough that SiLU is far from linear
            p.copy_(torch.randn(p.shape, generator=generator) * 1.5 / p.shape[1] ** 0.5)
    copy_weights(reference, candidate, "your SwiGLU")
    return candidate, reference


def _swiglu_dropout(candidate: nn.Module, x: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """A wrong output that is drawn anew at each call, or right once the module is in eval mode: dropout, which
    SwiGLU does not have (the layer is built in training mode, as nn.Module is)."""
    if random_or_kept(lambda: call_student(candidate, x.clone(), what=what), close) == "random":
        fail("dropout", f"{what}: your output changes from call to call on the same x, with torch's random state: "
                        f"something random, such as dropout, runs in forward. SwiGLU has no dropout: "
                        f"down(silu(gate(x)) * up(x)), in training mode as in eval mode.")
    call(candidate.eval, what=f"{what}: model.eval()")
    right_in_eval = close(call_student(candidate, x.clone(), what=f"{what} in eval mode"), expected)
    call(candidate.train, what=f"{what}: model.train()")
    if right_in_eval:
        fail("dropout", f"{what}: your output is right in eval mode but not in training mode: forward does "
                        f"something only while self.training is True (dropout?). SwiGLU has no dropout: "
                        f"down(silu(gate(x)) * up(x)) in both modes.")


@checker("9.4", example=lambda cls, *_, **__: module_example("SwiGLU(2, 3)", lambda: cls(2, 3),
                                                            lambda: ref.SwiGLU(2, 3), 2))
def check_swiglu(cls: Any) -> str:
    """``cls(embed_dim, hidden_dim)`` with gate, up, down; forward -> down(silu(gate(x)) * up(x))."""
    expect_callable(cls, "SwiGLU", "class")
    for embed, hidden in _SWIGLU_SIZES:
        generator = torch.Generator().manual_seed(4)
        shown = f"SwiGLU({embed}, {hidden})"
        candidate, reference = _build_swiglu(cls, generator, embed, hidden)
        layers = (reference.gate, reference.up, reference.down)   # the mistakes' outputs are f(x, *layers)
        for shape in [(*rows, embed) for rows in _SWIGLU_SHAPES]:
            x = torch.randn(shape, generator=generator)
            what = f"{shown} on x of shape {shape}"
            with torch.no_grad():
                out = call_student(candidate, x.clone(), what=what)
                if isinstance(out, torch.Tensor) and _shape(out) == (*shape[:-1], hidden):
                    fail("shape", f"{what} returned shape {_shape(out)}: the hidden width. Finish with self.down, "
                                  f"which maps hidden_dim back to embed_dim.")
                expect_tensor(out, shape, what, dtype=x.dtype)
                expected = reference(x)
                if not close(out, expected):
                    first_mistake(_swiglu_mistakes(),
                                  lambda m, out=out, x=x, layers=layers: close(out, m.output(x, *layers)), f"{what}: ")
                    _swiglu_dropout(candidate, x, expected, what)
                    fail("mismatch", f"{what}: the output differs from down(silu(gate(x)) * up(x)) by up to "
                                     f"{max_diff(out, expected):.3g}.")
    (embed, hidden), generator = _SWIGLU_SIZES[0], torch.Generator().manual_seed(4)
    candidate, reference = _build_swiglu(cls, generator, embed, hidden)
    x = torch.randn((*_SWIGLU_SHAPES[0], embed), generator=generator)
    what = f"SwiGLU({embed}, {hidden}) on x of shape {tuple(x.shape)}"
    _module_probes(candidate, reference, x, what)
    module_in_float64(lambda: _build_swiglu(cls, torch.Generator().manual_seed(4), embed, hidden), x, what)
    return "down(silu(gate(x)) * up(x)) for every batch, length and width: the gate branch through SiLU scales the up branch."


# ============================================================================ 9.5 repeat_kv

def _numbered(shape: tuple[int, ...], contiguous: bool) -> torch.Tensor:
    """0, 1, 2, ... plus a third, so every entry has one place and none survives a rounding (whole numbers this
    small survive float16); non-contiguous like split_heads' output when asked."""
    n, heads, length, head_dim = shape
    x = torch.arange(float(n * heads * length * head_dim)).reshape(n, length, heads, head_dim).transpose(1, 2)
    x = x + 1 / 3
    return x.contiguous() if contiguous else x                                  # (N, kv_heads, L, head_dim)


def _repeat_case(shape: tuple[int, ...], groups: int, contiguous: bool = True) -> Case:
    return Case((_numbered(shape, contiguous), groups), f"repeat_kv(x, {groups}) with x of shape {shape}")


def _repeat_axes(case: Case, out: Any) -> None:
    """A repeat along another axis, or the group axis left apart, named before the shape check."""
    x, groups = case.args
    n, kv, length, head_dim = x.shape
    expected = (n, kv * groups, length, head_dim)
    if not isinstance(out, torch.Tensor) or _shape(out) == expected or groups == 1:
        return
    wrong = {(n, kv, length * groups, head_dim): "along the sequence axis (dim 2)",
             (n, kv, length, head_dim * groups): "along the features (the last axis)",
             (n * groups, kv, length, head_dim): "along the batch (dim 0)"}.get(_shape(out))
    if wrong:
        fail("shape", f"{case.what} returned shape {_shape(out)}, expected {expected}: you repeat {wrong}. "
                      f"Repeat the key/value heads, dim 1.")
    if _shape(out) in ((n, kv, groups, length, head_dim), (n, groups, kv, length, head_dim)):
        fail("shape", f"{case.what} returned shape {_shape(out)}, expected {expected}: the head and group "
                      f"axes are still apart. Flatten them into one axis of kv_heads * groups heads "
                      f"(.reshape, which copies the expanded view).")


def _heads_copied(out: torch.Tensor, x: torch.Tensor) -> list[int] | None:
    """Which of x's heads each output head is an exact copy of (the first that fits), or None where one is not."""
    if out.dim() != 4 or out.shape[0] != x.shape[0] or out.shape[2:] != x.shape[2:]:
        return None
    found = []
    for h in range(out.shape[1]):
        source = next((k for k in range(x.shape[1]) if torch.equal(out[:, h].to(x.dtype), x[:, k])), None)
        if source is None:
            return None
        found.append(source)
    return found


def _misplaced(runs: list[Run], fn: Any) -> None:
    run = runs[0]
    x, groups = run.case.args
    _sequences_alone(run, fn, REPEAT_KV.reference)
    found = _heads_copied(run.out, x) if isinstance(run.out, torch.Tensor) else None
    if found is not None:
        right = [h // groups for h in range(x.shape[1] * groups)]
        fail("kv_grouping", f"{run.case.what}: your output heads are copies of x's heads, but in the wrong order: "
                            f"{found}, where head h should be x[:, h // groups], {right}. Each key/value head "
                            f"serves `groups` neighbouring query heads: repeat each one `groups` times in a row "
                            f"(repeat_interleave(groups, dim=1), or expand on a new axis after the heads), with no "
                            f"index arithmetic of your own.")
    if torch.equal(run.out.flatten().sort().values, run.expected.flatten().sort().values):
        fail("kv_grouping", f"{run.case.what}: the right numbers in the wrong places. Output head h must be "
                            f"key/value head h // groups, each head repeated `groups` times in a row.")
    how = rounding_of(run.out, run.expected)
    if how:
        fail("precision", f"{run.case.what}: your output holds x's numbers rounded (x holds 0.333..., 1.333..., "
                          f"...): something on the way {how}. Only copy x's heads, in its dtype.")


REPEAT_KV = FunctionExercise(
    "9.5", "repeat_kv", lambda x, groups: ref.repeat_kv(x, groups),
    # v comes from a transpose, so not contiguous; kv_heads 1 is multi-query, groups 1 multi-head attention
    lambda: [_repeat_case((2, 2, 3, 4), 3), _repeat_case((1, 4, 5, 2), 2, False),
             _repeat_case((2, 1, 3, 4), 4, False), _repeat_case((2, 3, 2, 4), 1),
             _repeat_case((1, 2, 1, 8), 2, False)],
    ("x", "groups"),
    success="Each key/value head repeated for its group of neighbouring query heads, for GQA, MQA (one kv head) "
            "and MHA (groups = 1).",
    mismatch=lambda run: (f"{run.case.what}: your output holds numbers that are not copies of x's heads. Output "
                          f"head h is a copy of x[:, h // groups]."),
    mistakes=(Mistake("kv_grouping", "the heads come out tiled, [0, 1, 0, 1, ...] (x.repeat, or expand on a new "
                                     "axis in front of the heads): query head h would read key/value head h % "
                                     "kv_heads. Each key/value head serves `groups` NEIGHBOURING query heads, so "
                                     "repeat each one `groups` times in a row, [0, 0, 1, 1, ...]: "
                                     "repeat_interleave(groups, dim=1), or expand on a new axis after the heads.",
                      output=lambda x, groups: x.repeat(1, groups, 1, 1)),
               Mistake("kv_grouping", "your new axis sits after the POSITIONS, x[:, :, :, None, :] (Meta's "
                                      "repeat_kv, written for (N, L, kv_heads, head_dim)), so the reshape to (N, "
                                      "kv_heads * groups, L, head_dim) mixes positions into heads: output head h holds "
                                      "one position of x's head h // groups, repeated. Here the heads are axis 1: "
                                      "expand a new axis right after them, x[:, :, None].expand(N, kv_heads, groups, "
                                      "L, head_dim), then reshape, or repeat_interleave(groups, dim=1).",
                       output=lambda x, groups: x[:, :, :, None, :].expand(*x.shape[:3], groups, x.shape[3])
                       .reshape(x.shape[0], x.shape[1] * groups, x.shape[2], x.shape[3]))),
    exact=True, each_case=True, finite=True, numpy_ok=True, raw=_repeat_axes, diagnose=_misplaced,
    gradients=lambda: [Case((torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(95)), 2),
                            "repeat_kv(x, 2) with x of shape (2, 2, 3, 4)")],
    examples=lambda: [Case((torch.arange(float(kv * length)).reshape(1, kv, length, 1), groups),
                           f"repeat_kv(x, {groups})") for kv, groups, length in ((1, 2, 1), (2, 2, 1), (2, 2, 2),
                                                                                  (2, 3, 1))],
    probes=FunctionExercise.probes + ("device", "bfloat16"),   # the text asks for x's device and dtype
)


@checker("9.5", example=function_example(REPEAT_KV))
def check_repeat_kv(fn: Callable[..., Any]) -> str:
    """``fn(x (N, kv_heads, L, head_dim), groups)`` -> (N, kv_heads * groups, L, head_dim), interleaved order."""
    return judge(REPEAT_KV, fn)


# ============================================================================ 9.6 GroupedQueryAttention
#
# The class is built with the notebook's constructor for multi-head (num_kv_heads = num_heads), grouped-query
# and multi-query attention, plus QK-norm and a sliding window when its constructor takes them; the
# reference's weights are copied in by name. A wrong output is named by the mistake in ``_gqa_variants``
# it matches. The forward uses the notebook's own apply_rotary and repeat_kv: when one of them fails its
# own exercise's check, the message says so.

EMBED_DIM, NUM_HEADS, MAX_TOKENS = 32, 4, 10
HEAD_DIM = EMBED_DIM // NUM_HEADS
# (num_kv_heads, rope_theta, constructor extras): multi-head first, so a module that only fails with
# fewer key/value heads is told so; then grouped-query and multi-query attention.
CONFIGS: tuple[tuple[int, float, dict[str, Any]], ...] = (
    (NUM_HEADS, 500.0, {}),
    (2, 10000.0, {}),
    (1, 10000.0, {}),
)
OPTIONAL = (
    (2, 10000.0, {"qk_norm": True}),
    (2, 10000.0, {"sliding_window": 3}),
    (2, 10000.0, {"dropout_rate": 0.5}),   # judged in eval mode, where dropout is off
    (2, 10000.0, {"head_dim": 12}),        # heads wider than embed_dim // num_heads: the scale is 1/sqrt(head_dim)
)
# (batch, length) of the full passes: the full length first, so a failure at a shorter one is told apart
CASES = ((2, MAX_TOKENS), (3, 5), (1, 1))
# the cached run: a prompt of 3, three tokens one at a time, then two at once; it stops short of
# max_tokens, so an offset that runs ahead still finds rows in the tables and its outputs can be named
PLAN = ((0, 3), (3, 1), (4, 1), (5, 1), (6, 2))
PLAN_TOKENS = sum(length for _, length in PLAN)


class RecordingCache(KVCache):
    """A KVCache that keeps a copy of what was appended, to read back what the student's module caches."""

    def __init__(self, max_tokens: int):
        super().__init__(max_tokens)
        self.appended: list[tuple[Any, Any]] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        copy = (lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t)
        self.appended.append((copy(k), copy(v)))
        return super().append(k, v)


@dataclass
class Built:
    kv_heads: int
    extra: dict[str, Any]
    model: nn.Module
    reference: nn.Module
    setup: Setup
    runs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)   # (x, out, expected)

    @property
    def label(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.extra.items())
        return f"num_kv_heads={self.kv_heads}{extra}"


def _randomize(reference: nn.Module, generator: torch.Generator) -> None:
    # queries and keys a bit larger than the default: the softmax is neither flat nor one-hot
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.4 * torch.randn(p.shape, generator=generator))
            else:
                gain = 1.5 if name.split(".")[0] in ("query", "key") else 1.0
                p.copy_(torch.randn(p.shape, generator=generator) * gain / math.sqrt(p.shape[1]))


def _check_tables(model: nn.Module, reference: nn.Module, theta: float, shown: str) -> None:
    """The constructor builds self.rope_cos / self.rope_sin, with the notebook's rope_tables (exercise 9.1)."""
    cos, sin = getattr(model, "rope_cos", None), getattr(model, "rope_sin", None)
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return
    if cos.shape == reference.rope_cos.shape and close(cos, reference.rope_cos) and close(sin, reference.rope_sin):
        return
    try:
        if cos.shape != reference.rope_cos.shape or sin.shape != cos.shape:
            fail("shape", f"they have shapes {shape_str(cos.shape)} and {shape_str(sin.shape)}, expected "
                          f"{shape_str(reference.rope_cos.shape)} (max_tokens, head_dim).")
        head_dim = reference.rope_cos.shape[-1]
        max_tokens = reference.rope_cos.shape[0]
        _diagnose_tables(cos, sin, head_dim, max_tokens, theta, f"rope_tables({head_dim}, {max_tokens}, "
                                                                f"theta={theta:g})", False)
    except Failure as failure:
        raise Failure(failure.diagnosis, f"The RoPE tables your constructor builds for {shown} (self.rope_cos, "
                                         f"self.rope_sin, from your rope_tables of exercise 9.1) are wrong: "
                                         f"{failure.message} Fix rope_tables first "
                                         f"(checks.check_rope_tables(rope_tables)).") from None


def _build(cls: Any, kv_heads: int, theta: float, extra: dict[str, Any], generator: torch.Generator,
           embed_dim: int = EMBED_DIM, num_heads: int = NUM_HEADS, max_tokens: int = MAX_TOKENS) -> Built:
    more = "".join(f", {k}={v!r}" for k, v in extra.items())
    shown = f"GroupedQueryAttention({embed_dim}, {num_heads}, {kv_heads}, {max_tokens}, {theta:g}{more})"
    reference = ref.GroupedQueryAttention(embed_dim, num_heads, kv_heads, max_tokens, theta, **extra)
    _randomize(reference, generator)
    model = construct(cls, embed_dim, num_heads, kv_heads, max_tokens, theta, what="GroupedQueryAttention",
                      shown=shown, **extra)
    copy_weights(reference, model, "your GroupedQueryAttention")
    call(model.eval, what="GroupedQueryAttention.eval()")
    _check_tables(model, reference, theta, shown)
    cos, sin = variants.tables(extra.get("head_dim") or embed_dim // num_heads, max_tokens, theta)
    params = {name: p.detach().double() for name, p in reference.named_parameters()}
    setup = Setup(embed_dim, num_heads, kv_heads, max_tokens, params, cos, sin,
                  qk_norm=bool(extra.get("qk_norm")), window=extra.get("sliding_window"),
                  eps=reference.q_norm.eps if reference.q_norm is not None else 1e-6)
    return Built(kv_heads, extra, model, reference.eval(), setup)


def _raised_frames(failure: BaseException) -> list[types.FrameType]:
    """The frames the student's error came up through, outermost first (none when it is no error of theirs)."""
    exc: BaseException | None = failure
    while exc is not None and isinstance(exc, Failure):
        exc = exc.__context__
    tb = exc.__traceback__ if exc is not None else None
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _rope_frame(failure: BaseException) -> dict[str, Any] | None:
    """The locals of apply_rotary (or rotate_half) where the student's code raised, if it raised there."""
    found = None
    for frame in _raised_frames(failure):
        code = frame.f_code
        if code.co_name in ("apply_rotary", "rotate_half") and code.co_argcount:
            # the tensor it turns is its first argument, whatever the student named it
            found = dict(frame.f_locals, x=frame.f_locals.get(code.co_varnames[0]))
    return found


def _explain_repeat_count(failure: Failure, built: Built) -> None:
    """When the student's code raised where queries of num_heads heads meet keys or values of another multiple of
    num_kv_heads heads: the key/value heads were repeated by another count than the group size."""
    if failure.diagnosis != "exception":
        return
    setup = built.setup
    heads, kv, head_dim = setup.num_heads, built.kv_heads, setup.head_dim
    for frame in reversed(_raised_frames(failure)):   # the innermost frame that holds them
        counts = {t.shape[1] for t in frame.f_locals.values()
                  if isinstance(t, torch.Tensor) and t.dim() == 4 and head_dim in t.shape[-2:]}
        wrong = sorted(h for h in counts if h not in (heads, kv) and h % kv == 0)
        if heads not in counts or not wrong:
            continue
        times = wrong[0] // kv
        named = " = ".join(name for name, count in (("num_kv_heads", kv), ("num_heads", heads)) if count == times)
        reraise_with(failure, "kv_grouping", f" Your keys or values have {wrong[0]} heads where the queries have "
                     f"{heads}: each of the num_kv_heads={kv} key/value heads is repeated {times} times"
                     f"{f' (= {named})' if named else ''}, but it serves a group of groups = num_heads // "
                     f"num_kv_heads = {heads // kv} query head(s). Repeat each by the group size: repeat_kv(k, "
                     f"self.num_heads // self.num_kv_heads), and v the same.")


def _forward(built: Built, x: torch.Tensor, what: str, *, start: int | None = None, **kwargs: Any) -> torch.Tensor:
    """The student's module on x (``start``: the tokens already in the cache passed in kwargs)."""
    with torch.no_grad():
        try:
            out = call_student(built.model, x.clone(), what=what, **kwargs)
        except Failure as failure:
            _explain_rope_error(failure, built, x.shape[1], start)
            _explain_repeat_count(failure, built)
            raise
    return expect_tensor(out, tuple(x.shape), what, dtype=x.dtype, finite=False)   # (N, L, E) as x


def _explain_rope_error(failure: Failure, built: Built, length: int, start: int | None) -> None:
    """When the student's code raised inside apply_rotary, say what it was given that it cannot take."""
    names = _rope_frame(failure) if failure.diagnosis == "exception" else None
    turned, offset = (names.get("x"), names.get("offset")) if names else (None, None)
    if not isinstance(turned, torch.Tensor):
        return
    heads, head_dim = built.setup.num_heads, built.setup.head_dim
    if turned.dim() == 4 and turned.shape[-1] != head_dim and turned.shape[-2] == length:
        features = turned.shape[1] * turned.shape[-1]
        which = {heads * head_dim: "queries", built.kv_heads * head_dim: "keys or values"}.get(features)
        if which is not None:
            right = heads if which == "queries" else built.kv_heads
            code = "kv_grouping" if which != "queries" else "head_split"
            reraise_with(failure, code, f" apply_rotary was given {which} split into {turned.shape[1]} heads of "
                         f"{turned.shape[-1]} features, shape {shape_str(turned.shape)}: the {which} have "
                         f"{features} features, {right} heads of head_dim={head_dim} "
                         f"({'self.num_heads' if which == 'queries' else 'self.num_kv_heads'} heads). Split them "
                         f"into that many heads; head_dim (self.head_dim) is the same for all three.")
    if turned.dim() != 4 or turned.shape[-1] != head_dim:
        reraise_with(failure, "rope_axes", f" apply_rotary was given a tensor of shape {shape_str(turned.shape)}: "
                     f"it takes queries or keys split into heads, (N, heads, L, head_dim) with head_dim={head_dim}. "
                     f"Rotate after the head split and the transpose, not the (N, L, features) projections.")
    if start is None or not isinstance(offset, int):
        return
    if turned.shape[-2] > length:
        reraise_with(failure, "kv_cache", f" apply_rotary was given {turned.shape[-2]} positions from offset "
                     f"{offset} although only {length} token(s) are new: you rotate the keys after appending "
                     f"them to the cache, so the cached keys are turned again, to the wrong positions (and past "
                     f"the tables). Rotate the new keys first (offset=cache.length), then append them rotated.")
    if offset != start:
        reraise_with(failure, "rope_positions", f" apply_rotary was given offset={offset} for {length} new "
                     f"token(s) after {start} cached ones: the offset is the number of tokens already cached, "
                     f"cache.length read BEFORE cache.append(...).")


def _full_passes(built: Built, generator: torch.Generator, mha_right: bool) -> None:
    for n, length in CASES:
        x = torch.randn(n, length, EMBED_DIM, generator=generator)
        what = f"GroupedQueryAttention({built.label}).forward(x) with x of shape {(n, length, EMBED_DIM)}"
        try:
            out = _forward(built, x, what)
        except Failure as failure:
            if failure.diagnosis in ("exception", "shape") and built.kv_heads < NUM_HEADS and mha_right:
                reraise_with(failure, "kv_grouping", f" Your module works with num_kv_heads = num_heads but not "
                             f"with num_kv_heads={built.kv_heads} < num_heads={NUM_HEADS}: split k and v into "
                             f"num_kv_heads heads (self.num_kv_heads) and repeat each for its group of query "
                             f"heads (repeat_kv) before the scores.")
            full = built.runs[0] if built.runs else None
            kept = [name for name, value in vars(built.model).items() if isinstance(value, KVCache)]
            if full is not None and failure.diagnosis in ("exception", "shape") and kept:
                reraise_with(failure, "kept_state", f" Your module keeps a KV cache of its own, self.{kept[0]}, from "
                             f"one call to the next, so the tokens of the earlier calls are still in it. Use the "
                             f"cache the caller passes (cache=...), and attend to x alone when none is passed.")
            if full is not None and failure.diagnosis in ("exception", "shape") and close(full[1], full[2]):
                reraise_with(failure, "causal_mask", f" Your module works for {MAX_TOKENS} tokens but not for "
                             f"{length}: cut the causal mask to the current length.")
            raise
        with torch.no_grad():
            built.runs.append((x, out, built.reference(x)))
        # a wrong output drawn anew at each call with torch's random state (not one kept from an earlier call)
        if not close(out, built.runs[-1][2]) and \
                random_or_kept(lambda x=x, what=what: _forward(built, x, what), close) == "random":
            fail("dropout", f"{what}: in eval mode (model.eval()) your layer gives other outputs for the same x at "
                            f"each call: " + (
                                "dropout still runs. F.scaled_dot_product_attention's dropout_p and F.dropout do "
                                "not follow the module's mode: pass dropout_p=self.dropout_rate if self.training "
                                "else 0.0 (or training=self.training)." if built.extra.get("dropout_rate") else
                                "something random runs in forward (F.dropout, whose training= defaults to True, "
                                "or dropout_p= of F.scaled_dot_product_attention, torch.rand). This layer has no "
                                "dropout: remove it."))


def _diagnose_full(built_all: list[Built], generator: torch.Generator) -> None:
    """Some full pass differs from the reference: raise the most specific Failure we can. The probes'
    answers are read from the student's module first (an exception there is reported at once: the
    full passes before already used these batch sizes and this length); then every judgement runs in turn."""
    built = built_all[0]
    x = torch.randn(3, MAX_TOKENS, EMBED_DIM, generator=generator)
    batch_what = f"GroupedQueryAttention({built.label}) on x of shape {shape_str(x.shape)}"
    together = _forward(built, x, batch_what)                                    # (3, L, E)
    alone = [_forward(built, x[i:i + 1], batch_what.replace("(3,", "(1,")) for i in range(3)]   # 3 x (1, L, E)
    x = torch.randn(2, MAX_TOKENS, EMBED_DIM, generator=generator)
    future_what = f"GroupedQueryAttention({built.label}) on x of shape {shape_str(x.shape)}"
    changed = x.clone()
    changed[:, MAX_TOKENS // 2:] += torch.randn(2, MAX_TOKENS - MAX_TOKENS // 2, EMBED_DIM, generator=generator)
    before, after = _forward(built, x, future_what), _forward(built, changed, future_what)   # (2, L, E)

    runs = [(b, x, out) for b in built_all for x, out, _ in b.runs]
    qk = any(b.setup.qk_norm for b in built_all)
    window = any(b.setup.window for b in built_all)
    hypotheses = [m for m in FULL_PASS if (qk or "qk_norm" not in m.spec) and (window or "window" not in m.spec)]
    found = first_match(hypotheses, [out for _, _, out in runs],
                        lambda i, spec: simulate(runs[i][0].setup, runs[i][1], [(0, runs[i][1].shape[1])], spec))
    if found is not None:
        fail(found.code, found.message)
    for b, x, out in runs:
        expect_finite(out, f"GroupedQueryAttention({b.label}) on x of shape {shape_str(x.shape)}")
    # Rows never mix (before the future: a reshape that mixes rows also "leaks" positions).
    batch_mixing(batch_what, together, alone, "your reshapes mix the sequences. Keep the batch axis first and take "
                                              "N and L from x.shape.")
    # The future never leaks: changing the second half leaves the first half's outputs as they were.
    if not close(after[:, :MAX_TOKENS // 2], before[:, :MAX_TOKENS // 2]):
        fail("causal_mask", f"{future_what}: the future leaks: changing the tokens after position "
                            f"{MAX_TOKENS // 2 - 1} changes the outputs before. Each query may see only keys at its "
                            f"position or earlier. Check the mask, and whatever else mixes positions: a softmax "
                            f"over the queries instead of the keys (the last axis), or heads split or merged by a "
                            f"reshape without the transpose.")
    found = fitted_scale(_SCALE, [((b, x), f"GroupedQueryAttention({b.label}) on x of shape {shape_str(x.shape)}",
                                   out) for b, x, out in runs])
    if found is not None:
        fail("scale", found)
    b, x, out, expected = next((b, x, out, e) for b in built_all for x, out, e in b.runs if not close(out, e))
    fail("mismatch", f"GroupedQueryAttention({b.label}) on x of shape {shape_str(x.shape)} differs from the "
                     f"reference by up to {max_diff(out, expected):.3g}, and {UNEXPLAINED}. The steps: "
                     f"project, split into heads (num_heads for q, num_kv_heads for k and v), rotate q and k, "
                     f"repeat k and v per group, causal attention scaled by 1/sqrt(head_dim), merge, self.proj.")


# ---------------------------------------------------------------- the KV cache

def _cached(built: Built) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RecordingCache]:
    """Prompt, then one token at a time, then two: (x, the student's outputs, the reference full pass, cache).
    The tokens are those of the first full pass (already right), so its reference outputs serve again."""
    full, _, reference = built.runs[0]
    x, expected = full[:, :PLAN_TOKENS], reference[:, :PLAN_TOKENS]    # causal: the first tokens' outputs
    cache = RecordingCache(MAX_TOKENS)
    outs = []
    for start, length in PLAN:
        what = (f"GroupedQueryAttention({built.label}).forward(x, cache) with {length} new token(s) and "
                f"{start} cached")
        try:
            out = _forward(built, x[:, start:start + length], what, start=start, cache=cache)
        except Failure as failure:
            if failure.diagnosis in ("exception", "shape"):   # unnamed: earlier wrong outputs may say more
                _named_before(built, x, expected, outs, start)
            if failure.diagnosis in ("exception", "shape") and start > 0 and length > 1 and len(outs) > 1:
                reraise_with(failure, "causal_mask", f" Your module runs on one new token at a time after a "
                             f"cache, but not on {length}: the new queries sit at positions {start} .. "
                             f"{start + length - 1} and see every cached key, so their mask is ({length}, "
                             f"{start + length}): rows start .. total - 1 of causal_mask(total), not a "
                             f"({length}, {length}) mask of the new tokens alone.")
            raise
        if start == 0 and not cache.appended:
            fail("kv_cache", f"{what}: your forward never appends to the cache it is given, so the next tokens "
                             f"cannot see the earlier ones. With a cache: read start = cache.length, rotate the new "
                             f"keys, then k, v = cache.append(k, v) and attend over what it returns.")
        outs.append(out)
    return x, torch.cat(outs, dim=1), expected, cache


def _named_before(built: Built, x: torch.Tensor, expected: torch.Tensor, outs: list[torch.Tensor], start: int
                  ) -> None:
    """Where a cached call fails after earlier calls already gave wrong outputs, a known mistake that explains those
    outputs says more than the failure does (the tables that run out at the end of a wrong offset, say)."""
    if not outs or close(torch.cat(outs, dim=1), expected[:, :start]):
        return
    plan = [(begin, length) for begin, length in PLAN if begin < start]
    found = first_match(CACHED, [torch.cat(outs, dim=1)],
                        lambda _, spec: simulate(built.setup, x[:, :start], plan, spec, cached=True))
    if found is not None:
        fail(found.code, found.message)


def _fill_context(built: Built, cache: RecordingCache) -> None:
    """After the plan, token by token to the last position: a position that runs ahead of cache.length
    (say the keys placed one late) is invisible to RoPE's offsets until the tables run out."""
    full, _, reference = built.runs[0]
    for start in range(PLAN_TOKENS, MAX_TOKENS):
        what = (f"GroupedQueryAttention({built.label}).forward(x, cache) with 1 new token and {start} cached "
                f"(the context fills at {MAX_TOKENS})")
        try:
            out = _forward(built, full[:, start:start + 1], what, start=start, cache=cache)
        except Failure as failure:
            if failure.diagnosis in ("exception", "shape"):
                reraise_with(failure, "rope_positions", f" Your module is right for the first {start} tokens and "
                             f"fails only as the context fills: your positions run ahead of the cache (a new "
                             f"token at cache.length + 1, or the keys placed one position late), which RoPE's "
                             f"relative angles hide until the tables run out. Rotate the new tokens with "
                             f"offset=cache.length, read before cache.append(...).")
            raise
        if not close(out, reference[:, start:start + 1]):
            fail("rope_positions", f"{what}: your output differs from the full pass only now that the context "
                                   f"fills ({max_diff(out, reference[:, start:start + 1]):.3g}): your positions run "
                                   f"ahead of the cache (a new token at cache.length + 1, or the keys placed one "
                                   f"position late), which RoPE's relative angles hide until the tables run out. "
                                   f"Rotate with offset=cache.length, read before cache.append(...).")


def _check_cache_contents(built: Built, x: torch.Tensor, cache: RecordingCache) -> None:
    """The cache must hold num_kv_heads heads of rotated keys (so GQA's cache is smaller, and never re-rotated)."""
    k, v = cache.appended[0]
    length = PLAN[0][1]
    what = f"GroupedQueryAttention({built.label}) with a cache"
    if isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[1] != built.kv_heads:
        fail("kv_cache", f"{what}: your cache receives keys of shape {shape_str(k.shape)}, {k.shape[1]} heads. It "
                         f"should hold the num_kv_heads={built.kv_heads} heads: append k and v BEFORE repeat_kv, "
                         f"and repeat what the cache returns. That is the point of GQA: the cache is "
                         f"num_heads / num_kv_heads times smaller.")
    s = built.setup
    raw = (x[:, :length].double() @ s.params["key.weight"].T).reshape(2, length, built.kv_heads, s.head_dim)
    raw = raw.transpose(1, 2)                                                   # (N, kv_heads, L, head_dim)
    if s.qk_norm:
        raw = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + s.eps) * s.params["k_norm.weight"]
    turned = variants.rotate(raw, s.cos, s.sin, 0)
    if isinstance(k, torch.Tensor) and close(k, raw) and not close(k, turned):
        fail("kv_cache", f"{what}: your outputs are right, but your cache holds the keys before RoPE, so every "
                         f"step turns all the cached keys again. Rotate the new keys (offset = cache.length) and append them rotated: each key is "
                         f"turned once, to its own position, and never again.")
    # keys turned to other positions, the queries with them, give right outputs until the tables run out:
    # _fill_context names that (rope_positions)
    shifted = any(close(k, variants.rotate(raw, s.cos, s.sin, offset)) for offset in (1, 2)) \
        if isinstance(k, torch.Tensor) and k.shape == turned.shape else False
    if isinstance(k, torch.Tensor) and k.shape == turned.shape and not close(k, turned) and not shifted:
        values = x[:, :length].double() @ s.params["value.weight"].T              # (N, L, kv_heads * head_dim)
        values = values.reshape(2, length, built.kv_heads, s.head_dim).transpose(1, 2)   # (N, kv_heads, L, head_dim)
        fail("kv_cache", f"{what}: your outputs are right, but " + (
            "your cache holds the values where the keys go: append keys first, k, v = cache.append(k, v)."
            if close(k, values) else
            "the keys your cache receives are not the layer's keys as attention uses them (normalised where "
            "qk_norm is on, then turned by RoPE): append those, k, v = cache.append(k, v), so that every later "
            "step can read them as they are."))


def _diagnose_cached(built_all: list[Built], cached: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]]) -> None:
    found = first_match(CACHED, [got for _, got, _, _ in cached],
                        lambda i, spec: simulate(built_all[i].setup, cached[i][0], list(PLAN), spec, cached=True))
    if found is not None:
        fail(found.code, found.message)
    index = next(i for i, (_, got, expected, _) in enumerate(cached) if not close(got, expected))
    built, (_, got, expected, _) = built_all[index], cached[index]
    wrong = [t for t in range(PLAN_TOKENS) if not close(got[:, t], expected[:, t])]
    prompt = PLAN[0][1]
    if wrong and wrong[0] < prompt:
        where = (f"already for the prompt ({prompt} tokens into an empty cache): with an empty cache the "
                 f"forward must give what it gives without one")
    elif wrong and wrong[0] >= PLAN[-1][0]:
        where = ("only when two new tokens come at once: the second may see the first, not the reverse. Mask the "
                 "new queries with the rows start .. total-1 of a (total, total) causal mask")
    else:
        where = (f"from position {wrong[0]} on: a new token must get position cache.length (its RoPE offset) and "
                 f"attend to every cached key")
    fail("kv_cache", f"GroupedQueryAttention({built.label}) with a KV cache differs from the full pass {where} "
                     f"(largest difference {max_diff(got, expected):.3g}).")


# ---------------------------------------------------------------- which part is at fault

def _helpers_used(cls: Any) -> dict[str, Any]:
    """The functions the class's methods reach by name: the globals they use, and through the student's own
    functions among those (a wrapper), or as default arguments (``rotate=apply_rotary``), theirs, a few deep."""
    reached: dict[str, Any] = {}
    todo = [value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            for value in (vars(cls).values() if isinstance(cls, type) else ())]
    seen: list[Any] = []
    while todo and len(seen) < 20:
        fn = todo.pop()
        if not isinstance(fn, types.FunctionType) or any(fn is done for done in seen):
            continue
        seen.append(fn)
        found = {name: fn.__globals__.get(name) for name in fn.__code__.co_names if name in fn.__globals__}
        found.update({d.__name__: d for d in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())
                      if isinstance(d, types.FunctionType)})
        for name, value in found.items():
            reached.setdefault(name, value)
            if isinstance(value, types.FunctionType) and is_student_file(value.__code__.co_filename):
                todo.append(value)
    return reached


def _parts_note(cls: Any) -> str:
    """A sentence per helper of an earlier exercise that the class calls and that fails its own check."""
    used = _helpers_used(cls)
    notes = []
    # the checkers undecorated (``__wrapped__``): a helper's own verdict is neither recorded nor shown
    for name, exercise, own_check in (("apply_rotary", "9.2", check_apply_rotary.__wrapped__),
                                      ("repeat_kv", "9.5", check_repeat_kv.__wrapped__)):
        fn = used.get(name)
        if not callable(fn):
            continue
        try:
            own_check(fn)
        except Failure as failure:
            notes.append(f" Your class calls your {name} (exercise {exercise}), which fails its own check "
                         f"({failure.diagnosis}): fix it first, checks.check_{name}({name}).")
    return "".join(notes)


# ---------------------------------------------------------------- the check

@checker("9.6", example=lambda cls, *_, **__: module_example(
    "GroupedQueryAttention(4, 2, 1, 4, 10.0)", lambda: cls(4, 2, 1, 4, 10.0),
    lambda: ref.GroupedQueryAttention(4, 2, 1, 4, 10.0), 4))
def check_grouped_query_attention(cls: Any) -> str:
    """``cls(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta)``; forward(x, cache=None)."""
    expect_callable(cls, "GroupedQueryAttention", "class")
    try:
        return _check(cls)
    except Failure as failure:
        if failure.diagnosis in ("not_implemented", "timeout"):
            raise
        note = _parts_note(cls)
        if not note:
            raise
        raise Failure(failure.diagnosis, failure.message.rstrip() + note, **failure.details) from None


def _check(cls: Any) -> str:
    torch.manual_seed(0)   # any dropout draws; the @checker decorator restores the caller's RNG state
    generator = torch.Generator().manual_seed(96)
    # The optional features (QK-norm, a sliding window, dropout, a head_dim of its own) are judged after the plain
    # module is right, so that a mistake in the common path is named from the plain configurations alone.
    optional = [c for c in OPTIONAL if all(accepts(cls, key) for key in c[2])]
    # Every module built stays alive to the end of the check: a freed one's id may be given to the next, and
    # state a wrong module keeps in a global keyed by id(self) would then pass from one to the other.
    start = Afresh(cls)   # the student's class and globals before the first module: a position kept there shows
    all_built = [_check_configs(cls, configs, generator, start) for configs in (CONFIGS, optional) if configs]
    built = all_built[0][1]
    all_built.append([_check_other_width(cls, torch.Generator().manual_seed(24))])
    # one module called in turn, first with a fresh cache of the caller's, then without one, on short inputs of one
    # batch and a batch of one: none of them may see another's keys (nor the cache passed before)
    try:
        _called_in_turn(built)
    except Failure as failure:
        _kept_since_the_checks_calls(failure, cls, built)
        raise
    _generations_with_fresh_caches(built)
    x = torch.randn(2, MAX_TOKENS, EMBED_DIM, generator=generator)   # the whole context: a branch for long inputs
    # grouped-query (2 key/value heads): every projection learns, and the module stays on its device
    _module_probes(built.model, built.reference, x, f"GroupedQueryAttention({built.label}) on x of shape "
                                                    f"{shape_str(x.shape)}", cache=lambda: KVCache(MAX_TOKENS))
    kv_heads, theta, extra = CONFIGS[1]

    def build() -> tuple[nn.Module, nn.Module]:
        again = _build(cls, kv_heads, theta, extra, torch.Generator().manual_seed(96))
        all_built.append([again])
        return again.model, again.reference
    module_in_float64(build, x, f"GroupedQueryAttention({built.label}) on x of shape {shape_str(x.shape)}")
    # No magnitude probe, as for 2.2 and 3.3 (``_attn_modules.module_check``): the scores come from the module's
    # weights, and a correct "mask after the softmax, then renormalise" underflows on large scores.
    extras = [key for _, _, extra in optional for key in extra]
    also = f", and with {', '.join(extras[:-1])}{' and ' if len(extras) > 1 else ''}{extras[-1]}" if extras else ""
    return (f"Matches the reference for multi-head ({NUM_HEADS} kv heads), grouped-query (2) and multi-query (1) "
            f"attention{also}, in a full pass and token by token with a KV cache that holds num_kv_heads heads of "
            f"rotated keys.")


def _called_in_turn(built: Built) -> None:
    shorts = [torch.randn(batch, length, EMBED_DIM, generator=torch.Generator().manual_seed(length + seed))
              for seed, (batch, length) in enumerate(IN_TURN)]
    called_in_turn([(f"GroupedQueryAttention({built.label}).forward(x{', cache=KVCache(...)' if first else ''}) "
                     f"with x of shape {shape_str(short.shape)}",
                     lambda short=short, first=first: _forward(built, short, "GroupedQueryAttention.forward(x)",
                                                               **({"cache": KVCache(MAX_TOKENS)} if first else {})),
                     lambda short=short: built.reference(short).detach())
                    for first, short in zip((True, *[False] * len(shorts)), (shorts[0], *shorts))], cache=True,
                   step=(built.model, built.reference))


def _generations_with_fresh_caches(built: Built) -> None:
    """Generations with a new cache each, then two caches in turn (``generations_with_fresh_caches``)."""
    full, _, reference = built.runs[0]

    def step(cache: KVCache, start: int, length: int) -> None:
        what = f"GroupedQueryAttention({built.label}).forward(x, cache) with {length} new token(s) and {start} cached"
        out, expected = _forward(built, full[:, start:start + length], what, start=start, cache=cache), \
            reference[:, start:start + length]
        if not close(out, expected):
            fail("kv_cache", f"{what}: your output differs from the full pass by up to {max_diff(out, expected):.3g}.")
    generations_with_fresh_caches(lambda: KVCache(MAX_TOKENS), step, PLAN[0][1])


def _kept_since_the_checks_calls(failure: Failure, cls: Any, built: Built) -> None:
    """``kept_state`` where the calls in turn fail (an exception too: a position counter on the module runs past the
    tables) on the module the full passes and the cached generations used, and pass on a fresh one."""
    if failure.diagnosis == "kept_state":
        return
    kv_heads, theta, extra = CONFIGS[1]
    try:
        _called_in_turn(_build(cls, kv_heads, theta, extra, torch.Generator().manual_seed(96)))
    except Failure:
        return   # wrong on a fresh module too: the first verdict stands
    said = failure.message.splitlines()[0].rstrip()
    said = said if len(said) <= 300 else said[:300].rstrip() + " [...]"
    said = said if said.endswith((".", "!", "?", "]")) else said + "."
    fail("kept_state", f"{said} Yet the same calls are right on a fresh GroupedQueryAttention({built.label}): this "
                       f"one fails only after its earlier calls (full passes, then a generation with a KV cache up to "
                       f"{MAX_TOKENS} tokens). Your module keeps something from call to call (a position counter such "
                       f"as self._pos, keys of an earlier call, stored on self or in a global). Each call must depend "
                       f"only on its inputs and the cache the caller passes: read the start position from "
                       f"cache.length, and keep what a call computes in local variables.")


# A factor on the scores that is none of FULL_PASS's: found by a search, and named with its value.
_SCALE = ScaleFit(lambda built, x, factor: simulate(built.setup, x, [(0, x.shape[1])], {"scale": factor}),
                  lambda built, x: built.setup.head_dim ** -0.5,
                  "{what}: your scores are multiplied by {factor:.4g} before the softmax, where the exercise asks "
                  "for 1/sqrt(head_dim) = {right:.4g}. Divide q @ k^T by sqrt(self.head_dim), once.")


# One more shape: every configuration above has embed_dim 32, 4 heads of 8 and max_tokens 10, so a size or a scale
# written into the code for them shows only here. (embed_dim, num_heads, num_kv_heads, max_tokens): heads of 12,
# two query heads per key/value head, 13 positions.
OTHER_WIDTH = (24, 2, 1, 13)


def _check_other_width(cls: Any, generator: torch.Generator) -> Built:
    embed_dim, num_heads, kv_heads, max_tokens = OTHER_WIDTH
    built = _build(cls, kv_heads, 10000.0, {}, generator, embed_dim=embed_dim, num_heads=num_heads,
                   max_tokens=max_tokens)
    x = torch.randn(2, max_tokens, embed_dim, generator=generator)
    what = (f"GroupedQueryAttention({embed_dim}, {num_heads}, {kv_heads}, {max_tokens}) on x of shape "
            f"{shape_str(x.shape)}")
    with torch.no_grad():
        at_other_sizes(lambda: _forward(built, x, what), lambda: built.reference(x), what,
                       f"at embed_dim={EMBED_DIM} with {NUM_HEADS} heads of {HEAD_DIM} and max_tokens={MAX_TOKENS}",
                       "Take every size from the module (self.num_heads, self.num_kv_heads, self.head_dim, its "
                       "tables) or from x.shape.", scale=(_SCALE, (built, x)))
    return built


def _cached_afresh(built: Built, start: Afresh, failure: Failure | None = None) -> None:
    """``kept_state`` where a cached generation that failed (``failure``) or went wrong is right when run again on
    the same module with the student's class attributes and globals as they were before the check (``Afresh``):
    what went wrong it took from the modules and generations before, through the class or a global."""
    if not start.places or failure is not None and failure.diagnosis in ("kept_state", "not_implemented", "timeout"):
        return
    with start.restored():
        try:
            _, got, expected, _ = _cached(built)
        except Failure:
            return
    if close(got, expected):
        how = "raised an error" if failure is not None else "differs from the full pass"
        fail("kept_state", f"GroupedQueryAttention({built.label}) with a KV cache {how}, yet the same generation is "
                           f"right when your code starts afresh (its class attributes and globals as they were before "
                           f"the checker's first module): your module keeps a position (or keys) on the class or in "
                           f"a global, shared by every module and every generation. Read start = cache.length, and "
                           f"keep what a call computes in local variables.")


def _check_configs(cls: Any, configs: Any, generator: torch.Generator, start: Afresh) -> list[Built]:
    built_all: list[Built] = []
    for kv_heads, theta, extra in configs:
        built = _build(cls, kv_heads, theta, extra, generator)
        mha_right = (bool(built_all) and built_all[0].kv_heads == NUM_HEADS
                     and all(close(out, e) for _, out, e in built_all[0].runs))
        _full_passes(built, generator, mha_right)
        built_all.append(built)
    if not all(close(out, e) for b in built_all for _, out, e in b.runs):
        _diagnose_full(built_all, generator)
    cached = []   # (x, the student's outputs, the reference's, the cache) per configuration
    for built in built_all:
        try:
            cached.append(_cached(built))
        except Failure as failure:
            _cached_afresh(built, start, failure)
            raise
        x, got, expected, cache = cached[-1]
        if close(got, expected):
            _check_cache_contents(built, x, cache)
    if not all(close(got, expected) for _, got, expected, _ in cached):
        _cached_afresh(next(b for b, (_, got, expected, _) in zip(built_all, cached) if not close(got, expected)),
                       start)
        _diagnose_cached(built_all, cached)
    for built, (*_, cache) in zip(built_all, cached):
        _fill_context(built, cache)
    return built_all
