"""Student attempts from the thirtieth search: state built on the first call (a memo, a cache, a weight cast once),
which the device and dtype probes never met while they ran on a fresh copy, or only once. Each wrong one passed
before.

7.2: causal masks kept on the layer, in a global keyed by the layer, or in an lru_cache keyed by the layer, by their
sizes but not by the device (the device probe ran on a fresh layer). 9.3: a weight copied once for float16 on the
module, in a global or in an lru_cache (the device probe ran in float32 only), and a dtype remembered from the first
call (the dtype probe ran on a fresh float64 module). 12.2: a tensor made on the CPU on the cached path only (the
device probe ran without a cache), or kept from an earlier call. Right code beside each: memos keyed by the device or
dtype too, a buffer, a mask made on x.device at every call, a weight cast to x.dtype at every call.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import modern
from course_lib.modern import RMSNorm

BUGGY, CORRECT, bug, correct = new_bank()

_KEPT: dict = {}


# ============================================================================ 7.2: masks kept by size, not by device

def _hf_attention(query, key, value, attention_mask, scaling, causal):
    """Attention with the causal mask ``causal(lq, lk)`` where no mask is given (bool, True = may attend)."""
    lq, lk = query.shape[-2], key.shape[-2]
    mask = causal(lq, lk) if attention_mask is None else attention_mask
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)   # (N, heads, Lq, d)
    return out.transpose(1, 2), None


@bug("7.2", "device", "kept", "device")
def attention_with_masks_kept_on_the_layer(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                           **kwargs):
    """Masks made on the query's device, kept on the layer (a plain dict attribute) by (Lq, Lk) alone."""
    masks = module.__dict__.setdefault("causal_masks", {})

    def causal(lq, lk):
        if (lq, lk) not in masks:
            masks[lq, lk] = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
        return masks[lq, lk]
    return _hf_attention(query, key, value, attention_mask, scaling, causal)


@bug("7.2", "device", "kept", "device")
def attention_with_masks_kept_per_layer_in_a_global(module, query, key, value, attention_mask, scaling=None,
                                                    dropout=0.0, **kwargs):
    """Masks kept in a global by (the layer, Lq, Lk): the device is not in the key."""
    def causal(lq, lk):
        return _KEPT.setdefault(("7.2", id(module), lq, lk), torch.ones(lq, lk, dtype=torch.bool,
                                                                         device=query.device).tril(lk - lq))
    _KEPT.setdefault(("7.2 layers", id(module)), module)   # the layer kept alive, so that its id is not reused
    return _hf_attention(query, key, value, attention_mask, scaling, causal)


@functools.cache
def _causal_on_the_layers_device(layer, lq, lk):
    """Made on the device of the layer's weights when first asked: an lru_cache keyed by the layer and the sizes."""
    return torch.ones(lq, lk, dtype=torch.bool, device=layer.c_attn.weight.device).tril(lk - lq)


@bug("7.2", "device", "kept", "device")
def attention_with_an_lru_cached_mask_per_layer(module, query, key, value, attention_mask, scaling=None,
                                                dropout=0.0, **kwargs):
    """functools.lru_cache keyed by (the layer, Lq, Lk): after model.to(device) it hands back the CPU mask."""
    return _hf_attention(query, key, value, attention_mask, scaling,
                         lambda lq, lk: _causal_on_the_layers_device(module, lq, lk))


@correct("7.2")
def attention_with_masks_kept_by_size_and_device(module, query, key, value, attention_mask, scaling=None,
                                                 dropout=0.0, **kwargs):
    """The memo on the layer keyed by (Lq, Lk, device): right."""
    masks = module.__dict__.setdefault("causal_masks_by_device", {})

    def causal(lq, lk):
        if (lq, lk, query.device) not in masks:
            masks[lq, lk, query.device] = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
        return masks[lq, lk, query.device]
    return _hf_attention(query, key, value, attention_mask, scaling, causal)


@functools.cache
def _causal_on(lq, lk, device):
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


@correct("7.2")
def attention_with_an_lru_cached_mask_per_device(module, query, key, value, attention_mask, scaling=None,
                                                 dropout=0.0, **kwargs):
    """functools.lru_cache keyed by (Lq, Lk, device): right."""
    return _hf_attention(query, key, value, attention_mask, scaling, lambda lq, lk: _causal_on(lq, lk, query.device))


