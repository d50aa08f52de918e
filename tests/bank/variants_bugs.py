"""Student attempts at the exercises of notebook 12 (12.1-12.3), correct and buggy, as students write them.

Each buggy attempt carries the diagnosis its checker must give (and words its message must contain);
each correct attempt must pass. 12.2's attempts take (layer, x, cache=None) with layer a
variants.MultiHeadLatentAttention (rope_interleave=False) whose weights they read.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import modern, variants

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 12.1 sliding_window_mask

def _grid(length):
    return torch.arange(length)[:, None], torch.arange(length)[None, :]


@correct("12.1")
def window_by_grid(length, window, sinks=0):
    i, j = _grid(length)
    return ((i - j >= 0) & (i - j < window)) | ((j < sinks) & (j <= i))


@correct("12.1")
def window_by_two_triangles(length, window, sinks=0):
    ones = torch.ones(length, length, dtype=torch.bool)
    mask = ones.tril() & ~ones.tril(-window)              # below the diagonal, minus what is window or more back
    mask[:, :sinks] |= ones.tril()[:, :sinks]
    return mask


@correct("12.1")
def window_by_loops(length, window, sinks=0):
    rows = []
    for i in range(length):
        rows.append([(0 <= i - j < window) or (j < sinks and j <= i) for j in range(length)])
    return torch.tensor(rows, dtype=torch.bool)


@correct("12.1")
def window_by_band_and_clamp(length, window, sinks=0):
    i, j = _grid(length)
    band = (j <= i) & (j > i - window)
    sink = (j < min(sinks, length)) & (j <= i)
    return torch.logical_or(band, sink)


@correct("12.1")
def window_on_modern_s_mask(length, window, sinks=0):
    # Notebook 09's window-only mask is the student's to reuse; only the sinks are this exercise's new part.
    mask = modern.sliding_window_mask(length, window)
    i, j = _grid(length)
    return mask | ((j < sinks) & (j <= i))


@bug("12.1", "calls_reference", "sliding_window_mask")
def window_calls_the_course(length, window, sinks=0):
    return variants.sliding_window_mask(length, window, sinks)


@bug("12.1", "causal_mask", "one key too wide")
def window_one_too_wide(length, window, sinks=0):
    i, j = _grid(length)
    return ((i - j >= 0) & (i - j <= window)) | ((j < sinks) & (j <= i))


@bug("12.1", "causal_mask", "too narrow")
def window_one_too_narrow(length, window, sinks=0):
    i, j = _grid(length)
    return ((i - j >= 0) & (i - j < window - 1)) | ((j < sinks) & (j <= i))


@bug("12.1", "causal_mask", "wrong side")
def window_facing_the_future(length, window, sinks=0):
    i, j = _grid(length)
    return ((j - i >= 0) & (j - i < window)) | ((j < sinks) & (j <= i))


@bug("12.1", "causal_mask", "both sides")
def window_on_both_sides(length, window, sinks=0):
    i, j = _grid(length)
    return ((i - j).abs() < window) | ((j < sinks) & (j <= i))


@bug("12.1", "causal_mask", "evicted")
def window_sinks_forgotten(length, window, sinks=0):
    i, j = _grid(length)
    return (i - j >= 0) & (i - j < window)


@bug("12.1", "causal_mask", "future")
def window_sinks_see_the_future(length, window, sinks=0):
    i, j = _grid(length)
    return ((i - j >= 0) & (i - j < window)) | (j < sinks)


@bug("12.1", "causal_mask", "entry")
def window_without_the_diagonal(length, window, sinks=0):
    i, j = _grid(length)
    return ((i - j > 0) & (i - j < window)) | ((j < sinks) & (j < i))


@bug("12.1", "causal_mask", "sinks")
def window_sinks_as_rows(length, window, sinks=0):
    i, j = _grid(length)
    return ((i - j >= 0) & (i - j < window)) | ((i < sinks) & (j <= i))


@bug("12.1", "causal_mask", "entry")
def window_ignored(length, window, sinks=0):
    return torch.ones(length, length, dtype=torch.bool).tril()


@bug("12.1", "dtype", "torch.bool")
def window_as_floats(length, window, sinks=0):
    return window_by_grid(length, window, sinks).float()


@bug("12.1", "dtype", "torch.bool")
def window_additive(length, window, sinks=0):
    allowed = window_by_grid(length, window, sinks)
    return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))


@bug("12.1", "dtype")
def window_in_numpy(length, window, sinks=0):
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    return ((i - j >= 0) & (i - j < window)) | ((j < sinks) & (j <= i))


@bug("12.1", "shape")
def window_with_a_batch_axis(length, window, sinks=0):
    return window_by_grid(length, window, sinks)[None]


# ============================================================================ 12.2 latent_attention

def _queries(layer, x):
    n, length, _ = x.shape
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    return q.view(n, length, layer.num_heads, layer.qk_nope_head_dim + layer.qk_rope_head_dim).transpose(1, 2)


def _mla(layer, x, cache=None, *, rope="split", offset=True, norm=True, scale=None, mask="causal",
         attend_new_only=False, rotate_cached=False, cache_up=False, append=True, softmax_dim=-1, detach=False):
    """A student's MLA, written once; each buggy attempt below switches one thing."""
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    pos = start if offset else 0
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = _queries(layer, x)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    if norm:
        latent = layer.kv_a_layernorm(latent)
    if detach:
        latent = latent.detach()
    if rope == "split" and not rotate_cached:
        k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=pos)
    if cache_up:   # caches the up-projected keys and values instead of the latent
        kv = layer.kv_b_proj(latent)
        if cache is not None:
            kv, k_rope = cache.append(kv, k_rope)
        latent = None
    elif cache is not None and append:
        latent, k_rope = cache.append(latent, k_rope)
        if attend_new_only:
            latent, k_rope = latent[:, start:], k_rope[:, start:]
    if rotate_cached:
        k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=pos)
    if latent is not None:
        kv = layer.kv_b_proj(latent)
    total = kv.shape[1]
    kv = kv.view(n, total, h, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, h, total, dr)], dim=-1)
    if rope == "split":
        q_nope, q_rope = q.split([dn, dr], dim=-1)
        q = torch.cat([q_nope, modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=pos)], dim=-1)
    elif rope == "whole":
        cos, sin = modern.rope_tables(dn + dr, layer.max_tokens)
        q = modern.apply_rotary(q, cos, sin, offset=pos)
        k = modern.apply_rotary(k, cos, sin)   # every key, cached or new, from position 0
    scores = q @ k.transpose(-2, -1) * (layer.softmax_scale if scale is None else scale)
    if mask == "causal":
        scores = scores.masked_fill(~torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[total - length:],
                                    float("-inf"))
    elif mask == "top_left":
        scores = scores.masked_fill(~torch.ones(length, total, dtype=torch.bool, device=x.device).tril(), float("-inf"))
    out = scores.softmax(dim=softmax_dim) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


