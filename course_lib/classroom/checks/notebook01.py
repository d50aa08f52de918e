"""Exercises of notebook 01 (attention from scratch): 1.1 toy prediction, 1.2 toy_attention,
1.3 scaled_dot_product_attention.

1.2 and 1.3 are declarations the engine runs (``engine.judge``): cases, reference, mistakes, messages.
When no known mistake reproduces the output, each probes the attention weights (``_attn_hypotheses``).
1.1 is a prediction written by hand, judged by a procedure of its own. Hints are in ``classroom.exercises``.
"""
from __future__ import annotations

import decimal
import math
import numbers
from collections.abc import Callable, Iterator, ValuesView
from dataclasses import replace
from typing import Any

import torch

from ... import attention as ref
from ..exercises import Mistake
from ..verdict import Failure, fail
from ._attn_hypotheses import SDPA_HYPOTHESES, diagnose_weights, fit_scale, identity_values, sdpa_variant, shape_str
from ._counterexample import Example
from ._device_probe import meta
from ._device_probe import probe as probe_device
from ._student_code import (
    HALF_PRECISION,
    call,
    call_student,
    close,
    coarse_precision,
    expect_finite,
    expect_tensor,
    max_diff,
    reraise_with,
)
from ._student_files import value_text
from .engine import Case, FunctionExercise, checker, function_example, judge
from .engine.example import SEEDS, tiny
from .engine.function import Run, keeps_number, kept_part
from .engine.probes import magnitude_scores
from .engine.scale_fit import kept_factor

__all__ = ["check_toy_prediction", "check_toy_attention", "check_scaled_dot_product_attention"]


# ============================================================================ 1.1 toy prediction

_TOY_QUERY = torch.tensor([0.0, 1.0])
# The worked example's keys and values as the course defines them, copied when the checks load: the notebook's own
# tensors are the student's to change (an in-place change must not move the answer to match a wrong prediction).
_TOY_KEYS, _TOY_VALUES = ref.TOY_KEYS.clone(), ref.TOY_VALUES.clone()
_TOY_TOLERANCE = 0.01   # predictions may be rounded to two decimals


def _plain(value: Any) -> Any:
    """Python numbers torch cannot read (a Fraction, a Decimal, numpy's 0-d arrays) as floats, in lists, tuples
    and any ordered collection of numbers (a generator, a map, a dict's values, a range) too."""
    if isinstance(value, (list, tuple, range, Iterator, ValuesView)):
        return [_plain(v) for v in value]
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item") and not isinstance(value, torch.Tensor):
        return _plain(value.item())   # a numpy 0-d array: a number in a box
    if getattr(getattr(value, "dtype", None), "kind", None) == "f" and hasattr(value, "astype"):
        return value.astype("float64")   # numpy's long double, which torch cannot read
    return value


def _numbers(value: Any, name: str) -> torch.Tensor:
    if value is None:
        fail("not_implemented", f"`{name}` is still None: write down your prediction, then run this cell again.")
    try:
        numbers = (value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(_plain(value)))
        if numbers.is_meta or numbers.is_complex():
            raise TypeError("not real numbers")
        if numbers.numel() > 1000:   # the callers name its shape as wrong; converting it could fill memory
            return torch.empty(numbers.shape, dtype=torch.float64, device="meta")
        return numbers.to(torch.float64)
    except Exception:  # anything that is not numbers
        fail("dtype", f"`{name}` should be numbers (a float, or a list or tensor of floats), got "
                      f"{type(value).__name__}: {value_text(value, 60)}")


def _prediction_example(weights: Any, result: Any) -> Example | None:
    """1.1's counter-example: the worked example itself, your weights beside the softmax of the scores."""
    try:
        w = _numbers(weights, "weights").flatten()
    except Failure:
        return None
    query, keys = _TOY_QUERY.double(), _TOY_KEYS.double()
    expected = (keys @ query).softmax(0)                                       # (3,)
    if w.shape != expected.shape or torch.allclose(w, expected, atol=_TOY_TOLERANCE, rtol=0):
        return None
    return Example("the weights of toy attention for the query [0, 1]", [("query", query), ("TOY_KEYS", keys)],
                   w, expected, [("scores (TOY_KEYS @ query)", keys @ query)])


