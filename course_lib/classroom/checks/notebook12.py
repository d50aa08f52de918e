"""Exercises of notebook 12 (where attention is going): 12.1 sliding_window_mask, 12.2 latent_attention,
12.3 linear_attention_recurrent.

All three are declarations the engine runs (``engine.judge``). 12.1 is compared bit for bit; 12.2 is a
procedure on engine pieces: the student's forward runs on a copy of an MLA layer, in one call or in two
with a fresh ``LatentCache`` (``_stream``), and every known mistake is the reference with one switch
(``_mla``). 12.2 and 12.3 end with a call in bfloat16 (``_in_bfloat16``): a float32 tensor made on the way (a
state, an additive mask, without dtype=) is promoted away by the engine's float64 probe, not by bfloat16. 12.3 also
backpropagates q and k of 60 to 120 (``_large_features``): elu(x) + 1 by hand with torch.where gives NaN there.
Hints are in ``classroom.exercises``.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import modern
from ... import variants as ref
from ..exercises import Mistake
from ..verdict import Failure, fail
from . import _gqa_variants as rotary
from ._attn_hypotheses import mistake_rows
from ._device_probe import probe_module
from ._gradients import check_module_gradients
from ._student_code import call_student, close, expect_tensor, max_diff, reraise_with
from .engine import Case, FunctionExercise, ScaleFit, checker, function_example, judge
from .engine.example import tiny
from .engine.function import UNEXPLAINED, Run
from .engine.probes import (
    called_in_bfloat16,
    expect_dtype_in_bfloat16,
    generations_with_fresh_caches,
    gradient_probe,
)

__all__ = ["check_sliding_window_mask", "check_latent_attention", "check_linear_attention_recurrent"]


# ============================================================================ 12.1 sliding-window mask

def _grid(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(length)[:, None]   # (L, 1) queries
    j = torch.arange(length)[None, :]   # (1, L) keys
    return i, j


def _window(shift: int = 0, future: bool = False, both: bool = False, sink_future: bool = False,
            no_sinks: bool = False) -> Callable[[int, int, int], torch.Tensor | None]:
    """A wrong mask: the window ``shift`` keys too wide, facing the future, on both sides, or sinks wrong."""
    def make(length: int, window: int, sinks: int = 0) -> torch.Tensor | None:
        if window + shift < 1 or (no_sinks and not sinks):
            return None
        i, j = _grid(length)
        near = (i - j >= 0) & (i - j < window + shift)
        if future:
            near = (j - i >= 0) & (j - i < window)
        if both:
            near = (i - j).abs() < window
        sink = (j < (0 if no_sinks else sinks)) & ((j <= i) | sink_future)
        return near | sink
    return make


def _raw_mask(case: Case, out: Any) -> None:
    length = case.args[0]
    if isinstance(out, torch.Tensor) and tuple(out.shape) == (length, length) and out.dtype != torch.bool:
        fail("dtype", f"{case.what} returned a mask of dtype {out.dtype}. This course's masks are bool, True "
                      f"where a query may attend (an additive mask with -inf is another convention): return "
                      f"dtype torch.bool.")


def _first_wrong_entry(runs: list[Run], fn: Any) -> None:
    run = runs[0]
    i, j = (run.out != run.expected).nonzero()[0].tolist()
    window, sinks = run.case.args[1], run.case.args[2]
    fail("causal_mask", f"{run.case.what}: entry [{i}, {j}] should be {bool(run.expected[i, j])}. Query i sees "
                        f"key j when 0 <= i - j < window (here {window}), or when j < sinks (here {sinks}) and "
                        f"j <= i.")


def _mask_cases(sizes: tuple[tuple[int, int, int], ...]) -> list[Case]:
    return [Case((n, w, s), f"sliding_window_mask({n}, window={w}, sinks={s})") for n, w, s in sizes]


SLIDING_WINDOW_MASK = FunctionExercise(
    "12.1", "sliding_window_mask", lambda n, w, s: ref.sliding_window_mask(n, w, s),
    lambda: _mask_cases(((7, 3, 0), (8, 3, 2), (6, 2, 1), (5, 8, 0), (5, 1, 0), (1, 1, 0), (9, 4, 3),
                         (8, 2, 4),     # more sinks than the window is wide
                         (7, 3, 2))),   # the first case's sizes with sinks: a mask kept by (length, window) shows
    ("length", "window", "sinks"),
    success="Right for every size tried: each query sees itself and the window - 1 keys before it, and the first "
            "sinks keys, never the future; dtype torch.bool.",
    mismatch=lambda run: "",   # _first_wrong_entry always decides
    mistakes=(
        Mistake("causal_mask", "Your window is one key too wide: query i sees window + 1 keys (i - j <= window). "
                               "It should see exactly window keys, itself included: 0 <= i - j < window.",
                output=_window(shift=1)),
        Mistake("causal_mask", "Your window is one key too narrow: query i sees only window - 1 keys. Count "
                               "itself: 0 <= i - j < window gives exactly window keys.", output=_window(shift=-1)),
        Mistake("causal_mask", "Your window faces the wrong side: query i sees itself and the keys AFTER it, the "
                               "future. The window reaches back: 0 <= i - j < window.", output=_window(future=True)),
        Mistake("causal_mask", "Your window is on both sides of the query (|i - j| < window), so the future leaks. "
                               "Keep only the keys at or before the query: 0 <= i - j < window.",
                output=_window(both=True)),
        Mistake("causal_mask", "The sinks are evicted: the first sinks positions must stay visible to every later "
                               "query, however far back they are (StreamingLLM).", output=_window(no_sinks=True)),
        Mistake("causal_mask", "Your sinks leak the future: a query before position sinks - 1 sees sink keys that "
                               "come after it. A sink is visible only when j < sinks AND j <= i.",
                output=_window(sink_future=True)),
    ),
    exact=True, each_case=True, raw=_raw_mask, diagnose=_first_wrong_entry,
    examples=lambda: _mask_cases(((3, 2, 0), (4, 2, 0), (4, 2, 1), (5, 2, 1))),
)


@checker("12.1", example=function_example(SLIDING_WINDOW_MASK))
def check_sliding_window_mask(fn: Callable[..., Any]) -> str:
    """``fn(length, window, sinks)`` -> bool (length, length), as course_lib.variants.sliding_window_mask."""
    return judge(SLIDING_WINDOW_MASK, fn)


# ============================================================================ 12.2 MLA with its latent cache

_CALLS_LAYER = ("Your latent_attention called the layer's own forward (layer(x, cache), layer.forward, "
                "MultiHeadLatentAttention.forward or its private _rotate): that is the course's MLA doing the work. "
                "Use only its weights (layer.q_proj, layer.kv_a_proj_with_mqa, ...) and modern.apply_rotary, and "
                "write the steps yourself.")


class _Weights(ref.MultiHeadLatentAttention):
    """The copy of the layer the student's function gets: its weights, but no forward of its own (the
    reference's forward, called unbound, goes through ``_rotate``, so that is closed too)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        fail("calls_reference", _CALLS_LAYER)

    def _rotate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        fail("calls_reference", _CALLS_LAYER)


# Every size differs from every other and from their sums (embed_dim 16, heads * dn 12, dn + dr 10, 2 * dr 8,
# kv_lora_rank 7, dn 6, dr 4, v_head_dim 3), so a scale taken from the wrong one shows.
_EMBED = 16
# A second geometry for one case (embed_dim, max_tokens, kv_lora_rank, dn, dr, v_head_dim; 3 heads): a size of the
# first one written into the code shows there.
_OTHER_GEOMETRY = (18, 24, 5, 2, 6, 4)


