"""Round 42b (notebooks 07, 09-12): attempts at 7.1-12.3, slips pasted from well-known public implementations.

Named by this round's fixes: 9.5 Meta's repeat_kv pasted onto the course's (N, kv_heads, L, d) layout, its new axis
after the positions (``kv_grouping``, now saying so); 10.1 a block's own sum merged without its factor
exp(m_blk - m_new) (``online_rescale``). Left out: FlashAttention-1's Algorithm 1 with diag(l) dropped from the old
output (10.2) and a shifted-ReLU feature map (12.3), both still a plain ``mismatch``.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import flash
from course_lib import modern as _modern
from course_lib.attention import KVCache as _KVCache
from course_lib.attention import causal_mask as _causal_mask
from course_lib.attention import merge_heads as _merge_heads
from course_lib.attention import scaled_dot_product_attention as _sdpa
from course_lib.attention import split_heads as _split_heads

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 7.1 split_c_attn

@correct("7.1")
def split_c_attn_nanogpt_transpose_whole_then_rows(weight):
    """nanoGPT's from_pretrained: transpose the whole Conv1D weight (sd_hf[k].t()), then cut the rows."""
    e = weight.shape[0]
    w = weight.t()
    return w[:e], w[e:2 * e], w[2 * e:]


@bug("7.1", "split_transpose", "conv1d")
def split_c_attn_hf_split_size_no_transpose_contiguous(weight):
    """HF GPT2Attention's `c_attn(x).split(self.split_size, dim=2)` carried over to the weight: the right columns,
    made contiguous 'for nn.Linear', but never transposed."""
    e = weight.shape[0]
    return tuple(w.contiguous() for w in weight.split(e, dim=1))


# ============================================================================ 7.2 attention_forward

def _causal_br(lq, lk, device):
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


@correct("7.2")
def attention_forward_hf_eager_with_bool_fill_returns_weights(module, query, key, value, attention_mask,
                                                              scaling=None, dropout=0.0, **kwargs):
    """HF's eager_attention_forward adapted: finfo.min fill for a bool mask, softmax in float32, and the weights
    returned (the table allows 'the weights or None')."""
    lq, lk = query.shape[-2], key.shape[-2]
    mask = attention_mask if attention_mask is not None else _causal_br(lq, lk, query.device)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, value).transpose(1, 2).contiguous()
    return out, w


@correct("7.2")
def attention_forward_gpt2_bias_slice_and_given_mask(module, query, key, value, attention_mask, scaling=None,
                                                     dropout=0.0, **kwargs):
    """Old HF GPT2Attention._attn: the causal 'bias' buffer sliced [Lk-Lq:Lk, :Lk], always; the given mask ANDed
    on top (it is causal already, so it changes nothing)."""
    lq, lk = query.shape[-2], key.shape[-2]
    bias = torch.tril(torch.ones(lk, lk, dtype=torch.bool, device=query.device))
    mask = bias[lk - lq:lk, :lk]
    if attention_mask is not None:
        mask = mask & attention_mask
    q = query * (scaling * query.shape[-1] ** 0.5)
    return _sdpa(q, key, value, mask).transpose(1, 2), None


@bug("7.2", "scale", "scaling")
def attention_forward_gpt2_divides_by_value_dim(module, query, key, value, attention_mask, scaling=None,
                                                dropout=0.0, **kwargs):
    """Old GPT-2 code: attn_weights / torch.full([], value.size(-1) ** 0.5), the `scaling` argument ignored."""
    lq, lk = query.shape[-2], key.shape[-2]
    mask = attention_mask if attention_mask is not None else _causal_br(lq, lk, query.device)
    w = query @ key.transpose(-1, -2) / torch.full([], value.size(-1) ** 0.5, dtype=query.dtype)
    w = w.masked_fill(~mask, float("-inf")).softmax(-1)
    return (w @ value).transpose(1, 2), None


@bug("7.2", "causal_mask")
def attention_forward_hf_eager_adds_the_bool_mask_sliced(module, query, key, value, attention_mask, scaling=None,
                                                         dropout=0.0, **kwargs):
    """HF eager verbatim: causal_mask = attention_mask[:, :, :, :Lk]; attn_weights + causal_mask (a bool mask
    added as 0/1), and None treated as 'no mask'."""
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, :key.shape[-2]]
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), None


@bug("7.2", "head_split")
def attention_forward_output_viewed_not_transposed(module, query, key, value, attention_mask, scaling=None,
                                                   dropout=0.0, **kwargs):
    """Right attention, then .reshape(N, Lq, H, d) of the (N, H, Lq, d) output 'as in merge_heads'."""
    n, h, lq, d = query.shape
    mask = attention_mask if attention_mask is not None else _causal_br(lq, key.shape[-2], query.device)
    out = _sdpa(query * (scaling * d ** 0.5), key, value, mask)
    return out.reshape(n, lq, h, d), None


# ============================================================================ 9.1 rope_tables