@checker("1.1", example=_prediction_example)
def check_toy_prediction(weights: Any, result: Any) -> str:
    """Your predicted ``weights`` (3,) and ``result`` for query [0, 1] on TOY_KEYS / TOY_VALUES."""
    w = _numbers(weights, "weights")
    if w.numel() != 3:
        fail("shape", f"`weights` should hold three numbers, one per key, got shape {tuple(w.shape)}.")
    w = w.flatten()
    if not torch.isfinite(w).all():
        fail("nan", "`weights` contains NaN or infinity: every weight is a number between 0 and 1.")
    keys, values = _TOY_KEYS.double(), _TOY_VALUES.double()
    scores = keys @ _TOY_QUERY.double()                                       # (3,)
    expected = scores.softmax(0)

    def near(other: torch.Tensor) -> bool:
        return bool(torch.allclose(w, other, atol=_TOY_TOLERANCE, rtol=0))

    if not near(expected):
        if near(scores):
            fail("normalization", "These are the raw scores (the dot products of the query with each key), or "
                                  "all the weight on the best key. A softmax gives every key a share: "
                                  "exp(score) divided by the sum of the three exps.")
        # 1/4, 1/2, 1/4, tried before the 1/sqrt(2)-scaled softmax, which rounds to the same numbers
        if near(2.0 ** scores / (2.0 ** scores).sum()):
            fail("scale", "Your weights are 2^score over their sum: a softmax raises e, not 2, to each score "
                          "(e ≈ 2.718, so the middle key gets e / (e + 2) ≈ 0.58). (The same numbers, rounded, "
                          "come from scaling the scores by 1/sqrt(2), which toy attention does not do either.)")
        if near((scores * 2 ** -0.5).softmax(0)):
            fail("scale", "You scaled the scores by 1/sqrt(2). Toy attention has no scaling (that comes in "
                          "exercise 1.3): take the softmax of the plain dot products.")
        if abs(float(w.sum()) - 1) > 2 * _TOY_TOLERANCE:
            fail("normalization", f"Your weights sum to {float(w.sum()):.3g}; attention weights come out of a "
                                  f"softmax, so they sum to one.")
        if near((keys @ torch.tensor([1.0, 0.0], dtype=torch.float64)).softmax(0)):
            fail("mismatch", "These are the weights for the query [1, 0]; this exercise asks about the "
                             "query [0, 1].")
        if near(torch.full((3,), 1 / 3, dtype=torch.float64)):
            fail("mismatch", "Equal weights ignore the query: the key that points the same way as the query "
                             "should get the largest weight.")
        if bool(torch.allclose(w, expected, atol=0.05 + 1e-9, rtol=0)):   # within one-decimal rounding
            fail("precision", f"Your weights {[round(float(x), 3) for x in w]} are close to the softmax of the "
                              f"scores, but off by up to {float((w - expected).abs().max()):.2g}, more than "
                              f"rounding to two decimals explains: compute them to two decimals or more, with "
                              f"e = 2.718... (math.exp), from the plain dot products.")
        fail("mismatch", f"Your weights {[round(float(x), 3) for x in w]} are not the softmax of the scores. "
                         f"Compute the dot product of [0, 1] with each key, then the softmax of those three "
                         f"scores (keep them in the order of TOY_KEYS).")
    r = _numbers(result, "result")
    if r.numel() != 1:
        fail("shape", f"`result` should be a single number (the values are scalars), got shape "
                      f"{tuple(r.shape)}.")
    r = float(r.flatten()[0])
    if not math.isfinite(r):   # NaN compares as far from nothing
        fail("nan", f"`result` is {r}: it is the weighted average of the values, a number between the smallest and "
                    f"the largest of them.")
    own = float(w @ values)   # a result worked out from the student's own rounded weights is right too
    if abs(r - float(expected @ values)) > _TOY_TOLERANCE and abs(r - own) > _TOY_TOLERANCE:
        hint = (" You added the values without weighting them." if abs(r - float(values.sum())) < 1e-6
                else " Did you use the scores instead of the weights?" if abs(r - float(scores @ values)) < 1e-6
                else "")
        fail("mismatch", f"Your weights are right, but the result {r:.4g} is not their weighted average of the "
                         f"values ({own:.4g} with your weights): multiply each value by its weight and add up.{hint}")
    return ("Right: the second key matches the query, the first and third tie, and by symmetry the "
            "weighted average lands exactly on the middle value.")