def _layer(seed: int, q_lora_rank: int | None, heads: int = 2, other: bool = False,
           **options: Any) -> ref.MultiHeadLatentAttention:
    torch.manual_seed(seed)
    embed_dim, max_tokens, rank, dn, dr, dv = _OTHER_GEOMETRY if other else (_EMBED, 16, 7, 6, 4, 3)
    # qk_rope_head_dim 4: two rotary pairs, so interleaved and half-split pairs differ (with one pair they agree)
    layer = ref.MultiHeadLatentAttention(embed_dim, 3 if other else heads, max_tokens, kv_lora_rank=rank,
                                         qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv,
                                         q_lora_rank=q_lora_rank, rope_interleave=False, **options)
    with torch.no_grad():
        for p in layer.parameters():   # weights of unit scale: every mistake moves the output visibly
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return layer.eval()


def _stream(forward: Callable[..., Any], layer: Any, x: torch.Tensor, split: int,
            caches: list[tuple[Any, torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """``forward(layer, x, cache)`` on the whole of x (split 0, no cache), or on x[:, :split] then x[:, split:]
    with one fresh LatentCache; the outputs side by side (N, L, embed_dim). ``caches`` collects (layer, the first
    chunk, the latents and the rotary keys the cache held after it), for ``_rotated_when_cached``."""
    if not split:
        return forward(layer, x, None)
    cache = ref.LatentCache(layer.max_tokens)
    first = forward(layer, x[:, :split], cache)
    if caches is not None and isinstance(cache.k_rope, torch.Tensor) and cache.length == split:
        latent = cache.latent.detach().clone() if isinstance(cache.latent, torch.Tensor) else None
        caches.append((layer, x[:, :split], latent, cache.k_rope.detach().clone()))
    if isinstance(first, torch.Tensor) and cache.length != split:
        fail("kv_cache", f"After latent_attention(layer, x[:, :{split}], cache) the cache holds {cache.length} "
                         f"tokens, not {split}: append the new latents and rotary keys (cache.append(latent, "
                         f"k_rope)) and attend to everything it returns.")
    if cache.latent is not None and (cache.latent.shape[-1], cache.k_rope.shape[-1]) != \
            (layer.kv_lora_rank, layer.qk_rope_head_dim):
        fail("kv_cache", f"Your cache holds tensors of sizes {cache.latent.shape[-1]} and {cache.k_rope.shape[-1]} "
                         f"per token; MLA caches only the normalised latent ({layer.kv_lora_rank} numbers) and the "
                         f"shared rotary key ({layer.qk_rope_head_dim}), not up-projected keys or values: append "
                         f"them before kv_b_proj.")
    second = forward(layer, x[:, split:], cache)
    if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
        return second if not isinstance(second, torch.Tensor) else first
    return torch.cat([first, second], dim=1)


def _rotated_when_cached(runs: list[Run], fn: Any) -> None:
    """Every output right: the cache's latents must already be normalised, and its rotary keys turned, when they
    entered it, or every later call does that again to the whole cache (9.6 reads its cache the same way)."""
    for layer, x, latents, cached in getattr(fn, "caches", ()):
        with torch.no_grad():
            latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
            normed = layer.kv_a_layernorm(latent)
        if latents is not None and latents.shape == latent.shape and close(latents, latent) and \
                not close(latent, normed):
            fail("kv_cache", "Your cache holds the latents before kv_a_layernorm: your outputs are right, but every "
                             "call then normalises the whole cache again. Normalise the latent once, BEFORE "
                             "cache.append(latent, k_rope): the cache holds what kv_b_proj reads.")
        if cached.shape == k_rope.shape and close(cached, k_rope) and \
                not close(k_rope, modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin)):
            fail("kv_cache", "Your cache holds the rotary keys before RoPE: your outputs are right, but every call "
                             "then turns the whole cache again. Rotate k_rope once, at its own positions, BEFORE "
                             "cache.append(latent, k_rope), and use what the cache returns as it is.")


def _student(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The student's function, run as _stream runs the reference, on its own copy of the layer; the caches it
    filled are kept on the wrapper (``run.caches``)."""
    def run(layer: Any, x: torch.Tensor, split: int) -> Any:
        mine = copy.deepcopy(layer)
        mine.__class__ = _Weights
        out = _stream(fn, mine, x, split, caches=run.caches)
        _layer_unchanged(layer, mine)
        return out
    run.caches = []
    return run


def _layer_unchanged(layer: nn.Module, mine: nn.Module) -> None:
    """The student's forward left its copy of the layer as it was given: the same weights and tables, the same
    settings (softmax_scale, the sizes). A weight scaled in place once (a scale folded into q_proj, a norm's weight
    changed) gives the right output on the first call, but changes the model the layer belongs to."""
    mine_tensors = dict(mine.state_dict(keep_vars=True)) if isinstance(mine, nn.Module) else {}
    for name, before in layer.state_dict(keep_vars=True).items():
        now = mine_tensors.get(name)
        if not isinstance(now, torch.Tensor) or now.shape != before.shape or now.dtype != before.dtype:
            continue   # replaced or removed: the gradient probe names that
        if not torch.equal(now.detach(), before.detach()):
            change = float((now.detach().double() - before.detach().double()).abs().max())
            fail("mutation", f"Your latent_attention changed the layer's weights in place: after the call, "
                             f"layer.{name} holds other numbers than before (largest change {change:.3g}), for "
                             f"example a scale folded into the weight (weight.mul_(layer.softmax_scale)) or a weight "
                             f"normalised with an in-place operation under torch.no_grad(). The layer belongs to "
                             f"the model: the next call, the optimizer and every other user read the changed "
                             f"weight. Leave the weights as they are and compute with them (multiply the scores by "
                             f"layer.softmax_scale).", parameter=name)
    for name, before in vars(layer).items():
        if isinstance(before, (bool, int, float)) and getattr(mine, name, before) != before:
            fail("mutation", f"Your latent_attention changed the layer's setting layer.{name} (from {before!r} to "
                             f"{getattr(mine, name)!r}) and left it so: the next call reads the changed value. Read "
                             f"the layer's settings; never assign to them in the forward.")


def _mla(layer: Any, x: torch.Tensor, split: int, *, rope: str = "split", scale: str | float = "both",
         norm: bool = True, q_norm: bool = True, offset: bool = True, mask_offset: bool = True, use_cache: bool = True,
         rotate_cached: bool = False, masked: bool = True, softmax_dim: int = -1, queries: str = "half",
         keys: str = "half", values_first: bool = False, mask_ahead: bool = False,
         merge: str = "ok", heads_view: str = "ok", biases: bool = True, unbiased: tuple[str, ...] = (),
         own_tables: bool = False,
         keys_at_zero: bool = False, queries_at: str = "start", norm_over: str = "latent",
         fill: str = "-inf", rope_first: str = "", norm_eps: float | None = None, norm_weight: bool = True,
         hide_own: bool = False) -> torch.Tensor:
    """The reference MLA forward with one mistake switched on (the defaults are right): ``queries`` and ``keys``
    how each rotary part turns (``rotary.rotate``'s kinds, "pairs" or "pairs_table"; "none": not at all),
    ``values_first`` kv_b_proj's output split as values then keys, ``mask_ahead`` one future key let through,
    ``merge`` "no_transpose" (the heads merged without moving them back) or "interleaved" (each feature's heads
    side by side), ``q_norm`` False: the query latent not normalised, ``heads_view`` "queries" or
    "keys_values" (viewed straight as (N, H, L, ...), without the transpose), ``scale`` "both" (right), "nope",
    "none", "value", "after" (softmax_scale on the weights) or a float, the factor on the scores; ``biases``
    False: the projections as products with their weights alone, a layer's biases left out (``unbiased``: those of
    the projections named only); ``own_tables``: the
    rotary parts turned by tables of their own (the default theta), not the layer's rope_cos and rope_sin;
    ``keys_at_zero``: the new rotary keys alone turned from position 0 with a cache (``offset``: queries too);
    ``fill`` what the hidden scores become: "-inf" (right), "zero" (0, as scores * mask or masked_fill(~mask, 0)
    give) or "add" (the 0/1 mask added to the scores); ``rope_first`` "queries": the query's rotary part read from
    the front of each head (q.split([dr, dn])), "keys": the keys built as [k_rope, k_nope] while the queries are
    [q_nope, q_rope]; ``norm_eps`` the latent's RMSNorm written out with an epsilon of its own, ``norm_weight``
    False: written out without kv_a_layernorm's weight; ``hide_own``: the mask hides each query's own key too."""
    def turn(t: torch.Tensor, kind: str, at: int) -> torch.Tensor:
        if kind == "none":
            return t
        cos, sin = modern.rope_tables(layer.qk_rope_head_dim, layer.max_tokens) if own_tables else \
            (layer.rope_cos, layer.rope_sin)
        return rotary.rotate(t, cos, sin, at, kind=kind).to(t.dtype)

    def forward(layer: Any, x: torch.Tensor, cache: Any) -> torch.Tensor:
        n, length, _ = x.shape
        start = cache.length if cache is not None else 0
        dn, dr, h = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads
        pos = start if offset else 0
        def project(linear: nn.Linear, t: torch.Tensor) -> torch.Tensor:
            left_out = not biases or any(getattr(layer, name, None) is linear for name in unbiased)
            return t @ linear.weight.T if left_out else linear(t)

        q = layer.q_proj(x) if layer.q_lora_rank is None else \
            layer.q_b_proj((layer.q_a_layernorm if q_norm else nn.Identity())(project(layer.q_a_proj, x)))
        q = (q.view(n, h, length, dn + dr) if heads_view == "queries"
             else q.view(n, length, h, dn + dr).transpose(1, 2))              # (N, H, L, dn + dr)
        latent, k_rope = project(layer.kv_a_proj_with_mqa, x).split([layer.kv_lora_rank, dr], dim=-1)
        if norm and norm_over != "latent":   # kv_a_layernorm's statistic over the latent and k_rope together
            both, ln = torch.cat([latent, k_rope], dim=-1), layer.kv_a_layernorm
            weight = torch.cat([ln.weight, ln.weight.new_ones(dr)])
            normed = F.layer_norm(both, both.shape[-1:]) * weight if norm_over == "both_layer" else \
                both * torch.rsqrt(both.pow(2).mean(-1, keepdim=True) + ln.eps) * weight
            latent, turned = normed.split([layer.kv_lora_rank, dr], dim=-1)
            k_rope = k_rope if norm_over == "stat_rms" else turned
        elif norm and (norm_eps is not None or not norm_weight):   # the RMSNorm written out, one part changed
            ln = layer.kv_a_layernorm
            latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + (ln.eps if norm_eps is None else
                                                                                   norm_eps))
            latent = latent * ln.weight if norm_weight else latent
        elif norm:
            latent = layer.kv_a_layernorm(latent)
        if rope == "split" and not rotate_cached:
            k_rope = turn(k_rope, keys, 0 if keys_at_zero else pos)
        if cache is not None:
            latent, k_rope = cache.append(latent, k_rope)
            if not use_cache:
                latent, k_rope = latent[:, start:], k_rope[:, start:]
        total = latent.shape[1]
        if rope == "split" and rotate_cached:   # the whole cache turned again to the new chunk's positions
            k_rope = turn(k_rope, keys, pos)
        kv = layer.kv_b_proj(latent)
        kv = (kv.view(n, h, total, dn + layer.v_head_dim) if heads_view == "keys_values"
              else kv.view(n, total, h, dn + layer.v_head_dim).transpose(1, 2))   # (N, H, T, dn + dv)
        if values_first:
            v, k_nope = kv.split([layer.v_head_dim, dn], dim=-1)
        else:
            k_nope, v = kv.split([dn, layer.v_head_dim], dim=-1)
        k_parts = [k_nope, k_rope[:, None].expand(n, h, total, dr)]
        k = torch.cat(k_parts[::-1] if rope_first == "keys" else k_parts, dim=-1)   # (N, H, T, dn + dr)
        if rope == "split":
            if rope_first == "queries":
                q_rope, q_nope = q.split([dr, dn], dim=-1)
            else:
                q_nope, q_rope = q.split([dn, dr], dim=-1)
            q = torch.cat([q_nope, turn(q_rope, queries, total if queries_at == "after_append" else pos)], -1)
        elif rope == "whole":
            cos, sin = modern.rope_tables(dn + dr, layer.max_tokens)
            q = modern.apply_rotary(q, cos, sin, offset=pos)
            k = modern.apply_rotary(k, cos, sin)   # every key, cached or new, from position 0
        factor = scale if isinstance(scale, float) else {
            "both": layer.softmax_scale, "nope": dn ** -0.5, "none": 1.0, "value": layer.v_head_dim ** -0.5,
            "after": 1.0, "latent": layer.kv_lora_rank ** -0.5, "cached": (layer.kv_lora_rank + dr) ** -0.5}[scale]
        scores = q @ k.transpose(-2, -1) * factor                           # (N, H, L, T)
        first = total - length if mask_offset else 0
        mask = torch.ones(total, total, dtype=torch.bool).tril(-1 if hide_own else int(mask_ahead))[first:first + length]
        if masked and fill == "add":
            scores = scores + mask.to(scores.dtype)
        elif masked:
            scores = scores.masked_fill(~mask, float("-inf") if fill == "-inf" else 0.0)
        weights = scores.softmax(softmax_dim) * ((dn + dr) ** -0.5 if scale == "after" else 1.0)
        out = weights @ v                                                   # (N, H, L, dv)
        out = {"ok": out.transpose(1, 2), "interleaved": out.permute(0, 2, 3, 1)}.get(merge, out)   # (N, L, H, dv)
        return project(layer.o_proj, out.reshape(n, length, h * layer.v_head_dim))
    return _stream(forward, layer, x, split)


def _mla_cases() -> list[Case]:
    cases = []
    for seed, (q_rank, n, length, split, other, options) in enumerate((
            (None, 2, 5, 0, False, {}), (4, 1, 6, 0, False, {}), (None, 2, 6, 4, False, {}),
            (4, 1, 7, 3, False, {}), (None, 1, 5, 1, False, {}),
            (3, 2, 17, 2, True, {}),    # 17 tokens, past 16
            (4, 1, 5, 2, False, {"bias": True}),   # DeepSeek's attention_bias: the layer's weights include biases
            # the layer's own settings away from their defaults: its tables and its norms come from the layer (its
            # scale may be computed from the widths, as the text's formula does: the bank holds that as right)
            (None, 2, 6, 3, False, {"rope_theta": 50.0, "norm_eps": 0.5}),
            # a softmax_scale of its own (YaRN's models set one): the text asks for layer.softmax_scale
            (4, 1, 6, 2, False, {"softmax_scale": 0.15}))):
        layer = _layer(seed, q_rank, other=other, **options)
        x = torch.randn(n, length, layer.embed_dim, generator=torch.Generator().manual_seed(seed))
        how = f"x of shape {(n, length, layer.embed_dim)}" + (
            f", in two calls ({split} tokens, then {length - split}) with one LatentCache" if split else ", cache=None")
        sizes = (f", a layer of {layer.num_heads} heads, dn={layer.qk_nope_head_dim}, dr={layer.qk_rope_head_dim}, "
                 f"kv_lora_rank={layer.kv_lora_rank}, max_tokens={layer.max_tokens}" if other else "")
        sizes += ", bias=True: q_a_proj, kv_a_proj_with_mqa and o_proj carry biases" if options.get("bias") else ""
        sizes += "".join(f", {key}={value}" for key, value in options.items() if key != "bias")
        cases.append(Case((layer, x, split), f"latent_attention(layer, ...) on {how} (q_lora_rank={q_rank}{sizes})"))
    return cases


def _mla_examples() -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    return [Case((_layer(0, None, heads=1), tiny(generator, 1, length, _EMBED), split),
                 f"latent_attention on x of shape (1, {length}, {_EMBED})" + (f", split after {split} tokens" if split else ""))
            for length, split in ((1, 0), (2, 0), (3, 0), (3, 2))]


def _mla_magnitude() -> list[Case]:
    """The first cases with the query and key weights 10 times larger: scores 100 times larger, several hundred."""
    cases = []
    for case in _mla_cases()[:2]:
        layer, x, split = case.args
        with torch.no_grad():
            (layer.q_proj if layer.q_lora_rank is None else layer.q_b_proj).weight.mul_(10.0)
            layer.kv_b_proj.weight.mul_(10.0)
            layer.kv_a_proj_with_mqa.weight[-layer.qk_rope_head_dim:].mul_(10.0)   # the rotary keys
        cases.append(Case((layer, x, split), f"{case.what}, with the query and key weights 10 times larger "
                                             f"(scores of several hundred)"))
    return cases


def _mla_gradients() -> list[Case]:
    """Both query paths the exercise allows: with a query latent (q_a_proj, q_b_proj) and without (q_proj); code cut
    from autograd on one path only shows on that path. (Not through a LatentCache: its append writes into its
    buffers in place, so no backward runs through two calls, the layer's own forward included.)"""
    cases = []
    for seed, (q_rank, split) in zip((7, 8), ((4, 0), (None, 0))):
        x = torch.randn(1, 4, _EMBED, generator=torch.Generator().manual_seed(seed))
        how = f", in two calls ({split} tokens, then {4 - split}) with one LatentCache" if split else ""
        cases.append(Case((_layer(seed, q_rank), x, split),
                          f"latent_attention(layer, x) with x of shape (1, 4, {_EMBED}){how} (q_lora_rank={q_rank})"))
    return cases


_TURNED_AGAIN = ("Your cache's rotary keys are turned again at every call: rotate k_rope once, at its own positions, "
                 "BEFORE it enters the cache, and use what the cache returns as it is.")
_QUERIES_FROM_ZERO = ("With a cache, your queries' rotary part is turned as if the new tokens started at position 0 "
                      "(offset=0), while your keys are turned right (the cache holds them rotated to their own "
                      "positions): the new query i sits at position start + i. Turn q_rope with "
                      "modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start), start = "
                      "cache.length read before appending, as you do for k_rope.")

_MLA_MISTAKES = (
    Mistake("rope_positions", "Your queries are turned to the positions after the new tokens (start + L onwards, "
                              "or L without a cache: the cache's length read after cache.append): query i sits at "
                              "start + i. Read start = cache.length before the append and turn q_rope and k_rope "
                              "with offset=start.", spec=dict(queries_at="after_append")),
    *(Mistake("norm_placement", "kv_a_layernorm is applied to the latent and k_rope together (before the split, "
                                "or its statistic over both): only the latent, the first kv_lora_rank numbers of "
                                "kv_a_proj_with_mqa's output, goes through the norm; k_rope is turned by RoPE as "
                                "it comes. Split first, then latent = layer.kv_a_layernorm(latent).",
              spec=dict(norm_over=over)) for over in ("both_rms", "stat_rms", "both_layer")),
    Mistake("rope_axes", "RoPE turns the whole head: only the rotary part (the last qk_rope_head_dim numbers of each "
                         "query, and the shared k_rope) is rotated; the part without position (qk_nope_head_dim) "
                         "must stay as it is, or W_UK could not be folded into the query.", spec=dict(rope="whole")),
    Mistake("rope_missing", "No rotary embedding: q_rope and k_rope must both be turned to their positions with "
                            "modern.apply_rotary(..., layer.rope_cos, layer.rope_sin, offset=start).",
            spec=dict(rope="none")),
    Mistake("rope_positions", "With a cache, the new tokens are rotated as if they started at position 0: turn them "
                              "to start = cache.length (read before appending), the positions they hold in the stream.",
            spec=dict(offset=False)),
    # the same outputs as queries turned from position 0 (a score depends only on the offset between query and key):
    # check_latent_attention reads the cache to tell them apart (``_queries_from_zero``)
    Mistake("kv_cache", _TURNED_AGAIN, spec=dict(rotate_cached=True)),
    Mistake("rope_positions", "With a cache, the new rotary KEYS are turned as if they started at position 0 (the "
                              "queries at start): turn k_rope with offset=start = cache.length, read before "
                              "appending, as the queries.", spec=dict(keys_at_zero=True)),
    Mistake("kv_cache", "With a cache, the new queries attend only to the new tokens: attend to everything "
                        "cache.append(latent, k_rope) returns (the tokens held before, then the new ones).",
            spec=dict(use_cache=False)),
    Mistake("causal_mask", "Your causal mask does not account for the cache: the new queries sit at positions "
                           "start .. start + L - 1, so query i sees keys 0 .. start + i (take rows start: of the "
                           "T x T lower triangle).", spec=dict(mask_offset=False)),
    Mistake("causal_mask", "Your causal mask hides each query's own key too (a strict lower triangle: tril(-1), or "
                           "-inf from triu(start) where it starts at triu(start + 1)): query start + i sees keys "
                           "0 .. start + i, its own included, so the first query is not left with no key at all.",
            spec=dict(hide_own=True)),
    Mistake("causal_mask", "No causal mask: each query also sees the later tokens of its chunk. Query start + i "
                           "may see keys 0 .. start + i only.", spec=dict(masked=False)),
    *mistake_rows("causal_mask", "fill", {
        "zero": "Your hidden scores are 0, not -inf (the scores multiplied by a 0/1 mask, or masked_fill(~mask, 0)): "
                "exp(0) = 1, so every future key still gets weight e^0 in the softmax, as much as a key of score 0 "
                "that the query may see. Hide a key with scores.masked_fill(~mask, float('-inf')) before the "
                "softmax: its weight is then exactly 0.",
        "add": "Your 0/1 mask is added to the scores (scores + mask): the keys a query may see get +1, the future "
               "keys keep their own scores, so the future still gets weight. A bool mask hides keys: fill their "
               "scores with -inf, scores.masked_fill(~mask, float('-inf')), before the softmax."}),
    *mistake_rows("softmax_dim", "softmax_dim", {
        -2: "The softmax runs over the queries (dim=-2): each query's weights must sum to one over the keys, the "
            "last axis of the (N, H, L, T) scores.",
        1: "The softmax runs over the heads (dim=1 of the (N, H, L, T) scores): a masked position is -inf in every "
           "head, so its column is all -inf and gives NaN. Each query's weights sum to one over the keys, the last "
           "axis."}),
    Mistake("rope_layout", "You turn interleaved pairs (0, 1), (2, 3), ... of the rotary parts: this layer pairs "
                           "dimension i with i + qk_rope_head_dim/2 (rope_interleave=False), as "
                           "modern.apply_rotary does with layer.rope_cos and layer.rope_sin.",
            spec=dict(queries="pairs_table", keys="pairs_table")),
    Mistake("rope_layout", "You turn interleaved pairs (0, 1), (2, 3), ... of the rotary parts, with angles of "
                           "their own: this layer pairs dimension i with i + qk_rope_head_dim/2 "
                           "(rope_interleave=False); use modern.apply_rotary with layer.rope_cos and layer.rope_sin.",
            spec=dict(queries="pairs", keys="pairs")),
    Mistake("rope_layout", "Your queries' rotary part is turned in interleaved pairs (0, 1), (2, 3), ... and the "
                           "keys' in the layer's half-split pairs (i, i + qk_rope_head_dim/2): turn both with "
                           "modern.apply_rotary, so that a query and a key turn alike.",
            spec=dict(queries="pairs_table")),
    Mistake("rope_layout", "Your rotary keys are turned in interleaved pairs (0, 1), (2, 3), ... and the queries "
                           "in the layer's half-split pairs (i, i + qk_rope_head_dim/2): turn both with "
                           "modern.apply_rotary, so that a query and a key turn alike.", spec=dict(keys="pairs_table")),
    Mistake("rope_missing", "Only the rotary keys are turned: turn q_rope too, with modern.apply_rotary(q_rope, "
                            "layer.rope_cos, layer.rope_sin, offset=start), so that a score depends on the offset "
                            "between the query and the key.", spec=dict(queries="none")),
    Mistake("rope_missing", "Only the queries' rotary part is turned: turn k_rope too, at its own positions, "
                            "before it enters the cache.", spec=dict(keys="none")),
    Mistake("values", "kv_b_proj's output is split as values then keys: per head it holds qk_nope_head_dim key "
                      "numbers first, then v_head_dim value numbers, kv.split([dn, dv], dim=-1).",
            spec=dict(values_first=True)),
    Mistake("rope_frequencies", "Your rotary parts are turned by tables of your own, made with the default theta: "
                                "this layer's rope_theta is its own. Turn them with layer.rope_cos and "
                                "layer.rope_sin, the tables the layer built.", spec=dict(own_tables=True)),
    Mistake("bias", "Your projections leave the layer's biases out (x @ weight.T): with bias=True, q_a_proj, "
                    "kv_a_proj_with_mqa and o_proj each add theirs. Call the layer's Linear modules, layer.o_proj(out), "
                    "or add layer.o_proj.bias yourself.", spec=dict(biases=False)),
    # one or two of the three left out (o_proj written as out @ o_proj.weight.T, the others called)
    *(Mistake("bias", f"Your {' and '.join(left)} leave{'s' if len(left) == 1 else ''} out "
                      f"{'its' if len(left) == 1 else 'their'} bias (t @ layer.{left[0]}.weight.T), while the other "
                      f"projections add theirs: with bias=True, q_a_proj, kv_a_proj_with_mqa and o_proj each carry "
                      f"one. Call the layer's Linear modules, layer.{left[0]}(t), or add layer.{left[0]}.bias "
                      f"yourself.", spec=dict(unbiased=left))
      for left in (("o_proj",), ("q_a_proj",), ("kv_a_proj_with_mqa",), ("q_a_proj", "kv_a_proj_with_mqa"),
                   ("q_a_proj", "o_proj"), ("kv_a_proj_with_mqa", "o_proj"))),
    Mistake("causal_mask", "Your causal mask lets one future key through: the new query i (at position start + i) "
                           "may see keys 0 .. start + i, the lower triangle shifted by start, not start + 1.",
            spec=dict(mask_ahead=True)),
    Mistake("head_split", "You merge the heads without moving them back: the (N, H, L, v_head_dim) output must "
                          "become (N, L, H, v_head_dim) (transpose(1, 2)) before the reshape to (N, L, "
                          "H * v_head_dim), or the reshape mixes positions and heads.",
            spec=dict(merge="no_transpose")),
    *mistake_rows("split_transpose", "heads_view", {
        "keys_values": "kv_b_proj's output is viewed straight as (N, H, T, ...), without the transpose: its memory "
                       "holds each token's heads side by side, so view it as (N, T, H, dn + dv) first, then "
                       ".transpose(1, 2), or the view mixes positions and heads.",
        "queries": "The queries are viewed straight as (N, H, L, ...), without the transpose: view them as (N, L, H, "
                   "dn + dr) first, then .transpose(1, 2), or the view mixes positions and heads."}),
    *mistake_rows("scale", "scale", {
        "nope": "The scores are scaled by 1/sqrt(qk_nope_head_dim): the query and key have qk_nope_head_dim + "
                "qk_rope_head_dim numbers, so scale by (dn + dr) ** -0.5 (layer.softmax_scale).",
        "none": "The scores are not scaled: multiply them by layer.softmax_scale, (dn + dr) ** -0.5.",
        "value": "The scores are scaled by 1/sqrt(v_head_dim): the scale belongs to the width of the query and key, "
                 "(qk_nope_head_dim + qk_rope_head_dim) ** -0.5.",
        "after": "The scale is applied to the weights after the softmax: layer.softmax_scale multiplies the scores "
                 "that go into the softmax; afterwards it only shrinks the output.",
        # the latent is what the keys come from and what is cached, but a score is a dot product of dn + dr numbers
        "latent": "The scores are scaled by 1/sqrt(kv_lora_rank), the latent's width: the keys are made from the "
                  "latent, but a score is the dot product of a query and a key of qk_nope_head_dim + "
                  "qk_rope_head_dim numbers each. Multiply by layer.softmax_scale ((dn + dr) ** -0.5 by default).",
        "cached": "The scores are scaled by 1/sqrt(kv_lora_rank + qk_rope_head_dim), the numbers cached per token: a "
                  "score is the dot product of a query and a key of qk_nope_head_dim + qk_rope_head_dim numbers "
                  "each. Multiply by layer.softmax_scale ((dn + dr) ** -0.5 by default)."}),
    *mistake_rows("rope_axes", "rope_first", {
        "queries": "Your query's rotary part is read from the front of each head (q.split([dr, dn])): per head, "
                   "q_proj gives the qk_nope_head_dim numbers without position FIRST, then the qk_rope_head_dim "
                   "rotary ones: q_nope, q_rope = q.split([dn, dr], dim=-1), and turn q_rope.",
        "keys": "Your keys put the rotary part first (torch.cat([k_rope, k_nope])) while your queries put it last "
                "([q_nope, q_rope]): a score then multiplies a query's nope numbers by a key's rotary ones. Build "
                "both the same way: k = torch.cat([k_nope, k_rope], dim=-1), like q."}),
    Mistake("norm_weight", "Your RMSNorm of the latent leaves out kv_a_layernorm's learned weight: after dividing by "
                           "the root mean square it multiplies by layer.kv_a_layernorm.weight. Call "
                           "layer.kv_a_layernorm(latent) itself.", spec=dict(norm_weight=False)),
    *(Mistake("epsilon", f"Your RMSNorm of the latent adds an epsilon of your own ({eps:g}) under the root: this "
                         f"layer's kv_a_layernorm has its own, layer.kv_a_layernorm.eps. Call "
                         f"layer.kv_a_layernorm(latent) itself, or read its .eps.", spec=dict(norm_eps=eps))
      for eps in (1e-6, 1e-5, 1e-8, 0.0)),
    Mistake("norm_placement", "The latent is not normalised: apply layer.kv_a_layernorm to the latent part of "
                              "kv_a_proj_with_mqa(x) (not to k_rope) before it is cached and up-projected.",
            spec=dict(norm=False)),
    Mistake("norm_placement", "The query latent is not normalised: the queries are q_b_proj(q_a_layernorm("
                              "q_a_proj(x))) when the layer has a q_lora_rank.", spec=dict(q_norm=False)),
    Mistake("head_split", "Your merge interleaves the heads: (N, H, L, v_head_dim) must become (N, L, H, "
                          "v_head_dim), transpose(1, 2), before the reshape, so each head's features stay together; "
                          "a permute that puts the heads last puts one feature of every head side by side.",
            spec=dict(merge="interleaved")),
)

_SIZES_DIFFER = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)")


def _mask_of_new_tokens(failure: Failure, case: Case) -> None:
    """A stream's second call that fails on its L new queries against its T = start + L keys: the scores are L x T,
    and a causal mask of the new tokens alone (torch.ones(L, L).tril()) does not fit them."""
    _, x, split = case.args
    sizes = _SIZES_DIFFER.search(failure.message) if failure.diagnosis == "exception" and split else None
    new, total = x.shape[1] - split, x.shape[1]
    if sizes is not None and {int(sizes[1]), int(sizes[2])} == {new, total}:
        fail("causal_mask", f"{failure.message.rstrip().rstrip('.')}. In the second call the {new} new queries meet all {total} "
                            f"tokens (start = {split} cached, then the {new} new ones): the scores are {new} x "
                            f"{total}, and something made for the new tokens alone does not fit them, most likely "
                            f"the causal mask ({new} x {new}, torch.ones(L, L).tril()). New query i stands at "
                            f"position start + i and sees keys 0 .. start + i: take the rows start: of the T x T "
                            f"lower triangle, torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[start:]. "
                            f"(If your mask is that already: every key part, k_rope too, comes from what "
                            f"cache.append returns.)", **failure.details)


def _other_geometry(failure: Failure, case: Case, out: Any, fn: Any) -> None:
    """A failure on the layer of other sizes: the other layers share one geometry, so a size may be written in. (A
    mask of the new tokens alone, in a stream's second call, is named first.)"""
    _mask_of_new_tokens(failure, case)
    if case.args[0].embed_dim != _EMBED:
        reraise_with(failure, failure.diagnosis, " This layer's sizes differ from the other cases' (2 heads, dn=6, "
                     "dr=4, kv_lora_rank=7, max_tokens=16): if your code runs on those, a size is most likely "
                     "written into it. Take every size from the layer (layer.num_heads, layer.qk_nope_head_dim, ...) "
                     "or from x.shape.")


LATENT_ATTENTION = FunctionExercise(
    "12.2", "latent_attention", lambda layer, x, split: _stream(lambda m, xx, c: m(xx, c), layer, x, split),
    _mla_cases, ("layer", "x", "split"),
    success="Right with and without a LatentCache, with and without a query latent (q_lora_rank): your MLA "
            "caches one latent and one rotary key per token and gives the layer's outputs.",
    mismatch=lambda run: f"{run.case.what} differs from the layer's own forward, and {UNEXPLAINED}. "
                         f"Go through the steps: queries split into nope and rope parts; latent and k_rope from "
                         f"kv_a_proj_with_mqa; the norm; RoPE on the rotary parts at start; the cache; keys and "
                         f"values from kv_b_proj; scores with layer.softmax_scale; the causal mask; o_proj.",
    mistakes=_MLA_MISTAKES, variant=lambda layer, x, split, spec: _mla(layer, x, split, **spec),
    scales=(ScaleFit(lambda layer, x, split, factor: _mla(layer, x, split, scale=factor),
                     lambda layer, *_: layer.softmax_scale,
                     "{what}: your scores are multiplied by {factor:.4g}, where the layer's softmax_scale is "
                     "{right:.4g} (by default (qk_nope_head_dim + qk_rope_head_dim) ** -0.5: the query and the key "
                     "have dn + dr numbers each; a layer may set it). Multiply by layer.softmax_scale."),),
    after=_rotated_when_cached, reword=_other_geometry,
    gradients=_mla_gradients, examples=_mla_examples, magnitude=_mla_magnitude,
)


def _latent_example(fn: Callable[..., Any], *_: Any, **__: Any) -> Any:
    """The engine's counter-example, with the student's function run as the check runs it (a copy of the layer,
    the cache made by ``_stream``)."""
    return function_example(LATENT_ATTENTION)(_student(fn))


@checker("12.2", example=_latent_example)
def check_latent_attention(fn: Callable[..., Any]) -> str:
    """``fn(layer, x, cache=None)`` -> (N, L, embed_dim), as MultiHeadLatentAttention.forward (rope_interleave=False)."""
    student = _student(fn)
    try:
        success = judge(LATENT_ATTENTION, student)
    except Failure as failure:
        _queries_from_zero(failure, student.caches)
        raise
    _layer_gradients(fn)
    _layer_on_device(fn)
    _layer_in_bfloat16(fn)
    _generations_with_fresh_caches(fn)
    return success


def _generations_with_fresh_caches(fn: Callable[..., Any]) -> None:
    """Generations with a new LatentCache each, then two caches in turn (``generations_with_fresh_caches``); after a
    prompt the cache must hold its rotary keys turned to positions 0 .. L - 1 (a start kept on the layer is off by
    the same amount for every token, which RoPE's relative angles hide from the outputs)."""
    layer, x, _ = _mla_cases()[2].args   # a prompt of 4 tokens, then more
    mine = copy.deepcopy(layer)
    mine.__class__ = _Weights
    with torch.no_grad():
        expected = layer(x)
        turned = modern.apply_rotary(layer.kv_a_proj_with_mqa(x)[..., layer.kv_lora_rank:], layer.rope_cos,
                                     layer.rope_sin)                              # (N, L, dr): positions 0 ..

    def step(cache: Any, start: int, length: int) -> None:
        what = f"latent_attention(layer, x, cache) with {length} new token(s) and {start} cached"
        with torch.no_grad():
            out = expect_tensor(call_student(fn, mine, x[:, start:start + length].clone(), cache, what=what),
                                (x.shape[0], length, x.shape[2]), what, finite=False)
        if not close(out, expected[:, start:start + length]):
            fail("kv_cache", f"{what}: your output differs from the layer's by up to "
                             f"{max_diff(out, expected[:, start:start + length]):.3g}.")
        held = cache.k_rope
        if isinstance(held, torch.Tensor) and held.shape == turned[:, :start + length].shape and \
                not close(held, turned[:, :start + length]):
            fail("kv_cache", f"{what}: your outputs are right, but the cache holds rotary keys turned to other "
                             f"positions than 0 .. {start + length - 1}.")
    generations_with_fresh_caches(lambda: ref.LatentCache(layer.max_tokens), step, 4)


def _queries_from_zero(failure: Failure, caches: list[tuple[Any, torch.Tensor, Any, torch.Tensor]]) -> None:
    """Keys turned again at every call and queries turned from position 0 give the same outputs (a score depends
    only on the offset between query and key): the cache tells them apart. Where every cache the student's code
    filled holds its rotary keys turned to their positions, the keys are right and the queries are not."""
    if failure.diagnosis != "kv_cache" or _TURNED_AGAIN not in failure.message or not caches:
        return
    shown = False
    for layer, x, _, cached in caches:
        with torch.no_grad():
            k_rope = layer.kv_a_proj_with_mqa(x)[..., layer.kv_lora_rank:]
            turned = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin)
        if close(k_rope, turned):   # a prompt of one token: position 0 turns nothing, so it tells nothing
            continue
        if cached.shape != turned.shape or not close(cached, turned):
            return
        shown = True
    if shown:
        fail("rope_positions", _QUERIES_FROM_ZERO)


class _Bound(nn.Module):
    """A layer and a forward function of it (the student's, or the layer's own) as one module, whose parameters are
    the layer's: so that the gradient probe compares every weight's gradient by name."""

    def __init__(self, layer: nn.Module, forward: Callable[..., Any]):
        super().__init__()
        self.layer, self.run = layer, forward

    def forward(self, x: torch.Tensor, cache: Any = None) -> Any:
        return self.run(self.layer, x, cache)


def _layer_gradients(fn: Callable[..., Any]) -> None:
    """The engine's gradient probe compares x's gradient; the layer's weights must learn as the layer's own do, on
    every gradient case (with and without a query latent)."""
    for case in _mla_gradients():
        layer, x, _ = case.args
        mine = copy.deepcopy(layer)
        mine.__class__ = _Weights
        check_module_gradients(_Bound(mine, fn), _Bound(copy.deepcopy(layer), lambda m, t, cache: m(t, cache)), x,
                               what=f"{case.what}: the layer's weights")


def _layer_on_device(fn: Callable[..., Any]) -> None:
    """Last: the layer and x on another device (meta), without a cache and with a LatentCache (x in a prompt and the
    rest, three ways), each also after the same calls on the CPU; a mask, positions or a table made on the CPU (no
    device=x.device), on the cached path only or kept from an earlier call, shows."""
    layer, x, _ = _mla_gradients()[0].args
    mine = copy.deepcopy(layer)
    mine.__class__ = _Weights
    probe_module(_Bound(mine, fn), x, f"latent_attention(layer, x) with x of shape {tuple(x.shape)}",
                 cache=lambda: ref.LatentCache(layer.max_tokens))


def _in_bfloat16(run: Callable[[], Any], expected: torch.Tensor, what: str, made: str) -> None:
    """The engine's bfloat16 probe on one call (``run``, the inputs already in bfloat16): the output's shape and
    dtype are judged, not its values (judged in float32 and float64); an error where two dtypes meet is ``dtype``,
    any other (no bfloat16 kernel) inconclusive. ``made``: which new tensors are likely made in float32."""
    out = called_in_bfloat16(run, what, made)
    if out is not None:   # None: an operation without a bfloat16 kernel, inconclusive
        expect_dtype_in_bfloat16(expect_tensor(out, tuple(expected.shape), what, finite=False), what, made)


def _layer_in_bfloat16(fn: Callable[..., Any]) -> None:
    """Last: the layer and x in bfloat16, without a cache and in a stream of two calls; the output must be bfloat16."""
    cases = _mla_cases()
    for case in (cases[0], cases[3]):   # without a cache, and a stream of two calls with a query latent
        layer, x, split = case.args
        layer, x = layer.to(torch.bfloat16), x.to(torch.bfloat16)
        what = f"{case.what}, with the layer and x in bfloat16 (layer.to(torch.bfloat16))"
        with torch.no_grad():
            expected = _stream(lambda m, xx, c: m(xx, c), copy.deepcopy(layer), x, split)
        student = _student(lambda m, xx, c=None, what=what: call_student(fn, m, xx, c, what=what))
        _in_bfloat16(lambda run=student, args=(layer, x, split): run(*args), expected, what,
                     "An additive mask made without dtype= (torch.zeros(L, T), torch.full(..., float('-inf'))) or "
                     "with dtype=torch.float32 takes float32 and turns the scores float32 (a bool mask with "
                     "scores.masked_fill(~mask, float('-inf')) has no dtype to get wrong).")


# ============================================================================ 12.3 recurrent linear attention

def _phi(x: torch.Tensor) -> torch.Tensor:
    return ref.elu_feature_map(x)


def _linear(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, *, diagonal: int = 0, causal: bool = True,
            normalise: bool = True, fq_norm: torch.Tensor | None = None, fk_norm: torch.Tensor | None = None,
            norm_keys: str = "same", z0: float = 0.0, eps: str = "denominator") -> torch.Tensor:
    """Linear attention from features: weights fq . fk over keys j <= i + diagonal (all if not causal); the
    normaliser (of ``fq_norm``, ``fk_norm`` where given) over the same keys, or ``norm_keys`` "through_i" (j <= i
    whatever ``diagonal``), "before_i" (j < i) or "own" (j = i), with z started at ``z0`` in every feature; the 1e-6
    added to the ``eps`` "denominator" (right), the "output" after the division or "both" numerator and denominator."""
    weights = fq @ fk.transpose(-2, -1)                                     # (..., L, L)
    length = weights.shape[-1]
    if causal:
        weights = weights * torch.ones(length, length).tril(diagonal)
    if not normalise:
        return weights @ v
    below = (fq if fq_norm is None else fq_norm) @ (fk if fk_norm is None else fk_norm).transpose(-2, -1)
    if causal:
        keys = {"same": torch.ones(length, length).tril(diagonal), "through_i": torch.ones(length, length).tril(),
                "own": torch.eye(length), "before_i": torch.ones(length, length).tril(-1)}[norm_keys]
        below = below * keys
    start = z0 * (fq if fq_norm is None else fq_norm).sum(-1, keepdim=True)   # phi(q_i) . z_0
    num, den = weights @ v, below.sum(-1, keepdim=True) + start
    return {"denominator": lambda: num / (den + 1e-6), "output": lambda: num / den + 1e-6,
            "both": lambda: (num + 1e-6) / (den + 1e-6)}[eps]()


# the feature maps students use instead of elu(x) + 1, with what goes wrong
_OTHER_MAPS = (
    ("elu(x) without the + 1", F.elu, "it is negative below zero, so a weight phi(q) . phi(k) and the normaliser "
                                      "can be negative or 0"),
    ("softplus", F.softplus, "it is positive, but it is not the map this exercise and its parallel form use"),
    ("exp", torch.exp, "it overflows for large inputs, and it is not the map the parallel form uses"),
    ("sigmoid", torch.sigmoid, "it flattens every large value to 1"),
    ("elu(x + 1), the 1 added inside", lambda t: F.elu(t + 1), "the 1 is added after the elu, phi(x) = elu(x) + 1 "
                                                             "(F.elu(x) + 1), which is positive everywhere; elu(x + 1) "
                                                             "is negative below -1"),
    ("x + 1", lambda x: x + 1, "it is negative below -1"),
)


def _linear_cases() -> list[Case]:
    # the last: one value feature (d_v = 1) in a batch, where a .squeeze() of the read drops more than it means to
    shapes = (((2, 3, 6, 4), 3), ((7, 4), 5), ((1, 1, 4), 2), ((2, 9, 3), 3), ((2, 5, 4), 1))
    cases = []
    for seed, (shape, dv) in enumerate(shapes):
        g = torch.Generator().manual_seed(seed)
        q, k = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        v = torch.randn(*shape[:-1], dv, generator=g)
        cases.append(Case((q, k, v), f"linear_attention_recurrent(q, k, v) with q, k {tuple(shape)}, "
                                     f"v {tuple(v.shape)}"))
    # q and k near -7: phi near 1e-3, so phi(q_i) . z_i is 4e-6 to 4e-5 and the 1e-6 the text adds to it weighs
    # 2 to 25 percent (phi still far above F.elu(x) + 1's float32 rounding)
    g = torch.Generator().manual_seed(9)
    q, k = (torch.randn(2, 8, 4, generator=g) * 0.3 - 7.0 for _ in range(2))
    v = torch.randn(2, 8, 3, generator=g)
    cases.append(Case((q, k, v), "linear_attention_recurrent(q, k, v) with q, k (2, 8, 4) near -7, where "
                                 "phi(q_i) . z_i is 4e-6 to 4e-5, v (2, 8, 3)"))
    return cases


def _linear_examples() -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    return [Case((tiny(generator, length, 2), tiny(generator, length, 2), tiny(generator, length, 1)),
                 f"linear_attention_recurrent(q, k, v) with q, k ({length}, 2), v ({length}, 1)") for length in (1, 2, 3)]


def _linear_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return ref.linear_attention_recurrent(q, k, v)[0]


def _large_features(runs: list[Run], fn: Any) -> None:
    """Every output right: the gradients once more, with q and k of 60 to 120. elu(x) + 1 written by hand as
    torch.where(t > 0, t + 1, torch.exp(t)) is right forward, but exp overflows float32 past 88 in the branch not
    taken, and where's backward multiplies that inf by 0: NaN (masks multiplied in, (t <= 0) * t.exp(), give 0 * inf
    = NaN forward too). F.elu, or the exp of t clamped to at most 0, has no inf anywhere."""
    g = torch.Generator().manual_seed(12)
    q, k = (60.0 + 60.0 * torch.rand(2, 5, 4, generator=g) for _ in range(2))   # (2, 5, 4), entries 60 .. 120
    v = torch.randn(2, 5, 3, generator=g)
    what = "linear_attention_recurrent(q, k, v) with q, k (2, 5, 4) of entries 60 to 120, v (2, 5, 3)"
    why = ("torch.exp(t) overflows to inf for t past 88 in float32, in the branch not taken, and 0 times that inf "
           "is NaN. A layer with NaN gradients cannot learn. Use F.elu(t) + 1, or clamp the exp's argument: "
           "torch.where(t > 0, t + 1, torch.exp(t.clamp(max=0))).")
    out = call_student(fn, q, k, v, what=what)
    if isinstance(out, torch.Tensor) and out.is_floating_point() and not bool(out.isfinite().all()):
        # masks multiplied in: (t <= 0) * t.exp() is 0 * inf = NaN already forward
        fail("gradient", f"{what}: your output holds NaN where the reference's is finite, although it is right on "
                         f"ordinary inputs. Most likely your feature map is elu(x) + 1 written with masks multiplied "
                         f"in, (t > 0) * (t + 1) + (t <= 0) * t.exp(), or with torch.where: {why}")
    try:
        gradient_probe(fn, _linear_reference, (q, k, v), ("q", "k", "v"), what)
    except Failure as failure:
        if failure.diagnosis != "gradient" or "NaN" not in failure.message:
            raise
        fail("gradient", f"{what}: the gradient holds NaN where the reference's is finite, although your outputs are "
                         f"right on ordinary inputs. Most likely your feature map is elu(x) + 1 written with "
                         f"torch.where(t > 0, t + 1, torch.exp(t)): the forward takes the right branch, but the "
                         f"backward goes through both: {why}", **failure.details)


def _linear_in_bfloat16(fn: Callable[..., Any]) -> None:
    """Last: q, k and v in bfloat16; the output must be bfloat16 (S and z kept in float32 inside, the output cast
    back, is right)."""
    for case in _linear_cases()[:2]:
        args = tuple(a.to(torch.bfloat16) for a in case.args)
        what = f"{case.what}, in bfloat16"
        _in_bfloat16(lambda args=args, what=what: call_student(fn, *args, what=what), _linear_reference(*args), what,
                     "S and z (or another new tensor) are made in float32: torch.zeros(...) without dtype= takes "
                     "the default, float32, and so does dtype=torch.float32; the text asks for them in the "
                     "inputs' dtype (q.new_zeros(...), or dtype=q.dtype).")


def _tuple_returned(failure: Any, case: Case, out: Any, fn: Any) -> None:
    """The course's version returns (outputs, state): a student who copied that shape is told what to keep."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        fail(failure.diagnosis, f"{failure.message} Return only the outputs (..., L, d_v): the course's "
                                f"variants.linear_attention_recurrent also returns the state (S, z), this exercise "
                                f"does not.")


LINEAR_RECURRENT = FunctionExercise(
    "12.3", "linear_attention_recurrent", _linear_reference,
    _linear_cases, ("q", "k", "v"),
    success="Right on every shape tried: a state S of d x d_v and a normaliser z, updated once per token, give "
            "the parallel form's outputs.",
    mismatch=lambda run: f"{run.case.what} differs from the parallel form, and {UNEXPLAINED}. Per "
                         f"token i: S += outer(phi(k_i), v_i), z += phi(k_i), then o_i = phi(q_i) S / (phi(q_i) . z "
                         f"+ 1e-6).",
    mistakes=(
        Mistake("normalization", "The normaliser is missing: divide phi(q_i) S_i by phi(q_i) . z_i (z_i the sum of "
                                 "phi(k_j) so far, plus 1e-6), or the outputs grow with the number of tokens.",
                output=lambda q, k, v: _linear(_phi(q), _phi(k), v, normalise=False)),
        Mistake("state_order", "Your state is read before token i is added to it: query i misses its own key and "
                               "value (the causal mask includes j = i). Add phi(k_i) v_i to S and phi(k_i) to z "
                               "first, then read them with phi(q_i).",
                output=lambda q, k, v: _linear(_phi(q), _phi(k), v, diagonal=-1)),
        Mistake("feature_map", "The feature map is missing: the weights q_i . k_j can be negative, so the "
                               "normaliser can reach 0. Apply phi(x) = elu(x) + 1 to q and k "
                               "(variants.elu_feature_map).", output=lambda q, k, v: _linear(q, k, v)),
        Mistake("feature_map", "phi is applied to the keys but not to the queries: both go through phi(x) = elu(x) "
                               "+ 1, in the numerator and in the normaliser.",
                output=lambda q, k, v: _linear(q, _phi(k), v)),
        Mistake("feature_map", "phi is applied to the queries but not to the keys: both go through phi(x) = elu(x) "
                               "+ 1, in the state S and in the normaliser z.",
                output=lambda q, k, v: _linear(_phi(q), k, v)),
        Mistake("feature_map", "Your feature map is relu: it is 0 for every negative number, so whole rows of "
                               "weights (and the normaliser) vanish. Use phi(x) = elu(x) + 1, positive everywhere.",
                output=lambda q, k, v: _linear(q.relu(), k.relu(), v)),
        Mistake("feature_map", "Your normaliser uses the raw query: it is phi(q_i) . z_i, with the same phi(q_i) as "
                               "the numerator.", output=lambda q, k, v: _linear(_phi(q), _phi(k), v, fq_norm=q)),
        Mistake("normalization", "Your normaliser z sums the queries' features: z is the sum of phi(k_j) over the "
                                 "keys so far, z += phi(k_i), as S sums phi(k_j) v_j.",
                output=lambda q, k, v: _linear(_phi(q), _phi(k), v, fk_norm=_phi(q))),
        Mistake("feature_map", "That is softmax attention (weights exp(q . k / sqrt(d))): linear attention replaces "
                               "the exponential by phi(q_i) . phi(k_j) with phi(x) = elu(x) + 1, which is what lets "
                               "it run as a recurrence.",
                output=lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
        *(Mistake("feature_map", f"Your feature map is {name}: {why}. Use phi(x) = elu(x) + 1 "
                                 f"(variants.elu_feature_map) on q and k.",
                  output=lambda q, k, v, phi=phi: _linear(phi(q), phi(k), v))
          for name, phi, why in _OTHER_MAPS),
        Mistake("feature_map", "phi is applied to the values too: only the queries and keys go through phi(x) = "
                               "elu(x) + 1; S adds phi(k_i) times v_i itself.",
                output=lambda q, k, v: _linear(_phi(q), _phi(k), _phi(v))),
        Mistake("normalization", "Your normaliser z starts at ones, not zeros: phi(q_i) . z_i comes out larger by "
                                 "phi(q_i) . 1, so every output is too small, most for the first tokens. Start z at "
                                 "torch.zeros(...), like S.", output=lambda q, k, v: _linear(_phi(q), _phi(k), v, z0=1.0)),
        Mistake("normalization", "Your normaliser holds only the current key: z must be the running sum of phi(k_j) "
                                 "over every token so far, z += phi(k_i), as S is.",
                output=lambda q, k, v: _linear(_phi(q), _phi(k), v, norm_keys="own")),
        Mistake("state_order", "S is read before token i is added to it, while z already holds it: update both "
                               "with token i (S += outer(phi(k_i), v_i), z += phi(k_i)), then read them with "
                               "phi(q_i).", output=lambda q, k, v: _linear(_phi(q), _phi(k), v, diagonal=-1,
                                                                           norm_keys="through_i")),
        Mistake("state_order", "z is read before token i is added to it, while S already holds it: the normaliser "
                               "must include token i too. Update both with token i (S += outer(phi(k_i), v_i), z += "
                               "phi(k_i)), then read them with phi(q_i).",
                output=lambda q, k, v: _linear(_phi(q), _phi(k), v, norm_keys="before_i")),
        *(Mistake("normalization", why, output=lambda q, k, v, eps=eps: _linear(_phi(q), _phi(k), v, eps=eps))
          for eps, why in {
            # after the division, 1e-6 moves an output by 1e-6 only: the same outputs as none at all
            "output": "Your denominator has no 1e-6 (left out, added after the division, num / den + 1e-6, or used "
                      "as a floor, den.clamp_min(1e-6), which leaves every denominator above 1e-6 as it is): the "
                      "text adds it to the denominator, o_i = phi(q_i) S_i / (phi(q_i) . z_i + 1e-6). Where "
                      "phi(q_i) . z_i is small (queries and keys far below zero) it weighs.",
            "both": "Your 1e-6 is added to the numerator too: only the denominator gets it, o_i = phi(q_i) S_i / "
                    "(phi(q_i) . z_i + 1e-6)."}.items()),
        Mistake("causal_mask", "Every query sees every token, also the later ones: the state must hold only the "
                               "tokens up to i when query i reads it (update, read, then move on).",
                output=lambda q, k, v: _linear(_phi(q), _phi(k), v, causal=False)),
    ),
    reword=_tuple_returned, after=_large_features, gradients=lambda: _linear_cases()[:1], examples=_linear_examples,
    probes=FunctionExercise.probes + ("batch", "device"),   # the text asks for the inputs' device and dtype
)


@checker("12.3", example=function_example(LINEAR_RECURRENT))
def check_linear_attention_recurrent(fn: Callable[..., Any]) -> str:
    """``fn(q, k, v)`` -> the outputs (..., L, d_v) of course_lib.variants.linear_attention_recurrent."""
    success = judge(LINEAR_RECURRENT, fn)
    _linear_in_bfloat16(fn)
    return success