@correct("7.2")
def attention_with_a_mask_buffer_on_the_layer(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                              **kwargs):
    """One mask for the whole context, registered on the layer as a buffer (model.to(device) moves it): right."""
    lk = key.shape[-2]
    if "course_causal" not in module._buffers or module.course_causal.shape[0] < lk:
        module.register_buffer("course_causal", torch.ones(lk, lk, dtype=torch.bool, device=query.device).tril(),
                               persistent=False)
    return _hf_attention(query, key, value, attention_mask, scaling,
                         lambda lq, lk: module.course_causal[lk - lq:lk, :lk])


@correct("7.2")
def attention_with_a_mask_made_on_the_query_each_call(module, query, key, value, attention_mask, scaling=None,
                                                      dropout=0.0, **kwargs):
    """A mask made on query.device at every call, by comparing positions: right."""
    def causal(lq, lk):
        keys = torch.arange(lk, device=query.device)
        return keys[None, :] <= torch.arange(lk - lq, lk, device=query.device)[:, None]
    return _hf_attention(query, key, value, attention_mask, scaling, causal)


# ============================================================================ 9.3: a weight kept for float16

def _normed(norm, x):
    h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)


@bug("9.3", "device", "device")
class RMSNormKeepsItsHalfWeightOnItself(RMSNorm):
    """A float16 model: its weight taken once (detached) for the half path and kept on the module."""

    def forward(self, x):
        normed = _normed(self, x)
        if self.weight.dtype == torch.float16:
            if "weight16" not in self.__dict__:
                self.weight16 = self.weight.detach().half()
            return (normed * self.weight16.float()).to(x.dtype)
        return (normed * self.weight.to(normed.dtype)).to(x.dtype)


_HALF_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@bug("9.3", "device", "device")
class RMSNormKeepsItsHalfWeightInAGlobal(RMSNorm):
    """The same copy, kept in a global keyed by the module."""

    def forward(self, x):
        normed = _normed(self, x)
        if self.weight.dtype == torch.float16:
            if self not in _HALF_WEIGHTS:
                _HALF_WEIGHTS[self] = self.weight.detach()
            return (normed * _HALF_WEIGHTS[self].float()).to(x.dtype)
        return (normed * self.weight.to(normed.dtype)).to(x.dtype)


@functools.cache
def _half_weight(norm):
    return norm.weight.detach()


@bug("9.3", "device", "device")
class RMSNormKeepsItsHalfWeightInAnLruCache(RMSNorm):
    """The float16 weight taken once (detached), in an lru_cache keyed by the module."""

    def forward(self, x):
        normed = _normed(self, x)
        w = _half_weight(self).float() if self.weight.dtype == torch.float16 else self.weight.to(normed.dtype)
        return (normed * w).to(x.dtype)


@bug("9.3", "dtype", "first call", "x.dtype")
class RMSNormRemembersItsFirstDtype(RMSNorm):
    """The output dtype read from the first input and kept: after model.double() it still casts to float32."""

    def forward(self, x):
        out_dtype = self.__dict__.setdefault("out_dtype", x.dtype)
        return (_normed(self, x) * self.weight.to(torch.promote_types(x.dtype, torch.float32))).to(out_dtype)


@bug("9.3", "dtype", "first call", "x.dtype")
class RMSNormKeepsItsAveragerByWidthNotDtype(RMSNorm):
    """The mean of the squares as a product with a (dim, 1) column of 1/dim, kept on the module by (dim, device)
    but not by dtype: made in the dtype of the first input."""

    def forward(self, x):
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        averagers, key = self.__dict__.setdefault("averagers", {}), (h.shape[-1], h.device)
        if key not in averagers:
            averagers[key] = torch.full((h.shape[-1], 1), 1.0 / h.shape[-1], dtype=h.dtype, device=h.device)
        ms = (h * h) @ averagers[key]                                            # (..., 1)
        return (h * torch.rsqrt(ms + self.eps) * self.weight.to(h.dtype)).to(x.dtype)


@correct("9.3")
class RMSNormCastsItsWeightAtEveryCall(RMSNorm):
    """The weight cast to the computing dtype at every call: right."""

    def forward(self, x):
        normed = _normed(self, x)
        return (normed * self.weight.to(normed.dtype)).to(x.dtype)


@correct("9.3")
class RMSNormKeepsItsScaleByWidthDtypeAndDevice(RMSNorm):
    """1/dim as a tensor kept on the module by (dim, dtype, device): right."""

    def forward(self, x):
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        scales = self.__dict__.setdefault("scales", {})
        key = (x.shape[-1], h.dtype, h.device)
        if key not in scales:
            scales[key] = torch.full((1,), 1.0 / x.shape[-1], dtype=h.dtype, device=h.device)
        ms = (h * h).sum(-1, keepdim=True) * scales[key]
        return (h * torch.rsqrt(ms + self.eps) * self.weight.to(h.dtype)).to(x.dtype)