# ============================================================================ 1.2 toy attention

def _toy_case(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, call: str | None = None) -> Case:
    what = call or (f"toy_attention(query, keys, values) with query {shape_str(query.shape)}, keys "
                    f"{shape_str(keys.shape)}, values {shape_str(values.shape)}")
    return Case((query, keys, values), what, (("scores (keys @ query)", keys @ query),))


def _toy_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(11)
    q, keys = torch.randn(3, generator=gen), torch.randn(5, 3, generator=gen)
    return [
        _toy_case(_TOY_QUERY.clone(), _TOY_KEYS.clone(), _TOY_VALUES.clone()),
        _toy_case(q, keys, torch.randn(5, generator=gen)),
        _toy_case(q, keys, torch.randn(5, 2, generator=gen)),
        _toy_case(torch.randn(4, generator=gen), torch.randn(1, 4, generator=gen), torch.randn(1, 3, generator=gen)),
        # one feature (d = 1), as "any dimension d" allows: a query.squeeze() makes it a number
        _toy_case(torch.randn(1, generator=gen), torch.randn(4, 1, generator=gen), torch.randn(4, 2, generator=gen)),
    ]


def _one_value_feature(runs: list[Run], fn: Any) -> None:
    """Every case right: values of one feature, (n, 1), give a result of shape (1,), not a scalar (a .squeeze())."""
    gen = torch.Generator().manual_seed(12)
    case = _toy_case(torch.randn(3, generator=gen), torch.randn(5, 3, generator=gen), torch.randn(5, 1, generator=gen))
    out, expected = call_student(fn, *case.given(), what=case.what), ref.toy_attention(*case.args)
    expect_tensor(out, (1,), case.what)
    if not close(out, expected):
        query, keys, values = case.given()
        if not close(call_student(fn, query, keys, values[:, 0], what=case.what), expected[0]):   # (n,) too
            fail("kept_state", kept_part(case.what, "on new keys", out, expected))
        fail("mismatch", f"{case.what}: your result differs from the reference by up to {max_diff(out, expected):.3g}, "
                         f"though it is right for values of shape (n,) and (n, 2).")


def _toy_examples() -> list[Case]:   # the same cases, tiny: (n keys, d features), one decimal
    sizes = [(n, d, torch.Generator().manual_seed(seed)) for n, d in ((1, 1), (2, 1), (2, 2), (3, 2)) for seed in SEEDS]
    return [_toy_case(tiny(g, d), tiny(g, n, d), tiny(g, n), "toy_attention(query, keys, values)") for n, d, g in sizes]


def _toy_reword(failure: Failure, case: Case, out: Any, fn: Any) -> None:
    query, keys, _ = case.args
    if failure.diagnosis == "shape" and tuple(failure.details.get("got", ())) == (keys.shape[0],):
        if close(out, torch.softmax(keys @ query, dim=0)):
            reraise_with(failure, "shape", " Those are the attention weights: return the weighted sum of the values.")
        reraise_with(failure, "shape", " That is one number per key instead of a single weighted sum: check how "
                                       "your weights and values broadcast when values has shape (n,).")


def _toy_diagnose(runs: list[Run], fn: Any) -> None:
    for run in runs:
        expect_finite(run.out, f"toy_attention with keys {shape_str(run.case.args[1].shape)}")
    query, keys, _ = runs[1].case.args
    try:   # values = one-hot rows, so the output is the weights themselves
        weights = call(fn, query.clone(), keys.clone(), torch.eye(keys.shape[0]), what="toy_attention")
    except Failure:
        weights = None
    if isinstance(weights, torch.Tensor) and weights.shape == (keys.shape[0],):
        diagnose_weights(weights[None].double(), (keys @ query)[None].double(), None, 1.0,
                         key_axis="the keys", scale_name="1 (no scaling in toy attention)",
                         scores_name="keys @ query", inputs="what you multiply: each key with the query")


