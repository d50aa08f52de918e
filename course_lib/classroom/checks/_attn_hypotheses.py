"""The attention mistakes students make (1.3, 2.2, 3.x), and how to recognise them in a student's output.

Attention is written once here with the classic mistakes switchable on (``sdpa_variant``, ``module_variant``);
each ``Mistake``'s ``spec`` holds the switches. The first mistake whose output matches the student's names it,
without reading any source (``engine.first_mistake``; ``first_match`` returns it instead, for notebook 09); when
none does, ``diagnose_weights`` reads the attention weights back and says what is wrong with them.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..exercises import Mistake
from ..verdict import fail
from ._student_code import close, coarse_precision, matches, max_diff, sums_to_one

NEG_INF = float("-inf")


def softmax_over(scores: torch.Tensor, dim: Any) -> torch.Tensor:
    """Softmax along ``dim``; "implicit" is the axis F.softmax picks when no dim is given."""
    if dim == "implicit":
        dim = 0 if scores.dim() in (0, 1, 3) else 1
    return scores.softmax(dim=dim)


def scale_factor(mode: str | float, dim: int, embed_dim: int | None = None) -> float:
    """The factor the scores get (or, for "after", the weights get); a float is the factor itself."""
    if isinstance(mode, float):
        return mode
    return {"sqrt": dim ** -0.5, "after": dim ** -0.5, "none": 1.0, "d": 1.0 / dim,
            "times": dim ** 0.5, "embed_dim": (embed_dim or dim) ** -0.5}[mode]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None, *,
           scale: float, scale_after: bool = False, softmax_dim: Any = -1, fill: str = "-inf") -> torch.Tensor:
    """softmax(q k^T * scale) v, with the mistakes switched on by the keyword arguments.

    fill: "-inf" (right), "zero" (masked_fill with 0), "post" (zero after the softmax, no renormalising).
    """
    scores = q @ k.transpose(-2, -1)                                        # (..., Lq, Lk)
    if not scale_after:
        scores = scores * scale
    if allowed is not None and fill != "post":
        scores = scores.masked_fill(~allowed, NEG_INF if fill == "-inf" else 0.0)
    weights = softmax_over(scores, softmax_dim)
    if allowed is not None and fill == "post":
        weights = weights.masked_fill(~allowed, 0.0)
    if scale_after:
        weights = weights * scale
    return weights @ v                                                      # (..., Lq, dv)


def sdpa_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 spec: dict[str, Any]) -> torch.Tensor:
    """scaled_dot_product_attention with the mistakes in ``spec`` (scale, softmax_dim, mask, fill)."""
    mode = spec.get("scale", "sqrt")
    allowed = None if mask is None else {"ignored": None, "inverted": ~mask}.get(spec.get("mask"), mask)
    if mask is None and spec.get("mask") == "causal_by_default":   # (Lq, Lk): is_causal's top-left triangle
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return attend(q, k, v, allowed, scale=scale_factor(mode, q.shape[-1]), scale_after=mode == "after",
                  softmax_dim=spec.get("softmax_dim", -1), fill=spec.get("fill", "-inf"))


def allowed_pattern(length: int, kind: str = "tril") -> torch.Tensor | None:
    """Which keys each query may see, for the mask mistakes students make."""
    ones = torch.ones(length, length, dtype=torch.bool)
    return {"tril": ones.tril(), "none": None, "triu": ones.triu(), "inverted": ones.triu(1),
            "strict": ones.tril(-1), "ahead": ones.tril(1)}[kind]


def split_heads_as(t: torch.Tensor, heads: int, how: str) -> torch.Tensor:
    """split_heads, right ("ok") or wrong ("no_transpose", "interleaved"): (N, L, E) -> (N, heads, L, head_dim)."""
    n, length, embed_dim = t.shape
    head_dim = embed_dim // heads
    if how == "no_transpose":
        return t.reshape(n, heads, length, head_dim)                         # positions cut, not features
    if how == "interleaved":
        return t.reshape(n, length, head_dim, heads).permute(0, 3, 1, 2)     # every heads-th feature
    return t.reshape(n, length, heads, head_dim).transpose(1, 2)            # (N, heads, L, head_dim)


def merge_heads_as(t: torch.Tensor, how: str) -> torch.Tensor:
    """merge_heads, right ("ok") or wrong ("bare", "interleaved"): (N, heads, L, head_dim) -> (N, L, E)."""
    n, heads, length, head_dim = t.shape
    if how == "bare":
        return t.reshape(n, length, heads * head_dim)
    if how == "interleaved":
        return t.permute(0, 2, 3, 1).reshape(n, length, heads * head_dim)
    return t.transpose(1, 2).reshape(n, length, heads * head_dim)           # (N, L, E)


def module_variant(x: torch.Tensor, params: dict[str, torch.Tensor], heads: int,
                   spec: dict[str, Any]) -> torch.Tensor:
    """Causal multi-head self-attention (eval mode) with the mistakes in ``spec``.

    spec keys: scale, softmax_dim, mask (allowed_pattern kind), fill, split ("ok", "no_transpose",
    "interleaved", "single" = one head over all features), split_v (the values' split, if it differs),
    merge ("ok", "bare", "interleaved"), proj (bool), value (True, False = x itself, "key" = the key
    projection), swap_qk (bool).
    """
    n, length, embed_dim = x.shape
    head_dim = embed_dim // heads
    q = x @ params["query.weight"].T                                         # (N, L, E)
    k = x @ params["key.weight"].T
    v = {True: lambda: x @ params["value.weight"].T, False: lambda: x,
         "key": lambda: x @ params["key.weight"].T}[spec.get("value", True)]()
    if spec.get("swap_qk"):
        q, k = k, q
    split = spec.get("split", "ok")
    used_heads = 1 if split == "single" else heads
    q, k = (split_heads_as(t, used_heads, split) for t in (q, k))                    # (N, heads, L, head_dim)
    v = split_heads_as(v, used_heads, spec.get("split_v", split))
    mode = spec.get("scale", "sqrt")
    out = attend(q, k, v, allowed_pattern(length, spec.get("mask", "tril")),
                 scale=scale_factor(mode, head_dim, embed_dim), scale_after=mode == "after",
                 softmax_dim=spec.get("softmax_dim", -1), fill=spec.get("fill", "-inf"))
    out = merge_heads_as(out, spec.get("merge", "ok"))                               # (N, L, E)
    return out @ params["proj.weight"].T if spec.get("proj", True) else out


# ----------------------------------------------------------------------------- the mistakes

_SOFTMAX_KEYS = ("Your attention weights sum to one down the columns, not across the rows: the softmax "
                 "runs over the queries. It should run over the keys (the last axis of the scores), "
                 "giving one distribution per query.")
_SOFTMAX_IMPLICIT = ("Your softmax normalises over the wrong axis: F.softmax without `dim=` picks an axis "
                     "for you (here a batch axis). Always pass the axis of the keys, the last one of the scores.")
# The scale mistakes of a function and of a module alike: {size}, {dim} and {d} name the dimension.
_SCALES = {
    "none": "Your scores are not scaled: divide the dot products by the square root of {size} before the softmax, "
            "so the logits keep unit variance.",
    "d": "You divide the scores by {dim} itself; divide by its square root instead.",
    "after": "Your 1/sqrt({d}) comes after the softmax (on the weights, the values or the output): the softmax "
             "sees the unscaled scores, so its weights come out too peaked, and the factor then only shrinks the "
             "result. It belongs on the scores that go into the softmax.",
    "times": "You multiply the scores by sqrt({d}); they should be divided by it.",
}


def _scales(size: str, dim: str, d: str) -> dict[str, str]:
    return {mode: why.format(size=size, dim=dim, d=d) for mode, why in _SCALES.items()}


def mistake_rows(code: str, switch: str, why: dict[Any, str]) -> tuple[Mistake, ...]:
    """One mistake per value of one switch of the variant (``spec={switch: value}``), in order."""
    return tuple(Mistake(code, message, {switch: value}) for value, message in why.items())


_FILL_ZERO = ("Masked positions still get weight: filling their scores with 0 leaves exp(0) = 1 in the "
              "softmax. Fill them with -inf (float('-inf')) so they get exactly zero weight.")
_POST = ("You zero the masked weights after the softmax, so each row no longer sums to one. Mask the "
         "scores before the softmax instead (or renormalise every row after zeroing).")

SDPA_HYPOTHESES: tuple[Mistake, ...] = (
    *mistake_rows("softmax_dim", "softmax_dim", {
        -2: _SOFTMAX_KEYS,
        "implicit": _SOFTMAX_IMPLICIT,
        1: "Your softmax runs over dim=1, which is the key axis only when q is 2-D (for 3-D inputs it is the "
           "queries, for 4-D the heads). Use the last axis (dim=-1) so any batch shape works.",
        0: "Your softmax normalises across the batch (dim 0) instead of over the keys (dim=-1)."}),
    *mistake_rows("scale", "scale", _scales("the size of the vectors", "the dimension", "d")),
    *mistake_rows("causal_mask", "mask", {
        "ignored": "Your function ignores `mask`: keys where the mask is False still get weight. Set their scores "
                   "to -inf before the softmax.",
        "inverted": "Your mask is applied the wrong way round: you hide the keys where the mask is True. In this "
                    "course True means 'may attend', so hide the positions where it is False.",
        "causal_by_default": "Without a mask your function still hides the future (a causal mask, is_causal=True or "
                             "a tril of its own): mask=None means no mask at all, every query sees every key. "
                             "Mask only where a mask is passed."}),
    Mistake("causal_mask", _FILL_ZERO, {"fill": "zero"}),
    Mistake("normalization", _POST, {"fill": "post"}),
)

# A module's causal mask, wrong: the allowed_pattern it builds instead of the lower triangle.
_MASKS = {
    "none": "The future leaks: the output at a position changes when later tokens change. Apply the causal mask "
            "to the scores before the softmax.",
    "triu": "Your mask points the wrong way: each position attends to itself and the future (upper triangle) "
            "instead of the past (lower triangle).",
    "inverted": "Your mask is inverted: you hide exactly the positions that should be visible (so the last token "
                "has no key left, which gives NaN). True in the causal mask means 'may attend': hide the positions "
                "where it is False.",
    "strict": "Each position must also see itself: your mask hides the diagonal (and the first token then has no "
              "key at all, which gives NaN).",
    "ahead": "Your mask is off by one: each position also sees the next token. Keep the diagonal and everything "
             "below it, nothing above.",
}

MODULE_HYPOTHESES: tuple[Mistake, ...] = (
    *mistake_rows("softmax_dim", "softmax_dim", {
        -2: _SOFTMAX_KEYS,
        0: "Your softmax normalises across the batch (dim 0) instead of over the keys; F.softmax without `dim=` "
           "does this for 3-D scores. Pass the key axis (dim=-1).",
        1: "Your softmax normalises across the heads (dim 1) instead of over the keys (the last axis of the "
           "scores)."}),
    *mistake_rows("scale", "scale", {
        **_scales("{d}", "{d}", "{d}"),   # {d}: head_dim or embed_dim, filled in by the module's check
        "embed_dim": "You scale by 1/sqrt(embed_dim), but each head works in head_dim = embed_dim // num_heads "
                     "dimensions: scale by 1/sqrt(head_dim)."}),
    *mistake_rows("causal_mask", "mask", _MASKS),
    Mistake("causal_mask", _FILL_ZERO, {"fill": "zero"}),
    Mistake("normalization", _POST, {"fill": "post"}),
    Mistake("head_split", "Your heads are cut along the sequence instead of along the features: reshaping "
                             "(N, L, E) straight to (N, heads, L, head_dim) mixes positions. Split the last axis "
                             "into (heads, head_dim) first, then move the head axis in front of the sequence axis.",
               {"split": "no_transpose"}),
    Mistake("head_split", "Your heads are merged with a bare reshape: (N, heads, L, head_dim) must first "
                             "become (N, L, heads, head_dim), head and sequence axes swapped back, before "
                             "flattening; otherwise rows of the output mix different positions.",
               {"merge": "bare"}),
    Mistake("head_split", "Both your split and your merge skip the transpose: a reshape alone between "
                             "(N, L, E) and (N, heads, L, head_dim) cuts the sequence, not the features, into "
                             "heads. Split the last axis into (heads, head_dim), then swap the head and "
                             "sequence axes (and swap them back before merging).",
               {"split": "no_transpose", "merge": "bare"}),
    Mistake("head_split", "Your heads take every num_heads-th feature instead of a block of head_dim "
                             "neighbouring features: split the last axis as (heads, head_dim), in that order.",
               {"split": "interleaved", "merge": "interleaved"}),
    Mistake("head_split", "Your split takes every num_heads-th feature instead of a contiguous block: split "
                             "the last axis as (heads, head_dim), in that order.", {"split": "interleaved"}),
    Mistake("head_split", "Your merge puts the heads' features in the wrong order: flatten as (heads, "
                             "head_dim), head after head.", {"merge": "interleaved"}),
    Mistake("head_split", "Your module computes one big head over all embed_dim features: the heads are "
                             "never split. Split q, k and v into num_heads heads of head_dim features each.",
               {"split": "single"}),
    Mistake("head_split", "Your module computes one big head over all embed_dim features (scaled by "
                             "1/sqrt(embed_dim)): the heads are never split. Split q, k and v into num_heads "
                             "heads of head_dim features each.", {"split": "single", "scale": "embed_dim"}),
    Mistake("mismatch", "You never apply the output projection `proj` to the attention output.",
               {"proj": False}),
    Mistake("values", "You use the input itself as the values: pass x through `value` first.",
               {"value": False}),
    Mistake("values", "Your values come from the key projection: v = self.value(x), not self.key(x).",
               {"value": "key"}),
    Mistake("head_split", "Your values are split into heads without the transpose: (N, L, E) reshaped straight "
                             "to (N, heads, L, head_dim) cuts the sequence, not the features. Split v exactly "
                             "like q and k: view as (N, L, heads, head_dim), then transpose(1, 2).",
               {"split_v": "no_transpose"}),
    Mistake("mismatch", "Queries and keys are swapped: score[i, j] compares the query of position i with "
                           "the key of position j, so use `query` for q and `key` for k.", {"swap_qk": True}),
)


# ---------------------------------------------------------------- heads of the wrong size (3.3, 9.6)

def split_into(which: str, heads: int, size: int, features: int, right: int, head_dim: int, attribute: str) -> str:
    """The words for ``which`` tensors split into ``heads`` heads of ``size`` features where their ``features`` make
    ``right`` heads of ``head_dim`` (``attribute``, the module's count of them)."""
    return (f"the {which} are split into {heads} heads of {size} features, where their {features} features make "
            f"{right} heads of head_dim={head_dim} ({attribute} heads).")


# torch.split's second argument, read as a number of pieces (the mistake behind heads of the wrong size)
SPLIT_SIZE = ("torch.split(t, n, dim=-1) cuts pieces of n features each: n is the size of a piece, not the number of "
              "pieces (torch.chunk(t, n, dim=-1) cuts n pieces). Split into that many heads of head_dim = embed_dim "
              "// num_heads features: view as (N, L, heads, head_dim), then transpose(1, 2).")


# ---------------------------------------------------------------- recognising a mistake

def shape_str(shape: Iterable[int]) -> str:
    return str(tuple(shape))


def fit_scale(weights: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> float | None:
    """The factor s with weights ~ softmax(s * scores) over the allowed keys, or None when no s fits."""
    usable = allowed & (weights > 1e-9)
    logw = torch.where(usable, weights.clamp_min(1e-30).double().log(), torch.zeros((), dtype=torch.float64))
    s = torch.where(usable, scores.double(), torch.zeros((), dtype=torch.float64))
    count = usable.sum(-1, keepdim=True).clamp_min(1)
    # centre each row: softmax is shift-invariant, so the row constant drops out
    dl = torch.where(usable, logw - logw.sum(-1, keepdim=True) / count, torch.zeros((), dtype=torch.float64))
    ds = torch.where(usable, s - s.sum(-1, keepdim=True) / count, torch.zeros((), dtype=torch.float64))
    denom = float((ds * ds).sum())
    if denom < 1e-9:
        return None
    factor = float((dl * ds).sum()) / denom
    residual = float(((dl - factor * ds) ** 2).sum()) / max(float((dl * dl).sum()), 1e-12)
    return factor if residual < 1e-4 else None


def _column_max_shift(weights: torch.Tensor, scaled: torch.Tensor, right: torch.Tensor, full: torch.Tensor,
                      seen: torch.Tensor, key_axis: str) -> None:
    """``softmax_dim`` where the weights are exp(s - m) over the keys with m each KEY's maximum over the queries
    (amax(dim=-2)), renormalised: a shift that changes along a row changes the softmax, which only a shift
    constant along the row (each row's own maximum) leaves alone."""
    if weights.shape[-2] < 2:
        return
    for column in (scaled.masked_fill(~full, float("-inf")).amax(-2, keepdim=True),   # (..., 1, Lk): over the
                   scaled.amax(-2, keepdim=True)):                                       # queries that see it, or all
        if not bool(torch.isfinite(column).all()):
            continue
        shifted = (scaled - column).exp().masked_fill(~full, 0.0)
        wrong = shifted / shifted.sum(-1, keepdim=True)
        if close(weights[seen], wrong[seen]) and not close(wrong[seen], right[seen]):
            fail("softmax_dim", f"Read back, your attention weights are exp(s - m) over the keys with m each key's "
                                f"maximum over the QUERIES (amax(dim=-2)): that shift changes along a row, so it "
                                f"changes the softmax (it is no softmax at all). Subtract each row's own maximum, over "
                                f"{key_axis}: scores.amax(dim=-1, keepdim=True), or use torch.softmax(scores, dim=-1).")


def diagnose_weights(weights: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor | None,
                     expected_scale: float, *, key_axis: str = "the keys (dim=-1)",
                     hidden: str = "masked keys", scale_name: str = "1/sqrt(d)", scores_name: str = "q k^T",
                     inputs: str = "the queries and the keys you multiply (which tensor is which)") -> None:
    """Raise the Failure that best explains wrong attention weights (..., Lq, Lk); do nothing if they are
    the softmax of ``scores`` times ``expected_scale`` over the ``allowed`` keys.

    ``scores`` are the raw dot products q k^T (same shape), ``allowed`` which keys a query may see.
    """
    if not torch.isfinite(weights).all():
        return
    full = torch.ones_like(weights, dtype=torch.bool) if allowed is None else allowed.expand_as(weights)
    expected = (scores * expected_scale).masked_fill(~full, float("-inf")).softmax(-1)
    seen = full.any(-1)   # a query with no key to see has no weights to compare
    factor = fit_scale(weights, scores, full)
    wrong_scale = factor is not None and abs(factor - expected_scale) > 1e-2 * expected_scale
    # Before any structural verdict: weights right to a rounding's size (a row then sums to 1.002) are no
    # mistake of structure, and a clean wrong factor is a scale however small.
    if not wrong_scale and coarse_precision(weights[seen], expected[seen]):
        fail("precision", f"Read back, your attention weights are the reference's to about three significant "
                          f"digits (off by up to {max_diff(weights[seen], expected[seen]):.3g}): part of your "
                          f"computation runs in a lower precision or rounds (.half(), torch.bfloat16, an "
                          f"autocast, a .round()). Keep the inputs' dtype throughout.")
    _column_max_shift(weights, scores * expected_scale, expected, full, seen, key_axis)
    if weights.shape[-1] == weights.shape[-2] > 1 and close(weights, expected.transpose(-2, -1)) and \
            not close(expected, expected.transpose(-2, -1)):
        fail("causal_mask" if allowed is not None else "mismatch",
             "Read back, your attention weights are the right ones transposed (weights.transpose(-2, -1) @ v): "
             "output i then mixes the values with column i of the weights, the weight every query gives key i"
             + (", so the future leaks although the mask and the softmax are right" if allowed is not None else "")
             + ". The output is weights @ v: row i of the weights, query i's distribution over the keys, times the "
               "values.")
    if not sums_to_one(weights, -1):
        for dim in range(weights.dim() - 1):
            if weights.shape[dim] > 1 and sums_to_one(weights, dim):
                axis = "the queries" if dim == weights.dim() - 2 else f"axis {dim}"
                fail("softmax_dim", f"Your attention weights sum to one over {axis}, not over {key_axis}: "
                                    f"the softmax runs along the wrong axis. Each query needs its own "
                                    f"distribution over the keys.")
        row = weights.sum(-1).flatten()
        farthest = float(row[(row - 1).abs().argmax()])   # the one that shows it, whatever the others round to
        if close(weights[seen], farthest * expected[seen]):   # the right weights, each row times one factor
            named = f" = {scale_name}" if math.isclose(farthest, expected_scale, rel_tol=1e-3) else ""
            fail("normalization", f"Read back with the values set to the identity, every row of your weights sums "
                                  f"to {farthest:.4g}{named} instead of one: your weights are the right softmax times "
                                  f"a factor of {farthest:.4g}, applied after the softmax (to the weights, to v or to "
                                  f"the output). The factor belongs on the scores only, before the softmax; nothing "
                                  f"after it is scaled.")
        fail("normalization", f"Your output is not softmax weights times the values: read back with the values "
                              f"set to the identity, a row sums to {farthest:.6g} instead of one. Either the weights are not a softmax over "
                              f"the keys, or something after the softmax changes the result (a factor, a residual "
                              f"x + ..., an activation, a reshape, values from another tensor): the output is the "
                              f"weights times v, and nothing else.")
    if weights.min() < -1e-6:
        fail("normalization", "Some of your attention weights are negative: they should come out of a "
                              "softmax, which gives positive weights that sum to one.")
    if allowed is not None:
        leak = weights.masked_fill(allowed, 0.0).abs().max()
        if leak > 1e-5:
            fail("causal_mask", f"The {hidden} still get weight (up to {float(leak):.3g}): when the softmax runs, "
                                f"their scores are not -inf. Check which positions you fill (mask False means "
                                f"hidden), and that nothing after the fill (a clamp, an addition) changes them; "
                                f"their weight must be exactly zero.")
    if wrong_scale:
        what = ("no scaling at all" if abs(factor - 1) < 1e-2 else f"a factor of {factor:.4g}")
        fail("scale", f"Your weights are a softmax of the scores with {what}; the expected factor is "
                      f"{scale_name} = {expected_scale:.4g}. Check how (and where) you scale the scores.")
    if weights.shape[-1] == weights.shape[-2] > 1 and close(weights, torch.eye(weights.shape[-1],
                                                                             dtype=weights.dtype).expand_as(weights)):
        fail("mismatch", "Read back, your attention weights are the identity: each query gives all its weight to "
                         "itself (your output is its input, or a mask hides every key but the query's own). Each "
                         f"query should spread its weight over the keys it may see: the softmax of {scores_name} "
                         f"times {scale_name}.")
    # A distribution over the right keys can still weigh them wrongly: the scores themselves are wrong.
    if not close(weights[seen], expected[seen]):
        fail("mismatch", f"Your attention weights are a distribution over the keys each query may see, but not "
                         f"the softmax of the scores {scores_name} times {scale_name} (off by up to "
                         f"{max_diff(weights[seen], expected[seen]):.3g}): the scores going into the softmax are "
                         f"wrong. Check {inputs}, and that nothing else is added to the scores.")


def identity_values(k: torch.Tensor) -> torch.Tensor:
    """v = one-hot rows, so attention returns its own weights: out[..., i, j] = weight of key j for query i."""
    length = k.shape[-2]
    return torch.eye(length, dtype=k.dtype).expand(*k.shape[:-1], length).clone()   # (..., Lk, Lk)


def first_match(hypotheses: Iterable[Any], outputs: list[torch.Tensor],
                compute: Callable[[int, dict[str, Any]], torch.Tensor]) -> Any | None:
    """The first hypothesis whose output matches the student's output in every case (NaN matching NaN)."""
    for hypothesis in hypotheses:
        try:
            if all(matches(out, compute(i, hypothesis.spec)) for i, out in enumerate(outputs)):
                return hypothesis
        except (RuntimeError, ValueError):   # a hypothesis that does not apply to these shapes
            continue
    return None