@correct("9.1")
def rope_tables_meta_polar_real_imag_cat(head_dim, max_tokens, theta=10000.0):
    """Meta's precompute_freqs_cis (torch.polar), then the real and imaginary parts, each concatenated twice."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: (head_dim // 2)].double() / head_dim))
    t = torch.arange(max_tokens, dtype=torch.float64)
    freqs = torch.outer(t, freqs)
    cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.cat([cis.real, cis.real], -1).float(), torch.cat([cis.imag, cis.imag], -1).float()


@correct("9.1")
def rope_tables_hf_llama_float32_inv_freq(head_dim, max_tokens, theta=10000.0):
    """HF LlamaRotaryEmbedding: inv_freq from int64 arange in float32, emb = cat(freqs, freqs), all float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_tokens, dtype=torch.int64).float()
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@bug("9.1", "rope_layout")
def rope_tables_meta_polar_repeat_interleave(head_dim, max_tokens, theta=10000.0):
    """Meta's freqs_cis made into tables for the interleaved layout: each angle repeated twice in a row."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cis = torch.polar(torch.ones(max_tokens, head_dim // 2), torch.outer(torch.arange(max_tokens).float(), freqs))
    return cis.real.repeat_interleave(2, -1), cis.imag.repeat_interleave(2, -1)


@bug("9.1", "shape")
def rope_tables_meta_max_seq_len_times_two(head_dim, max_tokens, theta=10000.0):
    """Meta's Transformer.__init__: precompute_freqs_cis(dim // n_heads, params.max_seq_len * 2)."""
    end = max_tokens * 2
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float64), freqs)
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "rope_frequencies")
def rope_tables_roformer_i_over_d(head_dim, max_tokens, theta=10000.0):
    """A RoFormer-style sinusoid copied with arange(0, d/2) / d: the exponent lacks its factor 2."""
    freqs = theta ** (-torch.arange(0, head_dim // 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * freqs
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "rope_frequencies")
def rope_tables_inverse_frequencies_not_inverted(head_dim, max_tokens, theta=10000.0):
    """inv_freq copied without the `1.0 /`: theta ** (arange(0, d, 2) / d), angles that grow with the pair."""
    freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * freqs
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


# ============================================================================ 9.2 apply_rotary

def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@bug("9.2", "exception")
def rotary_hf_unsqueeze_dim_one_with_1d_positions(x, cos, sin, offset=0):
    """HF apply_rotary_pos_emb with position_ids = arange(offset, offset + L) (1-D, no batch):
    cos[position_ids].unsqueeze(1) gives (L, 1, d), which does not line up with (N, H, L, d)."""
    position_ids = torch.arange(offset, offset + x.shape[-2], device=x.device)
    c = cos[position_ids].unsqueeze(1).to(x.dtype)
    s = sin[position_ids].unsqueeze(1).to(x.dtype)
    return (x * c) + (_rotate_half(x) * s)


@correct("9.2")
def rotary_hf_position_ids_batched_unsqueeze_one(x, cos, sin, offset=0):
    """HF apply_rotary_pos_emb as written there: position_ids (N, L), cos[position_ids] (N, L, d), unsqueeze(1)."""
    n, length = x.shape[0], x.shape[-2]
    position_ids = torch.arange(offset, offset + length, device=x.device).expand(n, length)
    c = cos[position_ids].unsqueeze(1)
    s = sin[position_ids].unsqueeze(1)
    return ((x.float() * c) + (_rotate_half(x.float()) * s)).to(x.dtype)


@bug("9.2", "rope_layout")
def rotary_meta_view_as_complex(x, cos, sin, offset=0):
    """Meta's apply_rotary_emb: view_as_complex of neighbouring pairs times cos + i sin of the first half."""
    length = x.shape[-2]
    c = cos[offset:offset + length, : x.shape[-1] // 2]
    s = sin[offset:offset + length, : x.shape[-1] // 2]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * torch.complex(c.float(), s.float())).flatten(-2)
    return out.type_as(x)


@correct("9.2")
def rotary_half_split_as_complex_numbers(x, cos, sin, offset=0):
    """The half-split pairs (x_i, x_{i+d/2}) as complex numbers x_i + i x_{i+d/2}, times cos + i sin."""
    length, half = x.shape[-2], x.shape[-1] // 2
    c = cos[offset:offset + length, :half].float()
    s = sin[offset:offset + length, :half].float()
    z = torch.complex(x[..., :half].float(), x[..., half:].float()) * torch.complex(c, s)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


@bug("9.2", "rope_layout")
def rotary_gptj_rotate_every_two(x, cos, sin, offset=0):
    """GPT-J's rotate_every_two (interleaved) with the half-split tables of 9.1."""
    length = x.shape[-2]
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * c + rot * s


@bug("9.2", "rope_positions")
def rotary_neox_cached_prefix_slice(x, cos, sin, offset=0):
    """GPT-NeoX's RotaryEmbedding.forward(x, seq_len): cos_cached[:seq_len], with seq_len = L: the offset never used."""
    seq_len = x.shape[-2]
    c, s = cos[:seq_len].to(x.dtype), sin[:seq_len].to(x.dtype)
    return x * c + _rotate_half(x) * s


# ============================================================================ 9.3 RMSNorm

class _Given09Norm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


@bug("9.3", "dtype")
class RMSNormMetaLlamaWeightAfterTypeAs(_Given09Norm):
    """Meta's Llama RMSNorm verbatim: self._norm(x.float()).type_as(x) * self.weight: a float32 weight
    promotes a bfloat16/float16 result back to float32."""

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


@bug("9.3", "dtype")
class RMSNormT5LayerNormHalfTimesFloatRsqrt(_Given09Norm):
    """HF T5LayerNorm: variance in float32, but the ORIGINAL x times the float32 rsqrt (promotes), cast to
    the weight's dtype only when the weight is half: a float32 result for half inputs."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


@correct("9.3")
class RMSNormHFLlamaWeightCastToInput(_Given09Norm):
    """HF LlamaRMSNorm, with the weight times the result in the input dtype and cast once more."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return (self.weight * hidden_states.to(input_dtype)).to(input_dtype)


@correct("9.3")
class RMSNormTorchFunctional(_Given09Norm):
    """F.rms_norm (torch >= 2.4) in float32 with self.eps and self.weight, cast back."""

    def forward(self, x):
        return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).to(x.dtype)


@bug("9.3", "epsilon")
class RMSNormTorchFunctionalDefaultEps(_Given09Norm):
    """F.rms_norm without eps=: torch then uses finfo(float32).eps (1.19e-7), not self.eps."""

    def forward(self, x):
        return F.rms_norm(x.float(), (self.dim,), self.weight.float()).to(x.dtype)


# ============================================================================ 9.4 SwiGLU

class _Given09Glu(nn.Module):
    def __init__(self, embed_dim, hidden_dim):
        super().__init__()
        self.gate = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, embed_dim, bias=False)


@bug("9.4", "gating", "gelu")
class SwiGLUQuickGeluFromClip(_Given09Glu):
    """A 'fast swish' copied from CLIP's QuickGELU: x * sigmoid(1.702 x) on the gate."""

    def forward(self, x):
        g = self.gate(x)
        return self.down(g * torch.sigmoid(1.702 * g) * self.up(x))


@correct("9.4")
class SwiGLUMetaW1W3W2Names(_Given09Glu):
    """Meta's FeedForward: w2(silu(w1(x)) * w3(x)), with w1 = gate, w3 = up, w2 = down aliased."""

    def forward(self, x):
        w1, w2, w3 = self.gate, self.down, self.up
        return w2(F.silu(w1(x)) * w3(x))


# ============================================================================ 9.5 repeat_kv

@correct("9.5")
def repeat_kv_hf_verbatim_early_return(hidden_states, n_rep):
    """HF's repeat_kv verbatim, `if n_rep == 1: return hidden_states` included."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


@bug("9.5", "kv_grouping", "after the POSITIONS")
def repeat_kv_meta_layout_axis_kept(x, n_rep):
    """Meta's repeat_kv is for (bs, slen, n_kv_heads, head_dim): x[:, :, :, None, :] expands after the 3rd axis;
    on (N, kv, L, d) that is after the positions, and the reshape to (N, kv * n_rep, L, d) mixes positions."""
    bs, n_kv_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, n_kv_heads, slen, n_rep, head_dim).reshape(bs, n_kv_heads * n_rep, slen,
                                                                                      head_dim)


# ============================================================================ 9.6 GroupedQueryAttention

class _NbGQA(nn.Module):
    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__()
        if embed_dim % num_heads or num_heads % num_kv_heads:
            raise ValueError("sizes")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.max_tokens = max_tokens
        self.query = nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.key = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.value = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=False)
        cos, sin = _modern.rope_tables(self.head_dim, max_tokens, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self):
        return _KVCache(self.max_tokens)


@bug("9.6", "rope_axes")
class GQAMetaLayoutRotaryBeforeTranspose(_NbGQA):
    """Meta's Llama order: xq.view(bs, seqlen, n_heads, head_dim), rotary BEFORE the transpose; with the course's
    apply_rotary (positions on axis -2) that turns the heads axis, not the positions."""

    def forward(self, x, cache=None):
        bsz, seqlen, _ = x.shape
        start = cache.length if cache is not None else 0
        xq = self.query(x).view(bsz, seqlen, self.num_heads, self.head_dim)
        xk = self.key(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim)
        xv = self.value(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim)
        xq = _modern.apply_rotary(xq, self.rope_cos, self.rope_sin, offset=start)
        xk = _modern.apply_rotary(xk, self.rope_cos, self.rope_sin, offset=start)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[-2]
        k = _modern.repeat_kv(k, self.groups)
        v = _modern.repeat_kv(v, self.groups)
        mask = _causal_mask(total, device=x.device)[start:total]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


@correct("9.6")
class GQAMetaLlama2AdditiveMaskHstack(_NbGQA):
    """Meta's Llama 2 forward: -inf triu(1) mask hstacked after zeros(seqlen, start_pos), added to the scores;
    mask only when seqlen > 1."""

    def forward(self, x, cache=None):
        bsz, seqlen, _ = x.shape
        start_pos = cache.length if cache is not None else 0
        xq = self.query(x).view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)
        xk = self.key(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        xv = self.value(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        xq = _modern.apply_rotary(xq, self.rope_cos, self.rope_sin, offset=start_pos)
        xk = _modern.apply_rotary(xk, self.rope_cos, self.rope_sin, offset=start_pos)
        if cache is not None:
            xk, xv = cache.append(xk, xv)
        keys = _modern.repeat_kv(xk, self.groups)
        values = _modern.repeat_kv(xv, self.groups)
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device, dtype=x.dtype)
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=x.device, dtype=x.dtype), mask])
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        return self.proj(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


@bug("9.6", "kv_cache", "two new tokens")
class GQAMetaLlama1MaskTriuStartPlusOne(_NbGQA):
    """Meta's Llama 1: mask = full((seqlen, seqlen), -inf).triu(diagonal=start_pos + 1), only when seqlen > 1
    (the original only ever had start_pos = 0 there); with a cache and L > 1 the (L, L) mask is wrong."""

    def forward(self, x, cache=None):
        bsz, seqlen, _ = x.shape
        start_pos = cache.length if cache is not None else 0
        xq = _split_heads(self.query(x), self.num_heads)
        xk = _split_heads(self.key(x), self.num_kv_heads)
        xv = _split_heads(self.value(x), self.num_kv_heads)
        xq = _modern.apply_rotary(xq, self.rope_cos, self.rope_sin, offset=start_pos)
        xk = _modern.apply_rotary(xk, self.rope_cos, self.rope_sin, offset=start_pos)
        if cache is not None:
            xk, xv = cache.append(xk, xv)
        keys = _modern.repeat_kv(xk, self.groups)
        values = _modern.repeat_kv(xv, self.groups)
        scores = xq @ keys.transpose(2, 3) / math.sqrt(self.head_dim)
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(diagonal=start_pos + 1)
            mask = F.pad(mask, (start_pos, 0)) if start_pos else mask   # 'make it fit' the (L, T) scores
            scores = scores + mask
        return self.proj(_merge_heads(scores.softmax(-1) @ values))


@bug("9.6", "causal_mask")
class GQASdpaIsCausalWithCache(_NbGQA):
    """F.scaled_dot_product_attention(..., is_causal=True) with the cache's keys: torch aligns its causal mask
    top-left, so a new token at position start sees only key 0."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q = _modern.apply_rotary(_split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, start)
        k = _modern.apply_rotary(_split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, start)
        v = _split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(_merge_heads(out))


@correct("9.6")
class GQASdpaEnableGqaBoolMask(_NbGQA):
    """torch >= 2.5: F.scaled_dot_product_attention(..., enable_gqa=True) groups the heads itself (in the
    repeat_interleave order), so no repeat_kv."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q = _modern.apply_rotary(_split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, start)
        k = _modern.apply_rotary(_split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, start)
        v = _split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[-2]
        mask = _causal_mask(total, device=x.device)[start:total]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.proj(_merge_heads(out))


# ============================================================================ 10.1 online_softmax

@correct("10.1")
def online_softmax_milakov_per_element_within_block(x, block_size):
    """Milakov & Gimelshein's online normaliser, block statistics first (block max, block sum) then merged:
    l = l * e^(m - m_new) + l_blk * e^(m_blk - m_new), with the -inf guards."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        blk = x[..., s:s + block_size]
        m_blk = blk.amax(-1)
        safe_blk = torch.where(torch.isinf(m_blk) & (m_blk < 0), torch.zeros_like(m_blk), m_blk)
        l_blk = torch.exp(blk - safe_blk[..., None]).sum(-1)
        m_new = torch.maximum(m, m_blk)
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe) + l_blk * torch.exp(safe_blk - safe)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "online_rescale")
def online_softmax_block_sums_merged_without_block_rescale(x, block_size):
    """Block statistics merged, but the block's own sum (measured against its own maximum) is added as is:
    l = l * e^(m - m_new) + l_blk."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        blk = x[..., s:s + block_size]
        m_blk = blk.amax(-1)
        safe_blk = torch.where(m_blk == float("-inf"), torch.zeros_like(m_blk), m_blk)
        l_blk = torch.exp(blk - safe_blk[..., None]).sum(-1)
        m_new = torch.maximum(m, m_blk)
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe) + l_blk
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ 10.2 flash_attention

@bug("10.2", "nan")
def flash_paper_algorithm1_key_outer_normalised_output(q, k, v, *, block_q, block_k, causal=False):
    """FlashAttention (v1) Algorithm 1: keys in the outer loop, queries inside; O kept NORMALISED and updated as
    O = diag(l_new)^-1 (diag(l) e^(m - m_new) O + e^(m~ - m_new) P~ V), with m~, l~ the block's own statistics."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    o = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    l = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for ks in range(0, lk, block_k):
        ke = min(ks + block_k, lk)
        kj, vj = k[..., ks:ke, :], v[..., ks:ke, :]
        for qs in range(0, lq, block_q):
            qe = min(qs + block_q, lq)
            if causal and ks > qe - 1:
                continue
            s = (q[..., qs:qe, :] * scale) @ kj.transpose(-2, -1)
            if causal and ke - 1 > qs:
                fut = torch.arange(ks, ke, device=q.device)[None, :] > torch.arange(qs, qe, device=q.device)[:, None]
                s = s.masked_fill(fut, float("-inf"))
            m_t = s.amax(-1)
            p_t = torch.exp(s - m_t[..., None])
            l_t = p_t.sum(-1)
            mi, li, oi = m[..., qs:qe], l[..., qs:qe], o[..., qs:qe, :]
            m_new = torch.maximum(mi, m_t)
            l_new = torch.exp(mi - m_new) * li + torch.exp(m_t - m_new) * l_t
            o[..., qs:qe, :] = ((li * torch.exp(mi - m_new))[..., None] * oi
                                + torch.exp(m_t - m_new)[..., None] * (p_t @ vj)) / l_new[..., None]
            l[..., qs:qe] = l_new
            m[..., qs:qe] = m_new
    return o, m + torch.log(l)