TOY_ATTENTION = FunctionExercise(
    "1.2", "toy_attention", lambda query, keys, values: ref.toy_attention(query, keys, values), _toy_cases,
    ("query", "keys", "values"),
    success="Matches toy_attention on the worked example and on random keys with scalar and vector values.",
    mismatch=lambda run: (
        f"For keys of shape {shape_str(run.case.args[1].shape)} and values of shape "
        f"{shape_str(run.case.args[2].shape)} your output differs from the reference by up to "
        f"{max_diff(run.out, run.expected):.3g}. Check the three steps: dot products of the query with each key, "
        f"softmax, weighted sum of the values."),
    mistakes=(
        Mistake("scale", "You scale the scores by 1/sqrt(d). Toy attention has no scaling yet (that comes in "
                         "exercise 1.3): take the softmax of the plain dot products.",
                output=lambda q, keys, v: (keys @ q * q.shape[0] ** -0.5).softmax(0) @ v),
        Mistake("normalization", "You weight the values by the raw scores: turn the scores into weights with a "
                                 "softmax first, so they are positive and sum to one.",
                output=lambda q, keys, v: (keys @ q) @ v),
        Mistake("normalization", "You exponentiate the scores but never divide by their sum, so the weights do "
                                 "not sum to one: that division is the other half of the softmax.",
                output=lambda q, keys, v: (keys @ q).exp() @ v),
        Mistake("softmax_dim", "Every key gets weight 1: your result is the plain sum of the values, as a softmax "
                               "over an axis of length one gives. Weight each value by the softmax of the n scores, "
                               "one per key.",
                output=lambda q, keys, v: torch.ones_like(keys @ q) @ v),
        Mistake("mismatch", "Your weights favour the keys that point away from the query: a larger dot product "
                            "means a better match, and should get more weight.",
                output=lambda q, keys, v: (-(keys @ q)).softmax(0) @ v),
        Mistake("mismatch", "Every key gets the same weight, whatever the query: the weights must come from the "
                            "dot products of the query with the keys.",
                output=lambda q, keys, v: torch.full_like(keys @ q, 1 / keys.shape[0]) @ v),
    ),
    reword=_toy_reword, diagnose=_toy_diagnose, examples=_toy_examples, after=_one_value_feature,
    gradients=lambda: [replace(_toy_cases()[2], what="toy_attention(query, keys, values) with values (n, dv)"),
                       replace(_toy_cases()[1], what="toy_attention(query, keys, values) with values (n,)")],
    magnitude=lambda: [Case((q, keys, values), f"toy_attention(query, keys, values) with {how}")
                       for query, keys0, values in (c.args for c in _toy_cases()[1:3])
                       for q, keys, how in magnitude_scores(query, keys0)],
)


@checker("1.2", example=function_example(TOY_ATTENTION))
def check_toy_attention(fn: Callable[..., Any]) -> str:
    """``fn(query (d,), keys (n, d), values (n,) or (n, dv))`` as ``course_lib.toy_attention``."""
    return judge(TOY_ATTENTION, fn)


# ============================================================================ 1.3 scaled dot-product attention

def _random_mask(lq: int, lk: int, gen: torch.Generator) -> torch.Tensor:
    """A bool (lq, lk) mask where every query keeps at least one key and hides at least one."""
    mask = torch.rand(lq, lk, generator=gen) < 0.5
    order = torch.argsort(torch.rand(lq, lk, generator=gen), dim=-1)
    mask.scatter_(1, order[:, :1], True)
    mask.scatter_(1, order[:, 1:2], False)
    return mask


_LARGE = 200.0


def _sdpa_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               call: str | None = None) -> Case:
    """Without a mask the student's function is called with three arguments: mask=None is its default."""
    what = call or (f"scaled_dot_product_attention with q {shape_str(q.shape)}, k {shape_str(k.shape)}, "
                    f"v {shape_str(v.shape)}"
                    + ("" if mask is None else f" and a mask of shape {shape_str(mask.shape)}"))
    notes = (("scores = q @ k^T / sqrt(d) (the reference's)", q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5),)
    return Case((q, k, v) + (() if mask is None else (mask,)), what, notes)


