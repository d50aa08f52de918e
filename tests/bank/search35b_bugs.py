"""Round 35b (the tester's round 35, notebook 12): slips the checks let through or did not name.

12.3: the running statistics S and z made in float32 whatever q's dtype (dtype=torch.float32, or zeros with only
device=q.device) passed: a float64 input promotes them at the first update, so the dtype probe saw nothing. The check
now also calls the function once with q, k and v in bfloat16 and judges the output's dtype (``dtype``); a float32
state with the output cast back to q's dtype is right. A feature map elu(t) + 1 written by hand with torch.where (or
masks multiplied in) overflows exp(t) to inf in the branch it does not use, and the backward multiplies that inf by
0: NaN gradients for large inputs. The check now also backpropagates q and k of 60 to 120 (``gradient``, the
message names torch.where); variants_bugs' ``linear_by_the_parallel_form`` is that mistake and is refiled.

12.2: an additive causal mask made without dtype= (torch.zeros(L, T), torch.full(..., float('-inf'))) or in
float32 passed: a float64 layer promotes the scores. The check now also runs a bfloat16 layer (``dtype``). Named
now instead of a generic ``scale`` factor or ``mismatch``: the scores scaled by 1/sqrt(kv_lora_rank) (``scale``),
the query's or the key's rotary part put first (``rope_axes``), a mask of the new tokens alone, L x L, in the second
call of a stream (``causal_mask``, was ``exception``). Checked and already named, so not filed again: a cache of the
up-projected keys (``kv_cache``), scaled_dot_product_attention's is_causal with a cache (``causal_mask``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import modern

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 12.3 linear_attention_recurrent

def _recurrent(q, k, v, phi=lambda t: F.elu(t) + 1, *, state_dtype=None, zeros_dtype_free=False, cast_back=False):
    """The recurrence, one token at a time, with elementwise products (type promotion applies): S and z made in
    ``state_dtype`` (q's when None; made without dtype= when ``zeros_dtype_free``), the output cast to q's dtype
    when ``cast_back``."""
    fq, fk = phi(q), phi(k)                                               # (..., L, d)
    *batch, length, d = q.shape
    if zeros_dtype_free:
        s = torch.zeros(*batch, d, v.shape[-1], device=q.device)          # (..., d, d_v)
        z = torch.zeros(*batch, d, device=q.device)                       # (..., d)
    else:
        dtype = q.dtype if state_dtype is None else state_dtype
        s = torch.zeros(*batch, d, v.shape[-1], dtype=dtype, device=q.device)
        z = torch.zeros(*batch, d, dtype=dtype, device=q.device)
    outs = []
    for i in range(length):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        num = (fq[..., i, :, None] * s).sum(-2)                           # (..., d_v)
        den = (fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6            # (..., 1)
        outs.append(num / den)
    out = torch.stack(outs, dim=-2)                                       # (..., L, d_v)
    return out.to(q.dtype) if cast_back else out


# ---------------------------------------------------------------------------- S and z in float32 whatever q's dtype

@bug("12.3", "dtype", "bfloat16", "float32")
def linear_state_made_in_float32(q, k, v):
    """Wrong (the tester's): S and z made with dtype=torch.float32 'for accuracy', the output left as it comes."""
    return _recurrent(q, k, v, state_dtype=torch.float32)


@bug("12.3", "dtype", "bfloat16")
def linear_state_on_the_device_only(q, k, v):
    """Wrong: torch.zeros(..., device=q.device), the device the text asks for but no dtype: the default's."""
    return _recurrent(q, k, v, zeros_dtype_free=True)


@bug("12.3", "dtype", "bfloat16")
def linear_state_as_float_of_q(q, k, v):
    """Wrong: S and z as q.new_zeros(...).float() 'for a stable sum', read with einsum: a float64 input promotes
    them at the first update; in bfloat16 they stay float32 and einsum meets two dtypes."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    *batch, length, d = q.shape
    s = q.new_zeros(*batch, d, v.shape[-1]).float()                       # (..., d, d_v)
    z = q.new_zeros(*batch, d).float()                                    # (..., d)
    outs = []
    for i in range(length):
        s = s + torch.einsum("...d,...e->...de", fk[..., i, :], v[..., i, :])
        z = z + fk[..., i, :]
        num = torch.einsum("...d,...de->...e", fq[..., i, :], s)
        outs.append(num / (torch.einsum("...d,...d->...", fq[..., i, :], z)[..., None] + 1e-6))
    return torch.stack(outs, dim=-2)


@correct("12.3")
def linear_state_in_float32_cast_back(q, k, v):
    """Right: S and z kept in float32 (promoted to float64 for float64 inputs), the output cast back to q's dtype."""
    return _recurrent(q, k, v, state_dtype=torch.float32, cast_back=True)


@correct("12.3")
def linear_state_accumulated_wider(q, k, v):
    """Right: S and z in float32 for half-precision inputs (q's dtype otherwise), the output back in q's dtype."""
    wide = torch.promote_types(q.dtype, torch.float32)
    out = _recurrent(q.to(wide), k.to(wide), v.to(wide))
    return out.to(q.dtype)


# ---------------------------------------------------------------------------- elu(t) + 1 by hand with torch.where

@bug("12.3", "gradient", "torch.where")
def linear_where_elu_by_hand(q, k, v):
    """Wrong (the tester's): phi(t) = torch.where(t > 0, t + 1, torch.exp(t)): right forward, but exp(t) is inf in
    the branch not taken for t past 88, and where's backward multiplies that inf by 0: NaN."""
    return _recurrent(q, k, v, phi=lambda t: torch.where(t > 0, t + 1, torch.exp(t)))


@bug("12.3", "gradient", "torch.where")
def linear_where_exp_minus_one(q, k, v):
    """Wrong: the elu itself by hand, torch.where(t > 0, t, t.exp() - 1) + 1."""
    return _recurrent(q, k, v, phi=lambda t: torch.where(t > 0, t, t.exp() - 1) + 1)


@bug("12.3", "gradient", "torch.where")
def linear_where_as_a_method(q, k, v):
    """Wrong: t.exp().where(t <= 0, t + 1), the method form, in a vectorised parallel form."""
    fq, fk = (t.exp().where(t <= 0, t + 1) for t in (q, k))
    weights = (fq @ fk.transpose(-2, -1)).tril()                          # (..., L, L)
    return weights @ v / (weights.sum(-1, keepdim=True) + 1e-6)


@bug("12.3", "gradient", "torch.where")
def linear_masks_multiplied(q, k, v):
    """Wrong: (t > 0) * (t + 1) + (t <= 0) * t.exp(): the same overflow, and 0 * inf is NaN already forward."""
    return _recurrent(q, k, v, phi=lambda t: (t > 0) * (t + 1) + (t <= 0) * t.exp())


@correct("12.3")
def linear_where_exp_clamped(q, k, v):
    """Right: the exp's argument clamped, torch.exp(torch.clamp(t, max=0)): no inf in the branch not taken."""
    return _recurrent(q, k, v, phi=lambda t: torch.where(t > 0, t + 1, torch.exp(torch.clamp(t, max=0))))


@correct("12.3")
def linear_where_exp_of_the_minimum(q, k, v):
    """Right: torch.exp(t.minimum(torch.zeros_like(t))) in the branch for t <= 0."""
    return _recurrent(q, k, v, phi=lambda t: torch.where(t > 0, t + 1, torch.exp(t.minimum(torch.zeros_like(t)))))


@correct("12.3")
def linear_elu_plus_one_parallel(q, k, v):
    """Right: F.elu(t) + 1 in the parallel form."""
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    weights = (fq @ fk.transpose(-2, -1)).tril()                          # (..., L, L)
    return weights @ v / (weights.sum(-1, keepdim=True) + 1e-6)


# ============================================================================ 12.2 latent_attention

def _mla(layer, x, cache=None, *, mask="bool", scale=None, q_order="nope_first", k_order="nope_first",
         new_only_mask=False, sdpa_causal=False):
    """A student's MLA: ``mask`` "bool" (masked_fill), "zeros" (an additive mask from torch.zeros without
    dtype=), "full" (torch.full(..., -inf).triu without dtype=), "float32" (dtype=torch.float32), "like" (in the
    scores' dtype); ``scale`` a function of the layer; ``q_order``/``k_order`` how the query's rotary part is read
    and where the keys' rotary part is put; ``new_only_mask`` True (a bool mask), "additive" or "sdpa": a causal
    mask of the new tokens alone, L x L."""
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q = q.view(n, length, h, dn + dr).transpose(1, 2)                     # (N, H, L, dn + dr)
    if q_order == "rope_first":
        q_rope, q_nope = q.split([dr, dn], dim=-1)
    else:
        q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2)   # (N, H, T, dn + dv)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k_rope = k_rope[:, None].expand(n, h, total, dr)                      # (N, H, T, dr)
    k = torch.cat([k_rope, k_nope] if k_order == "rope_first" else [k_nope, k_rope], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    factor = layer.softmax_scale if scale is None else scale(layer)
    if sdpa_causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=factor)
        return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))
    scores = q @ k.transpose(-2, -1) * factor                             # (N, H, L, T)
    if new_only_mask == "additive":   # an additive mask of the new tokens alone: (L, L)
        future = torch.full((length, length), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        return layer.o_proj(((scores + future).softmax(-1) @ v).transpose(1, 2).reshape(n, length, h * dv))
    if new_only_mask == "sdpa":
        keep = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=factor)
        return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))
    if new_only_mask:   # the causal mask of the new tokens alone: (L, L)
        keep = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    else:
        keep = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:]   # (L, T)
    if mask == "bool":
        scores = scores.masked_fill(~keep, float("-inf"))
    elif mask == "zeros":
        scores = scores + torch.zeros(length, total, device=x.device).masked_fill(~keep, float("-inf"))
    elif mask == "full":
        scores = scores + torch.full((length, total), float("-inf"), device=x.device).triu(start + 1)
    elif mask == "float32":
        scores = scores + torch.zeros(length, total, dtype=torch.float32, device=x.device).masked_fill(
            ~keep, float("-inf"))
    elif mask == "like":
        scores = scores + torch.zeros_like(scores[0, 0]).masked_fill(~keep, float("-inf"))
    elif mask == "full_like":
        scores = scores + torch.full((length, total), float("-inf"), dtype=x.dtype, device=x.device).triu(start + 1)
    out = scores.softmax(-1) @ v                                          # (N, H, L, dv)
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