def _flash_triton(q, k, v, block_q, block_k, causal, *, mask_fill=-1.0e6, l_init=1.0, mask_cmp="ge"):
    """Tri Dao's / the Triton tutorial's inner loop in torch: exp2 with qk_scale = sm_scale * log2(e), l_i
    initialised to 1.0, the causal mask added as where(mask, 0, -1e6) after scaling."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    qk_scale = sm_scale * 1.44269504
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :]
        m_i = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l_i = torch.zeros_like(m_i) + l_init
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        offs_m = torch.arange(qs, qe, device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            qk = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal and ke - 1 > qs:
                offs_n = torch.arange(ks, ke, device=q.device)
                keep = offs_m[:, None] >= offs_n[None, :] if mask_cmp == "ge" else offs_m[:, None] > offs_n[None, :]
                qk = qk * qk_scale + torch.where(keep, 0.0, mask_fill).to(q.dtype)
                m_ij = torch.maximum(m_i, qk.amax(-1))
                qk = qk - m_ij[..., None]
            else:
                m_ij = torch.maximum(m_i, qk.amax(-1) * qk_scale)
                qk = qk * qk_scale - m_ij[..., None]
            p = torch.exp2(qk)
            alpha = torch.exp2(m_i - m_ij)
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[..., ks:ke, :]
            m_i = m_ij
        outs.append(acc / l_i[..., None])
        lses.append((m_i + torch.log2(l_i)) / 1.44269504)   # natural-log lse
    return torch.cat(outs, -2), torch.cat(lses, -1)


@correct("10.2")
def flash_triton_tutorial_l_init_one_mask_minus_1e6(q, k, v, *, block_q, block_k, causal=False):
    """The Triton tutorial's loop, its l_i = 1.0 start (harmless: alpha = exp2(-inf) = 0 on the first block) and
    its additive -1e6 causal mask included; lse converted back to natural log."""
    return _flash_triton(q, k, v, block_q, block_k, causal)


@bug("10.2", "causal_mask")
def flash_triton_tutorial_mask_strict(q, k, v, *, block_q, block_k, causal=False):
    """The tutorial's mask `offs_m[:, None] >= offs_n` copied as `>`: each query loses its own key
    (-1e6, not -inf: no NaN, query 0 sees everything of its block equally)."""
    return _flash_triton(q, k, v, block_q, block_k, causal, mask_cmp="gt")


# ============================================================================ 10.3 FlashAttentionFunction

class _FlashGiven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out


def _bwd(ctx, grad_out, *, scale_dq=True, scale_dk=True, keys_outer=False):
    q, k, v, out, lse = ctx.saved_tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(-1)
    pairs = [(qs, ks) for qs in range(0, lq, ctx.block_q) for ks in range(0, lk, ctx.block_k)]
    if keys_outer:
        pairs.sort(key=lambda p: (p[1], p[0]))
    for qs, ks in pairs:
        qe, ke = min(qs + ctx.block_q, lq), min(ks + ctx.block_k, lk)
        if ctx.causal and ks > qe - 1:
            continue
        qb, dob, kb, vb = q[..., qs:qe, :], grad_out[..., qs:qe, :], k[..., ks:ke, :], v[..., ks:ke, :]
        s = qb @ kb.transpose(-2, -1) * scale
        if ctx.causal and ke - 1 > qs:
            fut = torch.arange(ks, ke, device=q.device)[None, :] > torch.arange(qs, qe, device=q.device)[:, None]
            s = s.masked_fill(fut, float("-inf"))
        p = torch.exp(s - lse[..., qs:qe, None])
        dv[..., ks:ke, :] += p.transpose(-2, -1) @ dob
        ds = p * (dob @ vb.transpose(-2, -1) - delta[..., qs:qe, None])
        dq[..., qs:qe, :] += ds @ kb * (scale if scale_dq else 1.0)
        dk[..., ks:ke, :] += ds.transpose(-2, -1) @ qb * (scale if scale_dk else 1.0)
    return dq, dk, dv, None, None, None


@bug("10.3", "scale", "dq")
class FlashBackwardFA2PaperNoTau(_FlashGiven):
    """FlashAttention-2's Algorithm 2 copied as printed (S = Q K^T, the softmax scale left out of the pseudocode):
    the forward's scores are scaled, but dQ += dS K and dK += dS^T Q miss the 1/sqrt(d)."""

    @staticmethod
    def backward(ctx, grad_out):
        return _bwd(ctx, grad_out, scale_dq=False, scale_dk=False)