def _sdpa_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(13)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    head_mask = torch.stack([_random_mask(5, 5, gen) for _ in range(2)])[:, None]    # (2, 1, 5, 5)
    padding = torch.ones(2, 1, 6, dtype=torch.bool)                                    # (N, 1, Lk)
    padding[1, :, 4:] = False                                                          # the second sequence padded
    return [
        _sdpa_case(r(2, 5, 8), r(2, 6, 8), r(2, 6, 3)),
        _sdpa_case(r(2, 3, 4, 8), r(2, 3, 4, 8), r(2, 3, 4, 5)),
        _sdpa_case(r(3, 4, 8), r(3, 6, 8), r(3, 6, 3), _random_mask(4, 6, gen)),
        _sdpa_case(r(2, 6, 16), r(2, 6, 16), r(2, 6, 4), ref.causal_mask(6).expand(2, 6, 6).clone()),
        _sdpa_case(r(2, 2, 5, 8), r(2, 2, 5, 8), r(2, 2, 5, 4), head_mask),
        _sdpa_case(r(2, 1, 8), r(2, 4, 8), r(2, 4, 3)),
        _sdpa_case(r(4, 8), r(5, 8), r(5, 3)),                                 # no batch axis at all
        _sdpa_case(r(2, 4, 8), r(2, 6, 8), r(2, 6, 3), padding),               # one row of keys for every query
        # large scores (hundreds): a softmax written as exp(s) / sum(exp(s)) overflows here. No mask:
        # masking after the softmax and renormalising is right, but underflows to 0/0 with such scores.
        _sdpa_case(r(2, 4, 8) * _LARGE, r(2, 4, 8), r(2, 4, 3)),
    ]


def _sdpa_examples() -> list[Case]:   # the same cases, tiny: (length, d, masked), one decimal
    cases = []
    for length, d, masked in ((1, 1, False), (2, 2, False), (3, 2, False), (2, 2, True), (3, 2, True)):
        for seed in SEEDS:
            g = torch.Generator().manual_seed(seed)
            q, k, v = (tiny(g, 1, length, d) for _ in range(3))
            mask = ref.causal_mask(length)[None] if masked else None
            shown = f"scaled_dot_product_attention(q, k, v{', mask' if masked else ''})"
            cases.append(_sdpa_case(q, k, v, mask, shown))
    return cases


def _sdpa_reword(failure: Failure, case: Case, out: Any, fn: Any) -> None:
    q, k = case.args[0], case.args[1]
    if len(case.args) == 3 and failure.diagnosis == "exception" and _works_with_a_mask(fn, case):
        reraise_with(failure, "exception", " Your function works when a mask is given but not without one: "
                                           "mask=None (the default) means every query may attend to every key, "
                                           "so only apply the mask when there is one.")
    if failure.diagnosis == "shape" and tuple(failure.details.get("got", ())) == tuple(q.shape[:-1]) + (k.shape[-2],):
        reraise_with(failure, "shape", " That is the shape of the attention weights (one per query and key): "
                                       "multiply them by v.")


def _works_with_a_mask(fn: Callable[..., Any], case: Case) -> bool:
    """Whether ``fn`` runs on the failing case's own q, k, v once given a mask that hides nothing (what
    mask=None means): then it is the missing mask, not the shapes, that it cannot take."""
    q, k, v = (t.clone() for t in case.args)
    everything = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)   # (Lq, Lk): every key visible
    try:
        out = call_student(fn, q, k, v, everything, what="scaled_dot_product_attention")
    except Failure:
        return False
    return isinstance(out, torch.Tensor) and out.shape == q.shape[:-1] + v.shape[-1:]