# ---------------------------------------------------------------------------- an additive mask in float32

@bug("12.2", "dtype", "bfloat16", "mask")
def latent_additive_mask_without_dtype(layer, x, cache=None):
    """Wrong (the tester's): torch.zeros(L, T).masked_fill(~keep, -inf) added to the scores: float32 (the default)
    whatever the layer's dtype."""
    return _mla(layer, x, cache, mask="zeros")


@bug("12.2", "dtype", "bfloat16", "mask")
def latent_additive_mask_full_of_inf(layer, x, cache=None):
    """Wrong: torch.full((L, T), float('-inf')).triu(start + 1) added to the scores, without dtype=."""
    return _mla(layer, x, cache, mask="full")


@bug("12.2", "dtype", "bfloat16", "mask")
def latent_additive_mask_in_float32(layer, x, cache=None):
    """Wrong: the additive mask made with dtype=torch.float32 'so that -inf is exact'."""
    return _mla(layer, x, cache, mask="float32")


@correct("12.2")
def latent_sdpa_with_a_float_mask(layer, x, cache=None):
    """Right: F.scaled_dot_product_attention with attn_mask = torch.zeros(L, T) filled with -inf above the shifted
    diagonal, made without dtype=: scaled_dot_product_attention takes a float32 mask beside bfloat16 queries and
    keeps the queries' dtype, so nothing float32 reaches the output."""
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, h, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    q = torch.cat([q_nope, modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)], -1)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    k_nope, v = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2).split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, h, total, dr)], -1)  # (N, H, T, dn + dr)
    mask = torch.zeros(length, total, device=x.device).masked_fill(
        torch.ones(length, total, dtype=torch.bool, device=x.device).triu(start + 1), float("-inf"))   # (L, T)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.softmax_scale)
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


