"""Student attempts at the exercises of notebook 09 (9.1-9.6), correct and buggy, as students write them.

Each buggy attempt carries the diagnosis its checker must give (and words its message must contain);
each correct attempt must pass. The classes keep the notebook's given constructor (they subclass the
reference) and only write ``forward``, as the exercises ask. A notebook's class calls the notebook's
own apply_rotary and repeat_kv: ``in_notebook`` rebuilds a class whose methods see a student's
version of those helpers instead of the reference's.
"""
from __future__ import annotations

import math
import types
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.modern import (
    GroupedQueryAttention,
    RMSNorm,
    SwiGLU,
    apply_rotary,
    repeat_kv,
    rope_tables,
    rotate_half,
    sliding_window_mask,
)

BUGGY, CORRECT, bug, correct = new_bank()


def in_notebook(cls: type, name: str, **helpers: Any) -> type:
    """``cls`` as a notebook defines it where ``helpers`` (say the student's apply_rotary) are globals."""
    namespace = dict(globals(), **helpers)
    body = {key: (types.FunctionType(value.__code__, namespace, key, value.__defaults__)
                  if isinstance(value, types.FunctionType) else value)
            for key, value in vars(cls).items() if key not in ("__dict__", "__weakref__")}
    return type(name, cls.__bases__, body)


# ============================================================================ 9.1 rope_tables