@bug("10.3", "scale", "dk")
class FlashBackwardTauOnDqOnly(_FlashGiven):
    """FA1 Algorithm 4's `dQ_i += tau dS_ij K_j` kept, its `dK_j += tau dS_ij^T Q_i` copied without tau."""

    @staticmethod
    def backward(ctx, grad_out):
        return _bwd(ctx, grad_out, scale_dq=True, scale_dk=False)


@correct("10.3")
class FlashBackwardFA2KeyOuterPairs(_FlashGiven):
    """FA2's backward order: key blocks outer (dK_j, dV_j held), query blocks inner."""

    @staticmethod
    def backward(ctx, grad_out):
        return _bwd(ctx, grad_out, keys_outer=True)


@bug("10.3", "exception", "three")
class FlashBackwardReturnsThreeGradients(_FlashGiven):
    """A PyTorch 'custom Function' tutorial's habit: return exactly the tensors' gradients (dq, dk, dv)."""

    @staticmethod
    def backward(ctx, grad_out):
        return _bwd(ctx, grad_out)[:3]


# ============================================================================ 11.1 / 11.2

@correct("11.1")
def prev_arena_loop_over_heads(weights):
    """ARENA's detector per head, attention_pattern[h].diagonal(-1).mean(), over a batch and stacked."""
    return torch.stack([weights[:, h].diagonal(-1, dim1=-2, dim2=-1).mean() for h in range(weights.shape[1])])


