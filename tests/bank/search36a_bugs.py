"""Round 36a (notebooks 01-05): attempts at 1.2, 1.3, 2.1, 2.2, 3.1, 3.2, 3.3, 4.1, 5.1.

New classes aimed at: operator-precedence and integer-division scale slips (d**1/2, ** (1 // 2)), a max subtracted
over the wrong axis in a hand-written softmax, F.dropout with its default training=True, a softmax forced to
float32 (dtype=torch.float32), an additive float32 mask made on the right device but not in q's dtype, a mask input
inverted in place, the layout of torch.nn.MultiheadAttention (sequence first) applied to batch-first inputs,
len(x) as the sequence length, heads' weights averaged, and right attempts in other styles (logsumexp softmax,
bmm over a flattened batch, PyTorch's own (L, N*H, hd) route, chunk/unbind, finfo.min, lru_cache).

Named by this round's fixes: 1.3 q, k and v flattened to 2-D (the engine's batch probe: ``batch_mixing``), a float32
bias (the engine's bfloat16 probe: ``dtype``), F.dropout (a wrong output that torch's random state changes:
``dropout``), softmax(dtype=torch.float32) raising on float64 inputs (``dtype``), each column's maximum subtracted
(``softmax_dim``, read from the weights); 2.2 len(x) as the length and 3.3 a view written for a batch of one (the
first call fails: the module is tried on x[:1] and on a square batch). Left out: 1.2 a softmax over the values'
axis, which the one-hot read-back cannot see (debatable, contrived).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.2 toy_attention

@correct("1.2")
def toy_broadcast_then_sum(query, keys, values):
    """The weighted sum by broadcasting: values.T times the weights, summed over the keys (last axis)."""
    weights = torch.softmax(keys @ query, dim=0)              # (n,)
    return (values.T * weights).sum(-1)                         # (n,) -> (); (dv, n) -> (dv,)


@correct("1.2")
def toy_einsum_logsumexp(query, keys, values):
    scores = torch.einsum("nd,d->n", keys, query)
    weights = torch.exp(scores - torch.logsumexp(scores, dim=0))
    return torch.einsum("n,n...->...", weights, values)


@bug("1.2", "scale")
def toy_scaled_by_number_of_keys(query, keys, values):
    """Scales by 1/sqrt(n), the number of keys (confusing n with d)."""
    scores = keys @ query / math.sqrt(keys.shape[0])
    return torch.softmax(scores, dim=0) @ values


@bug("1.2", "mutation")
def toy_normalises_keys_in_place(query, keys, values):
    """Cosine attention with the keys normalised in place (the caller's keys change)."""
    keys /= keys.norm(dim=-1, keepdim=True)
    return torch.softmax(keys @ query, dim=0) @ values


# ============================================================================ 1.3 scaled_dot_product_attention

@correct("1.3")
def sdpa_logsumexp_softmax(q, k, v, mask=None):
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), -math.inf)
    weights = (scores - torch.logsumexp(scores, dim=-1, keepdim=True)).exp()
    return weights @ v


@correct("1.3")
def sdpa_bmm_over_flattened_batch(q, k, v, mask=None):
    """Flatten the leading axes, torch.bmm, view back."""
    *batch, lq, d = q.shape
    lk, dv = k.shape[-2], v.shape[-1]
    q3, k3, v3 = q.reshape(-1, lq, d), k.reshape(-1, lk, d), v.reshape(-1, lk, dv)
    scores = torch.bmm(q3, k3.transpose(1, 2)) * d ** -0.5
    if mask is not None:
        m = mask.expand(*batch, lq, lk).reshape(-1, lq, lk)
        scores = scores.masked_fill(~m, float("-inf"))
    out = torch.bmm(F.softmax(scores, dim=2), v3)
    return out.reshape(*batch, lq, dv)


@correct("1.3")
def sdpa_default_mask_on_q_device(q, k, v, mask=None):
    """mask=None replaced by an all-True mask made on q's device."""
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(k.size(-1))
    scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1) @ v