@correct("12.2")
def mla_step_by_step(layer, x, cache=None):
    return _mla(layer, x, cache)


@correct("12.2")
def mla_with_sdpa(layer, x, cache=None):
    n, length, _ = x.shape
    start = cache.length if cache is not None else 0
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q_nope, q_rope = _queries(layer, x).split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    down = layer.kv_a_proj_with_mqa(x)
    latent = layer.kv_a_layernorm(down[..., :layer.kv_lora_rank])
    k_rope = modern.apply_rotary(down[..., layer.kv_lora_rank:], layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).reshape(n, total, h, dn + dv).permute(0, 2, 1, 3)
    k = torch.cat([kv[..., :dn], k_rope.unsqueeze(1).repeat(1, h, 1, 1)], dim=-1)
    allowed = torch.arange(total, device=x.device)[None, :] <= torch.arange(start, start + length, device=x.device)[:, None]
    out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1), k, kv[..., dn:], attn_mask=allowed,
                                         scale=layer.softmax_scale)
    return layer.o_proj(out.permute(0, 2, 1, 3).flatten(2))


# right before 12.2 built a layer with a softmax_scale of its own: the text asks for layer.softmax_scale, and
# 1 / sqrt(dn + dr) is only its default
@bug("12.2", "scale", "softmax_scale")
def mla_absorbed_by_hand(layer, x, cache=None):
    """The absorbed form: W_UK folded into the query, W_UV applied after the softmax; the scores scaled by
    1 / sqrt(dn + dr) from the widths instead of layer.softmax_scale."""
    n, length, _ = x.shape
    start = cache.length if cache is not None else 0
    dn, dr, h, dv, r = (layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim,
                        layer.kv_lora_rank)
    q_nope, q_rope = _queries(layer, x).split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    w = layer.kv_b_proj.weight.view(h, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_latent = torch.einsum("nhld,hdr->nhlr", q_nope, w_uk)
    scores = (torch.einsum("nhlr,ntr->nhlt", q_latent, latent)
              + torch.einsum("nhld,ntd->nhlt", q_rope, k_rope)) / math.sqrt(dn + dr)
    total = latent.shape[1]
    future = torch.ones(length, total, dtype=torch.bool, device=x.device).triu(start + 1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("nhlr,hvr->nlhv", torch.einsum("nhlt,ntr->nhlr", weights, latent), w_uv)
    return layer.o_proj(out.reshape(n, length, h * dv))


@bug("12.2", "rope_axes", "whole head")
def mla_rope_on_the_whole_head(layer, x, cache=None):
    return _mla(layer, x, cache, rope="whole")


@bug("12.2", "rope_missing")
def mla_without_rope(layer, x, cache=None):
    return _mla(layer, x, cache, rope="none")


@bug("12.2", "rope_positions", "position 0")
def mla_rope_from_zero_each_call(layer, x, cache=None):
    return _mla(layer, x, cache, offset=False)


@bug("12.2", "kv_cache", "turned again")
def mla_rotates_the_cache_again(layer, x, cache=None):
    return _mla(layer, x, cache, rotate_cached=True)


@bug("12.2", "kv_cache", "up-projected")
def mla_caches_up_projected_keys(layer, x, cache=None):
    return _mla(layer, x, cache, cache_up=True)


@bug("12.2", "kv_cache", "holds 0 tokens")
def mla_never_appends(layer, x, cache=None):
    return _mla(layer, x, cache, append=False)


@bug("12.2", "kv_cache", "only to the new tokens")
def mla_attends_to_the_new_tokens_only(layer, x, cache=None):
    return _mla(layer, x, cache, attend_new_only=True)


@bug("12.2", "causal_mask", "rows start")
def mla_mask_from_the_top_left(layer, x, cache=None):
    return _mla(layer, x, cache, mask="top_left")


@bug("12.2", "causal_mask", "later tokens")
def mla_without_a_mask(layer, x, cache=None):
    return _mla(layer, x, cache, mask="none")


@bug("12.2", "softmax_dim", "dim=-2")
def mla_softmax_over_queries(layer, x, cache=None):
    return _mla(layer, x, cache, softmax_dim=-2)


@bug("12.2", "scale", "qk_nope_head_dim")
def mla_scaled_by_the_nope_part(layer, x, cache=None):
    return _mla(layer, x, cache, scale=layer.qk_nope_head_dim ** -0.5)


@bug("12.2", "scale", "not scaled")
def mla_unscaled(layer, x, cache=None):
    return _mla(layer, x, cache, scale=1.0)


@bug("12.2", "scale", "v_head_dim")
def mla_scaled_by_the_value_width(layer, x, cache=None):
    return _mla(layer, x, cache, scale=layer.v_head_dim ** -0.5)


@bug("12.2", "norm_placement", "kv_a_layernorm")
def mla_latent_not_normalised(layer, x, cache=None):
    return _mla(layer, x, cache, norm=False)


@bug("12.2", "calls_reference")
def mla_calls_the_layer(layer, x, cache=None):
    return layer(x, cache)


@bug("12.2", "calls_reference")
def mla_calls_the_class_forward(layer, x, cache=None):
    return variants.MultiHeadLatentAttention.forward(layer, x, cache)


@bug("12.2", "shape")
def mla_forgets_o_proj(layer, x, cache=None):
    out = _mla(layer, x, cache)
    return out[..., :layer.num_heads * layer.v_head_dim] if layer.embed_dim != layer.num_heads * layer.v_head_dim \
        else out[..., :-1]


@bug("12.2", "exception", "q_proj")
def mla_ignores_the_query_latent(layer, x, cache=None):
    n, length, _ = x.shape
    layer.q_proj(x)   # only a layer without q_lora_rank has q_proj
    return _mla(layer, x, cache)


@bug("12.2", "mutation")
def mla_scales_x_in_place(layer, x, cache=None):
    x.mul_(2.0)
    return _mla(layer, x / 2.0, cache)


@bug("12.2", "gradient")
def mla_detaches_the_latent(layer, x, cache=None):
    return _mla(layer, x, cache, detach=True)


# ============================================================================ 12.3 linear_attention_recurrent

def _phi(x):
    return F.elu(x) + 1


def _recurrence(q, k, v, *, fq=None, fk=None, normalise=True, read_first=False, fq_norm=None, detach=False):
    """A student's recurrence, written once; each buggy attempt below switches one thing."""
    fq = _phi(q) if fq is None else fq
    fk = _phi(k) if fk is None else fk
    fq_norm = fq if fq_norm is None else fq_norm
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outputs = []
    for i in range(q.shape[-2]):
        if read_first:
            out = (fq[..., i, None, :] @ s).squeeze(-2)
            below = (fq_norm[..., i, :] * z).sum(-1, keepdim=True)
        update = fk[..., i, :, None] * v[..., i, None, :]
        s = s + (update.detach() if detach else update)
        z = z + fk[..., i, :]
        if not read_first:
            out = (fq[..., i, None, :] @ s).squeeze(-2)
            below = (fq_norm[..., i, :] * z).sum(-1, keepdim=True)
        outputs.append(out / (below + 1e-6) if normalise else out)
    return torch.stack(outputs, dim=-2)


@correct("12.3")
def linear_by_the_recurrence(q, k, v):
    return _recurrence(q, k, v)


@correct("12.3")
def linear_by_cumulative_sums(q, k, v):
    fq, fk = _phi(q), _phi(k)
    states = torch.cumsum(fk.unsqueeze(-1) * v.unsqueeze(-2), dim=-3)      # (..., L, d, d_v): S_i for every i
    norms = torch.cumsum(fk, dim=-2)                                         # (..., L, d): z_i
    numerator = torch.einsum("...ld,...ldv->...lv", fq, states)
    return numerator / ((fq * norms).sum(-1, keepdim=True) + 1e-6)


# wrong since round 35b: elu(x) + 1 by hand with torch.where, whose exp(q) is inf in the branch not taken for q past
# 88 (float32), and where's backward multiplies that inf by 0: NaN gradients (F.elu(q) + 1 has none)
@bug("12.3", "gradient", "torch.where")
def linear_by_the_parallel_form(q, k, v):
    fq, fk = torch.where(q > 0, q + 1, q.exp()), torch.where(k > 0, k + 1, k.exp())
    length = q.shape[-2]
    weights = (fq @ fk.transpose(-2, -1)) * torch.ones(length, length, dtype=q.dtype, device=q.device).tril()
    return weights @ v / (weights.sum(-1, keepdim=True) + 1e-6)


@correct("12.3")
def linear_by_the_parallel_form_with_elu(q, k, v):
    """Right: the parallel form with the feature map of the text, elu(x) + 1, whose gradient is finite everywhere."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    length = q.shape[-2]
    weights = (fq @ fk.transpose(-2, -1)) * torch.ones(length, length, dtype=q.dtype, device=q.device).tril()
    return weights @ v / (weights.sum(-1, keepdim=True) + 1e-6)


# right before 12.3 had a case where the epsilon shows: the text asks for + 1e-6 in the denominator
@bug("12.3", "normalization", "1e-6")
def linear_with_einsum_and_no_epsilon(q, k, v):
    """The recurrence in einsum, its denominator phi(q_i) . z_i without the text's + 1e-6."""
    fq, fk = _phi(q), _phi(k)
    s = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=q.dtype, device=q.device)
    z = torch.zeros(*q.shape[:-2], q.shape[-1], dtype=q.dtype, device=q.device)
    outs = []
    for i in range(q.shape[-2]):
        s = s + torch.einsum("...d,...e->...de", fk[..., i, :], v[..., i, :])
        z = z + fk[..., i, :]
        outs.append(torch.einsum("...d,...de->...e", fq[..., i, :], s) / torch.einsum("...d,...d->...", fq[..., i, :], z)[..., None])
    return torch.stack(outs, -2)


@bug("12.3", "normalization", "normaliser")
def linear_without_the_normaliser(q, k, v):
    return _recurrence(q, k, v, normalise=False)


@bug("12.3", "state_order", "before")
def linear_reads_before_the_update(q, k, v):
    return _recurrence(q, k, v, read_first=True)


@bug("12.3", "feature_map", "missing")
def linear_without_the_feature_map(q, k, v):
    return _recurrence(q, k, v, fq=q, fk=k)


@bug("12.3", "feature_map", "not to the queries")
def linear_phi_on_the_keys_only(q, k, v):
    return _recurrence(q, k, v, fq=q)


@bug("12.3", "feature_map", "not to the keys")
def linear_phi_on_the_queries_only(q, k, v):
    return _recurrence(q, k, v, fk=k)


@bug("12.3", "feature_map", "raw query")
def linear_normaliser_with_the_raw_query(q, k, v):
    return _recurrence(q, k, v, fq_norm=q)


@bug("12.3", "feature_map", "relu")
def linear_with_relu(q, k, v):
    return _recurrence(q, k, v, fq=q.relu(), fk=k.relu())


@bug("12.3", "feature_map", "softmax")
def linear_is_softmax_attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


@bug("12.3", "causal_mask", "later")
def linear_sums_over_every_token(q, k, v):
    fq, fk = _phi(q), _phi(k)
    s = fk.transpose(-2, -1) @ v
    z = fk.sum(-2)
    return (fq @ s) / ((fq * z[..., None, :]).sum(-1, keepdim=True) + 1e-6)


@bug("12.3", "dtype", "only the outputs")
def linear_returns_the_state_too(q, k, v):
    out = _recurrence(q, k, v)
    return out, (torch.zeros(q.shape[-1], v.shape[-1]), torch.zeros(q.shape[-1]))


@bug("12.3", "gradient")
def linear_detaches_the_update(q, k, v):
    return _recurrence(q, k, v, detach=True)


@bug("12.3", "calls_reference")
def linear_calls_the_course(q, k, v):
    return variants.linear_attention_recurrent(q, k, v)[0]