@correct("12.2")
def latent_additive_mask_like_the_scores(layer, x, cache=None):
    """Right: the additive mask made with torch.zeros_like(scores[0, 0]): the scores' dtype and device."""
    return _mla(layer, x, cache, mask="like")


@correct("12.2")
def latent_additive_mask_full_in_x_dtype(layer, x, cache=None):
    """Right: torch.full(..., float('-inf'), dtype=x.dtype).triu(start + 1)."""
    return _mla(layer, x, cache, mask="full_like")


# ---------------------------------------------------------------------------- slips named by what they are

@bug("12.2", "scale", "kv_lora_rank")
def latent_scaled_by_the_latent_width(layer, x, cache=None):
    """Wrong: the scores scaled by 1/sqrt(kv_lora_rank), 'the keys come from the latent'."""
    return _mla(layer, x, cache, scale=lambda m: m.kv_lora_rank ** -0.5)


@bug("12.2", "scale", "kv_lora_rank")
def latent_scaled_by_the_cached_width(layer, x, cache=None):
    """Wrong: the scores scaled by 1/sqrt(kv_lora_rank + qk_rope_head_dim), the numbers cached per token."""
    return _mla(layer, x, cache, scale=lambda m: 1 / math.sqrt(m.kv_lora_rank + m.qk_rope_head_dim))