@correct("1.3")
def sdpa_softmax_upcast_for_half_only(q, k, v, mask=None):
    """The softmax in at least float32 (bfloat16 inputs upcast, float64 kept), cast back to v's dtype."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return weights.to(v.dtype) @ v


@bug("1.3", "scale")
def sdpa_power_precedence(q, k, v, mask=None):
    """`/ d**1/2` reads as (scores / d) / 2, not / sqrt(d)."""
    d = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / d**1/2
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "scale")
def sdpa_integer_division_exponent(q, k, v, mask=None):
    """`d ** (1 // 2)` is d ** 0 = 1: no scaling at all."""
    d = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / d ** (1 // 2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "device", "device")
def sdpa_default_mask_on_the_cpu(q, k, v, mask=None):
    """mask=None replaced by an all-True mask made without device=."""
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


@bug("1.3", "dtype")
def sdpa_additive_bias_float32_on_device(q, k, v, mask=None):
    """An additive -inf bias made on q's device but in float32 (no dtype=): float64 inputs promote it away,
    bfloat16 ones are promoted to float32 by it (and the product with v then fails)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        bias = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
        scores = scores + bias
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "dropout")
def sdpa_functional_dropout(q, k, v, mask=None):
    """F.dropout on the weights, as in a tutorial's attention function: training=True by default."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.dropout(torch.softmax(scores, dim=-1), p=0.1)
    return weights @ v


@bug("1.3", "dtype")
def sdpa_softmax_in_float32(q, k, v, mask=None):
    """torch.softmax(..., dtype=torch.float32): float32 weights meet float64 values."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32) @ v


@bug("1.3", "mutation")
def sdpa_inverts_the_mask_in_place(q, k, v, mask=None):
    """logical_not_ on the caller's mask, to get the keys to hide."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not_(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "softmax_dim")
def sdpa_max_over_the_queries(q, k, v, mask=None):
    """A softmax by hand that subtracts each COLUMN's maximum (dim=-2): not a constant per row, so the weights
    change."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    shifted = scores - scores.amax(dim=-2, keepdim=True)
    e = shifted.exp()
    return e / e.sum(dim=-1, keepdim=True) @ v


@bug("1.3", "gradient")
def sdpa_zeroes_hidden_weights_in_place(q, k, v, mask=None):
    """After the -inf fill, the hidden weights zeroed again "to be safe", in place on the softmax's output (which its
    backward needs)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:
        weights.masked_fill_(~mask, 0.0)
    return weights @ v


@bug("1.3", "softmax_dim")
def sdpa_column_max_then_renormalised(q, k, v, mask=None):
    """A softmax by hand over the raw scores with each COLUMN's maximum subtracted (dim=-2), the mask applied by
    zeroing the hidden exps and renormalising: no NaN, but the shift is not constant along a row."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = (scores - scores.amax(dim=-2, keepdim=True)).exp()
    if mask is not None:
        e = e * mask
    return e / e.sum(dim=-1, keepdim=True) @ v


@bug("1.3", "exception")
def sdpa_boolean_index_assign(q, k, v, mask=None):
    """scores[~mask] = -inf: needs a mask of the scores' full shape; a broadcastable one raises."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores[~mask] = float("-inf")
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "batch_mixing")
def sdpa_flattens_every_leading_axis(q, k, v, mask=None):
    """'Any leading dimensions' handled by flattening q, k and v to 2-D: every query then sees the keys of every
    sequence of the batch."""
    d, dv = q.shape[-1], v.shape[-1]
    scores = q.reshape(-1, d) @ k.reshape(-1, d).T / math.sqrt(d)          # (B*Lq, B*Lk)
    if mask is not None:
        scores = scores.masked_fill(~mask.expand(*q.shape[:-1], k.shape[-2]).reshape(-1, k.shape[-2]).repeat(
            1, scores.shape[-1] // k.shape[-2]), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.reshape(-1, dv)
    return out.reshape(*q.shape[:-1], dv)


# ============================================================================ 2.1 causal_mask

@correct("2.1")
@functools.cache
def causal_mask_lru_cached(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


@correct("2.1")
def causal_mask_by_comparing_positions(n):
    i = torch.arange(n)
    return i[:, None] - i[None, :] >= 0


@correct("2.1")
def causal_mask_from_numpy_tri(n):
    return torch.from_numpy(np.tri(n, dtype=bool))


@bug("2.1", "dtype")
def causal_mask_in_numpy(n):
    """np.tril: the right pattern, but a numpy array."""
    return np.tril(np.ones((n, n), dtype=bool))


# ============================================================================ 2.2 MaskedAttention.forward

class _Given02(nn.Module):
    """Notebook 02's constructor, exactly."""

    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", torch.ones(max_tokens, max_tokens, dtype=torch.bool).tril(), persistent=False)