def _sdpa_diagnose(runs: list[Run], fn: Any) -> None:
    finite = [bool(torch.isfinite(run.out).all()) for run in runs]
    # NaN only on the large scores, and right on every other case: the softmax overflows (a shift that is wrong
    # everywhere, each column's maximum, is judged on the ordinary cases below)
    if finite[:-1] == [True] * (len(runs) - 1) and not finite[-1] and \
            all(close(run.out, run.expected) for run in runs[:-1]):
        q, k = runs[-1].case.args[:2]
        largest = float((q @ k.transpose(-2, -1)).abs().max()) * q.shape[-1] ** -0.5
        fail("nan", f"Your function gives NaN when the scores are large (here up to about {largest:.0f}): exp of "
                    f"a large number overflows to inf (inf / inf is NaN), or every weight of a row rounds to 0 "
                    f"(0 / 0 is NaN). Subtract each row's maximum score before exponentiating (the softmax does not "
                    f"change), or use torch.softmax, which does this for you.")
    read = []   # (run, its weights read back, the keys each query may see), in the order of the calls
    for run in runs:
        q, k = run.case.args[:2]
        mask = run.case.args[3] if len(run.case.args) == 4 else None
        try:
            weights = call_student(fn, *(a.clone() for a in (q, k, identity_values(k))),
                                   *(() if mask is None else (mask.clone(),)), what="scaled_dot_product_attention")
        except Failure:
            continue
        if isinstance(weights, torch.Tensor) and weights.shape == q.shape[:-1] + (k.shape[-2],):
            read.append((run, weights.double(), None if mask is None else mask.expand(weights.shape)))
    scores = lambda run: (run.case.args[0] @ run.case.args[1].transpose(-2, -1)).double()
    full = lambda weights, allowed: torch.ones_like(weights, dtype=torch.bool) if allowed is None else allowed
    # a factor that was right for an earlier call, kept from it (held by the function, not written in)
    kept_factor([(f"scaled_dot_product_attention with q {shape_str(run.case.args[0].shape)}",
                  fit_scale(weights, scores(run), full(weights, allowed)) if bool(torch.isfinite(weights).all())
                  else None, run.case.args[0].shape[-1] ** -0.5) for run, weights, allowed in read],
                lambda factor: keeps_number(fn, factor))
    # masked cases first: they show the most
    for run, weights, allowed in sorted(read, key=lambda item: item[2] is None):
        try:
            diagnose_weights(weights, scores(run), allowed, run.case.args[0].shape[-1] ** -0.5)
        except Failure as failure:
            if failure.diagnosis == "scale":
                _scale_from_a_size(run, runs)
            raise
    for run in runs:   # after the weights: a wrong shift of the softmax that gives NaN is named from its weights
        expect_finite(run.out, f"scaled_dot_product_attention with q {shape_str(run.case.args[0].shape)}")
    probed = bool(read)
    run = next(run for run in runs if not close(run.out, run.expected))
    q, k, v = run.case.args[:3]
    if all(coarse_precision(run.out, run.expected) for run in runs if not close(run.out, run.expected)):
        fail("precision", f"For q {shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)}: "
                          f"{HALF_PRECISION} (Off by up to {max_diff(run.out, run.expected):.3g}.)")
    where = ("although the attention weights look right: check how you combine them with v." if probed else
             "Check each step: scores q k^T over the last two axes, scaling, mask, softmax over the keys, times v.")
    fail("mismatch", f"For q {shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)} your output "
                     f"differs from the reference by up to {max_diff(run.out, run.expected):.3g}, {where}")


# What each axis of q, k and v holds, counted from the end (the batch axes before them have no name of their own).
_AXES = {("q", -1): "d, the size of each vector", ("q", -2): "Lq, the number of queries",
         ("k", -1): "d, the size of each vector", ("k", -2): "Lk, the number of keys",
         ("v", -1): "dv, the size of each value", ("v", -2): "Lk, the number of keys"}
_POWERS = ((0.5, "1/sqrt({size})"), (1.0, "1/{size}"))   # a size under a square root, or the size itself


def _axis_meaning(name: str, shape: torch.Size, axis: int) -> str:
    back = axis - len(shape) if axis >= 0 else axis
    if (name, back) in _AXES:
        return _AXES[name, back]
    return "H, the number of heads" if len(shape) == 4 and back == -3 else "N, the batch size"


def _size(run: Run, index: int, axis: int) -> int | None:
    """The size of axis ``axis`` of the call's argument ``index`` (q, k, v), None where it has no such axis."""
    shape = run.case.args[index].shape
    return shape[axis] if -len(shape) <= axis < len(shape) else None


def _sdpa_scaled(run: Run, factor: float) -> torch.Tensor:
    """The reference on the call's own inputs, with ``factor`` on the scores."""
    q, k, v, *mask = run.case.args
    return sdpa_variant(q, k, v, mask[0] if mask else None, {"scale": float(factor)})


