"""Exercises of notebook 10 (FlashAttention): 10.1 online_softmax, 10.2 flash_attention (the tiled forward),
10.3 FlashAttentionFunction (the backward by recomputation, judged on its dq, dk and dv joined along the sequence).

10.2 is two declarations (its output, then its log-sum-exp). Whether the student tiled at all is watched
while their code runs (``_flash_probe``). 10.1 and 10.2 get the engine's magnitude probe (scores of hundreds,
far below zero, rows far apart), 10.1 also rows near -1e20 and -1e100 (a running maximum from a finite stand-in for
-inf), and both a bfloat16 call whose output's dtype is judged (``engine.probes.in_bfloat16``: statistics made in
float32 are promoted away in float64, not in bfloat16); 10.3 runs through the engine's saved_tensors probe
(``forward_backward``), and once right, with its output's heads merged before the loss (a non-contiguous gradient:
``.view`` on it raises) and two calls with their backwards pending at once (``in_flight_together``: state kept off ctx).
The mistakes of the topic (tiling, backward, precision, rows never written) are ``_flash_variants``'.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from ... import flash as ref
from ..exercises import Mistake
from ..verdict import Failure, fail
from . import _flash_variants as variants
from ._device_probe import meta
from ._device_probe import probe as probe_device
from ._flash_probe import Record, Recorder
from ._model_common import as_values
from ._student_code import (
    HALF_PRECISION,
    call_student,
    close,
    coarse_precision,
    expect_callable,
    expect_tensor,
    max_diff,
)
from .engine import Case, FunctionExercise, ScaleFit, checker, function_example, judge
from .engine.example import tiny
from .engine.function import Run
from .engine.probes import (
    called_in_bfloat16,
    expect_dtype_in_bfloat16,
    float64_notebook,
    in_bfloat16,
    magnitude_rows,
    magnitude_scores,
)
from .engine.saved_tensors import forward_backward, in_flight_together

__all__ = ["check_online_softmax", "check_flash_attention", "check_flash_backward"]


# ============================================================================ 10.1 online_softmax

def _rows(seed: int, shape: tuple[int, ...], ramp: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * scale
    return x + torch.linspace(0.0, ramp, shape[-1])       # a rising ramp: the maximum moves to later blocks


def _large(first: bool) -> torch.Tensor:
    """Scores near 100 (exp overflows float32 past 88) in the first block, or in the last, others near -100."""
    x = _rows(7, (2, 12), scale=0.5) - 100.0
    x[:, :4 if first else 0] += 200.0
    if not first:
        x[:, -4:] += 200.0
    return x


def _masked_start(seed: int, shape: tuple[int, int], masked: tuple[int, ...]) -> torch.Tensor:
    """Rows whose first ``masked[r]`` entries are -inf."""
    x = _rows(seed, shape, ramp=2.0, scale=2.0)
    for row, count in enumerate(masked):
        x[row, :count] = float("-inf")
    return x


# (x, block_size): blocks that divide L and blocks that do not, a block of 1, a block longer than the row,
# a maximum that keeps rising, float64, and large scores first or last (overflow, and which maximum is used).
_SOFTMAX_CASES = (
    (_rows(1, (3, 10), ramp=6.0, scale=2.0), 3),
    (_rows(2, (2, 8), ramp=4.0, scale=3.0), 4),
    (_rows(3, (2, 2, 7), ramp=-3.0, scale=2.0), 1),
    (_rows(4, (2, 6), scale=2.0), 8),
    (_rows(5, (2, 9), ramp=5.0, scale=2.0).double(), 2),
    (_large(first=True), 4),
    (_large(first=False), 4),
    (_rows(6, (2, 10), scale=2.0) - 150.0, 3),              # every score below -104: exp(x - 0) underflows
    (_rows(8, (3, 8), scale=2.0) + torch.tensor([[150.0], [0.0], [-150.0]]), 3),   # rows far apart
)

# Rows that start with whole blocks of -inf (left padding, a window, 10.2's causal blocks): weight 0 there, the rest
# of the row its softmax. One block, two, and a block size that does not divide the row. Judged last
# (_masked_rows), once the check has passed: a student who has another mistake too hears of that one first.
_MASKED_CASES = (
    (_masked_start(9, (2, 10), (3, 0)), 3),
    (_masked_start(10, (3, 7), (4, 2, 5)), 2),
    (_masked_start(11, (2, 9), (8, 4)), 4),
)


def _far_below(level: float, dtype: torch.dtype) -> torch.Tensor:
    """Two rows of 10 whose every score is between ``level`` and twice it (far below any finite stand-in for -inf a
    student may start the running maximum at): the maximum in the first block, then in the last. Each row's other
    scores are lower by 1e19 or more, so its softmax is exactly one-hot in every right way of computing it (a flat
    row's would be 1/L, which a log-sum-exp of -1e20 cannot hold in float32: -1e20 + log(10) rounds to -1e20)."""
    rising = torch.linspace(2.0, 1.0, 10, dtype=dtype)                              # (10,)
    return level * torch.stack((rising.flip(0), rising))                            # (2, 10)


# (x, block_size): rows near -1e20 in float32 and -1e100 in float64. A running maximum started at a finite number
# above them (-1e4, -1e9, -1e30 in float64) never moves: exp(x - m) underflows to 0 and the row is 0/0. One
# started below them stays right (torch.finfo(x.dtype).min, or -1e30 in float32 and -1e300 in float64).
_FAR_BELOW_CASES = ((_far_below(-1e20, torch.float32), 3), (_far_below(-1e100, torch.float64), 4))

def _softmax_mistake(code: str, why: str, **spec: str) -> Mistake:
    return Mistake(code, f"online_softmax: {why}.", spec)


_SOFTMAX_MISTAKES = (
    # the magnitude slips first: a student wrong only at large magnitudes is NaN there, which other
    # slips' outputs can be too
    _softmax_mistake("magnitude", "one maximum is shared by all rows (x.max() or x.amax() without dim=-1): a row "
                     "far below the largest row then has exp(x - m) = 0 everywhere and 0/0. Keep one running "
                     "maximum per row, m_new = torch.maximum(m, block.amax(dim=-1))", maximum="shared"),
    _softmax_mistake("running_max", "your running maximum starts at 0 (or another finite number), not at -inf: "
                     "when every score of a row is below about -104 (float32), exp(x - 0) underflows to 0 for all of them and you divide 0 by 0. "
                     "Start with m = torch.full(..., float('-inf')), so the first block's maximum replaces it",
                     maximum="zero"),
    _softmax_mistake("overflow", "no maximum is subtracted, so exp overflows to inf for scores above about 88 in "
                     "float32 and you divide inf by inf. Subtract the running maximum m inside every exp",
                     maximum="none"),
    *(_softmax_mistake("online_rescale", why, rescale=rescale) for rescale, why in {
        "none": "the running sum is not rescaled when the maximum changes: every earlier term was exp(x - m_old), "
                "so when a block raises the maximum the sum must be multiplied by exp(m_old - m_new) before the new "
                "block's terms are added",
        "block": "the running sum is rescaled by exp(block_max - m_new), with this block's own maximum: the earlier "
                 "terms were exp(x - m_old), so the factor is exp(m_old - m_new), with the maximum before this block",
        "old_over_block": "the running sum is rescaled by exp(m_old - block_max), against this block's own maximum, "
                          "not the new running one: where a block's maximum is below the running maximum, that "
                          "blows the old sum up. The earlier terms were exp(x - m_old) and the sum is now kept "
                          "against m_new = max(m_old, block_max): the factor is exp(m_old - m_new)",
        # guarded: no factor before the first block (m = -inf)
        **dict.fromkeys(("inverted", "inverted_guarded"), "the rescale factor is upside down: when the maximum grows "
                        "from m_old to m_new, the old sum shrinks, l * exp(m_old - m_new), a factor of at most 1"),
        "after": "the factor exp(m_old - m_new) multiplies the new block's terms too: (l + new terms) * factor. Those "
                 "terms are exp(x - m_new) already; only the old sum is rescaled, l = l * exp(m_old - m_new) + the "
                 "new terms",
        "block_own": "each block's sum is taken against its own maximum, l_blk = sum(exp(x - m_blk)), and merged as "
                     "l * exp(m_old - m_new) + l_blk: the block's sum needs its factor too, l_blk * exp(m_blk - "
                     "m_new), or take its terms against m_new directly, sum(exp(x - m_new))",
        "new": "the factor exp(m_old - m_new) multiplies the new block's terms instead of the old sum. The new terms "
               "are exp(x - m_new) already; the old sum, made of exp(x - m_old), is what needs it: l = l * "
               "exp(m_old - m_new) + the new terms"}.items()),
    _softmax_mistake("running_max", "you keep the maximum of the latest block, not the running maximum of all blocks "
                     "so far: it is right in exact arithmetic, but when a later block is much smaller than an earlier "
                     "one the rescale factor exp(m_old - m_new) overflows. Use m_new = torch.maximum(m, "
                     "block.amax(dim=-1))", maximum="last"),
    _softmax_mistake("early_normalization", "each block is normalised with the sum seen so far; the earlier blocks "
                     "never learn about the later ones. Only the statistics (m, l) are updated per block: divide by "
                     "the final sum once, at the end", normalize="every"),
    *(_softmax_mistake("block_bounds", why, bounds=bounds) for bounds, why in {
        "short": "the last entry of every block is never read: block s covers x[..., s : s + block_size] (the end is "
                 "excluded already, no -1)",
        "shifted": "every block starts one entry late: block s covers x[..., s : s + block_size]",
        "overlap": "your blocks overlap: x[..., s : s + block_size + 1] reads the first entry of the next block too, "
                   "so it is counted twice. The end of a slice is excluded already: x[..., s : s + block_size]",
        "last_entry": "the row's last entry is never read: the blocks end at min(s + block_size, L) and a slice "
                      "already excludes its end (no L - 1)",
        "stop_early": "your loop stops before the last block: range(0, L, block_size) visits every start, the last "
                      "block may be shorter",
        "whole_blocks": "a last block shorter than block_size is never read (L is not always a multiple of the block "
                        "size): loop over range(0, L, block_size) and slice to the end"}.items()),
)


def _softmax_cases(cases: Any) -> list[Case]:
    return [Case((x, size), f"online_softmax(x, {size}) with x of shape {tuple(x.shape)}") for x, size in cases]


def _softmax_magnitudes() -> list[Case]:
    """The magnitude probe: two cases again at scores of hundreds, far below zero, and rows far apart."""
    return [Case((big, size), f"online_softmax(x, {size}) with x of shape {tuple(x.shape)}, {words}")
            for x, size in (_SOFTMAX_CASES[0], _SOFTMAX_CASES[2]) for big, words in magnitude_rows(x)]


def _softmax_not_finite(runs: list[Run], fn: Any) -> None:
    run = next(run for run in runs if not close(run.out, run.expected))
    (x, size), out = run.case.args, run.out
    if not torch.isfinite(out).all():
        fail("overflow" if x[x.isfinite()].abs().max() > 50 else "nan",
             f"online_softmax(x, {size}) gave NaN or inf for x of shape {tuple(x.shape)} (scores up to "
             f"{float(x.max()):.0f}). Subtract the running maximum inside every exp, and rescale the sum "
             f"with exp(m_old - m_new), which is at most 1.")
    if coarse_precision(out, run.expected):
        fail("precision", f"online_softmax(x, {size}) with x of shape {tuple(x.shape)}: {HALF_PRECISION}")


def _by_up_to(out: torch.Tensor, expected: torch.Tensor) -> str:
    """"by up to X" from the entries a student computed; entries that hold NaN, inf or numbers far beyond the
    reference's (memory from torch.empty that was never written) are counted apart, not quoted as a difference."""
    out, expected = out.detach().double(), expected.detach().double()
    finite = expected[expected.isfinite()]
    largest = float(finite.abs().max()) if finite.numel() else 1.0
    wild = ~torch.isfinite(out) | (out.abs() > 1e6 * (1.0 + largest))
    if not bool(wild.any()):
        return f"by up to {max_diff(out, expected):.3g}"
    rest = f", and elsewhere by up to {max_diff(out[~wild], expected[~wild]):.3g}" if bool((~wild).any()) else ""
    biggest = float(out[wild].abs().nan_to_num(0.0).max())
    return (f"in {int(wild.sum())} entries that hold NaN, inf or numbers as large as {biggest:.3g} (rows never "
            f"written: memory from torch.empty holds whatever was there before; do your loops reach every row?){rest}")


def _softmax_mismatch(run: Run) -> str:
    (x, size), out = run.case.args, run.out
    return (f"online_softmax(x, {size}) differs from torch.softmax(x, dim=-1) "
            f"{_by_up_to(out, torch.softmax(x.double(), -1))} for x of shape {tuple(x.shape)}. Keep the "
            f"running maximum m and sum l over the blocks, then return exp(x - m) / l.")


def _tiny_rows() -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(0)
    rows = [(tiny(generator, 1, length), size) for length, size in ((3, 1), (4, 2), (5, 2), (5, 3))]
    return rows + [(tiny(generator, 1, 4) + torch.tensor([0.0, 0.0, 100.0, 100.0]), 2)]   # exp(100): overflow


def _whole_row(runs: list[Run], fn: Any) -> None:
    """Right values from an operation that reduces a whole row at once (softmax, max, logsumexp...)."""
    x, size = runs[0].case.args
    with Recorder(0) as watch:
        call_student(fn, x.clone(), size, what=f"online_softmax(x, {size})")
    whole = next((name for name, length in watch.record.reduced if length == x.shape[-1] > size), None)
    if whole:
        fail("not_tiled", f"online_softmax reduces over the whole row at once ({whole} over all {x.shape[-1]} "
                          f"entries): the point is to read the row one block of block_size entries at a time, "
                          f"keeping only the running maximum and sum between blocks.")
    lengths = {length for _, length in watch.record.reduced}
    widest = max(lengths, default=size)
    blocks = -(-x.shape[-1] // size)
    if widest != size and widest == blocks and size in lengths:   # blocks of the size given, statistics kept
        fail("not_tiled", f"online_softmax(x, {size}) with x of shape {tuple(x.shape)} reads blocks of {size} "
                          f"entries, then reduces over {blocks} numbers at once: one per block, the blocks' own "
                          f"maxima or sums combined at the end. Keep one running maximum m and sum l instead, and "
                          f"update them as each block is read, as the exercise asks: m and l are all that is kept between blocks.")
    if widest != size:   # right values from blocks of another size: block_size is not what the loop reads
        fail("not_tiled", f"online_softmax(x, {size}) reads blocks of {widest} entries, not block_size={size}: take "
                          f"the blocks x[..., s:s + block_size] for s in range(0, L, block_size), with the size "
                          f"given.")


def _masked_rows(fn: Any) -> None:
    """Rows whose first block (or more) is all -inf, as the exercise asks: weight 0 there, no NaN."""
    for x, size in _MASKED_CASES:
        what = f"online_softmax(x, {size}) with x of shape {tuple(x.shape)}"
        out = expect_tensor(call_student(fn, x.clone(), size, what=what), tuple(x.shape), what, finite=False)
        expected = ref.online_softmax(x, size)
        if close(out, expected):
            continue
        lead = (x == float("-inf")).int().cumprod(-1).sum(-1)                  # leading -inf entries per row
        row = next((tuple(r) for r in (~torch.isclose(out.detach().double(), expected.double())).any(-1)
                    .nonzero().tolist()), (0,))
        starts = (f"row {row}, which starts with {int(lead[row])} entries of -inf ({int(lead[row]) // size} "
                  f"whole block(s) of {size})")
        if bool(torch.isnan(out).any()):
            fail("nan", f"{what}: NaN in {starts}, where the reference gives those entries weight 0 and the rest "
                        f"of the row its softmax. A row whose first block is all -inf has a running maximum of "
                        f"-inf after it, and exp(-inf - (-inf)) is NaN. Guard: while m_new is -inf subtract 0 "
                        f"instead, shift = torch.where(m_new == float('-inf'), 0, m_new), in exp(block - shift) and "
                        f"in the rescale exp(m - shift) (every term is exp(-inf) = 0 there).")
        fail("mismatch", f"{what}: {starts} differs from torch.softmax(x, dim=-1) "
                         f"{_by_up_to(out, expected)}. The -inf entries get weight 0 and the rest of the row its "
                         f"softmax: while m is -inf, subtract 0 instead of m (-inf - (-inf) is NaN).")


ONLINE_SOFTMAX = FunctionExercise(
    "10.1", "online_softmax", lambda x, block_size: ref.online_softmax(x, block_size),
    lambda: _softmax_cases(_SOFTMAX_CASES), ("x", "block_size"),
    success="Equal to torch.softmax for blocks that divide the row and blocks that do not, rows that start with "
            "blocks of -inf included, and stable for scores near 100 wherever they are: the running sum is "
            "rescaled whenever the maximum grows.",
    mismatch=_softmax_mismatch, mistakes=_SOFTMAX_MISTAKES,
    variant=lambda x, size, *, spec: variants.softmax_variant(x, size, **spec),
    diagnose=_softmax_not_finite, after=_whole_row, examples=lambda: _softmax_cases(_tiny_rows()),
    magnitude=_softmax_magnitudes, gradients=lambda: _softmax_cases(_SOFTMAX_CASES[:2]),
    probes=FunctionExercise.probes + ("batch",), item_axes=1,   # each row is a softmax of its own
)


@checker("10.1", example=function_example(ONLINE_SOFTMAX))
def check_online_softmax(fn: Callable[..., Any]) -> str:
    """``fn(x, block_size)`` -> softmax over the last axis of x (..., L), computed one block at a time."""
    message = judge(ONLINE_SOFTMAX, fn)
    _rows_far_below(fn)
    _masked_rows(fn)
    _softmax_on_device(fn)
    _softmax_in_bfloat16(fn)   # after the device probe, as the engine runs its dtype probe after its device probe
    return message


def _rows_far_below(fn: Callable[..., Any]) -> None:
    """Rows whose every score is far below zero, beyond the engine's magnitude probe (-1e20, -1e100): 0/0 there
    (or a row of zeros) is a running maximum that starts at a finite number instead of -inf (``overflow``, as the
    engine names a start of -100 on its rows)."""
    for x, size in _FAR_BELOW_CASES:
        what = (f"online_softmax(x, {size}) with {str(x.dtype).replace('torch.', '')} x of shape {tuple(x.shape)}, "
                f"every score near {float(x.amax()):.0e}".replace("e+", "e"))
        out = expect_tensor(call_student(fn, x.clone(), size, what=what), tuple(x.shape), what, finite=False)
        expected = ref.online_softmax(x, size)
        if close(out, expected):
            continue
        if not bool(torch.isfinite(out).all()) or bool((out == 0).all(-1).any()):   # 0/0, or 0/(0 + eps)
            fail("overflow", f"{what}: your result holds NaN, inf or a row of zeros (0/0) where the reference's is "
                             f"finite, although it is right on every other row. Your running maximum starts at a "
                             f"finite number (-1e4, -1e9, ...) instead of -inf, or is compared with one: when every "
                             f"score of a row lies below it, m never moves from it, exp(x - m) underflows to 0 for "
                             f"every entry and the sum l is 0. Start with m = torch.full(..., float('-inf'), "
                             f"dtype=x.dtype, device=x.device) (or the first block's maximum), so that the first "
                             f"block's maximum replaces it; torch.finfo(x.dtype).min, the lowest number of x's own "
                             f"dtype, works too.")
        # other values at such magnitudes are not judged: the text asks for no precision there


def _softmax_in_bfloat16(fn: Callable[..., Any]) -> None:
    """The dtype probe in bfloat16 (the text asks for m and l in x's dtype): statistics made in float32 pass the
    float64 probe, promoted there, but make a float32 result here. Only the dtype is judged: the values of a right
    answer in bfloat16 are three digits."""
    for x, size in (_SOFTMAX_CASES[0], _MASKED_CASES[0]):
        (x,) = in_bfloat16((x,))
        what = f"online_softmax(x, {size}) with bfloat16 x of shape {tuple(x.shape)}"
        made = _FLOAT32_STATISTICS.format(stats="m and l")
        out = called_in_bfloat16(lambda x=x, size=size, what=what: call_student(fn, x.clone(), size, what=what),
                                 what, made)
        if out is None:
            return   # an operation without a bfloat16 kernel: inconclusive
        expect_dtype_in_bfloat16(expect_tensor(out, tuple(x.shape), what, finite=False), what, made)


# what in a student's code comes out float32 for bfloat16 inputs: its statistics, made in float32
_FLOAT32_STATISTICS = ("Your {stats} are made in float32 whatever the input's dtype (torch.full or torch.zeros "
                       "without dtype=, which take the default, dtype=torch.float32, or .float()); float64 inputs hide "
                       "it, since float32 with float64 gives float64, but float32 with bfloat16 gives float32.")


def _softmax_on_device(fn: Callable[..., Any]) -> None:
    """The device probe (the text asks for x's device), after the masked rows (only the bfloat16 probe comes after it):
    every case again on meta, where statistics made with torch.full or torch.zeros without device= show."""
    for case in ONLINE_SOFTMAX.cases():
        x, size = case.args
        probe_device(lambda x=x, size=size: fn(meta(x), size), case.what)


# ============================================================================ 10.2 flash_attention

def _qkv(seed: int, shape_q: tuple[int, ...], length_k: int | None = None, spread: float = 2.0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape_k = shape_q[:-2] + (length_k or shape_q[-2], shape_q[-1])
    q = torch.randn(shape_q, generator=generator) * spread    # spread: peaked weights, so rescaling matters
    k = torch.randn(shape_k, generator=generator) * spread
    v = torch.randn(shape_k, generator=generator)
    return q, k, v


def _pushed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: float, alternate: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with one direction added so every score is moved by about ``score`` (``alternate``: +score for
    even queries, -score for odd ones), on top of its own spread."""
    d = q.shape[-1]
    push = (abs(score) * d ** 0.5) ** 0.5                      # push**2 / sqrt(d) = |score|
    direction = torch.zeros(d, dtype=q.dtype)
    direction[0] = 1.0
    signs = torch.ones(q.shape[-2], dtype=q.dtype)
    if alternate:
        signs[1::2] = -1.0                                     # (Lq,): +, -, +, ...
    toward = 1.0 if score > 0 else -1.0
    return q + push * signs[:, None] * direction, k + toward * push * direction, v   # (..., L, d) each


# (q, k, v, block_q, block_k, causal): blocks that divide L and blocks that do not, block_q != block_k
# (where comparing block numbers goes wrong), Lq != Lk, blocks longer than the sequence; every score far below
# zero (a running maximum from 0 gives 0/0) and query rows far apart (one maximum for all rows gives 0/0).
_FORWARD_CASES = (
    (*_qkv(11, (1, 2, 13, 4)), 4, 5, False),
    (*_qkv(12, (2, 1, 12, 8)), 4, 4, True),
    (*_qkv(13, (1, 2, 11, 4)), 4, 3, True),
    (*_qkv(14, (1, 1, 6, 4), length_k=10), 4, 4, False),
    (*_qkv(15, (1, 1, 7, 4)), 16, 16, True),
    (*_qkv(16, (1, 2, 10, 4)), 3, 4, True),
    (*_pushed(*_qkv(17, (1, 2, 9, 4)), -150.0, alternate=False), 4, 3, False),
    (*_pushed(*_qkv(18, (1, 1, 10, 4)), 150.0, alternate=True), 3, 4, True),
)

# The watched run: per head, the full score matrix is 64 x 64 = 4096 numbers, q is 64 x 12; d = 12 differs
# from both block sizes so a score product (contracting over d) is told from weights @ values.
_PROBE_SHAPE, _BLOCK_Q, _BLOCK_K = (1, 2, 64, 12), 16, 8


def _pair(result: Any, shown: str, shape: tuple[int, ...]) -> tuple[Any, Any]:
    result = as_values(result, 2)   # a generator of the two unpacks as `out, lse = ...` does
    if isinstance(result, torch.Tensor) or not isinstance(result, (tuple, list)) or len(result) != 2:
        got = (f"one tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else
               "nothing" if result is None else f"a {type(result).__name__}"
               + (f" of {len(result)} values" if isinstance(result, (tuple, list)) else ""))
        fail("shape", f"{shown} returned {got}; it should return two tensors, `return out, lse`: the output "
                      f"{shape} and the log-sum-exp of each query's scores {shape[:-1]}.")
    return result[0], result[1]


def _forward_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int, causal: bool) -> str:
    return (f"flash_attention(q, k, v, block_q={block_q}, block_k={block_k}, causal={causal}) with q of shape "
            f"{tuple(q.shape)}" + (f" and k of shape {tuple(k.shape)}" if k.shape != q.shape else ""))


def _call_forward(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int,
                  block_k: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    shown = _forward_call(q, k, v, block_q, block_k, causal)
    try:
        result = call_student(fn, q.clone(), k.clone(), v.clone(), block_q=block_q, block_k=block_k, causal=causal,
                              what=shown)
    except Failure as failure:
        if failure.diagnosis == "exception":
            _name_an_empty_block(fn, q, k, v, block_q, block_k, causal, shown)
        raise
    shape = tuple(q.shape)[:-1] + (v.shape[-1],)
    out, lse = _pair(result, shown, shape)
    out = expect_tensor(out, shape, f"{shown} (its output)", dtype=q.dtype, finite=False)
    lse = expect_tensor(lse, shape[:-1], f"{shown} (its log-sum-exp)", finite=False)
    return out, lse


def _name_an_empty_block(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int,
                         block_k: int, causal: bool, shown: str) -> None:
    """After the student's forward raised: was it on a block of 0 positions (a loop bound one block too far)?
    Watched in a second run only then, so that every other call runs at full speed."""
    with Recorder(0) as watch:
        try:
            call_student(fn, q.clone(), k.clone(), v.clone(), block_q=block_q, block_k=block_k, causal=causal,
                         what=shown)
        except Failure:
            pass
    seen = [(length, start) for length, start in watch.record.empty if length in (q.shape[-2], k.shape[-2])]
    if not seen:
        return
    length, start = seen[0]
    fail("block_bounds", f"{shown}: your code took an empty block, positions {start}:{start} of {length}, and "
                         f"then raised on it (a max or a softmax over no scores). A loop bound goes one block too "
                         f"far. The query blocks start at range(0, Lq, block_q) and the key blocks at range(0, Lk, "
                         f"block_k); with causal, the key loop stops before the query block's end qe, which is "
                         f"already one past its last query: range(0, min(Lk, qe), block_k), no + 1.")


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, factor: float | None = None) -> torch.Tensor:
    """The scores the softmax sees, q k^T / sqrt(d) (or q k^T * factor), masked when causal, in float64:
    (..., Lq, Lk)."""
    scores = (q.double() @ k.double().transpose(-2, -1)) * (q.shape[-1] ** -0.5 if factor is None else factor)
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return scores


def _lse_mistake(why: str, output: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]) -> Mistake:
    return Mistake("logsumexp", f"the output is right but the log-sum-exp is not: {why}. The backward (10.3) "
                                f"rebuilds every weight from it, as exp(s - lse).",
                   output=lambda q, k, v, block_q, block_k, causal: output(_scores(q, k, causal), q, causal))


def _lse(scores: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(scores, -1)


# What a log-sum-exp that is not m + log(l) usually is, from the scores s and their maximum m.
_LSE_MISTAKES = (
    _lse_mistake("you return the running maximum m alone; the log-sum-exp is m + log(l)", lambda s, q, c: s.amax(-1)),
    _lse_mistake("you return log(l) alone; the sum l was measured against the maximum, so lse = m + log(l)",
                 lambda s, q, c: _lse(s) - s.amax(-1)),
    *(_lse_mistake("you return the sum itself, not its logarithm: lse = m + log(l)", output) for output in
      (lambda s, q, c: torch.exp(_lse(s)), lambda s, q, c: torch.exp(_lse(s) - s.amax(-1)))),
    *(_lse_mistake("your log-sum-exp is of the unscaled scores q k^T; it should be of the scores the softmax saw, "
                   "q k^T / sqrt(d)", output) for output in
      (lambda s, q, c: _lse(s) * q.shape[-1] ** 0.5, lambda s, q, c: _lse(s * q.shape[-1] ** 0.5))),
)


def _watched(seed: int, run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
             length_k: int | None = None) -> Record:
    """What the student's code does on the probe's q, k, v (k and v of ``length_k``), under the recorder."""
    q, k, v = _qkv(seed, _PROBE_SHAPE, length_k)
    with Recorder(_PROBE_SHAPE[-1]) as recorder:
        run(q, k, v)
    return recorder.record


def _probe_forward(fn: Callable[..., Any], causal: bool) -> None:
    """No L x L tensor, key blocks of block_k, future blocks skipped."""
    batch, heads, length, _ = _PROBE_SHAPE
    block_q, block_k, per_head = _BLOCK_Q, _BLOCK_K, batch * heads
    shown = f"flash_attention(q, k, v, block_q={block_q}, block_k={block_k}, causal={causal}) with L = {length}"
    record = _watched(21, lambda q, k, v: call_student(fn, q, k, v, block_q=block_q, block_k=block_k,
                                                         causal=causal, what=shown))
    full = record.score_shaped(length, length)
    if full is not None:
        fail("full_scores", f"{shown}: your code materialised the full score matrix: it built a tensor of shape "
                            f"{full}, L x L = {length} x {length} scores or more. The point of tiling is that no "
                            f"tensor bigger than a (block_q, block_k) block of scores ever exists; build the causal "
                            f"mask per block too, from the positions.")
    if record.fused:
        fail("not_tiled", f"{shown}: your code calls PyTorch's fused attention ({record.fused[0]}); write the "
                          f"loops over query and key blocks yourself.")
    if math.prod(record.largest_tile) > block_q * block_k:     # () when no score product was seen: 1
        fail("not_tiled", f"{shown}: one of your score blocks has shape {record.largest_tile}, more than a "
                          f"(block_q, block_k) = ({block_q}, {block_k}) block: take the keys block_k at a time.")
    _tiles_as_given(record, shown)
    if causal and record.score_elements:
        needed, total = ref.causal_blocks(length, block_q, block_k)
        expected = needed * block_q * block_k * per_head
        if record.score_elements > expected * 1.01:
            share = record.score_elements / (total * block_q * block_k * per_head)
            fail("block_skip", f"{shown}: you computed {share:.0%} of the score matrix, but with causal masking "
                               f"only {needed} of the {total} key blocks ({needed / total:.0%}) hold any key a "
                               f"query of its block may see. Skip (do not compute) every key block whose first "
                               f"key comes after the query block's last query.")


# The keys' length of the probe that tells block_q from block_k: a multiple of block_k (8), not of block_q (16),
# so loops with the two sizes swapped cut an (8, 8) block of scores that the right loops never make. Equal
# lengths cannot tell them apart: the blocks come out the same, either way round.
_SWAP_LENGTH_K = 24


def _tile_shapes(length_q: int, length_k: int, block_q: int, block_k: int) -> set[tuple[int, ...]]:
    """The blocks of scores that loops over these sizes make, each (smaller, larger)."""
    return {tuple(sorted((min(block_q, length_q - qs), min(block_k, length_k - ks))))
            for qs in range(0, length_q, block_q) for ks in range(0, length_k, block_k)}


def _sizes_not_swapped(record: Record, shown: str) -> None:
    """The blocks of a non-causal run with k of _SWAP_LENGTH_K keys are the ones block_q queries and block_k keys
    make, not the ones the sizes swapped make."""
    seen = {tuple(sorted(tile)) for tile in record.tiles if len(tile) == 2 and min(tile) > 1}
    right = _tile_shapes(_PROBE_SHAPE[-2], _SWAP_LENGTH_K, _BLOCK_Q, _BLOCK_K)
    swapped = _tile_shapes(_PROBE_SHAPE[-2], _SWAP_LENGTH_K, _BLOCK_K, _BLOCK_Q)
    if seen - right and seen <= right | swapped:
        fail("not_tiled", f"{shown}: your loops take block_k = {_BLOCK_K} queries and block_q = {_BLOCK_Q} keys at "
                          f"a time (a block of scores of shape {min(seen - right)} appears, which only the two "
                          f"sizes swapped make): the query loop steps by block_q, range(0, Lq, block_q), and the "
                          f"key loop by block_k, range(0, Lk, block_k).")


def _tiles_as_given(record: Record, shown: str) -> None:
    """Every block of scores is (block_q, block_k), either way round (the probe's L is a multiple of both, so no
    block is cut short): right values from blocks of other sizes mean the loops ignore the block sizes given.
    Products with an axis of 1 (one query's row, a row-wise dot product through einsum) are no blocks."""
    given = (_BLOCK_Q, _BLOCK_K)
    for tile in sorted(record.tiles):
        if len(tile) == 2 and min(tile) > 1 and sorted(tile) != sorted(given):
            fail("not_tiled", f"{shown}: one of your blocks of scores has shape {tile}, not (block_q, block_k) = "
                              f"{given}: the loops must take block_q queries and block_k keys at a time, the sizes "
                              f"given (only the last block of each may be shorter).")


def _part(fn: Callable[..., Any], index: int) -> Callable[..., torch.Tensor]:
    """The student's forward as a function of one case's arguments, giving its output (0) or its lse (1)."""
    return lambda q, k, v, block_q, block_k, causal: _call_forward(fn, q, k, v, block_q, block_k, causal)[index]


def _forward_cases(cases: Any) -> list[Case]:
    return [Case(case, _forward_call(*case)) for case in cases]


def _forward_magnitudes() -> list[Case]:
    """The magnitude probe: two cases again with scores of hundreds, every score far below zero, and query rows
    far apart (``magnitude_scores`` gives the first and the last)."""
    cases = []
    for q, k, v, block_q, block_k, causal in (_FORWARD_CASES[0], _FORWARD_CASES[2]):
        (big_q, big_k, big), (apart_q, apart_k, apart), (low_q, low_k, low) = magnitude_scores(q, k)
        for q_, k_, words in ((big_q, big_k, big), (low_q, low_k, low), (apart_q, apart_k, apart)):
            cases.append(Case((q_, k_, v, block_q, block_k, causal),
                              f"{_forward_call(q_, k_, v, block_q, block_k, causal)}, {words}"))
    return cases


def _future_leaks(run: Run, fn: Any) -> None:
    """Causal: the outputs up to a position stay as they were when the keys and values after it change."""
    q, k, v, block_q, block_k, causal = run.case.args
    if not causal or k.shape[-2] != q.shape[-2] or not bool(torch.isfinite(run.out).all()):
        return   # NaN compares unequal to itself: a NaN output is judged as such, below
    # rows that come out otherwise from a second call on the same inputs hold memory never written (torch.empty):
    # a change there after the future changed is no leak
    again = fn(q.clone(), k.clone(), v.clone(), block_q, block_k, causal)
    unstable = [i for i in range(q.shape[-2]) if not close(again[..., i, :], run.out[..., i, :])]
    steady_right = all(close(run.out[..., i, :], run.expected[..., i, :]) for i in range(q.shape[-2])
                       if i not in unstable)   # else a state carried from call to call, judged later
    if unstable and steady_right:
        fail("block_bounds", f"{run.case.what}: " + (variants.unwritten_rows(run.out, run.expected, block_q) or (
            f"query rows {', '.join(map(str, unstable[:6]))} come out otherwise from one call to the next on the "
            f"same inputs: they are never written, and hold whatever memory torch.empty found. Loop over every "
            f"query block, range(0, Lq, block_q), and write each block's rows, qe = min(qs + block_q, Lq).")))
    generator = torch.Generator().manual_seed(5)
    for t in range(q.shape[-2] - 1):   # a few small calls: only where the output is wrong already
        k2, v2 = k.clone(), v.clone()
        k2[..., t + 1:, :] = torch.randn(k2[..., t + 1:, :].shape, generator=generator) * 2
        v2[..., t + 1:, :] = torch.randn(v2[..., t + 1:, :].shape, generator=generator)
        changed = fn(q.clone(), k2, v2, block_q, block_k, causal)
        if not close(changed[..., :t + 1, :], run.out[..., :t + 1, :]):
            fail("causal_mask", f"{run.case.what}: the future leaks: changing the keys and values after position "
                                f"{t} changes your output at position {t} or before. In every key block that "
                                f"crosses the diagonal, set the scores of keys after their query to -inf, with "
                                f"positions counted from the start of the sequence (qs + row and ks + col), not "
                                f"from the block's corner.")


def _rows_short_of_keys(run: Run) -> str | None:
    """When every wrong query row is attention over its first keys only (some it may see left out at the end),
    what that says about the key loop's bound (None otherwise): such rows are written, from too few keys."""
    q, k, v, _, _, causal = run.case.args
    out, expected = run.out.double(), run.expected.double()
    length_q, length_k = q.shape[-2], k.shape[-2]
    wrong = [i for i in range(length_q) if not close(out[..., i, :], expected[..., i, :])]
    if not wrong or len(wrong) == length_q:
        return None
    scores = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5   # (..., Lq, Lk)
    seen = {}
    for i in wrong:
        visible = i + 1 if causal else length_k
        seen[i] = next((stop for stop in range(visible - 1, 0, -1)
                        if close(out[..., i:i + 1, :],
                                 scores[..., i:i + 1, :stop].softmax(-1) @ v.double()[..., :stop, :])), None)
        if seen[i] is None:
            return None
    shown = ", ".join(f"row {i} keys 0 to {stop - 1}" for i, stop in list(seen.items())[:3])
    return (f"some query rows are attention over too few keys ({shown}{', ...' if len(seen) > 3 else ''}), while "
            f"every other row is right: your key loop stops before the key block that holds a key they may see. "
            + ("With causal, the key loop runs over range(0, min(Lk, qe), block_k), where qe = min(qs + block_q, "
               "Lq) is already one past the block's last query: not qe - 1, not qs + block_k." if causal else
               "Without causal, every query sees every key: the key loop runs over range(0, Lk, block_k)."))


def _forward_not_finite(runs: list[Run], fn: Any) -> None:
    run = next(run for run in runs if not close(run.out, run.expected))
    if coarse_precision(run.out, run.expected):
        fail("precision", f"{run.case.what}: {HALF_PRECISION}")
    short = _rows_short_of_keys(run)
    if short:   # causal: a key block skipped that holds a key the query may see
        fail("block_skip" if run.case.args[5] else "block_bounds", f"{run.case.what}: {short}")
    # before the future: rows never written hold whatever memory held, which a second call may find changed
    rows = variants.unwritten_rows(run.out, run.expected, run.case.args[3])
    # the query loop is the same with and without causal: right on a case without it whose last query block is as
    # short (Lq % block_q the same), it writes every row here too
    def tail(args: tuple[Any, ...]) -> int:
        return args[0].shape[-2] % args[3]
    loop_right = any(not r.case.args[5] and close(r.out, r.expected) and tail(r.case.args) == tail(run.case.args)
                     for r in runs)
    if rows and not (run.case.args[5] and loop_right):
        fail("block_bounds", f"{run.case.what}: {rows}")
    _future_leaks(run, fn)
    if not torch.isfinite(run.out).all():
        fail("nan", f"{run.case.what} gave NaN or inf. Start each query block with m = -inf, l = 0 and acc = 0, "
                    f"and take exp(s - m_new) after updating m_new; a query must see key 0.")


def _lse_unexplained(runs: list[Run], fn: Any) -> None:
    run = runs[0]
    q, k, _, _, _, causal = run.case.args
    scores = _scores(q, k, causal)
    if float(scores[scores.isfinite()].abs().max()) > 80:   # exp over- or underflows in float32 near here
        fail("overflow", f"{run.case.what}: the output is right but the log-sum-exp is not (it differs by up to "
                         f"{max_diff(run.out, run.expected):.3g}), and only now that scores reach "
                         f"{float(scores[scores.isfinite()].abs().max()):.0f}: your log-sum-exp sums exp(s) "
                         f"itself, which overflows above about 88 and underflows below about -104 (float32). Use "
                         f"the running maximum m and sum l of each row: lse = m + log(l).")
    fail("logsumexp", f"{run.case.what}: the output is right but the log-sum-exp is not: it differs from "
                      f"log(sum_j exp(s_ij)) by up to {max_diff(run.out, run.expected):.3g}, with s the scaled "
                      f"scores; with the running maximum m of those scaled scores and the sum l of each row, lse = "
                      f"m + log(l) (a maximum taken before the scale makes it scale * m + log(l)). The backward "
                      f"(10.3) rebuilds every weight from it, as exp(s - lse).")


def _tiny_forward() -> list[tuple[Any, ...]]:
    generator = torch.Generator().manual_seed(0)
    sizes = ((2, 1, 1, True), (3, 2, 2, False), (3, 2, 2, True), (4, 2, 1, True), (5, 2, 3, True))
    return [(*(tiny(generator, 1, 1, length, 2) for _ in range(3)), block_q, block_k, causal)
            for length, block_q, block_k, causal in sizes]


def _attention_with(factor: float, after: float = 1.0) -> Callable[..., torch.Tensor]:
    """Attention whose scores are multiplied by ``factor``, and its output by ``after``, in float64."""
    return lambda q, k, v, block_q, block_k, causal: (_scores(q, k, causal, factor).softmax(-1) @ v.double()) * after


_FORWARD_SCALES = (
    ScaleFit(lambda *case: _attention_with(case[-1])(*case[:-1]), lambda q, *_: q.shape[-1] ** -0.5,
             "{what}: your scores are multiplied by {factor:.4g} before the softmax, where the exercise asks for "
             "1/sqrt(d) = {right:.4g}, with d = q.shape[-1]."),
    ScaleFit(lambda *case: _attention_with(1.0, case[-1])(*case[:-1]), lambda *_: math.nan,
             "{what}: your scores are not scaled, and your output is multiplied by {factor:.4g} after the softmax. "
             "The factor 1/sqrt(d) belongs to the scores, s = q k^T / sqrt(d), before the running maximum and exp."),
)
_FORWARD_ARGS = ("q", "k", "v", "block_q", "block_k", "causal")
_FORWARD_OUT = FunctionExercise(
    "10.2", "flash_attention",
    lambda q, k, v, block_q, block_k, causal: ref.naive_attention(q.double(), k.double(), v.double(), causal=causal)[0],
    lambda: _forward_cases(_FORWARD_CASES), _FORWARD_ARGS, success="",
    mismatch=lambda run: (f"{run.case.what} differs from attention {_by_up_to(run.out, run.expected)}. "
                          f"For every query block: loop over the key blocks, update m, l and acc (rescaled by "
                          f"exp(m - m_new)), and divide acc by l at the end."),
    mistakes=variants.FORWARD_MISTAKES, variant=lambda *case, spec: variants.forward_variant(*case, **spec)[0],
    scales=_FORWARD_SCALES, dtype=False, diagnose=_forward_not_finite,
    examples=lambda: _forward_cases(_tiny_forward()),
    magnitude=_forward_magnitudes)
_FORWARD_LSE = FunctionExercise(
    "10.2", "flash_attention", lambda q, k, v, block_q, block_k, causal: _lse(_scores(q, k, causal)),
    _FORWARD_OUT.cases, _FORWARD_ARGS, success="", mismatch=lambda run: "", mistakes=_LSE_MISTAKES, each_case=True,
    dtype=False, diagnose=_lse_unexplained, examples=_FORWARD_OUT.examples, magnitude=_forward_magnitudes)


def _forward_example(fn: Any, *_: Any, **__: Any) -> Any:
    """The tiny case where the output differs, else the one where the log-sum-exp does."""
    return function_example(_FORWARD_OUT)(_part(fn, 0)) or function_example(_FORWARD_LSE)(_part(fn, 1))


@checker("10.2", example=_forward_example)
def check_flash_attention(fn: Callable[..., Any]) -> str:
    """``fn(q, k, v, *, block_q, block_k, causal)`` -> (out, lse), tiled, never building the L x L scores."""
    expect_callable(fn, "flash_attention")
    judge(_FORWARD_OUT, _part(fn, 0))
    judge(_FORWARD_LSE, _part(fn, 1))
    _probe_forward(fn, causal=False)
    _probe_forward(fn, causal=True)
    shown = (f"flash_attention(q, k, v, block_q={_BLOCK_Q}, block_k={_BLOCK_K}, causal=False) with Lq = "
             f"{_PROBE_SHAPE[-2]} and Lk = {_SWAP_LENGTH_K}")
    _sizes_not_swapped(_watched(23, lambda q, k, v: call_student(fn, q, k, v, block_q=_BLOCK_Q, block_k=_BLOCK_K,
                                                                 causal=False, what=shown), _SWAP_LENGTH_K), shown)
    _forward_on_device(fn)
    _forward_in_bfloat16(fn)   # after the device probe, as the engine runs its dtype probe after its device probe
    needed, total = ref.causal_blocks(_PROBE_SHAPE[-2], _BLOCK_Q, _BLOCK_K)
    return (f"Output and log-sum-exp equal to attention's, for blocks that do not divide L and block_q != "
            f"block_k; no L x L tensor built, and causal masking computed {needed} of {total} key blocks.")


def _forward_in_bfloat16(fn: Callable[..., Any]) -> None:
    """The dtype probe in bfloat16 (the text asks for every new tensor in q's dtype), without causal and with: m, l
    or acc made in float32 pass the float64 probe, promoted there, but here make a float32 output or log-sum-exp,
    or meet the bfloat16 values in p @ v, which raises. Only the dtypes are judged (a right answer in bfloat16 has
    three digits); statistics kept in float32 with out and lse cast back to q's dtype are right."""
    for case in (_FORWARD_CASES[0], _FORWARD_CASES[2]):
        q, k, v, block_q, block_k, causal = (*in_bfloat16(case[:3]), *case[3:])
        shown = f"{_forward_call(q, k, v, block_q, block_k, causal)}, q, k and v in bfloat16"
        made = _FLOAT32_STATISTICS.format(stats="m and l, or the accumulator acc,")
        result = called_in_bfloat16(lambda q=q, k=k, v=v, block_q=block_q, block_k=block_k, causal=causal, shown=shown:
                                    call_student(fn, q.clone(), k.clone(), v.clone(), block_q=block_q,
                                                 block_k=block_k, causal=causal, what=shown), shown, made)
        if result is None:
            return   # an operation without a bfloat16 kernel: inconclusive
        shape = tuple(q.shape)[:-1] + (v.shape[-1],)
        out, lse = _pair(result, shown, shape)
        expect_dtype_in_bfloat16(expect_tensor(out, shape, f"{shown} (its output)", finite=False),
                                 f"{shown} (its output)", made)
        expect_dtype_in_bfloat16(expect_tensor(lse, shape[:-1], f"{shown} (its log-sum-exp)", finite=False),
                                 f"{shown} (its log-sum-exp)", made + " The log-sum-exp is cast back too: lse in "
                                 "q's dtype, as the exercise asks of every tensor it makes.")


def _forward_on_device(fn: Callable[..., Any]) -> None:
    """The device probe (the text asks for q's device): every case again on meta, the student's function called
    as it is (its output and log-sum-exp both judged): a block's positions, a mask or a buffer made on the CPU
    shows, on the causal path only too."""
    for q, k, v, block_q, block_k, causal in _FORWARD_CASES:
        probe_device(lambda q=q, k=k, v=v, block_q=block_q, block_k=block_k, causal=causal: fn(
            meta(q), meta(k), meta(v), block_q=block_q, block_k=block_k, causal=causal),
            _forward_call(q, k, v, block_q, block_k, causal))


# ============================================================================ 10.3 the backward

# (q shape, block_q, block_k, causal). Square blocks first: a transposed product fits them (and only them),
# so it is named there before the blocks that do not divide L, or block_q != block_k, make it crash.
_BACKWARD_CASES = (((2, 1, 12, 4), 4, 4, True), ((1, 2, 12, 8), 4, 4, False), ((1, 2, 13, 8), 4, 5, False),
                   ((2, 1, 11, 4), 4, 3, True), ((1, 1, 9, 4), 16, 16, True))
# and fewer queries than keys, which 10.2's forward takes without causal: dk and dv have the keys' length
_BACKWARD_CASES_LK = (((1, 2, 6, 8), 10, 4, 4, False),)
_GRADS = ("dq", "dk", "dv")


def _backward_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, block_q: int,
                   block_k: int, causal: bool, shown: str = "") -> Case:
    return Case((q, k, v, grad_out, causal, block_q, block_k), f"FlashAttentionFunction.apply(q, k, v, {causal}, "
                f"{block_q}, {block_k}) with q of shape {tuple(q.shape)}{shown}")


def _backward_cases() -> list[Case]:
    cases = [(shape, None, *blocks) for shape, *blocks in _BACKWARD_CASES] + list(_BACKWARD_CASES_LK)
    return [_backward_case(*_qkv(31 + seed, shape, length_k, spread=1.5),
                           torch.randn(shape, generator=torch.Generator().manual_seed(41 + seed)), *blocks,
                           shown=f" and k of shape {shape[:-2] + (length_k, shape[-1])}" if length_k else "")
            for seed, (shape, length_k, *blocks) in enumerate(cases)]


def _joined(grads: Any) -> torch.Tensor:
    """dq, dk and dv as one tensor, one after another along the sequence axis (dk and dv have the keys' length)."""
    return torch.cat(tuple(grads), dim=-2)   # (N, heads, Lq + 2 Lk, d)


def _tiny_backward() -> list[Case]:
    """Tiny cases for the counter-example, which shows the gradients joined: dq's rows, then dk's, then dv's."""
    generator = torch.Generator().manual_seed(0)
    return [_backward_case(*(tiny(generator, 1, 1, length, 2) for _ in range(4)), *blocks,
                           shown=", its gradients one after another along the sequence axis: dq's rows, then dk's, "
                                 "then dv's")
            for length, *blocks in ((2, 1, 1, True), (3, 2, 2, False), (4, 2, 2, True), (3, 2, 1, True))]


def _gradients_of(cls: Any) -> Callable[..., torch.Tensor]:
    """The student's class as a function of one case's arguments: its dq, dk and dv, joined (``_joined``)."""
    return lambda *case: _joined(_student_grads(cls, *case))


def _student_grads(cls: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, causal: bool,
                   block_q: int, block_k: int) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of the student's class, through its forward and its backward, each checked for its shape; the
    engine's saved_tensors probe watches both passes (an input, grad_out or a saved tensor changed in place)."""
    shown = (f"FlashAttentionFunction.apply(q, k, v, {causal}, {block_q}, {block_k}) with q of shape "
             f"{tuple(q.shape)}" + (f" and k of shape {tuple(k.shape)}" if k.shape != q.shape else ""))

    def forward_output(out: Any) -> None:
        expect_tensor(out, tuple(q.shape), f"{shown} (the forward)", finite=False)
        if out.grad_fn is None:
            fail("exception", f"{shown}: the output has no gradient function; return the forward's output "
                              f"from forward, as given.")

    _, found = forward_backward(cls, (q, k, v, causal, block_q, block_k), grad_out,
                                names=("q", "k", "v", "causal", "block_q", "block_k"), what=shown,
                                check_output=forward_output)
    for name, grad, like in zip(_GRADS, found, (q, k, v)):
        if grad is None:
            fail("gradient", f"{shown}: your backward returned None for {name}, so {name[1:]} gets no gradient "
                             f"and cannot learn; return dq, dk, dv (and None for causal, block_q and block_k).")
        expect_tensor(grad, tuple(like.shape), f"{shown}: your backward's {name}", finite=False)
    return found


def _backward_mismatch(run: Run) -> str:
    lengths = (run.case.args[0].shape[-2], *[run.case.args[1].shape[-2]] * 2)   # dq's rows, dk's, dv's
    wrong = [name for name, got, right in zip(_GRADS, run.out.split(lengths, -2), run.expected.split(lengths, -2))
             if not close(got, right)]
    return (f"{', '.join(wrong)} differ from attention's gradients ({_by_up_to(run.out, run.expected)}). "
            f"Per block: P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dQ += dS K / sqrt(d), "
            f"dK += dS^T Q / sqrt(d), with D = rowsum(dO * O).")


def _backward_precision(runs: list[Run], fn: Any) -> None:
    run = runs[-1]
    if coarse_precision(run.out, run.expected):
        fail("precision", f"{run.case.what}: {HALF_PRECISION}")


def _backward_with(**spec: float) -> Callable[..., torch.Tensor]:
    return lambda *case: _joined(variants.backward_variant(*case, **spec))


_BACKWARD_SCALES = (
    ScaleFit(lambda *case: _backward_with(score_scale=case[-1])(*case[:-1]), lambda q, *_: q.shape[-1] ** -0.5,
             "{what}: your gradients are those of attention whose scores are multiplied by {factor:.4g}, where the "
             "exercise asks for 1/sqrt(d) = {right:.4g}, with d = q.shape[-1]: S = q k^T / sqrt(d) in the forward "
             "and in the recomputation alike."),
    ScaleFit(lambda *case: _backward_with(grad_scale=case[-1])(*case[:-1]), lambda q, *_: q.shape[-1] ** -0.5,
             "{what}: your dQ and dK are multiplied by {factor:.4g}, where the chain rule through S = q k^T / "
             "sqrt(d) brings 1/sqrt(d) = {right:.4g} (d = q.shape[-1]): dQ = dS @ K / sqrt(d) and dK = dS^T @ Q / "
             "sqrt(d)."),
    ScaleFit(lambda *case: _backward_with(recompute_scale=case[-1])(*case[:-1]), lambda q, *_: q.shape[-1] ** -0.5,
             "{what}: your backward recomputes the weights from scores multiplied by {factor:.4g}, where the forward "
             "(whose log-sum-exp you read) multiplied them by 1/sqrt(d) = {right:.4g}, d = q.shape[-1]: P = exp(q "
             "k^T / sqrt(d) - lse)."),
    ScaleFit(lambda *case: _backward_with(recompute_scale=case[-1], grad_scale=case[-1])(*case[:-1]),
             lambda q, *_: q.shape[-1] ** -0.5,
             "{what}: your backward multiplies the scores by {factor:.4g}, in the recomputed weights and in dQ and "
             "dK, where the forward (whose log-sum-exp you read) multiplied them by 1/sqrt(d) = {right:.4g}, d = "
             "q.shape[-1]: P = exp(q k^T / sqrt(d) - lse), dQ = dS @ K / sqrt(d), dK = dS^T @ Q / sqrt(d)."),
)

FLASH_BACKWARD = FunctionExercise(
    "10.3", "FlashAttentionFunction", lambda *case: _joined(variants.backward_variant(*case)), _backward_cases,
    ("q", "k", "v", "grad_out", "causal", "block_q", "block_k"),
    success="dq, dk and dv equal attention's gradients, causal or not, for blocks that do not divide L; no L x L "
            "tensor stored or built: each block's weights are recomputed from the log-sum-exp.",
    mismatch=lambda run: f"{run.case.what}: {_backward_mismatch(run)}", mistakes=variants.BACKWARD_MISTAKES,
    variant=lambda *case, spec: _joined(variants.backward_variant(*case, **spec)), scales=_BACKWARD_SCALES,
    each_case=True, dtype=False,
    examples=_tiny_backward, probes=FunctionExercise.probes + ("saved_tensors",), diagnose=_backward_precision)


@checker("10.3", example=lambda cls, *_, **__: function_example(FLASH_BACKWARD)(_gradients_of(cls)))
def check_flash_backward(cls: Any) -> str:
    """``cls.apply(q, k, v, causal, block_q, block_k)``: gradients of q, k, v equal attention's, by recomputation."""
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        fail("exception", f"Expected your class FlashAttentionFunction itself, a subclass of "
                          f"torch.autograd.Function, got {cls!r}.")
    success = judge(FLASH_BACKWARD, _gradients_of(cls))
    _heads_merged(cls)
    _two_layers(cls)
    _probe_backward(cls)
    _backward_on_device(cls)
    _backward_dtype(cls)
    return success


# (q shape, block_q, block_k, causal) of the call whose output's heads are merged before the loss: heads > 1, so the
# gradient that comes back through the merge is a transposed view
_MERGED = ((2, 3, 10, 4), 4, 3, True)


def _heads_merged(cls: Any) -> None:
    """The output's heads merged as a model does before its output projection, out.transpose(1, 2).reshape(N, L,
    heads * d), then a loss: the gradient the student's backward is given is then a transposed view, not contiguous
    (autograd hands it over as the merge's backward makes it), and .view on it raises. Run first with a contiguous
    gradient of the same shape: an error there is not about memory, and is judged as it is."""
    shape, block_q, block_k, causal = _MERGED
    n, heads, length, d = shape
    q, k, v = _qkv(71, shape, spread=1.5)
    merged = torch.randn(n, length, heads * d, generator=torch.Generator().manual_seed(72))   # (N, L, heads * d)
    grad_out = merged.view(n, length, heads, d).transpose(1, 2)             # (N, heads, L, d), not contiguous
    args, names = (q, k, v, causal, block_q, block_k), ("q", "k", "v", "causal", "block_q", "block_k")
    shown = (f"FlashAttentionFunction.apply(q, k, v, {causal}, {block_q}, {block_k}) with q of shape {shape}, its "
             f"output's heads then merged as a model does, out.transpose(1, 2).reshape({n}, {length}, {heads * d}), "
             f"before the loss")
    _, plain = forward_backward(cls, args, grad_out.contiguous(), names=names,
                                what=f"FlashAttentionFunction.apply(q, k, v, {causal}, {block_q}, {block_k}) with q "
                                     f"of shape {shape}")
    try:
        _, found = forward_backward(cls, args, grad_out, names=names, what=shown)
    except Failure as failure:
        if failure.diagnosis != "exception":
            raise
        said = failure.message.split(" raised ", 1)[-1].split(" Tip:", 1)[0].rstrip(". ")
        fail("exception", f"{shown}: your backward raised {said[:200]}. It runs when grad_out is contiguous, but "
                          f"through the merge the gradient your backward is given is a transposed view, not "
                          f"contiguous in memory, and .view needs contiguous memory. Use .reshape(...) (it copies "
                          f"only where it must), or grad_out.contiguous() before .view(...).")
    expected = variants.backward_variant(q, k, v, grad_out, causal, block_q, block_k)
    if all(isinstance(g, torch.Tensor) and g.shape == e.shape for g, e in zip(found, expected)) and \
            close(_joined(found), _joined(expected)):
        return
    right_when_contiguous = all(isinstance(g, torch.Tensor) and g.shape == e.shape for g, e in zip(plain, expected)) \
        and close(_joined(plain), _joined(expected))
    if right_when_contiguous:
        fail("mismatch", f"{shown}: your dq, dk and dv are wrong, though right for the same gradient laid out "
                         f"contiguously: through the merge grad_out is a transposed view, and your backward reads "
                         f"its memory as if it were in order (untyped_storage, as_strided, .numpy().ravel(), "
                         f"data_ptr). Use grad_out as a tensor: its indexing follows its strides; .contiguous() lays "
                         f"it out in order first where a copy in order is needed.")
    found = tuple(g if isinstance(g, torch.Tensor) and g.shape == e.shape else torch.full_like(e, float("nan"))
                  for g, e in zip(found, expected))
    fail("mismatch", f"{shown}: {_backward_mismatch(Run(Case(args, shown), _joined(found), _joined(expected)))}")


def _raw_gradients(cls: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, causal: bool,
                   block_q: int, block_k: int) -> tuple[Any, ...]:
    """The forward, then the student's backward called by hand on its ctx (the output's grad_fn): dq, dk, dv as the
    backward returns them, before autograd casts them to the inputs' dtype (and refuses another device)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out = cls.apply(*leaves, causal, block_q, block_k)
        return tuple(cls.backward(out.grad_fn, grad_out)[:3])


def _backward_on_device(cls: Any) -> None:
    """The device probe (the text asks for the inputs' device): every case again on meta, forward and backward: dq,
    dk, dv or a mask made on the CPU shows."""
    for case in _backward_cases():
        q, k, v, grad_out, causal, block_q, block_k = case.args
        on_meta = (meta(q), meta(k), meta(v), meta(grad_out))
        settings = (causal, block_q, block_k)
        probe_device(lambda on_meta=on_meta, settings=settings: _raw_gradients(cls, *on_meta, *settings),
                     f"{case.what}, forward then backward")


def _backward_dtype(cls: Any) -> None:
    """The dtype probe: float64 q, k, v, in the notebook's default dtype and then in a float64 notebook. Autograd
    casts a float32 dq back to q's dtype, so only the backward's own return shows that the sums ran in float32."""
    q, k, v, grad_out, causal, block_q, block_k = _backward_cases()[3].args
    for notebook in (contextlib.nullcontext, float64_notebook):
        with notebook():
            shown = (f"FlashAttentionFunction.apply(q, k, v, {causal}, {block_q}, {block_k}) with float64 q, k, v "
                     f"of shape {tuple(q.shape)}" + (" in a float64 notebook" if notebook is float64_notebook else ""))
            try:
                grads = call_student(lambda: _raw_gradients(cls, q.double(), k.double(), v.double(), grad_out.double(),
                                                            causal, block_q, block_k), what=shown)
            except Failure as failure:
                if failure.diagnosis != "exception":
                    raise
                return   # a backward that runs through autograd only: judged there
            for name, grad in zip(_GRADS, grads):
                if isinstance(grad, torch.Tensor) and grad.dtype != torch.float64:
                    fail("dtype", f"{shown}: your backward returns {name} of dtype {grad.dtype}. Autograd casts it "
                                  f"back to float64, but every sum into it was rounded to {grad.dtype} first. Make "
                                  f"dq, dk and dv like q, k and v: torch.zeros_like(q) (torch.zeros(q.shape) takes "
                                  f"the default dtype, and the CPU).")
    # bfloat16, where a float32 tensor of the backward (D summed with dtype=torch.float32) is not promoted away as
    # float64 promotes it: it meets a bfloat16 block in a matmul, or comes out float32
    shown = (f"FlashAttentionFunction.apply(q, k, v, {causal}, {block_q}, {block_k}) with bfloat16 q, k, v of shape "
             f"{tuple(q.shape)}")
    made = ("A tensor of your backward is made in float32 whatever the inputs' dtype (D or a statistic summed with "
            "dtype=torch.float32, torch.zeros without dtype=, .float()): float64 inputs hide it.")
    low = [t.to(torch.bfloat16) for t in (q, k, v, grad_out)]
    grads = called_in_bfloat16(lambda: call_student(lambda: _raw_gradients(cls, *low, causal, block_q, block_k),
                                                    what=shown), shown, made)
    for grad in grads or ():
        expect_dtype_in_bfloat16(grad, shown, made)


# Two calls whose backwards are pending at once, as two attention layers of a model make them: other numbers,
# and causal then not (an encoder-decoder's two kinds of attention), one shape so that nothing fails on it.
_TWO_LAYERS = (((1, 2, 12, 8), 4, 3, True), ((1, 2, 12, 8), 4, 3, False))


def _two_layers(cls: Any) -> None:
    """``kept_state`` when the gradients go wrong (or the backward raises) once two forwards ran before their
    backwards, the later call's backward first, as autograd runs two layers: the Function keeps what its backward
    needs on the class, the module or a global, where the second forward overwrites the first one's."""
    calls = []
    for seed, (shape, block_q, block_k, causal) in enumerate(_TWO_LAYERS):
        q, k, v = _qkv(51 + seed, shape, spread=1.5)
        grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(61 + seed))
        calls.append(((q, k, v, causal, block_q, block_k), grad_out))
    for first_backward_first in (False, True):
        _backwards_in_order(cls, calls, first_backward_first)


def _backwards_in_order(cls: Any, calls: list[Any], first_backward_first: bool) -> None:
    (shape, block_q, block_k, _), _ = _TWO_LAYERS
    order = ("the first call's first, as two losses' backwards run one after the other" if first_backward_first
             else "the second call's first, as autograd runs them")
    shown = (f"FlashAttentionFunction.apply called twice, as two attention layers do (q, k, v of shape {shape}, "
             f"block_q={block_q}, block_k={block_k}, causal=True, then other numbers with causal=False), and then "
             f"their two backwards, {order}")
    advice = ("Keep everything the backward needs on ctx, which is the call's own: ctx.save_for_backward(q, k, v, "
              "out, lse) for tensors and ctx.causal = causal (and the block sizes) for the rest, and read them back "
              "from ctx (ctx.saved_tensors) in backward.")
    try:
        found, kept = in_flight_together(cls, calls, what=shown, first_backward_first=first_backward_first)
    except Failure as failure:
        if failure.diagnosis != "exception":
            raise
        fail("kept_state", f"{shown}: your backward raised ({failure.message.split(': ', 1)[-1][:160]}), though "
                           f"each call alone, forward then backward, works: it reads something a later forward "
                           f"changed. {advice}")
    places = ", ".join(kept[:3])
    for index, (((q, k, v, causal, block_q, block_k), grad_out), grads) in enumerate(zip(calls, found)):
        expected = variants.backward_variant(q, k, v, grad_out, causal, block_q, block_k)
        if grads is not None and all(isinstance(g, torch.Tensor) and g.shape == e.shape
                                     for g, e in zip(grads, expected)) and close(_joined(grads), _joined(expected)):
            continue
        off = (f" (by up to {max_diff(_joined(grads), _joined(expected)):.3g})" if grads is not None and all(
            isinstance(g, torch.Tensor) and g.shape == e.shape for g, e in zip(grads, expected)) else "")
        fail("kept_state", f"{shown}: the {('first', 'second')[index]} call's dq, dk and dv are wrong{off}, though "
                           f"each call alone, forward then backward, gets them right. Your forward keeps what its "
                           f"backward needs outside ctx"
                           + (f" ({places}, set by the forward)" if places else " (on the class, the module or a "
                                                                                 "global)")
                           + f", so the second forward overwrote what the first call's backward reads (or a stack there "
                             f"handed one call's backward the other's). {advice}")


def _probe_backward(cls: Any) -> None:
    length = _PROBE_SHAPE[-2]
    shown = f"FlashAttentionFunction with L = {length}"
    record = _watched(22, lambda q, k, v: _student_grads(cls, q, k, v, torch.randn_like(q), True, _BLOCK_Q, _BLOCK_K))
    full = record.score_shaped(length, length)
    if full is not None:
        fail("full_scores", f"{shown}: your forward or backward materialised a tensor of shape {full}, the L x L = "
                            f"{length} x {length} scores or more. The backward should rebuild one (block_q, "
                            f"block_k) block of weights at a time, exp(s - lse), and never store or build them all.")
    _tiles_as_given(record, f"{shown} (block_q={_BLOCK_Q}, block_k={_BLOCK_K})")
    _backward_skips(record, shown)
    shown = f"FlashAttentionFunction with Lq = {length} and Lk = {_SWAP_LENGTH_K}, causal=False"
    _sizes_not_swapped(_watched(24, lambda q, k, v: _student_grads(cls, q, k, v, torch.randn_like(q), False, _BLOCK_Q,
                                                                  _BLOCK_K), _SWAP_LENGTH_K),
                       f"{shown} (block_q={_BLOCK_Q}, block_k={_BLOCK_K})")


def _backward_skips(record: Record, shown: str) -> None:
    """Causal: every pass over the blocks (the forward's, and the backward's scores and dO V^T, in one loop or
    several) skips the future key blocks. The score products computed are then a whole number of skipping
    passes; a pass that skips none adds a whole matrix's worth, and no small number of skipping passes makes
    the same total (20 and 32 blocks at the probe's sizes)."""
    batch, heads, length, _ = _PROBE_SHAPE
    needed, total = ref.causal_blocks(length, _BLOCK_Q, _BLOCK_K)
    blocks, rest = divmod(record.score_elements, _BLOCK_Q * _BLOCK_K * batch * heads)
    passes = [(skipping, full) for skipping in range(8) for full in range(8 - skipping)
              if skipping * needed + full * total == blocks]
    if rest == 0 and passes and all(full for _, full in passes):
        fail("block_skip", f"{shown}, causal: your backward computes the scores of every key block, also those "
                           f"whose first key comes after the query block's last query ({total} blocks a pass "
                           f"where {needed} hold a key any query of the block may see). Skip them as the forward "
                           f"does: the key loop stops before the query block's end, range(0, min(Lk, qe), "
                           f"block_k).")