@correct("2.2")
class MaskedBmmFinfoMin(_Given02):
    """torch.bmm, k.permute, softmax over dim=2 (3-D scores), finfo.min as the fill, scale from x.size(-1)."""

    def forward(self, x):
        n, length, e = x.size()
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = torch.bmm(q, k.permute(0, 2, 1)) / math.sqrt(x.size(-1))
        scores = scores.masked_fill(self.mask[:length, :length] == 0, torch.finfo(scores.dtype).min)
        weights = self.attn_dropout(F.softmax(scores, dim=2))
        return self.proj_dropout(self.proj(torch.bmm(weights, v)))


@correct("2.2")
class MaskedInPlaceFillOnScores(_Given02):
    """masked_fill_ on the scores (a new tensor), scale from the key layer's size."""

    def forward(self, x):
        length = x.shape[-2]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q.matmul(k.transpose(1, 2))
        scores.div_(math.sqrt(self.key.out_features))
        scores.masked_fill_(~self.mask[:length, :length], -math.inf)
        weights = scores.softmax(-1)
        return self.proj_dropout(self.proj(self.attn_dropout(weights).matmul(v)))


@bug("2.2", "scale")
class MaskedPowerPrecedence(_Given02):
    """`/ self.embed_dim**1/2`: divides by embed_dim / 2."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / self.embed_dim**1/2
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(torch.softmax(scores, dim=-1)) @ v))


@bug("2.2", "scale")
class MaskedScaledByMaxTokens(_Given02):
    """Scales by 1/sqrt(max_tokens), the size of the mask buffer."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.mask.shape[0])
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(torch.softmax(scores, dim=-1)) @ v))


@bug("2.2", "causal_mask")
class MaskedLengthFromLen(_Given02):
    """length = len(x): the batch size, not the number of tokens."""

    def forward(self, x):
        length = len(x)
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(torch.softmax(scores, dim=-1)) @ v))


@bug("2.2", "dropout")
class MaskedFunctionalDropoutDefaultTraining(_Given02):
    """F.dropout(weights, p) with the layer's rate but training left at its default True."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = F.dropout(torch.softmax(scores, dim=-1), p=self.attn_dropout.p)
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "dtype")
class MaskedSoftmaxForcedToFloat32(_Given02):
    """torch.softmax(..., dtype=torch.float32) "for stability": float32 weights meet float64 values."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1, dtype=torch.float32))
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "batch_mixing")
class MaskedSequenceFirstLayout(_Given02):
    """Reads x as (L, N, E), nn.MultiheadAttention's default layout: attends across the batch."""

    def forward(self, x):
        length = x.shape[0]                                         # "L" of (L, N, E): really N
        q, k, v = (layer(x).transpose(0, 1) for layer in (self.query, self.key, self.value))   # "(N, L, E)"
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        out = self.attn_dropout(torch.softmax(scores, dim=-1)) @ v
        return self.proj_dropout(self.proj(out.transpose(0, 1)))