def _scale_from_a_size(run: Run, runs: list[Run]) -> None:
    """``scale`` with the size of the inputs the wrong factor came from: the one read of a shape (``q.shape[2]``,
    ``v.shape[-1]``) whose 1/sqrt (or 1/size) as the factor on the scores gives the student's output on every call,
    right where that axis happens to hold d (q.shape[2] of a 3-D q) and wrong elsewhere."""
    for index, name in enumerate("qkv"):
        for axis in range(-4, 4):
            for power, said in _POWERS:
                if any(_size(r, index, axis) is None
                       or not close(r.out, _sdpa_scaled(r, _size(r, index, axis) ** -power)) for r in runs):
                    continue
                shape, size_here = run.case.args[index].shape, _size(run, index, axis)
                d, factor = run.case.args[0].shape[-1], float(size_here) ** -power
                meaning = _axis_meaning(name, shape, axis)
                where = f"For q {shape_str(run.case.args[0].shape)}, your factor on the scores is {factor:.4g} = " \
                        f"{said.format(size=size_here)}"
                if size_here == d and meaning.startswith("d,"):   # d itself: divided by d, not its square root
                    fail("scale", f"{where}, 1/{name}.shape[{axis}]: you divide by d itself. Divide by its square "
                                  f"root, 1/sqrt(d) = {d ** -0.5:.4g}.")
                of = "" if name == "q" else f" for {name} of shape {shape_str(shape)}"
                fail("scale", f"{where}, and {size_here} is {name}.shape[{axis}]:{of} that is {meaning}, not d. "
                              f"The factor is 1/sqrt(d) = {d ** -0.5:.4g}, d the size of each query and key: the LAST "
                              f"axis, q.shape[-1] = {d}, whatever the number of axes before it.")


def _sdpa_gradients() -> list[Case]:
    cases = _sdpa_cases()
    return [replace(cases[1], what=f"scaled_dot_product_attention with q {shape_str(cases[1].args[0].shape)}"),
            replace(cases[2], what=f"scaled_dot_product_attention with q {shape_str(cases[2].args[0].shape)} "
                                   f"and a mask")]


SCALED_DOT_PRODUCT_ATTENTION = FunctionExercise(
    "1.3", "scaled_dot_product_attention",
    lambda q, k, v, mask=None: ref.scaled_dot_product_attention(q, k, v, mask), _sdpa_cases, ("q", "k", "v", "mask"),
    success="Matches the reference for 2-D, 3-D and 4-D inputs, queries and keys of different lengths, with and "
            "without masks.",
    mismatch=lambda run: "",   # _sdpa_diagnose always decides
    mistakes=SDPA_HYPOTHESES,
    variant=lambda q, k, v, mask=None, *, spec: sdpa_variant(q, k, v, mask, spec),
    reword=_sdpa_reword, diagnose=_sdpa_diagnose, examples=_sdpa_examples, gradients=_sdpa_gradients,
    # each sequence (and head) of a batch alone: q, k and v flattened to 2-D let every query see every sequence;
    # bfloat16: the text asks for new tensors in q's dtype, and float64 promotes a float32 one away
    probes=FunctionExercise.probes + ("batch", "bfloat16"),
    # without a mask: masking after the softmax and renormalising is right, and underflows on large scores
    magnitude=lambda: [_sdpa_case(q2, k2, v, call=f"{case.what} with {how}") for case in _sdpa_cases()[:2]
                       for q, k, v in (case.args,) for q2, k2, how in magnitude_scores(q, k)],
)


@checker("1.3", example=function_example(SCALED_DOT_PRODUCT_ATTENTION))
def check_scaled_dot_product_attention(fn: Callable[..., Any]) -> str:
    """``fn(q, k, v, mask=None)`` as ``course_lib.scaled_dot_product_attention``."""
    said = judge(SCALED_DOT_PRODUCT_ATTENTION, fn)
    _sdpa_on_meta(fn)
    return said


def _sdpa_on_meta(fn: Callable[..., Any]) -> None:
    """The device probe (the text asks for new tensors on q's device): every case again on the meta device, where a
    tensor made on the CPU (a -inf fill for torch.where) shows. Run once the whole check holds, after the dtype
    probe, so that a mask kept from an earlier call is named as kept (``kept_state``) before its device."""
    for case in _sdpa_cases():
        args = [meta(a) if isinstance(a, torch.Tensor) else a for a in case.args]
        probe_device(lambda args=args: fn(*args), case.what)