@correct("9.3")
class RMSNormWithItsEpsilonAsABuffer(RMSNorm):
    """eps held in a registered buffer (model.to(...) moves and converts it): right."""

    def __init__(self, dim, eps=1e-6):
        super().__init__(dim, eps)
        self.register_buffer("eps_buffer", torch.tensor(float(eps)), persistent=False)

    def forward(self, x):
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps_buffer.to(h.dtype))
        return (normed * self.weight.to(h.dtype)).to(x.dtype)


# ============================================================================ 12.2: the cached path on the CPU

def _mla_sdpa(layer, x, cache, allowed):
    """MLA with F.scaled_dot_product_attention; ``allowed(start, length, total)`` the (L, T) bool mask."""
    n, length, _ = x.shape
    start = cache.length if cache is not None else 0
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, h, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    down = layer.kv_a_proj_with_mqa(x)
    latent = layer.kv_a_layernorm(down[..., :layer.kv_lora_rank])
    k_rope = modern.apply_rotary(down[..., layer.kv_lora_rank:], layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2)
    k = torch.cat([kv[..., :dn], k_rope.unsqueeze(1).expand(n, h, total, dr)], dim=-1)
    out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1), k, kv[..., dn:],
                                         attn_mask=allowed(start, length, total), scale=layer.softmax_scale)
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


@bug("12.2", "device", "KV cache", "device")
def mla_positions_on_the_cpu_with_a_cache(layer, x, cache=None):
    """Without a cache the mask is made on x's device; with one, the query positions come from an arange made
    without device=."""
    def allowed(start, length, total):
        if cache is None:
            return torch.ones(length, total, dtype=torch.bool, device=x.device).tril()
        positions = torch.arange(start, start + length)                              # on the CPU
        return torch.arange(total, device=x.device)[None, :] <= positions[:, None]
    return _mla_sdpa(layer, x, cache, allowed)


@functools.cache
def _cached_positions(start, length):
    return torch.arange(start, start + length)


@bug("12.2", "device", "KV cache", "device")
def mla_lru_cached_positions_with_a_cache(layer, x, cache=None):
    """With a cache, the query positions from an lru_cache keyed by (start, length): made on the CPU."""
    def allowed(start, length, total):
        if cache is None:
            return torch.ones(length, total, dtype=torch.bool, device=x.device).tril()
        return torch.arange(total, device=x.device)[None, :] <= _cached_positions(start, length)[:, None]
    return _mla_sdpa(layer, x, cache, allowed)


@bug("12.2", "device", "kept", "device")
def mla_masks_kept_on_the_layer_by_offset(layer, x, cache=None):
    """Masks made on x's device, kept on the layer by (start, length) alone."""
    masks = layer.__dict__.setdefault("masks", {})

    def allowed(start, length, total):
        if (start, length) not in masks:
            masks[start, length] = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:total]
        return masks[start, length]
    return _mla_sdpa(layer, x, cache, allowed)


@bug("12.2", "device", "kept", "device")
def mla_masks_kept_in_a_global_by_offset(layer, x, cache=None):
    """Masks made on x's device, kept in a global by (the layer, start, length)."""
    def allowed(start, length, total):
        _KEPT.setdefault(("12.2 layers", id(layer)), layer)   # the layer kept alive, so that its id is not reused
        return _KEPT.setdefault(("12.2", id(layer), start, length),
                                torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:total])
    return _mla_sdpa(layer, x, cache, allowed)


@correct("12.2")
def mla_positions_on_the_device_with_a_cache(layer, x, cache=None):
    """Positions made on x's device on both paths: right."""
    def allowed(start, length, total):
        positions = torch.arange(start, start + length, device=x.device)
        return torch.arange(total, device=x.device)[None, :] <= positions[:, None]
    return _mla_sdpa(layer, x, cache, allowed)


@correct("12.2")
def mla_masks_kept_by_offset_and_device(layer, x, cache=None):
    """Masks kept on the layer by (start, length, device): right."""
    masks = layer.__dict__.setdefault("masks_by_device", {})

    def allowed(start, length, total):
        key = (start, length, x.device)
        if key not in masks:
            masks[key] = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:total]
        return masks[key]
    return _mla_sdpa(layer, x, cache, allowed)


@correct("12.2")
def mla_mask_from_the_layers_rope_table_device(layer, x, cache=None):
    """The mask made on the device of the layer's buffers (rope_cos), which model.to(device) moves: right."""
    def allowed(start, length, total):
        return torch.ones(total, total, dtype=torch.bool, device=layer.rope_cos.device).tril()[start:total]
    return _mla_sdpa(layer, x, cache, allowed)