@bug("2.2", "gradient")
class MaskedNanGuardInPlace(_Given02):
    """nan_to_num_ on the softmax's output, in place: the softmax's backward needs that tensor unchanged."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
        return self.proj_dropout(self.proj(self.attn_dropout(weights) @ v))


@correct("2.2")
class MaskedCourseCausalMaskOnDevice(_Given02):
    """A fresh causal mask from course_lib's causal_mask (exercise 2.1's, not 2.2's) on x's device."""

    def forward(self, x):
        from course_lib import causal_mask
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~causal_mask(length, device=x.device), float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(torch.softmax(scores, dim=-1)) @ v))


# ============================================================================ 3.1 / 3.2 split and merge heads

@correct("3.1")
def split_heads_the_pytorch_way(x, num_heads):
    """torch.nn.MultiheadAttention's route: sequence first, (L, N*H, hd), then back to (N, H, L, hd)."""
    n, length, e = x.shape
    t = x.transpose(0, 1).reshape(length, n * num_heads, e // num_heads).transpose(0, 1)   # (N*H, L, hd)
    return t.reshape(n, num_heads, length, e // num_heads)


@correct("3.1")
def split_heads_by_chunks(x, num_heads):
    return torch.stack(x.chunk(num_heads, dim=-1), dim=1)


@bug("3.1", "batch_mixing")
def split_heads_sequence_first(x, num_heads):
    """Reshapes as if x were (L, N, E), then permutes: right for a batch of one only."""
    n, length, e = x.shape
    return x.reshape(length, n, num_heads, e // num_heads).permute(1, 2, 0, 3)


@correct("3.2")
def merge_heads_by_unbind(x):
    return torch.cat(x.unbind(dim=1), dim=-1)


@bug("3.2", "batch_mixing")
def merge_heads_sequence_first(x):
    """Moves to (L, N, H, hd) (sequence first) and reshapes to (N, L, E): right for a batch of one only."""
    n, heads, length, head_dim = x.shape
    return x.permute(2, 0, 1, 3).reshape(n, length, heads * head_dim)


@bug("3.2", "head_split")
def merge_heads_transposes_last_two(x):
    """transpose(-1, -2) where transpose(1, 2) is meant."""
    n, heads, length, head_dim = x.shape
    return x.transpose(-1, -2).reshape(n, length, heads * head_dim)


# ============================================================================ 3.3 MultiHeadMaskedAttention.forward

class _Given03(nn.Module):
    """Notebook 03's constructor, exactly."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"num_heads: embed_dim={embed_dim} must be divisible by num_heads, got {num_heads}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", torch.ones(max_tokens, max_tokens, dtype=torch.bool).tril(), persistent=False)

    def weights_of(self, q, k, length):
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.attn_dropout(torch.softmax(scores, dim=-1))


@correct("3.3")
class MultiChunkAndUnbind(_Given03):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = (torch.stack(layer(x).chunk(self.num_heads, dim=-1), dim=1)
                   for layer in (self.query, self.key, self.value))           # (N, H, L, hd)
        out = self.weights_of(q, k, length) @ v
        return self.proj_dropout(self.proj(torch.cat(out.unbind(1), dim=-1)))


@correct("3.3")
class MultiUnflattenPermute(_Given03):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = (layer(x).unflatten(-1, (self.num_heads, -1)).permute(0, 2, 1, 3)
                   for layer in (self.query, self.key, self.value))
        scores = torch.einsum("nhqd,nhkd->nhqk", q, k) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(self.mask[:length, :length].logical_not(), torch.finfo(scores.dtype).min)
        out = torch.einsum("nhqk,nhkd->nhqd", self.attn_dropout(scores.softmax(-1)), v)
        return self.proj_dropout(self.proj(out.permute(0, 2, 1, 3).flatten(2)))


@correct("3.3")
class MultiThePyTorchWay(_Given03):
    """torch.nn.MultiheadAttention's own layout, transposed to sequence first: (N*H, L, hd) and torch.bmm."""

    def forward(self, x):
        n, length, e = x.shape
        h, hd = self.num_heads, self.head_dim
        xt = x.transpose(0, 1)                                                   # (L, N, E)
        q, k, v = (layer(xt).reshape(length, n * h, hd).transpose(0, 1) for layer in (self.query, self.key, self.value))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(hd)                 # (N*H, L, L)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        out = torch.bmm(self.attn_dropout(scores.softmax(-1)), v)                # (N*H, L, hd)
        out = out.transpose(0, 1).reshape(length, n, e).transpose(0, 1)          # (N, L, E)
        return self.proj_dropout(self.proj(out))


@correct("3.3")
class MultiWithCourseSplitAndMerge(_Given03):
    """split_heads and merge_heads from course_lib, as the notebook imports them before 3.3."""

    def forward(self, x):
        from course_lib import merge_heads, split_heads
        length = x.shape[1]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        return self.proj_dropout(self.proj(merge_heads(self.weights_of(q, k, length) @ v)))


@correct("3.3")
class MultiMaskFromOnesLikeScores(_Given03):
    """The causal mask rebuilt from torch.ones_like on one (L, L) slice of the scores: x's device, any length."""

    def forward(self, x):
        n, length, e = x.shape
        q, k, v = (layer(x).view(n, length, self.num_heads, -1).transpose(1, 2)
                   for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        allowed = torch.ones_like(scores[0, 0]).tril().bool()
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = self.attn_dropout(scores.softmax(-1)) @ v
        return self.proj_dropout(self.proj(out.transpose(1, 2).contiguous().view(n, length, e)))


class _Multi(_Given03):
    def split(self, t):
        n, length, _ = t.shape
        return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)

    def merge(self, t):
        n, _, length, _ = t.shape
        return t.transpose(1, 2).reshape(n, length, self.embed_dim)


@bug("3.3", "scale")
class MultiIntegerDivisionExponent(_Multi):
    """`self.head_dim ** (1 // 2)` is 1: no scaling."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (self.split(layer(x)) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / self.head_dim ** (1 // 2)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        out = self.attn_dropout(torch.softmax(scores, dim=-1)) @ v
        return self.proj_dropout(self.proj(self.merge(out)))


@bug("3.3", "scale")
class MultiPowerPrecedence(_Multi):
    """`/ self.head_dim**1/2`: divides by head_dim / 2."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (self.split(layer(x)) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / self.head_dim**1/2
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        out = self.attn_dropout(torch.softmax(scores, dim=-1)) @ v
        return self.proj_dropout(self.proj(self.merge(out)))


@bug("3.3", "batch_mixing")
class MultiSequenceFirstPyTorchCode(_Given03):
    """torch.nn.MultiheadAttention's code (tgt_len, bsz, embed_dim = x.shape) on batch-first x: attends across the
    batch."""

    def forward(self, x):
        tgt_len, bsz, e = x.shape                                                # really N, L, E
        h, hd = self.num_heads, self.head_dim
        q, k, v = (layer(x).reshape(tgt_len, bsz * h, hd).transpose(0, 1) for layer in (self.query, self.key, self.value))
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(hd)                 # (L*H, N, N)
        scores = scores.masked_fill(~self.mask[:tgt_len, :tgt_len], float("-inf"))
        out = torch.bmm(self.attn_dropout(scores.softmax(-1)), v)
        out = out.transpose(0, 1).reshape(tgt_len, bsz, e)
        return self.proj_dropout(self.proj(out))


@bug("3.3", "batch_mixing")
class MultiSplitSequenceFirst(_Multi):
    """Splits with reshape(L, N, H, hd).permute(1, 2, 0, 3): mixes the sequences of the batch."""

    def forward(self, x):
        n, length, e = x.shape
        q, k, v = (layer(x).reshape(length, n, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
                   for layer in (self.query, self.key, self.value))
        out = self.weights_of(q, k, length) @ v
        return self.proj_dropout(self.proj(self.merge(out)))


@bug("3.3", "head_split")
class MultiWeightsAveragedOverHeads(_Multi):
    """Averages the heads' attention weights (as nn.MultiheadAttention's average_attn_weights), then applies the one
    average to every head's values."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (self.split(layer(x)) for layer in (self.query, self.key, self.value))
        weights = self.weights_of(q, k, length).mean(dim=1, keepdim=True)
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@correct("3.3")
class MultiSoftmaxInFloat32ThenBack(_Multi):
    """Scores cast to float32 for the softmax (as Hugging Face's eager attention does), cast back to v's dtype.
    Filed right: 3.3's text sets no rule on the internal dtype, and float64 inputs lose only float32's rounding."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (self.split(layer(x)) for layer in (self.query, self.key, self.value))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).float()
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1)).type_as(v)
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@bug("3.3", "shape")
class MultiViewWithABatchOfOne(_Multi):
    """view(1, L, H, hd): written for a batch of one sequence."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (layer(x).view(1, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for layer in (self.query, self.key, self.value))
        out = self.weights_of(q, k, length) @ v
        return self.proj_dropout(self.proj(out.transpose(1, 2).reshape(1, length, self.embed_dim)))


# ============================================================================ 4.1 sinusoidal_table

@correct("4.1")
def sinusoidal_table_stacked_in_float64(max_tokens, embed_dim):
    """Angles in float64, sines and cosines interleaved by stack + flatten, returned in float32."""
    position = torch.arange(max_tokens, dtype=torch.float64)[:, None]
    frequency = torch.pow(10000.0, -torch.arange(0, embed_dim, 2, dtype=torch.float64) / embed_dim)
    angles = position * frequency
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1).float()


@correct("4.1")
def sinusoidal_table_python_loops(max_tokens, embed_dim):
    table = torch.zeros(max_tokens, embed_dim)
    for pos in range(max_tokens):
        for i in range(embed_dim // 2):
            angle = pos / 10000 ** (2 * i / embed_dim)
            table[pos, 2 * i] = math.sin(angle)
            table[pos, 2 * i + 1] = math.cos(angle)
    return table


@bug("4.1", "scale")
def sinusoidal_table_base_typo(max_tokens, embed_dim):
    """10e4 typed for 10000: the base is 100000."""
    position = torch.arange(max_tokens).float()[:, None]
    frequency = 1.0 / 10e4 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


@bug("4.1", "dtype")
def sinusoidal_table_zeros_like_positions(max_tokens, embed_dim):
    """The table made in the positions' dtype (torch.long): every sine and cosine truncated to an integer."""
    position = torch.arange(max_tokens)[:, None]
    frequency = torch.exp(torch.arange(0, embed_dim, 2) * (-math.log(10000.0) / embed_dim))
    table = torch.zeros(max_tokens, embed_dim, dtype=position.dtype)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


@bug("4.1", "scale")
def sinusoidal_table_divides_by_the_frequency(max_tokens, embed_dim):
    """pos / frequency where frequency = 1 / 10000^(2i/d) already: angles pos * 10000^(2i/d)."""
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    frequency = 1.0 / 10000 ** (torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)
    angles = position / frequency
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table


@bug("4.1", "scale")
def sinusoidal_table_integer_exponent(max_tokens, embed_dim):
    """two_i // embed_dim (floor division): every exponent 0, every frequency 1."""
    position = torch.arange(max_tokens)[:, None].float()
    two_i = torch.arange(0, embed_dim, 2)
    frequency = 1.0 / 10000 ** (two_i // embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


# ============================================================================ 5.1 lm_windows

@correct("5.1")
def lm_windows_by_index_arithmetic(ids, max_tokens):
    count = (len(ids) - 1) // max_tokens
    index = torch.arange(count)[:, None] * max_tokens + torch.arange(max_tokens + 1)   # (count, T + 1)
    chunks = ids.long()[index]
    return chunks[:, :-1], chunks[:, 1:]


@correct("5.1")
def lm_windows_while_loop(ids, max_tokens):
    inputs, targets, s = [], [], 0
    while s + max_tokens + 1 <= len(ids):
        inputs.append(ids[s:s + max_tokens].to(torch.long))
        targets.append(ids[s + 1:s + max_tokens + 1].to(torch.long))
        s += max_tokens
    return torch.stack(inputs), torch.stack(targets)


@bug("5.1", "shape")
def lm_windows_count_from_len_over_t(ids, max_tokens):
    """len(ids) // max_tokens windows, the last one clipped when it does not fit, then dropped only if empty."""
    count = len(ids) // max_tokens
    chunks = [ids[s * max_tokens:s * max_tokens + max_tokens + 1] for s in range(count)]
    chunks = [c for c in chunks if len(c) > max_tokens]
    chunks = torch.stack(chunks) if chunks else ids.new_zeros(0, max_tokens + 1)
    # pad back to count windows with the last one repeated, "so that no data is lost"
    while len(chunks) < count:
        chunks = torch.cat([chunks, chunks[-1:]])
    return chunks[:, :-1].long(), chunks[:, 1:].long()


# Before round 36a the bank held this one as right (attention_bugs.sdpa_log_mask, now made in q's dtype): mask.float()
# makes a new tensor in float32, not in q's dtype as the text asks; float64 promotes it away, bfloat16 queries meet
# it in the matmul with v (the engine's bfloat16 probe)
@bug("1.3", "dtype", "bfloat16")
def sdpa_log_mask_in_float32(q, k, v, mask=None):
    """The mask turned into an additive bias with torch.log(mask.float()): log(0) = -inf, log(1) = 0."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + torch.log(mask.float())
    return scores.softmax(dim=-1) @ v