@bug("11.1", "score_offset")
def prev_arena_current_token_detector(weights):
    """ARENA's current-attn detector (the main diagonal) pasted in place of the previous-token one."""
    return weights.diagonal(0, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.1", "score_positions")
def prev_sum_over_all_l_positions(weights):
    """The diagonal summed and divided by L (TransformerLens-style `/ seq_len`): position 0 counted."""
    length = weights.shape[-1]
    return weights.diagonal(-1, dim1=-2, dim2=-1).sum(-1).mean(0) / length


@bug("11.2", "score_positions")
def induction_arena_offset_one_minus_seq_len_no_drop(weights, half):
    """ARENA's induction_attn_detector: diagonal(-seq_len + 1).mean(), written for [BOS, r, r]; here there is
    no BOS, so the first entry (query half - 1, in the first half) is kept."""
    return weights.diagonal(-half + 1, dim1=-2, dim2=-1).mean(dim=(0, 2))


@correct("11.2")
def induction_by_mask_selector(weights, half):
    """A 0/1 selector of the entries (i, i - half + 1), i >= half, built with arange on the weights' device."""
    length = weights.shape[-1]
    i = torch.arange(length, device=weights.device)[:, None]
    j = torch.arange(length, device=weights.device)[None, :]
    sel = ((j == i - half + 1) & (i >= half)).to(weights.dtype)
    return (weights * sel).sum(dim=(-2, -1)).mean(0) / (length - half)


# ============================================================================ 11.3 ablate_head

@correct("11.3")
@contextlib.contextmanager
def ablate_head_transformerlens_in_place_on_view(model, layer, head):
    """TransformerLens' hook_z zero-ablation: z[:, :, head, :] = 0 on a (N, L, H, d_h) VIEW of a clone of the
    hook's input, returned."""
    attn = model.blocks[layer].attn

    def hook(module, inputs):
        z = inputs[0].clone()
        n, length, _ = z.shape
        z.view(n, length, -1, attn.head_dim)[:, :, head, :] = 0.0
        return (z,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "ablation_slice")
@contextlib.contextmanager
def ablate_head_tl_view_heads_first(model, layer, head):
    """TransformerLens' (N, L, H, d) layout misremembered as heads first: view(N, H, L, d)[:, head] = 0 on the
    merged (N, L, H*d) input: the wrong entries are zeroed."""
    attn = model.blocks[layer].attn

    def hook(module, inputs):
        z = inputs[0].clone()
        n, length, width = z.shape
        z.view(n, width // attn.head_dim, length, attn.head_dim)[:, head] = 0.0
        return (z,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "not_restored")
@contextlib.contextmanager
def ablate_head_hook_removed_without_finally(model, layer, head):
    """The HF/PyTorch forum snippet: handle = register...; yield; handle.remove(), no try/finally."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs):
        z = inputs[0].clone()
        z[..., cols] = 0
        return (z,)

    handle = attn.proj.register_forward_pre_hook(hook)
    yield model
    handle.remove()


# ============================================================================ 12.1 sliding_window_mask

@bug("12.1", "dtype")
def sliding_window_mistral_reference_log_mask(length, window, sinks=0):
    """Mistral's one-file reference: full(1).tril().triu(-window), then torch.log (0 / -inf float mask)."""
    mask = torch.full((length, length), fill_value=1.0)
    mask = torch.tril(mask, diagonal=0)
    mask = torch.triu(mask, diagonal=-(window - 1))
    if sinks:
        mask[:, :sinks] = torch.tril(torch.ones(length, length))[:, :sinks]
    return torch.log(mask)


@bug("12.1", "causal_mask", "too wide")
def sliding_window_mistral_reference_triu_minus_window(length, window, sinks=0):
    """Mistral's reference band, triu(diagonal=-sliding_window), as bool: window + 1 keys."""
    mask = torch.ones(length, length, dtype=torch.bool).tril().triu(diagonal=-window)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return mask | ((j < sinks) & (j <= i))


@correct("12.1")
def sliding_window_hf_mask_function_vmapped(length, window, sinks=0):
    """HF's mask functions (causal AND kv > q - window, OR sink) evaluated on broadcast indices."""
    q_idx = torch.arange(length)[:, None]
    kv_idx = torch.arange(length)[None, :]
    causal = kv_idx <= q_idx
    sliding = kv_idx > q_idx - window
    sink = kv_idx < sinks
    return causal & (sliding | sink)


@correct("12.1")
def sliding_window_hf_cache_position_bitwise_or(length, window, sinks=0):
    """HF's older 4-D mask builder: a 'masked' tensor (True = hidden) from triu(1), OR'ed with the keys too far
    back (arange <= cache_position - window), the sink columns unhidden, then inverted."""
    cache_position = torch.arange(length)
    hidden = torch.ones(length, length, dtype=torch.bool).triu(diagonal=1)
    too_far = torch.arange(length)[None, :] <= (cache_position.reshape(-1, 1) - window)
    too_far[:, :sinks] = False
    hidden.bitwise_or_(too_far)
    return ~hidden


# ============================================================================ 12.2 latent_attention

def _mla_queries(layer, x):
    if layer.q_lora_rank is None:
        return layer.q_proj(x)
    return layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))