@correct("9.1")
def rope_hf_style(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(max_tokens).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@correct("9.1")
def rope_python_loops(head_dim, max_tokens, theta=10000.0):
    cos = torch.zeros(max_tokens, head_dim)
    sin = torch.zeros(max_tokens, head_dim)
    half = head_dim // 2
    for m in range(max_tokens):
        for i in range(half):
            angle = m / theta ** (2 * i / head_dim)
            cos[m, i] = cos[m, i + half] = math.cos(angle)
            sin[m, i] = sin[m, i + half] = math.sin(angle)
    return cos, sin


@correct("9.1")
def rope_float64_then_float(head_dim, max_tokens, theta=10000.0):
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    freqs = torch.exp(-2 * i / head_dim * math.log(theta))
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * freqs[None, :]
    angles = angles.repeat(1, 2)                         # [a, a] along the last axis: two halves
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "rope_layout", "repeat_interleave", "cat")
def rope_repeat_interleave(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    emb = freqs.repeat_interleave(2, dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_layout", "(2i, 2i+1)")
def rope_stack_flatten(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    emb = torch.stack([freqs, freqs], dim=-1).flatten(-2)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_frequencies", "exponent")
def rope_pair_index_exponent(head_dim, max_tokens, theta=10000.0):
    i = torch.arange(head_dim // 2).float()
    inv_freq = 1.0 / theta ** (i / head_dim)          # forgot the 2 of 2i/d
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_frequencies", "ignore", "theta")
def rope_ignores_theta(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_frequencies", "grow")
def rope_frequencies_grow(head_dim, max_tokens, theta=10000.0):
    freq = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_tokens).float(), freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_frequencies", "default", "1000")
def rope_default_theta_1000(head_dim, max_tokens, theta=1000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_frequencies", "log")
def rope_exp_without_log(head_dim, max_tokens, theta=10000.0):
    inv_freq = torch.exp(-torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_positions", "position 0")
def rope_positions_from_one(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(1, max_tokens + 1).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_rotation", "swapped")
def rope_sin_first(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.outer(torch.arange(max_tokens).float(), inv_freq).repeat(1, 2)
    return emb.sin(), emb.cos()


@bug("9.1", "shape", "torch.cat([angles, angles]")
def rope_half_width(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    return freqs.cos(), freqs.sin()


@bug("9.1", "shape", "two tables")
def rope_returns_angles(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_tokens).float(), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)


@bug("9.1", "dtype", "float32")
def rope_numpy_float64(head_dim, max_tokens, theta=10000.0):
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.outer(np.arange(max_tokens), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


@bug("9.1", "not_implemented", "NotImplementedError")
def rope_not_written(head_dim, max_tokens, theta=10000.0):
    raise NotImplementedError("Exercise 9.1: write rope_tables")


# ============================================================================ 9.2 apply_rotary

@correct("9.2")
def rotary_own_rotate_half(x, cos, sin, offset=0):
    def rotate(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat((-t2, t1), dim=-1)
    length = x.shape[-2]
    cos = cos[offset:offset + length].type_as(x)
    sin = sin[offset:offset + length].type_as(x)
    return x * cos + rotate(x) * sin


@correct("9.2")
def rotary_positions_index(x, cos, sin, offset=0):
    positions = torch.arange(offset, offset + x.shape[2])
    out = x * cos[positions][None, None] + rotate_half(x) * sin[positions][None, None]
    return out.to(x.dtype)


@correct("9.2")
def rotary_einsum_matrix(x, cos, sin, offset=0):
    d = x.shape[-1]
    half = d // 2
    turn = torch.zeros(d, d, dtype=x.dtype, device=x.device)           # rotate_half(x) == x @ turn
    turn[half:, :half] = -torch.eye(half, dtype=x.dtype, device=x.device)
    turn[:half, half:] = torch.eye(half, dtype=x.dtype, device=x.device)
    rows = slice(offset, offset + x.shape[-2])
    return x * cos[rows].to(x.dtype) + torch.einsum("nhld,de->nhle", x, turn) * sin[rows].to(x.dtype)


@correct("9.2")
def rotary_complex_halves(x, cos, sin, offset=0):
    half = x.shape[-1] // 2
    rows = slice(offset, offset + x.shape[-2])
    z = torch.complex(x[..., :half].float(), x[..., half:].float())
    turn = torch.complex(cos[rows, :half].float(), sin[rows, :half].float())
    z = z * turn
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


@bug("9.2", "rope_layout", "interleaved", "rotate_half")
def rotary_interleaved_pairs(x, cos, sin, offset=0):
    length = x.shape[-2]
    x_even, x_odd = x[..., ::2], x[..., 1::2]
    rotated = torch.stack([-x_odd, x_even], dim=-1).flatten(-2)
    return x * cos[offset:offset + length] + rotated * sin[offset:offset + length]


@bug("9.2", "rope_layout", "view_as_complex")
def rotary_view_as_complex(x, cos, sin, offset=0):
    # Meta's Llama code: consecutive pairs as complex numbers, turned by e^(i m w)
    length, half = x.shape[-2], x.shape[-1] // 2
    angles = torch.atan2(sin[offset:offset + length, :half].float(), cos[offset:offset + length, :half].float())
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], half, 2))
    return torch.view_as_real(z * freqs_cis).flatten(-2).to(x.dtype)


@bug("9.2", "rope_positions", "offset")
def rotary_ignores_offset(x, cos, sin, offset=0):
    length = x.shape[-2]
    return x * cos[:length] + rotate_half(x) * sin[:length]


@bug("9.2", "rope_positions", "cos[offset:offset + L]", "offset=4")
def rotary_slices_to_length(x, cos, sin, offset=0):
    length = x.shape[-2]
    return x * cos[offset:length] + rotate_half(x) * sin[offset:length]


@bug("9.2", "rope_axes", "head axis", "x.shape[-2]")
def rotary_expects_length_second(x, cos, sin, offset=0):
    # written for (N, L, heads, head_dim)
    length = x.shape[1]
    c = cos[offset:offset + length][:, None, :]
    s = sin[offset:offset + length][:, None, :]
    return x * c + rotate_half(x) * s


@bug("9.2", "rope_rotation", "wrong way")
def rotary_sign_flipped(x, cos, sin, offset=0):
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:], -x[..., :half]], dim=-1)
    rows = slice(offset, offset + x.shape[-2])
    return x * cos[rows] + rotated * sin[rows]


@bug("9.2", "rope_rotation", "swapped")
def rotary_sin_cos_swapped(x, cos, sin, offset=0):
    rows = slice(offset, offset + x.shape[-2])
    return x * sin[rows] + rotate_half(x) * cos[rows]


@bug("9.2", "rope_rotation", "rotate_half")
def rotary_without_rotate_half(x, cos, sin, offset=0):
    rows = slice(offset, offset + x.shape[-2])
    return x * cos[rows] + x * sin[rows]


@bug("9.2", "mutation", "in place")
def rotary_in_place(x, cos, sin, offset=0):
    rows = slice(offset, offset + x.shape[-2])
    rotated = rotate_half(x)
    x *= cos[rows]
    x += rotated * sin[rows]
    return x


@bug("9.2", "dtype", "x's dtype")
def rotary_returns_float32(x, cos, sin, offset=0):
    rows = slice(offset, offset + x.shape[-2])
    x = x.float()
    return x * cos[rows].float() + rotate_half(x) * sin[rows].float()


# ============================================================================ 9.3 RMSNorm

@bug("9.3", "dtype", "whatever the weight")   # Hugging Face's order: a float32 weight makes float16 x's result float32
class RMSNormHFStyle(RMSNorm):
    def forward(self, x):
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * hidden.to(input_dtype)


@bug("9.3", "dtype", "whatever the weight")   # cast back before the weight: a float32 weight promotes it again
class RMSNormWithNorm(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        rms = torch.sqrt(x32.norm(dim=-1, keepdim=True) ** 2 / self.dim + self.eps)
        return (x32 / rms).type_as(x) * self.weight


@correct("9.3")
class RMSNormSqrtMean(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        out = x32 / torch.sqrt(torch.mean(x32 ** 2, dim=-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


@bug("9.3", "epsilon", "inside")
class RMSNormNoEps(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 / x32.pow(2).mean(-1, keepdim=True).sqrt() * self.weight).to(x.dtype)


@bug("9.3", "epsilon", "outside the square root")
class RMSNormEpsOutside(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "epsilon", "self.eps")
class RMSNormConstantEps(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)


@bug("9.3", "norm_weight", "self.weight")
class RMSNormNoWeight(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


@bug("9.3", "norm_weight", "1 + weight")
class RMSNormOnePlusWeight(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)).to(x.dtype)


@bug("9.3", "norm_statistic", "LayerNorm")
class RMSNormCentred(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        x32 = x32 - x32.mean(-1, keepdim=True)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "norm_statistic", "sqrt(dim)")
class RMSNormPlainNorm(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 / (x32.norm(dim=-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "norm_statistic", "variance")
class RMSNormVariance(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 / torch.sqrt(x32.var(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "norm_statistic", "dim=-1")
class RMSNormDimTwo(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(2, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "exception", "keepdim=True")
class RMSNormNoKeepdim(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        rms = x32.pow(2).mean(-1).add(self.eps).sqrt()
        return (x32 / rms * self.weight).to(x.dtype)


@bug("9.3", "precision", "float32", "65504")
class RMSNormInInputDtype(RMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@bug("9.3", "dtype", "cast the result back")
class RMSNormReturnsFloat32(RMSNorm):
    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


@bug("9.3", "mutation", "in place")
class RMSNormInPlace(RMSNorm):
    def forward(self, x):
        x *= torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight


# ============================================================================ 9.4 SwiGLU

@correct("9.4")
class SwiGLUFunctional(SwiGLU):
    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@correct("9.4")
class SwiGLUSigmoidWrittenOut(SwiGLU):
    def forward(self, x):
        g = self.gate(x)
        hidden = g * torch.sigmoid(g) * self.up(x)
        return self.down(hidden)


@bug("9.4", "gating", "wrong branch")
class SwiGLUSiluOnUp(SwiGLU):
    def forward(self, x):
        return self.down(self.gate(x) * F.silu(self.up(x)))


@bug("9.4", "gating", "no SiLU")
class SwiGLUNoActivation(SwiGLU):
    def forward(self, x):
        return self.down(self.gate(x) * self.up(x))


@bug("9.4", "gating", "sigmoid")
class SwiGLUSigmoid(SwiGLU):
    def forward(self, x):
        return self.down(torch.sigmoid(self.gate(x)) * self.up(x))


@bug("9.4", "gating", "GELU")
class SwiGLUGelu(SwiGLU):
    def forward(self, x):
        return self.down(F.gelu(self.gate(x)) * self.up(x))


@bug("9.4", "gating", "after the product")
class SwiGLUSiluAfterProduct(SwiGLU):
    def forward(self, x):
        return self.down(F.silu(self.gate(x) * self.up(x)))


@bug("9.4", "gating", "gate is missing")
class SwiGLUNoGate(SwiGLU):
    def forward(self, x):
        return self.down(F.silu(self.up(x)))


@bug("9.4", "shape", "self.down")
class SwiGLUNoDown(SwiGLU):
    def forward(self, x):
        return F.silu(self.gate(x)) * self.up(x)


@bug("9.4", "residual", "block")
class SwiGLUWithResidual(SwiGLU):
    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


# ============================================================================ 9.5 repeat_kv

@correct("9.5")
def repeat_kv_interleave(x, groups):
    return torch.repeat_interleave(x, groups, dim=1)


@correct("9.5")
def repeat_kv_expand_reshape(x, groups):
    n, kv_heads, length, head_dim = x.shape
    return x[:, :, None, :, :].expand(n, kv_heads, groups, length, head_dim).reshape(
        n, kv_heads * groups, length, head_dim)


@correct("9.5")
def repeat_kv_stack_loop(x, groups):
    heads = [x[:, h] for h in range(x.shape[1]) for _ in range(groups)]
    return torch.stack(heads, dim=1)


@bug("9.5", "kv_grouping", "repeat_interleave")
def repeat_kv_tiled(x, groups):
    return x.repeat(1, groups, 1, 1)


@bug("9.5", "kv_grouping", "neighbouring")
def repeat_kv_expand_in_front(x, groups):
    n, kv_heads, length, head_dim = x.shape
    return x[:, None].expand(n, groups, kv_heads, length, head_dim).reshape(n, groups * kv_heads, length, head_dim)


@bug("9.5", "kv_grouping", "h % kv_heads")
def repeat_kv_cat_copies(x, groups):
    return torch.cat([x] * groups, dim=1)


@bug("9.5", "shape", "sequence axis")
def repeat_kv_on_sequence(x, groups):
    return x.repeat_interleave(groups, dim=2)


@bug("9.5", "shape", "flatten")
def repeat_kv_not_flattened(x, groups):
    n, kv_heads, length, head_dim = x.shape
    return x[:, :, None].expand(n, kv_heads, groups, length, head_dim)


@bug("9.5", "exception", "reshape")
def repeat_kv_with_view(x, groups):
    n, kv_heads, length, head_dim = x.shape
    x = x.view(n, kv_heads, 1, length, head_dim).expand(n, kv_heads, groups, length, head_dim)
    return x.view(n, kv_heads * groups, length, head_dim)


# ============================================================================ 9.6 GroupedQueryAttention

def _attend(self, q, k, v, start):
    """The end of every attempt below that gets it right: causal attention over the cached keys, merge, proj."""
    total = k.shape[2]
    mask = causal_mask(total, device=q.device)[start:total]
    if self.sliding_window is not None:
        mask = mask & sliding_window_mask(total, self.sliding_window, device=q.device)[start:total]
    return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


@correct("9.6")
class GQAWithMask(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        mask = causal_mask(total, device=x.device)[start:total]
        if self.sliding_window is not None:
            mask = mask & sliding_window_mask(total, self.sliding_window, device=x.device)[start:total]
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


@correct("9.6")
class GQAManualScores(GroupedQueryAttention):
    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = cache.length if cache is not None else 0
        q = self.query(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k = torch.repeat_interleave(k, self.groups, dim=1)
        v = torch.repeat_interleave(v, self.groups, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        i = torch.arange(start, start + length, device=x.device)[:, None]
        j = torch.arange(k.shape[2], device=x.device)[None, :]
        allowed = j <= i
        if self.sliding_window is not None:
            allowed = allowed & (i - j < self.sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, length, -1))


@correct("9.6")
class GQAEnableGqa(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        if start == 0 and self.sliding_window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            total = k.shape[2]
            mask = causal_mask(total, device=x.device)[start:total]
            if self.sliding_window is not None:
                mask = mask & sliding_window_mask(total, self.sliding_window, device=x.device)[start:total]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.proj(merge_heads(out))


@correct("9.6")
class GQAPlainConstructor(nn.Module):
    """The notebook may give a constructor without QK-norm, window or dropout: the checker copes."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.value = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        cos, sin = rope_tables(self.head_dim, max_tokens, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(k.shape[2], device=x.device)[start:]
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class _GQAStudentHelpers(GroupedQueryAttention):
    """A right forward, written with the notebook's apply_rotary and repeat_kv (see in_notebook)."""

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


GQAWithInterleavedRotary = in_notebook(_GQAStudentHelpers, "GQAWithInterleavedRotary",
                                       apply_rotary=rotary_interleaved_pairs)
bug("9.6", "rope_layout", "interleaved", "exercise 9.2", "check_apply_rotary")(GQAWithInterleavedRotary)
GQAWithTiledRepeatKv = in_notebook(_GQAStudentHelpers, "GQAWithTiledRepeatKv", repeat_kv=repeat_kv_tiled)
bug("9.6", "kv_grouping", "repeat_interleave", "exercise 9.5")(GQAWithTiledRepeatKv)
correct("9.6")(in_notebook(_GQAStudentHelpers, "GQAWithOwnRightHelpers", apply_rotary=rotary_own_rotate_half,
                           repeat_kv=repeat_kv_expand_reshape))


@bug("9.6", "rope_layout", "9.1", "check_rope_tables")
class GQAWithInterleavedTables(_GQAStudentHelpers):
    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0, **kwargs):
        super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta, **kwargs)
        cos, sin = rope_repeat_interleave(self.head_dim, max_tokens, rope_theta)   # the student's 9.1
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)


@bug("9.6", "kv_grouping", "h // groups")
class GQARepeatNotInterleave(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = k.repeat(1, self.groups, 1, 1), v.repeat(1, self.groups, 1, 1)
        return _attend(self, q, k, v, start)


@bug("9.6", "kv_grouping", "num_kv_heads=2")
class GQAForgetsRepeat(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        total = k.shape[2]
        scores = scores.masked_fill(~causal_mask(total)[start:total], float("-inf"))
        return self.proj(merge_heads(scores.softmax(-1) @ v))


@bug("9.6", "rotated_values", "values")
class GQARotatesValues(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        q, k, v = (apply_rotary(t, self.rope_cos, self.rope_sin, offset=start) for t in (q, k, v))
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_missing", "Neither")
class GQAWithoutRope(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_missing", "keys too")
class GQARopeOnQueriesOnly(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_axes", "(N, L, heads, head_dim)", "transpose")
class GQARopeBeforeTranspose(GroupedQueryAttention):
    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = 0 if cache is None else cache.length
        q = self.query(x).view(n, length, self.num_heads, self.head_dim)
        k = self.key(x).view(n, length, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start).transpose(1, 2)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start).transpose(1, 2)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_axes", "(2, 10, 32)", "head split")
class GQARopeBeforeSplit(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(apply_rotary(self.query(x), self.rope_cos, self.rope_sin, offset=start), self.num_heads)
        k = split_heads(apply_rotary(self.key(x), self.rope_cos, self.rope_sin, offset=start), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_positions", "offset=cache.length")
class GQAIgnoresOffset(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "kv_cache", "after appending")
class GQARopeAfterCache(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)   # all cached keys, from start
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_positions", "AFTER appending")
class GQAQueriesTurnedAfterAppend(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        offset = 0 if cache is None else cache.length          # read again, after the append
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=offset)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "kv_cache", "num_kv_heads")
class GQACachesRepeatedHeads(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, k, v, start)


@bug("9.6", "kv_cache", "before RoPE")
class GQACachesUnrotatedKeys(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k = apply_rotary(k, self.rope_cos, self.rope_sin)   # every key again, from position 0: right, but slow
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "kv_cache", "never appends")
class GQAIgnoresCache(GroupedQueryAttention):
    def forward(self, x, cache=None):
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin)
        v = split_heads(self.value(x), self.num_kv_heads)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), is_causal=True)
        return self.proj(merge_heads(out))


@bug("9.6", "causal_mask", "is_causal=True")
class GQAIsCausalWithCache(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), is_causal=True)
        return self.proj(merge_heads(out))


@bug("9.6", "causal_mask", "future leaks")
class GQANoMask(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups))
        return self.proj(merge_heads(out))


@bug("9.6", "scale", "sqrt(head_dim)")
class GQANoScale(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        scores = torch.einsum("nhqd,nhkd->nhqk", q, k)
        scores = scores.masked_fill(~causal_mask(total)[start:total], float("-inf"))
        return self.proj(merge_heads(torch.einsum("nhqk,nhkd->nhqd", scores.softmax(-1), v)))


@bug("9.6", "head_split", "transpose")
class GQASplitWithoutTranspose(GroupedQueryAttention):
    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = 0 if cache is None else cache.length
        q = self.query(x).reshape(n, self.num_heads, length, self.head_dim)
        k = self.key(x).reshape(n, self.num_kv_heads, length, self.head_dim)
        v = self.value(x).reshape(n, self.num_kv_heads, length, self.head_dim)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "norm_placement", "after RoPE")
class GQAQkNormAfterRope(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "causal_mask", "sliding window")
class GQAIgnoresWindow(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups),
                                             attn_mask=causal_mask(total)[start:total])
        return self.proj(merge_heads(out))


@bug("9.6", "not_implemented", "NotImplementedError")
class GQANotWritten(GroupedQueryAttention):
    def forward(self, x, cache=None):
        raise NotImplementedError("Exercise 9.6: write GroupedQueryAttention.forward")


# ============================================================================ issue 20: the classes that passed or got
# the wrong name (each with its expected diagnosis), and more of the same classes

def _half_angles(head_dim, max_tokens, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return torch.outer(torch.arange(max_tokens, dtype=torch.float64), inv_freq)      # (max_tokens, head_dim/2)


@bug("9.1", "rope_rotation", "wrong sign")
def rope_negative_sine(head_dim, max_tokens, theta=10000.0):
    angles = _half_angles(head_dim, max_tokens, theta).repeat(1, 2)
    return angles.cos().float(), torch.sin(-angles).float()


@bug("9.1", "precision", "float16")
def rope_float16_angles(head_dim, max_tokens, theta=10000.0):
    inv_freq = (1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))).half()
    angles = torch.outer(torch.arange(max_tokens).half(), inv_freq)                   # rounded to float16
    angles = torch.cat([angles, angles], dim=-1)
    return angles.float().cos(), angles.float().sin()


@bug("9.1", "precision", "rounded")
def rope_bfloat16_angles(head_dim, max_tokens, theta=10000.0):
    angles = _half_angles(head_dim, max_tokens, theta).to(torch.bfloat16).float()
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@bug("9.1", "rope_rotation", "cosines again")
def rope_cos_twice(head_dim, max_tokens, theta=10000.0):
    angles = _half_angles(head_dim, max_tokens, theta).repeat(1, 2)
    cos = angles.cos().float()
    return cos, cos


@bug("9.1", "mismatch", "of the sin table")
def rope_sin_half_angles(head_dim, max_tokens, theta=10000.0):
    angles = _half_angles(head_dim, max_tokens, theta).repeat(1, 2)
    return angles.cos().float(), (angles / 2).sin().float()     # the message must point at sin, not cos


@bug("9.2", "dtype", "x's dtype")
def rotary_float32_tables_promote(x, cos, sin, offset=0):
    rows = slice(offset, offset + x.shape[-2])
    return x * cos[rows] + rotate_half(x) * sin[rows]        # float16 x times float32 rows: float32


@bug("9.2", "gradient", "no gradient")
def rotary_detached(x, cos, sin, offset=0):
    x = x.detach()
    rows = slice(offset, offset + x.shape[-2])
    return x * cos[rows].to(x.dtype) + rotate_half(x) * sin[rows].to(x.dtype)


@bug("9.2", "gradient", "no_grad")
def rotary_under_no_grad(x, cos, sin, offset=0):
    with torch.no_grad():
        rows = slice(offset, offset + x.shape[-2])
        return x * cos[rows].to(x.dtype) + rotate_half(x) * sin[rows].to(x.dtype)


@bug("9.2", "rope_positions", "cos[-L:]", "LAST")
def rotary_last_rows(x, cos, sin, offset=0):
    length = x.shape[-2]
    return x * cos[-length:].to(x.dtype) + rotate_half(x) * sin[-length:].to(x.dtype)


@bug("9.2", "rope_rotation", "first half")
def rotary_first_half_only(x, cos, sin, offset=0):
    half = x.shape[-1] // 2
    rows = slice(offset, offset + x.shape[-2])
    c, s = cos[rows, :half].to(x.dtype), sin[rows, :half].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2], dim=-1)


@bug("9.2", "device", "meta")
def rotary_result_on_cpu(x, cos, sin, offset=0):
    rows = slice(offset, offset + x.shape[-2])
    return (x * cos[rows].to(x.dtype) + rotate_half(x) * sin[rows].to(x.dtype)).cpu()


@bug("9.2", "device", "device=x.device")
def rotary_buffer_without_device(x, cos, sin, offset=0):
    out = torch.empty(x.shape, dtype=x.dtype)                 # on the CPU whatever x is on
    rows = slice(offset, offset + x.shape[-2])
    out[:] = x * cos[rows].to(x.dtype) + rotate_half(x) * sin[rows].to(x.dtype)
    return out


@bug("9.3", "norm_statistic", "mean absolute")
class RMSNormMeanAbs(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 / (x32.abs().mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@bug("9.3", "gradient", "`weight`")
class RMSNormDetachedWeight(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.detach()).to(x.dtype)


@bug("9.3", "gradient", "`x`")
class RMSNormStatisticUnderNoGrad(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        with torch.no_grad():              # "the statistic is a constant": but its gradient is part of x's
            scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale * self.weight).to(x.dtype)


@bug("9.4", "gating", "after self.down")
class SwiGLUSiluAfterDown(SwiGLU):
    def forward(self, x):
        return F.silu(self.down(self.gate(x) * self.up(x)))


@bug("9.4", "gradient", "`gate.weight`")
class SwiGLUGateUnderNoGrad(SwiGLU):
    def forward(self, x):
        with torch.no_grad():
            gate = F.silu(self.gate(x))
        return self.down(gate * self.up(x))


@bug("9.4", "gradient", "`up.weight`")
class SwiGLUUpFromItem(SwiGLU):
    def forward(self, x):
        up = torch.tensor(self.up(x).tolist())                # a copy of the numbers: no graph
        return self.down(F.silu(self.gate(x)) * up)


@bug("9.5", "gradient", "no gradient")
def repeat_kv_detached(x, groups):
    return torch.repeat_interleave(x.detach(), groups, dim=1)


@bug("9.5", "device", "meta")
def repeat_kv_on_cpu(x, groups):
    return torch.repeat_interleave(x, groups, dim=1).cpu()


class _GQAPlain(GroupedQueryAttention):
    """The steps of the notebook's solution, with hooks for one slip each."""

    def offsets(self, start, length):
        return start, start                     # (queries, keys)

    def turn(self, q, k, start, length):
        q_offset, k_offset = self.offsets(start, length)
        return (apply_rotary(q, self.rope_cos, self.rope_sin, offset=q_offset),
                apply_rotary(k, self.rope_cos, self.rope_sin, offset=k_offset))

    def project(self, x):
        return (split_heads(self.query(x), self.num_heads), split_heads(self.key(x), self.num_kv_heads),
                split_heads(self.value(x), self.num_kv_heads))

    def normed(self, x):
        q, k, v = self.project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k, v = self.normed(x)
        q, k = self.turn(q, k, start, x.shape[1])
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "softmax_dim", "dim=-1")
class GQASoftmaxOverQueries(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k, v = _GQAPlain.project(self, x)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~causal_mask(total, device=x.device)[start:total], float("-inf"))
        return self.proj(merge_heads(scores.softmax(dim=-2) @ v))


@bug("9.6", "kv_grouping", "num_kv_heads", "keys or values")
class GQAKeysWithNumHeads(_GQAPlain):
    def project(self, x):
        return (split_heads(self.query(x), self.num_heads), split_heads(self.key(x), self.num_heads),
                split_heads(self.value(x), self.num_heads))


@bug("9.6", "rope_positions", "QUERIES")
class GQAQueriesWithoutOffset(_GQAPlain):
    def offsets(self, start, length):
        return 0, start


@bug("9.6", "rope_positions", "KEYS")
class GQAKeysWithoutOffset(_GQAPlain):
    def offsets(self, start, length):
        return start, 0


@bug("9.6", "rope_positions", "context fills")
class GQAKeysOneLate(_GQAPlain):
    def forward(self, x, cache=None):
        if cache is None:
            return _GQAPlain.forward(self, x)
        start = cache.length
        late = start + 1                      # the cached tokens and the new ones, all one position late
        q, k, v = self.normed(x)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=late)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=late)
        k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_axes", "tiled")
class GQARotatesFlatWithTiledTables(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        length = x.shape[1]
        cos_q = self.rope_cos[start:start + length].repeat(1, self.num_heads)        # (L, heads * head_dim)
        sin_q = self.rope_sin[start:start + length].repeat(1, self.num_heads)
        cos_k = self.rope_cos[start:start + length].repeat(1, self.num_kv_heads)
        sin_k = self.rope_sin[start:start + length].repeat(1, self.num_kv_heads)
        q, k = self.query(x), self.key(x)
        q = q * cos_q + rotate_half(q) * sin_q
        k = k * cos_k + rotate_half(k) * sin_k
        q, k = split_heads(q, self.num_heads), split_heads(k, self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), start)


@bug("9.6", "rope_frequencies", "rope_theta")
class GQARebuildsTablesWithDefaultTheta(_GQAPlain):
    def turn(self, q, k, start, length):
        cos, sin = rope_tables(self.head_dim, self.max_tokens)
        return apply_rotary(q, cos, sin, offset=start), apply_rotary(k, cos, sin, offset=start)


@bug("9.6", "device", "register_buffer")
class GQAMaskOnCpu(_GQAPlain):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k, v = self.normed(x)
        q, k = self.turn(q, k, start, x.shape[1])
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        mask = torch.ones(total, total, dtype=torch.bool).tril()[start:total]     # on the CPU
        if self.sliding_window is not None:
            mask = mask & sliding_window_mask(total, self.sliding_window)[start:total]
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), attn_mask=mask)
        return self.proj(merge_heads(out))


@bug("9.6", "gradient", "`key.weight`")
class GQAKeysDetached(_GQAPlain):
    def project(self, x):
        return (split_heads(self.query(x), self.num_heads), split_heads(self.key(x).detach(), self.num_kv_heads),
                split_heads(self.value(x), self.num_kv_heads))


@bug("9.6", "gradient", "no_grad")
class GQAProjectionsUnderNoGrad(_GQAPlain):
    def project(self, x):
        with torch.no_grad():
            return _GQAPlain.project(self, x)


@correct("9.6")
class GQAHelpersAsMethods(_GQAPlain):
    """The same steps split over small methods, as tidy students write them."""