@bug("12.2", "rope_axes", "rotary", "first")
def latent_query_rope_read_first(layer, x, cache=None):
    """Wrong: the query's rotary part read from the front of each head, q.split([dr, dn])."""
    return _mla(layer, x, cache, q_order="rope_first")


@bug("12.2", "rope_axes", "rotary", "first")
def latent_key_rope_put_first(layer, x, cache=None):
    """Wrong: the keys built as torch.cat([k_rope, k_nope]) while the queries are [q_nope, q_rope]."""
    return _mla(layer, x, cache, k_order="rope_first")


@correct("12.2")
def latent_rope_first_in_both(layer, x, cache=None):
    """Right: the rotary part put first in the query AND the key: the dot product is the same sum."""
    return _rope_first_both(layer, x, cache)


def _rope_first_both(layer, x, cache):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, h, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    q = torch.cat([modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start), q_nope], -1)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    k_nope, v = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2).split([dn, dv], dim=-1)
    k = torch.cat([k_rope[:, None].expand(n, h, total, dr), k_nope], -1)   # (N, H, T, dr + dn)
    keep = torch.arange(total, device=x.device) <= torch.arange(start, start + length, device=x.device)[:, None]
    scores = (q @ k.transpose(-2, -1) * layer.softmax_scale).masked_fill(~keep, float("-inf"))
    out = scores.softmax(-1) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


@bug("12.2", "causal_mask", "new tokens", "start")
def latent_mask_of_the_new_tokens(layer, x, cache=None):
    """Wrong: the causal mask of the new tokens alone, torch.ones(L, L).tril(): with a cache the scores are L x T."""
    return _mla(layer, x, cache, new_only_mask=True)


@bug("12.2", "causal_mask", "new tokens", "start")
def latent_additive_mask_of_the_new_tokens(layer, x, cache=None):
    """Wrong: an additive mask torch.full((L, L), -inf, dtype=x.dtype).triu(1), made for the new tokens alone."""
    return _mla(layer, x, cache, new_only_mask="additive")


@bug("12.2", "causal_mask", "new tokens", "start")
def latent_sdpa_mask_of_the_new_tokens(layer, x, cache=None):
    """Wrong: scaled_dot_product_attention with attn_mask=torch.ones(L, L).tril(), the new tokens alone."""
    return _mla(layer, x, cache, new_only_mask="sdpa")