@correct("12.2")
def latent_deepseek_v3_absorbed_einsums(layer, x, cache=None):
    """DeepSeek-V3 inference/model.py's 'absorb' path: wkv_b viewed (H, dn + dv, r), q_nope folded into the latent
    space, scores against the cached latents, values up-projected after the softmax."""
    bsz, seqlen, _ = x.shape
    start = cache.length if cache is not None else 0
    dn, dr, dv, h = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim, layer.num_heads
    q = _mla_queries(layer, x).view(bsz, seqlen, h, dn + dr)
    q_nope, q_pe = q.split([dn, dr], dim=-1)
    q_pe = _modern.apply_rotary(q_pe.transpose(1, 2), layer.rope_cos, layer.rope_sin, offset=start).transpose(1, 2)
    kv, k_pe = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    kv = layer.kv_a_layernorm(kv)
    k_pe = _modern.apply_rotary(k_pe, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        kv, k_pe = cache.append(kv, k_pe)
    end = kv.shape[1]
    wkv_b = layer.kv_b_proj.weight.view(h, -1, layer.kv_lora_rank)
    q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :dn])
    scores = (torch.einsum("bshc,btc->bsht", q_nope, kv)
              + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * layer.softmax_scale
    mask = torch.full((seqlen, end), float("-inf"), device=x.device, dtype=x.dtype).triu_(start + 1)
    scores = scores + mask[None, :, None, :]
    scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
    o = torch.einsum("bsht,btc->bshc", scores, kv)
    o = torch.einsum("bshc,hdc->bshd", o, wkv_b[:, -dv:])
    return layer.o_proj(o.flatten(2))


@bug("12.2", "rope_layout")
def latent_hf_deepseek_v2_deinterleave_before_rotate_half(layer, x, cache=None):
    """HF modeling_deepseek (V2) apply_rotary_pos_emb: q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(...)
    before rotate_half, the checkpoint's interleaved pairs re-ordered; this layer is half-split already."""
    def deint(t):
        *lead, d = t.shape
        return t.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)

    n, length, _ = x.shape
    start = cache.length if cache is not None else 0
    dn, dr, dv, h = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim, layer.num_heads
    q = _mla_queries(layer, x).view(n, length, h, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = _modern.apply_rotary(deint(q_rope), layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = _modern.apply_rotary(deint(k_rope), layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, h, total, dr)], dim=-1)
    mask = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:]
    out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1), k, v, attn_mask=mask,
                                         scale=layer.softmax_scale)
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


