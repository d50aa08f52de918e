"""RoPE and grouped-query attention written once, with the classic student mistakes switchable on
(exercises 9.1, 9.2 and 9.6): the topic's mistakes module.

``tables`` and ``rotate`` are RoPE's tables and rotation with a slip switched on; ``simulate`` runs a whole
sequence of calls of a GroupedQueryAttention (a full pass, or a prefix and then new tokens with a KV cache)
as a student's module with one mistake would run it. ``FULL_PASS`` and ``CACHED`` list the module's
mistakes with what to tell the student; a checker names the first whose outputs the student's match in
every run. Everything runs in float64, so a match is never a matter of rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..exercises import Mistake
from ._attn_hypotheses import mistake_rows

# ---------------------------------------------------------------- the tables (9.1)

# The exponent of theta for pair i of head_dim d, right ("2i/d") and as students slip.
_EXPONENTS = {
    "2i/d": lambda i, d: 2 * i / d,
    "i/d": lambda i, d: i / d,                        # the pair index where the dimension index 2i belongs
    "4i/d": lambda i, d: 4 * i / d,                   # stepping 0, 2, 4, ... and doubling again
    "2i/(d-1)": lambda i, d: 2 * i / max(d - 1, 1),   # dividing by d - 1
    "-2i/d": lambda i, d: -2 * i / d,                 # theta ** (+2i/d): frequencies that grow
}


def tables(head_dim: int, max_tokens: int, theta: float, *, exponent: str = "2i/d", base: float | None = None,
           layout: str = "half", first_position: int = 0, down: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_tokens, head_dim) in float64: pair i turns by base ** -exponent per position
    (base = theta when right). layout "half" repeats the head_dim/2 angles as two halves (right);
    "flipped" repeats them in reverse order; "interleaved" repeats each angle twice in a row. ``down``: the
    positions counted down, row m at position max_tokens - 1 - m (+ first_position)."""
    pairs = torch.arange(head_dim // 2, dtype=torch.float64)
    turns = float(theta if base is None else base) ** -_EXPONENTS[exponent](pairs, head_dim)   # (d/2,)
    positions = torch.arange(max_tokens, dtype=torch.float64) + first_position             # (T,)
    positions = positions.flip(0) if down else positions
    angles = torch.outer(positions, turns)                                                  # (T, d/2)
    if layout == "half":
        angles = torch.cat([angles, angles], dim=-1)                                        # (T, d)
    elif layout == "flipped":
        angles = torch.cat([angles, angles.flip(-1)], dim=-1)                               # (T, d)
    else:
        angles = angles.repeat_interleave(2, dim=-1)                                        # (T, d)
    return angles.cos(), angles.sin()


def table_mistakes(theta: float) -> list[Mistake]:
    """The slips students make in rope_tables, each with its tables() keywords as its spec."""
    default = theta == 10000.0
    found = [
        *(("rope_layout", why, {"layout": layout}) for layout, why in {
            "interleaved": "the angles are repeated element by element (repeat_interleave, or stacking and "
                           "flattening), which pairs dimensions (2i, 2i+1). This course (like Hugging Face Llama) "
                           "pairs dimension i with i + head_dim/2: concatenate the head_dim/2 angles with themselves, "
                           "torch.cat([angles, angles], dim=-1)",
            "flipped": "the second half of the angles is the first half in reverse order: dimension i and i + "
                       "head_dim/2 must turn by the same angle, so repeat the first half in the same order, "
                       "torch.cat([angles, angles], dim=-1)"}.items()),
        *(("rope_frequencies", why, {"exponent": exponent}) for exponent, why in {
            "i/d": "the exponent uses the pair index i over head_dim; it should be 2i/head_dim (step through 0, 2, "
                   "4, ... or multiply i by 2)",
            "4i/d": "the exponent counts the dimension index twice: you step through 0, 2, 4, ... and multiply by 2 "
                    "again",
            "-2i/d": "the frequencies grow with the dimension instead of shrinking: pair i turns by "
                     "theta^(-2i/head_dim) per position, so divide by theta^(2i/head_dim), do not multiply",
            "2i/(d-1)": "the exponent divides by head_dim - 1; it should divide by head_dim"}.items()),
        ("rope_frequencies", "the base is e: with exp(), the exponent needs the factor log(theta)", {"base": math.e}),
        ("rope_positions", "your positions start at 1. Row 0 is position 0, which is not turned at all "
                           "(cos = 1, sin = 0)", {"first_position": 1}),
        # positions counted down (a flip, arange(max_tokens - 1, -1, -1), or from max_tokens down to 1)
        *(("rope_positions", f"your positions count DOWN, from {top} at row 0 to {first} at the last row. Row m is "
                             f"position m, counted up from 0 (torch.arange(max_tokens)), with no flip",
           {"down": True, "first_position": first}) for first, top in ((0, "max_tokens - 1"), (1, "max_tokens"))),
    ]
    if not default:
        found.insert(1, ("rope_frequencies", f"you ignore `theta`: these are the tables of theta=10000, "
                                             f"but theta={theta:g} was asked for. Use the argument as the base",
                         {"base": 10000.0}))
    for base in (1000.0, 100.0, 500000.0):
        if base != theta:
            found.append(("rope_frequencies", f"the base is {base:g} whatever `theta` says; use theta "
                                              f"(here {theta:g})", {"base": base}))
    return [Mistake(*slip) for slip in found]


# ---------------------------------------------------------------- the rotation (9.2, 9.6)

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_halves(x: torch.Tensor, pattern: str) -> torch.Tensor:
    """rotate_half as ``pattern`` writes it, e.g. "cat(x2, x1)": the halves x1, x2 of the last axis, each one maybe
    negated, in either order."""
    half = x.shape[-1] // 2
    halves = {"x1": x[..., :half], "x2": x[..., half:]}
    return torch.cat([-halves[t[1:]] if t.startswith("-") else halves[t] for t in pattern[4:-1].split(", ")], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The quarter turn of interleaved pairs (2i, 2i+1): [x0, x1, x2, x3] -> [-x1, x0, -x3, x2]."""
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int, *, kind: str = "half",
           axis: str = "length") -> torch.Tensor:
    """x (N, heads, L, head_dim) turned to positions offset.., with the mistake ``kind`` (and ``axis``).

    kind: "half" (right), "reverse" (the other way), "swapped" (sin and cos swapped), "no_rotate_half"
    (x * sin instead of rotate_half(x) * sin), "pairs_table" (interleaved pairs with the half-split tables
    as they are), "pairs" (interleaved pairs with their own angles, GPT-J / Meta's Llama code),
    "first_half" / "second_half" (only that half of the last axis turned, the other passed through), or
    rotate_half written as a pattern of ``rotate_halves`` ("cat(x2, x1)": a sign or the order of the halves wrong).
    axis: "length" (right) or "heads" (positions read along the head axis, as for (N, L, heads, head_dim)).
    """
    x = x.double()
    rows = x.shape[-2] if axis == "length" else x.shape[1]
    c, s = cos[offset:offset + rows].double(), sin[offset:offset + rows].double()   # (rows, head_dim)
    if axis == "heads":
        c, s = c[:, None, :], s[:, None, :]                                         # (heads, 1, head_dim)
    if kind == "pairs":
        half = x.shape[-1] // 2
        c, s = c[..., :half].repeat_interleave(2, dim=-1), s[..., :half].repeat_interleave(2, dim=-1)
    turned = {"half": rotate_half, "reverse": lambda t: -rotate_half(t), "no_rotate_half": lambda t: t,
              "pairs_table": rotate_pairs, "pairs": rotate_pairs}
    if kind == "swapped":
        return x * s + rotate_half(x) * c
    if kind in ("first_half", "second_half"):
        half = x.shape[-1] // 2
        full = x * c + rotate_half(x) * s
        keep = slice(half, None) if kind == "first_half" else slice(None, half)
        full[..., keep] = x[..., keep]
        return full
    return x * c + (turned[kind](x) if kind in turned else rotate_halves(x, kind)) * s


# The slips of apply_rotary (9.2), as the switches of rotary_variant; each message names the function.
def _rotary(code: str, why: str, **spec: str) -> Mistake:
    return Mistake(code, f"apply_rotary: {why}", spec)


def _halves_slip(pattern: str) -> str:
    """What is wrong with rotate_half written as ``pattern``: a sign of a half, or the order of the halves."""
    terms = pattern[4:-1].split(", ")
    wrong = ["your halves stay in place (x1 first): rotate_half swaps them, the second half first"] \
        if terms[0].endswith("x1") else []
    if "-x2" not in terms:
        wrong.append("the second half x2 needs a minus sign")
    if "-x1" in terms:
        wrong.append("the first half x1 keeps its sign (no minus)")
    return (f"your rotate_half(x) is {pattern}, not cat(-x2, x1): {'; '.join(wrong)}. With x1 = x[..., :head_dim/2] "
            f"and x2 = x[..., head_dim/2:], negate x2 alone and put it first: x * cos + cat(-x2, x1) * sin (a roll by "
            f"head_dim/2 gives cat(x2, x1): its first half still needs the minus).")


# every other sign of the two halves, in either order (the right one, cat(-x2, x1), and the slips named on their own,
# cat(x2, -x1) and cat(x1, x2), left out): the kinds of ``rotate`` for 9.2 and 9.6
_HALVES_SLIPS = tuple(f"cat({a}{first}, {b}{second})" for first, second in (("x2", "x1"), ("x1", "x2"))
                      for a in ("", "-") for b in ("", "-")
                      if f"{a}{first}, {b}{second}" not in ("-x2, x1", "x2, -x1", "x1, x2"))


ROTARY: tuple[Mistake, ...] = (
    _rotary("rope_layout", "you turn interleaved pairs (2i, 2i+1) (GPT-J's and Meta's original Llama layout, e.g. "
                           "through view_as_complex). This course, like Hugging Face Llama, pairs dimension i with i "
                           "+ head_dim/2: x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) of the "
                           "two halves of the last axis.", kind="pairs"),
    _rotary("rope_layout", "you turn interleaved pairs (2i, 2i+1) (x[..., ::2] and x[..., 1::2]) against the "
                           "half-split tables, whose angle for dimension j is that of pair j mod head_dim/2. The "
                           "tables pair dimension i with i + head_dim/2: rotate_half(x) = cat(-x2, x1) of the two "
                           "HALVES of the last axis.", kind="pairs_table"),
    _rotary("rope_rotation", "your rotation turns the wrong way: rotate_half(x) is cat(-x2, x1), the minus on the "
                             "second half moved to the front; yours is cat(x2, -x1).", kind="reverse"),
    _rotary("rope_rotation", "sin and cos are swapped: x * cos + rotate_half(x) * sin.", kind="swapped"),
    _rotary("rope_rotation", "you multiply x itself by sin; the sin term needs the quarter-turned x: x * cos + "
                             "rotate_half(x) * sin.", kind="no_rotate_half"),
    *(_rotary("rope_positions", why, offset=offset) for offset, why in {
        "zero": "you ignore `offset`: the rows of the tables for x are offset .. offset+L-1 (with a KV cache, the new "
                "tokens come after the cached ones), not 0 .. L-1.",
        "plus_one": "your rows are one position too far: take cos[offset : offset + L].",
        "one_row": "every token is turned by the one row cos[offset] (and sin[offset]): token m of x sits at position "
                   "offset + m, so take the L rows cos[offset : offset + L].",
        "end": "you take the LAST L rows of the tables (cos[-L:]): row m is position m, so the rows for x are offset "
               ".. offset+L-1, cos[offset : offset + L]."}.items()),
    *(_rotary("rope_rotation", why, kind=kind) for kind, why in {
        "first_half": "only the first half of the head turns: both halves of each pair change, x * cos + "
                      "rotate_half(x) * sin over the whole last axis (the second half gets x2 * cos + x1 * sin).",
        "second_half": "only the second half of the head turns: both halves of each pair change, x * cos + "
                       "rotate_half(x) * sin over the whole last axis (the first half gets x1 * cos - x2 * sin)."
    }.items()),
    *(_rotary("rope_rotation", _halves_slip(pattern), kind=pattern) for pattern in _HALVES_SLIPS),
    _rotary("rope_axes", "you read the positions along the head axis: x is (N, heads, L, head_dim), so the sequence "
                         "length is x.shape[-2] and the table rows (L, head_dim) broadcast as they are over N and "
                         "heads. Yours turn each head by its head index, as if x were (N, L, heads, head_dim).",
                         axis="heads"),
    _rotary("rope_axes", "you read the positions along the head axis (as if x were (N, L, heads, head_dim)) and "
                         "ignore `offset`: x is (N, heads, L, head_dim), so L = x.shape[-2] and the rows are offset "
                         ".. offset+L-1.", axis="heads", offset="zero"),
    _rotary("rope_layout", "you turn interleaved pairs (2i, 2i+1) and ignore `offset`. Pair i is (i, i + head_dim/2) "
                           "here (rotate_half), and the rows are offset .. offset+L-1.", kind="pairs", offset="zero"),
)


def rotary_variant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int, *,
                   spec: dict[str, Any]) -> torch.Tensor:
    """apply_rotary with the slips of ``spec`` switched on: ``offset`` and ``rotate``'s kind and axis."""
    if spec.get("offset") == "one_row":   # every token turned to position `offset` alone
        rows = x.shape[-2]
        cos, sin = cos[offset:offset + 1].expand(rows, -1), sin[offset:offset + 1].expand(rows, -1)
        return rotate(x, cos, sin, 0, kind=spec.get("kind", "half"), axis=spec.get("axis", "length"))
    used = {"ok": offset, "zero": 0, "plus_one": offset + 1,
            "end": cos.shape[0] - x.shape[-2]}[spec.get("offset", "ok")]
    return rotate(x, cos, sin, used, kind=spec.get("kind", "half"), axis=spec.get("axis", "length"))


# ---------------------------------------------------------------- grouped-query attention (9.6)

@dataclass(frozen=True)
class Setup:
    """One configuration of the module, and its weights (float64), as the checker built them."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    max_tokens: int
    params: dict[str, torch.Tensor]
    cos: torch.Tensor                 # (max_tokens, head_dim), float64
    sin: torch.Tensor
    qk_norm: bool = False
    window: int | None = None
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        # the tables' width: embed_dim // num_heads unless the layer was built with a head_dim of its own
        return self.cos.shape[-1]


def _split(t: torch.Tensor, heads: int, how: str) -> torch.Tensor:
    n, length, features = t.shape
    if how == "no_transpose":
        return t.reshape(n, heads, length, features // heads)                   # positions cut, not features
    return t.reshape(n, length, heads, features // heads).transpose(1, 2)       # (N, heads, L, head_dim)


def _merge(t: torch.Tensor, how: str) -> torch.Tensor:
    n, heads, length, head_dim = t.shape
    if how == "bare":
        return t.reshape(n, length, heads * head_dim)
    return t.transpose(1, 2).reshape(n, length, heads * head_dim)               # (N, L, heads * head_dim)


def _group(t: torch.Tensor, groups: int, how: str) -> torch.Tensor:
    if how == "tile":
        return t.repeat(1, groups, 1, 1)                                        # head h reads h % kv_heads
    n, kv_heads, length, head_dim = t.shape                                     # head h reads h // groups
    if how == "first":                                                          # every head reads kv head 0
        return t[:, :1].expand(n, kv_heads * groups, length, head_dim)
    return t[:, :, None].expand(n, kv_heads, groups, length, head_dim).reshape(n, kv_heads * groups, length, head_dim)


def _rms(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight


def _offset(how: str, start: int, length: int) -> int:
    # (A constant shift of every position is no mistake the outputs can show: RoPE only sees offsets.)
    return {"ok": start, "zero": 0, "after_append": start + length, "one_row": start, "twice": 2 * start}[how]


def _allowed(how: str, start: int, length: int, total: int, window: int | None, window_how: str,
             cached: bool) -> torch.Tensor:
    """Bool (L, total): which keys each new query sees under the mistake ``how``."""
    i = torch.arange(start, start + length)[:, None]          # the queries' true positions
    j = torch.arange(total)[None, :]
    if how == "top_left_chunks":                              # is_causal=(L > 1) whatever the cache holds
        how = "top_left" if length > 1 else "none"
    if how == "none" or (how == "none_cached" and cached):
        causal = torch.ones(length, total, dtype=torch.bool)
    elif how == "top_left":                                   # is_causal=True with fewer queries than keys
        causal = j <= i - start
    elif how == "rows_early" and cached and start > 0:        # rows start-1 .. total-2: no query sees itself
        causal = j <= i - 1
    else:
        causal = j <= i
    if window is None or window_how == "ignored":
        return causal
    reach = window + 1 if window_how == "plus_one" else window
    return causal & (i - j < reach)


def simulate(setup: Setup, x: torch.Tensor, plan: list[tuple[int, int]], spec: dict[str, Any], *,
             cached: bool = False) -> torch.Tensor:
    """The outputs (N, sum of lengths, E), in float64, of a module with the mistakes in ``spec`` called
    once per (start, length) of ``plan``, with a KV cache when ``cached`` (a prefix, then new tokens).

    spec keys (right value first): group "interleave"/"tile"/"first" (group_v: the values' alone); rope_q, rope_k True/False; rope_v False/True;
    kind "half"/... and axis "length"/"heads" (see rotate above); offset (and offset_q, the
    queries' alone) "ok"/"zero"/"after_append"/"one_row" (with a cache, every new token turned by the one row
    cos[start])/"twice" (the tables sliced at start and the offset start as well: position 2 * start); mask "causal"/"none"/"top_left"/"top_left_chunks"/"none_cached"/"rows_early"; window "ok"/"ignored"/"plus_one"; scale "head_dim"/"none"/"embed_dim"/"d"/"times"/
    "after"/"embed_over_heads" or a float (the factor itself); split and merge "ok"/"no_transpose"/"bare"; value "value"/"key";
    qk_norm "ok"/"none"/"after_rope"/"q_only"; softmax "keys"/"queries"/"heads"; theta (tables rebuilt with this
    theta); flat False/True (the flat projection turned with tiled tables, before the head split).
    """
    p = setup.params
    x = x.double()
    heads, kv_heads, head_dim = setup.num_heads, setup.num_kv_heads, setup.head_dim
    rope = dict(kind=spec.get("kind", "half"), axis=spec.get("axis", "length"))
    cos, sin = (setup.cos, setup.sin) if "theta" not in spec else tables(head_dim, setup.max_tokens, spec["theta"])
    norm = spec.get("qk_norm", "ok") if setup.qk_norm else "off"
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs = []
    for start, length in plan:
        chunk = x[:, start:start + length]                                       # (N, L, E)
        split = spec.get("split", "ok")
        offset = _offset(spec.get("offset", "ok"), start, length)
        q, k = chunk @ p["query.weight"].T, chunk @ p["key.weight"].T            # (N, L, features)
        if spec.get("flat"):   # the flat projection turned with the tables tiled across the heads
            q = rotate(q, cos.repeat(1, heads), sin.repeat(1, heads), offset)       # (N, L, heads * head_dim)
            k = rotate(k, cos.repeat(1, kv_heads), sin.repeat(1, kv_heads), offset)
        q = _split(q, heads, split)                                             # (N, heads, L, head_dim)
        k = _split(k, kv_heads, split)                                          # (N, kv_heads, L, head_dim)
        v = _split(chunk @ p[f"{spec.get('value', 'value')}.weight"].T, kv_heads, split)
        if norm in ("ok", "q_only"):
            q = _rms(q, p["q_norm.weight"], setup.eps)
        if norm == "ok":
            k = _rms(k, p["k_norm.weight"], setup.eps)
        turn = not spec.get("flat")
        rows = (cos, sin)
        if spec.get("offset") == "one_row" and cached and start > 0:   # every new token at position start
            rows, offset = (cos[start:start + 1].expand(length, -1), sin[start:start + 1].expand(length, -1)), 0
        offset_q = offset if "offset_q" not in spec else _offset(spec["offset_q"], start, length)
        if turn and spec.get("rope_q", True):
            q = rotate(q, *rows, offset_q, **rope)
        if turn and spec.get("rope_k", True):
            k = rotate(k, *rows, offset, **rope)
        if spec.get("rope_v", False):
            v = rotate(v, *rows, offset, **rope)
        if norm == "after_rope":
            q, k = _rms(q, p["q_norm.weight"], setup.eps), _rms(k, p["k_norm.weight"], setup.eps)
        keys += [k]
        values += [v]
        total = start + length
        all_k, all_v = torch.cat(keys, dim=2), torch.cat(values, dim=2)         # (N, kv_heads, total, head_dim)
        all_k = _group(all_k, heads // kv_heads, spec.get("group", "interleave"))    # (N, heads, total, head_dim)
        all_v = _group(all_v, heads // kv_heads, spec.get("group_v", spec.get("group", "interleave")))
        mode = spec.get("scale", "head_dim")
        scale = mode if isinstance(mode, float) else {   # a float: any other factor (the fitted one)
            "head_dim": head_dim ** -0.5, "none": 1.0, "embed_dim": setup.embed_dim ** -0.5, "d": 1.0 / head_dim,
            "times": head_dim ** 0.5, "after": 1.0, "embed_over_heads": (setup.embed_dim // heads) ** -0.5}[mode]
        scores = q @ all_k.transpose(-2, -1) * scale                             # (N, heads, L, total)
        allowed = _allowed(spec.get("mask", "causal"), start, length, total, setup.window,
                           spec.get("window", "ok"), cached)
        axis = {"queries": -2, "heads": 1}.get(spec.get("softmax"), -1)   # scores (N, heads, L, T)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(axis)
        if mode == "after":                                                      # the factor on the weights
            weights = weights * head_dim ** -0.5
        out = _merge(weights @ all_v, spec.get("merge", "ok"))                  # (N, L, heads * head_dim)
        outputs += [out @ p["proj.weight"].T]                                    # (N, L, E)
    return torch.cat(outputs, dim=1)


# ----------------------------------------------------------------------------- the mistakes

_INTERLEAVED = ("Your queries and keys are turned in interleaved pairs (2i, 2i+1) (GPT-J's and Meta's original "
                "Llama layout), but the tables and the weights of this course (and of Hugging Face Llama) pair "
                "dimension i with i + head_dim/2: rotate_half(x) = cat(-x2, x1) of the two halves.")

# Mistakes visible in a full pass (one call, no cache), most specific first.
FULL_PASS: tuple[Mistake, ...] = (
    Mistake("kv_grouping", "Your key/value heads are shared in the wrong order: query head h reads key/value "
                           "head h % num_kv_heads, as `repeat` (or expand on a new first axis) tiles the whole "
                           "stack. Each key/value head serves num_heads // num_kv_heads NEIGHBOURING query heads: "
                           "h reads h // groups, which is repeat_interleave(groups, dim=1).", {"group": "tile"}),
    *(Mistake("kv_grouping", f"Your {wrong} heads are shared in another order than your {right}': query head h "
                             f"must read the key AND the value of key/value head h // groups. Repeat both the same "
                             f"way, repeat_interleave(groups, dim=1) (`repeat` tiles the stack: h % num_kv_heads).",
              spec) for wrong, right, spec in (("values'", "keys", {"group_v": "tile"}),
                                               ("keys'", "values", {"group": "tile", "group_v": "interleave"}))),
    Mistake("kv_grouping", "Every query head reads key/value head 0 (k[:, :1] or k[:, 0] expanded, multi-query "
                           "attention by hand): the other key/value heads are never used. Repeat each of the "
                           "num_kv_heads heads for its groups = num_heads // num_kv_heads neighbouring query heads, "
                           "repeat_kv(k, groups) (repeat_interleave(groups, dim=1)), so query head h reads key/value "
                           "head h // groups.", {"group": "first"}),
    Mistake("rotated_values", "You rotate the values too. RoPE turns only the queries and the keys, so that "
                              "their dot product depends on the offset between positions; the values are "
                              "mixed by the attention weights as they are.", {"rope_v": True}),
    Mistake("rotated_values", "You rotate the values instead of the keys: turn q and k, and leave v as it is.",
            {"rope_v": True, "rope_k": False}),
    Mistake("rope_missing", "Neither the queries nor the keys are rotated: without RoPE the attention cannot "
                            "tell positions apart. Apply apply_rotary to q and k after the head split.",
            {"rope_q": False, "rope_k": False}),
    Mistake("rope_missing", "Only the queries are rotated: turn the keys too (with the same offset), so that "
                            "the score of a query and a key depends on their offset.", {"rope_k": False}),
    Mistake("rope_missing", "Only the keys are rotated: turn the queries too (with the same offset).",
            {"rope_q": False}),
    Mistake("rope_layout", _INTERLEAVED, {"kind": "pairs"}),
    Mistake("rope_layout", _INTERLEAVED.replace("(GPT-J's and Meta's original Llama layout), but",
                                                "against the half-split tables, but"), {"kind": "pairs_table"}),
    Mistake("rope_rotation", "Your rotation turns the wrong way: x*cos + rotate_half(x)*sin with rotate_half(x) "
                             "= cat(-x2, x1); yours has the minus sign on the other half.", {"kind": "reverse"}),
    Mistake("rope_rotation", "Your rotation swaps sin and cos: x*cos + rotate_half(x)*sin.", {"kind": "swapped"}),
    *(Mistake("rope_rotation", "Y" + _halves_slip(pattern)[1:], {"kind": pattern}) for pattern in _HALVES_SLIPS),
    Mistake("rope_axes", "You rotate q and k while they are (N, L, heads, head_dim), before the transpose: "
                         "apply_rotary reads positions along the second-to-last axis, which is then the heads, "
                         "so each head is turned by its head index instead of each token by its position. "
                         "Rotate after transpose(1, 2), on (N, heads, L, head_dim).", {"axis": "heads"}),
    Mistake("softmax_dim", "Your softmax runs over the queries (dim=-2): each KEY's weights sum to one. Each "
                           "query's weights over the keys must sum to one: softmax over the last axis, dim=-1.",
            {"softmax": "queries"}),
    Mistake("softmax_dim", "Your softmax runs over the heads (dim=1 of the (N, heads, L, T) scores): a masked "
                           "position is -inf in every head, so its column is all -inf and gives NaN. Each query's "
                           "weights over the keys must sum to one: softmax over the last axis, dim=-1.",
            {"softmax": "heads"}),
    Mistake("rope_frequencies", "You rebuild the RoPE tables in forward with theta=10000 (the default), ignoring "
                                "the module's rope_theta: use the tables the constructor built, self.rope_cos and "
                                "self.rope_sin.", {"theta": 10000.0}),
    Mistake("rope_axes", "You rotate the flat projections (N, L, heads * head_dim) with the tables tiled across "
                         "the heads: rotate_half then swaps the halves of ALL the features, mixing the heads. "
                         "Split the heads first, then rotate each (N, heads, L, head_dim) with the (L, head_dim) "
                         "rows.", {"flat": True}),
    Mistake("causal_mask", "The future leaks: no causal mask. Each query may only see keys at its own position "
                           "or earlier (is_causal=True, or mask the scores with -inf before the softmax).",
            {"mask": "none"}),
    Mistake("causal_mask", "Your sliding window is ignored: each token should see only itself and the "
                           "sliding_window - 1 tokens before it.", {"window": "ignored"}),
    Mistake("causal_mask", "Your sliding window is one token too wide: query i may see key j when "
                           "0 <= i - j < sliding_window.", {"window": "plus_one"}),
    *mistake_rows("scale", "scale", {
        "none": "Your scores are not scaled: divide them by sqrt(head_dim) before the softmax.",
        "embed_dim": "You scale by 1/sqrt(embed_dim), but each head works in head_dim dimensions: scale by "
                     "1/sqrt(head_dim).",
        # the same as head_dim for a layer built without a head_dim of its own: shows only where it differs
        "embed_over_heads": "You scale by 1/sqrt(embed_dim // num_heads), but this layer was built with a head_dim "
                            "of its own (Qwen and Gemma layers are): each head works in self.head_dim dimensions. "
                            "Scale by 1/sqrt(self.head_dim) (or q.shape[-1]).",
        "d": "You divide the scores by head_dim; divide by its square root.",
        "times": "You multiply the scores by sqrt(head_dim); divide them by it.",
        "after": "You apply the 1/sqrt(head_dim) factor after the softmax: it belongs to the scores that go into "
                 "the softmax. Applied afterwards it only shrinks the output (each row of weights then sums to "
                 "1/sqrt(head_dim), not one)."}),
    Mistake("head_split", "Your heads are cut along the sequence: reshaping (N, L, features) straight to "
                          "(N, heads, L, head_dim) mixes positions. View as (N, L, heads, head_dim), then "
                          "transpose(1, 2).", {"split": "no_transpose"}),
    Mistake("head_split", "Your heads are merged with a bare reshape: (N, heads, L, head_dim) must become "
                          "(N, L, heads, head_dim) (transpose(1, 2)) before flattening.", {"merge": "bare"}),
    Mistake("head_split", "Both your split and your merge skip the transpose between (N, L, heads, head_dim) "
                          "and (N, heads, L, head_dim).", {"split": "no_transpose", "merge": "bare"}),
    Mistake("values", "Your values come from the key projection: v = self.value(x), not self.key(x).",
            {"value": "key"}),
    Mistake("norm_placement", "QK-norm is missing: with qk_norm=True, normalise each query and key head with "
                              "self.q_norm and self.k_norm right after the head split, before RoPE.",
            {"qk_norm": "none"}),
    Mistake("norm_placement", "You normalise the queries but not the keys: apply self.k_norm to k as well.",
            {"qk_norm": "q_only"}),
    Mistake("norm_placement", "You apply QK-norm after RoPE: normalise q and k (self.q_norm, self.k_norm) right "
                              "after the head split, then rotate them.", {"qk_norm": "after_rope"}),
)

# Mistakes visible only with a KV cache (the full pass is right).
CACHED: tuple[Mistake, ...] = (
    Mistake("rope_positions", "With a KV cache your new tokens are rotated as if they started at position 0: "
                              "pass offset=cache.length (the number of tokens already cached, read BEFORE "
                              "appending) to apply_rotary, for the queries and the keys.", {"offset": "zero"}),
    Mistake("rope_positions", "With a KV cache your new QUERIES are rotated as if they started at position 0 (the "
                              "keys get their offset): pass offset=cache.length to apply_rotary for the queries "
                              "too.", {"offset_q": "zero"}),
    Mistake("rope_positions", "With a KV cache your new KEYS are rotated as if they started at position 0 (the "
                              "queries get their offset): pass offset=cache.length to apply_rotary for the keys "
                              "too.", {"offset": "zero", "offset_q": "ok"}),
    Mistake("rope_positions", "With a KV cache your queries are rotated too far: their offset is the cache length "
                              "read AFTER appending the new keys. Read start = cache.length once, before "
                              "cache.append(...), and rotate q and k with it.", {"offset_q": "after_append"}),
    Mistake("rope_positions", "With a KV cache your new tokens are rotated too far: the offset is the cache length "
                              "read AFTER appending them. Read start = cache.length before cache.append(...).",
            {"offset": "after_append"}),
    Mistake("rope_positions", "With a KV cache your new tokens are turned to position 2 * cache.length: the tables "
                              "are sliced at start (cos[start:], sin[start:]) AND offset=start is passed too, so "
                              "the offset counts twice (and the tables run out half way). Do one of the two: "
                              "apply_rotary(..., offset=cache.length) with the whole tables.", {"offset": "twice"}),
    Mistake("causal_mask", "With a KV cache your new queries see only the first keys: is_causal=True (or a "
                           "top-left triangle) aligns query i with key i, but the new queries sit at the END, "
                           "at positions cache.length ... total-1. Use a mask whose rows are those positions "
                           "(e.g. causal_mask(total, device=x.device)[start:total]), or no mask for a single new token.",
            {"mask": "top_left"}),
    Mistake("causal_mask", "With several new tokens at once and a cache, your queries see only the first keys: "
                           "is_causal=(L > 1) aligns query i with key i, but the new queries sit at positions "
                           "cache.length ... total-1. Mask with the rows of those positions, "
                           "causal_mask(total, device=x.device)[start:total].", {"mask": "top_left_chunks"}),
    Mistake("rope_positions", "With a KV cache every new token is turned by the one row cos[start] (sin[start]), "
                              "as if one token came at a time: token i of x sits at position start + i, so rotate "
                              "the new tokens with the rows start .. start + L - 1 (apply_rotary(..., "
                              "offset=cache.length)).", {"offset": "one_row"}),
    Mistake("causal_mask", "With a KV cache your mask's rows are one too early, so no new token sees its own key: "
                           "query i of x sits at position start + i and may see keys 0 .. start + i, itself "
                           "included. Take the rows start .. total - 1 of causal_mask(total), "
                           "causal_mask(total, device=x.device)[start:total].", {"mask": "rows_early"}),
    Mistake("causal_mask", "With a KV cache you drop the causal mask, but the tokens of one call still must not "
                           "see each other's future (a prompt, or several new tokens at once): query i, at "
                           "position cache.length + i, may see keys up to there only.", {"mask": "none_cached"}),
)