@bug("12.2", "causal_mask")
def latent_deepseek_mask_triu_one_ignores_start(layer, x, cache=None):
    """DeepSeek-V3's generate() mask, full(-inf).triu_(1), made (seqlen, end) to fit the scores with a cache:
    aligned top-left, so new query i sees only keys 0..i, not 0..start+i."""
    bsz, seqlen, _ = x.shape
    start = cache.length if cache is not None else 0
    dn, dr, dv, h = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim, layer.num_heads
    q = _mla_queries(layer, x).view(bsz, seqlen, h, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = _modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = _modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    end = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(bsz, end, h, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(bsz, h, end, dr)], dim=-1)
    scores = torch.cat([q_nope, q_rope], -1) @ k.transpose(-2, -1) * layer.softmax_scale
    mask = torch.full((seqlen, end), float("-inf"), device=x.device, dtype=x.dtype).triu_(1)
    out = (scores + mask).softmax(-1) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, h * dv))


# ============================================================================ 12.3 linear_attention_recurrent

def _phi(x):
    return F.elu(x) + 1


@correct("12.3")
def linear_fast_transformers_recurrent_einsums(q, k, v):
    """fast-transformers' RecurrentLinearAttention step, looped: Zi += K; Si += einsum('nd,nm->ndm');
    Z = 1 / (einsum(Q, Zi) + eps); V = einsum('nd,ndm,n->nm', Q, Si, Z)."""
    Q, K = _phi(q), _phi(k)
    Si = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    Zi = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        Zi = Zi + K[..., i, :]
        Si = Si + torch.einsum("...d,...m->...dm", K[..., i, :], v[..., i, :])
        Z = 1.0 / (torch.einsum("...d,...d->...", Q[..., i, :], Zi) + 1e-6)
        outs.append(torch.einsum("...d,...dm,...->...m", Q[..., i, :], Si, Z))
    return torch.stack(outs, dim=-2)


@bug("12.3", "causal_mask")
def linear_fast_transformers_noncausal_k_sum(q, k, v):
    """fast-transformers' (non-causal) LinearAttention: KV = einsum(K, V) over ALL positions,
    Z = 1 / (Q . K.sum(dim=-2) + eps): every query sees every key."""
    Q, K = _phi(q), _phi(k)
    KV = torch.einsum("...sd,...sm->...dm", K, v)
    Z = 1.0 / (torch.einsum("...ld,...d->...l", Q, K.sum(dim=-2)) + 1e-6)
    return torch.einsum("...ld,...dm,...l->...lm", Q, KV, Z)


@bug("12.3", "normalization", "1e-6")
def linear_lucidrains_cumsum_eps_in_z(q, k, v):
    """lucidrains' causal linear attention with elu+1: k.cumsum, the context as a cumsum of outer products, and
    eps added to the cumulated keys (phi(q) . (z + eps): a different, also tiny, epsilon term)."""
    Q, K = _phi(q), _phi(k)
    k_cumsum = K.cumsum(dim=-2)
    D_inv = 1.0 / torch.einsum("...nd,...nd->...n", Q, k_cumsum + 1e-6 / q.shape[-1])
    context = torch.einsum("...nd,...ne->...nde", K, v).cumsum(dim=-3)
    return torch.einsum("...nde,...nd,...n->...ne", context, Q, D_inv)


# ============================================================================ second batch

@correct("10.2")
def flash_paper_algorithm1_key_outer_guarded(q, k, v, *, block_q, block_k, causal=False):
    """Algorithm 1 (keys outer, O kept normalised), with the block statistics measured against m_new and a row
    that sees none of a block's keys left alone (its m_t = -inf)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    o = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    l = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for ks in range(0, lk, block_k):
        ke = min(ks + block_k, lk)
        kj, vj = k[..., ks:ke, :], v[..., ks:ke, :]
        for qs in range(0, lq, block_q):
            qe = min(qs + block_q, lq)
            if causal and ks > qe - 1:
                continue
            s = (q[..., qs:qe, :] * scale) @ kj.transpose(-2, -1)
            if causal and ke - 1 > qs:
                fut = torch.arange(ks, ke, device=q.device)[None, :] > torch.arange(qs, qe, device=q.device)[:, None]
                s = s.masked_fill(fut, float("-inf"))
            mi, li, oi = m[..., qs:qe], l[..., qs:qe], o[..., qs:qe, :]
            m_new = torch.maximum(mi, s.amax(-1))
            safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe[..., None])
            c = torch.exp(mi - safe)
            l_new = c * li + p.sum(-1)
            denom = torch.where(l_new == 0, torch.ones_like(l_new), l_new)
            o[..., qs:qe, :] = ((li * c)[..., None] * oi + p @ vj) / denom[..., None]
            l[..., qs:qe] = l_new
            m[..., qs:qe] = m_new
    return o, m + torch.log(l)


@bug("7.2", "causal_mask")
def attention_forward_hf_sdpa_is_causal_rule(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                             **kwargs):
    """HF's sdpa_attention_forward: is_causal = Lq > 1 and attention_mask is None; torch's is_causal is aligned
    top-left, so with 1 < Lq < Lk (a chunk after a cache) the queries miss the last keys."""
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                         scale=scaling, is_causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


@correct("7.2")
def attention_forward_sdpa_causal_lower_right_bias(module, query, key, value, attention_mask, scaling=None,
                                                   dropout=0.0, **kwargs):
    """torch.nn.attention.bias.causal_lower_right(Lq, Lk): torch's own bottom-right causal bias, for None."""
    from torch.nn.attention.bias import causal_lower_right
    mask = attention_mask if attention_mask is not None else causal_lower_right(query.shape[-2], key.shape[-2])
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2), None


@correct("9.4")
class SwiGLUHFAct2FnSilu(_Given09Glu):
    """HF LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)) with act_fn = ACT2FN['silu']."""

    def forward(self, x):
        from transformers.activations import ACT2FN
        act_fn = ACT2FN["silu"]
        return self.down(act_fn(self.gate(x)) * self.up(x))


@bug("9.4", "gating", "gelu")
class SwiGLUHFGemmaGeluTanh(_Given09Glu):
    """HF GemmaMLP copied: ACT2FN['gelu_pytorch_tanh'] (GeGLU), not SiLU."""

    def forward(self, x):
        from transformers.activations import ACT2FN
        return self.down(ACT2FN["gelu_pytorch_tanh"](self.gate(x)) * self.up(x))


@bug("10.1", "running_max", "-inf")
def online_softmax_m_starts_at_zero(x, block_size):
    """m = 0 at the start (the notebook's question): right mathematically, but every score below ~-104 underflows."""
    m = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        blk = x[..., s:s + block_size]
        m_new = torch.maximum(m, blk.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(blk - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("10.3")
class FlashBackwardTritonTutorialTransposed(_FlashGiven):
    """The Triton tutorial's _attn_bwd_dkdv in torch: everything transposed, qkT = k q^T, pT = exp(qkT - lse),
    dv += pT dO, dpT = v dO^T, dsT = pT (dpT - D), dk += dsT q; dq from dsT^T k."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        sm = 1.0 / math.sqrt(q.shape[-1])
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        Di = (out * grad_out).sum(-1)
        for ks in range(0, lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            kb, vb = k[..., ks:ke, :], v[..., ks:ke, :]
            for qs in range(0, lq, ctx.block_q):
                qe = min(qs + ctx.block_q, lq)
                if ctx.causal and ks > qe - 1:
                    continue
                qb, dob = q[..., qs:qe, :], grad_out[..., qs:qe, :]
                qkT = kb @ qb.transpose(-2, -1) * sm
                pT = torch.exp(qkT - lse[..., None, qs:qe])
                if ctx.causal:
                    keep = torch.arange(qs, qe, device=q.device)[None, :] >= torch.arange(ks, ke, device=q.device)[:, None]
                    pT = torch.where(keep, pT, torch.zeros_like(pT))
                dv[..., ks:ke, :] += pT @ dob
                dpT = vb @ dob.transpose(-2, -1)
                dsT = pT * (dpT - Di[..., None, qs:qe])
                dk[..., ks:ke, :] += dsT @ qb * sm
                dq[..., qs:qe, :] += dsT.transpose(-2, -1) @ kb * sm
        return dq, dk, dv, None, None, None


@bug("11.3", "mutation", "clone")
@contextlib.contextmanager
def ablate_head_transformerlens_in_place_returns_none(model, layer, head):
    """TransformerLens' habit: zero the head in place on the hook's own input and return nothing: the merged input
    is a view of the attention output autograd saved, so the backward breaks."""
    attn = model.blocks[layer].attn

    def hook(module, inputs):
        z = inputs[0]
        z[..., head * attn.head_dim:(head + 1) * attn.head_dim] = 0.0

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("12.1")
def sliding_window_hf_gemma2_tril_negative_window(length, window, sinks=0):
    """HF Gemma 2: hide where tril(ones, diagonal=-window) (i - j >= window) on top of the causal mask."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    too_far = torch.tril(torch.ones(length, length, dtype=torch.bool), diagonal=-window)
    too_far[:, :sinks] = False
    return causal & ~too_far


@bug("12.2", "scale")
def latent_deepseek_qk_head_dim_scale(layer, x, cache=None):
    """DeepSeek's self.softmax_scale = qk_head_dim ** -0.5 recomputed by hand, not the layer's softmax_scale."""
    n, length, _ = x.shape
    start = cache.length if cache is not None else 0
    dn, dr, dv, h = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim, layer.num_heads
    q = _mla_queries(layer, x).view(n, length, h, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = _modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = _modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, h, total, dr)], dim=-1)
    mask = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:]
    out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1), k, v, attn_mask=mask,
                                         scale=(dn + dr) ** -0.5)
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


@correct("9.5")
def repeat_kv_meta_layout_transposed_around(x, n_rep):
    """Meta's repeat_kv used as written, on its own layout: transpose to (N, L, kv, d), repeat, transpose back."""
    y = x.transpose(1, 2)
    bs, slen, n_kv_heads, head_dim = y.shape
    if n_rep == 1:
        return x
    y = y[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                  head_dim)
    return y.transpose(1, 2)


@bug("9.2", "rope_rotation")
def rotary_rotate_half_other_sign_convention(x, cos, sin, offset=0):
    """A rotate_half written as cat(x2, -x1) (some ports): each pair turns backwards."""
    length = x.shape[-2]
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat([x2, -x1], dim=-1) * s
