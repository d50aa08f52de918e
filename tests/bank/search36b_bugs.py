"""Round 36b (notebooks 09, 11, 12): attempts at 9.1-9.6, 11.1-11.3 and 12.1.

Named before this round only in part, now each by its own class: 9.6 a start position kept in a global keyed by
id(cache) (``kept_state``: generations with fresh caches, each freed before the next, so a new cache gets an old
one's id), F.dropout left on in the plain class (``dropout``, not ``batch_mixing``), every cached token turned by
the one row cos[start] (``rope_positions``), mask rows one early in a cached call (``causal_mask``); 9.1 pairs
counted from 1 (``rope_frequencies``); 9.3 the mean of squares in bfloat16 (``precision``); 9.4 F.glu on
cat([gate, up]) and a quick-GELU gate (``gating``). The right attempts are other styles that must keep passing
(no repeat of k and v, a float32 softmax cast back, an additive float32 mask, roll-and-sign rotate_half,
torch.polar tables, numpy and list masks). Left out: 12.1 an lru_cached mask edited in place by a later call (the
checker names the mask it was handed, which is wrong by then: causal_mask, not kept_state; debatable).
"""
from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import new_bank
from bank.variants_bugs import _queries as _mla_queries
from course_lib import modern
from course_lib.attention import KVCache, causal_mask, merge_heads, split_heads

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ helpers as the notebook gives them

def rotate_half(x):
    """[x1, x2] -> [-x2, x1] over the last axis (given in the notebook)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin, offset=0):
    """A student's apply_rotary that passed 9.2 (the notebook then uses it in 9.6)."""
    length = x.shape[-2]
    cos = cos[offset:offset + length].to(x.dtype)
    sin = sin[offset:offset + length].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, groups):
    return x.repeat_interleave(groups, dim=1)


class NbGQA(nn.Module):
    """The notebook's given constructor of exercise 9.6 (no qk_norm, window, dropout or head_dim)."""

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
        cos, sin = modern.rope_tables(self.head_dim, max_tokens, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self):
        return KVCache(self.max_tokens)

    # the common first steps, as most students write them
    def _qkv(self, x, start):
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        return q, k, v


# ============================================================================ 9.6 right, written differently

@correct("9.6")
class GQATrilDiagonalStartEinsum(NbGQA):
    """Mask of shape (L, total) straight from tril(diagonal=start); scores with einsum; softmax by hand."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        length, total = x.shape[1], k.shape[2]
        mask = torch.ones(length, total, dtype=torch.bool, device=x.device).tril(diagonal=start)
        scores = torch.einsum("nhld,nhtd->nhlt", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        out = torch.einsum("nhlt,nhtd->nhld", weights, v)
        return self.proj(merge_heads(out))


@correct("9.6")
class GQAGroupedQueriesNoRepeat(NbGQA):
    """No repeat at all: the queries viewed as (N, kv_heads, groups, L, d) broadcast against (N, kv_heads, 1, T, d),
    which is the same sharing (query head h = kv head h // groups)."""

    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = 0 if cache is None else cache.length
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        qg = q.reshape(n, self.num_kv_heads, self.groups, length, self.head_dim)
        scores = qg @ k[:, :, None].transpose(-2, -1) * self.head_dim ** -0.5     # (N, kv, G, L, T)
        mask = causal_mask(total, device=x.device)[start:]
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ v[:, :, None]                                   # (N, kv, G, L, d)
        out = out.reshape(n, self.num_heads, length, self.head_dim)
        return self.proj(merge_heads(out))


@correct("9.6")
class GQAAdditiveMaskInQDtype(NbGQA):
    """An additive float mask (0 / -inf) made on x's device in q's dtype, passed to sdpa; rows taken from the end."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        allowed = causal_mask(total, device=x.device)[-x.shape[1]:]               # the last L rows
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(merge_heads(out))


@correct("9.6")
class GQAInlineRotationHfSoftmax(NbGQA):
    """Rotation written inline from the buffers (rows start .. start+L-1), and the softmax taken in float32 as
    Hugging Face's eager attention does (softmax(dim=-1, dtype=torch.float32).to(q.dtype))."""

    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = cache.length if cache is not None else 0
        q = self.query(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos = self.rope_cos[start:start + length].to(x.dtype)
        sin = self.rope_sin[start:start + length].to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(k, v)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        i = torch.arange(start, start + length, device=x.device)[:, None]
        j = torch.arange(k.shape[2], device=x.device)[None, :]
        scores = scores.masked_fill(j > i, torch.finfo(scores.dtype).min)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = weights @ v
        return self.proj(out.transpose(1, 2).reshape(n, length, -1))


# ============================================================================ 9.6 wrong

@bug("9.6", "scale", "sqrt(self.head_dim)")
class GQAScaleBySequenceLength(NbGQA):
    """Divides the scores by sqrt(k.shape[-2]): the number of keys, not head_dim (index slip)."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        scores = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-2])
        mask = causal_mask(k.shape[2], device=x.device)[start:]
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(merge_heads(out))


@bug("9.6", "batch_mixing")
class GQAMergePermuteMixesBatch(NbGQA):
    """Merges heads with permute(2, 0, 1, 3) -> (L, N, H, d) and reshapes that to (N, L, E): the batch and the
    positions are mixed."""

    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(k.shape[2], device=x.device)[start:]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)       # (N, H, L, d)
        out = out.permute(2, 0, 1, 3).reshape(n, length, self.embed_dim)
        return self.proj(out)


@bug("9.6", "device")
class GQAMaskKeptOnSelf(NbGQA):
    """Builds the whole (max_tokens, max_tokens) causal mask once, at the first call, on the CPU, and keeps it."""

    def forward(self, x, cache=None):
        if not hasattr(self, "_full_mask"):
            self._full_mask = torch.tril(torch.ones(self.max_tokens, self.max_tokens, dtype=torch.bool))
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        mask = self._full_mask[start:total, :total]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(merge_heads(out))


@correct("9.6")
class GQAAdditiveMaskFloat32(NbGQA):
    """An additive mask made with torch.zeros(...) in the default dtype (float32), whatever q's dtype: harmless,
    scaled_dot_product_attention accepts a float32 mask with float64, float16 and bfloat16 queries (checked)."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        bias = torch.zeros(x.shape[1], total, device=x.device)
        bias = bias.masked_fill(~causal_mask(total, device=x.device)[start:], float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(merge_heads(out))


@bug("9.6", "rope_positions")
class GQAOneRowPerCachedCall(NbGQA):
    """With a cache, assumes exactly one new token: every new token is turned by the one row cos[start]."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is None or start == 0:
            cos, sin = self.rope_cos[:x.shape[1]], self.rope_sin[:x.shape[1]]
        else:
            cos, sin = self.rope_cos[start], self.rope_sin[start]             # (head_dim,): one position
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(k.shape[2], device=x.device)[start:]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(merge_heads(out))


@bug("9.6", "kv_grouping")
class GQAQueriesGroupedTheOtherWay(NbGQA):
    """The no-repeat trick with the group axis first: q viewed as (N, groups, kv_heads, L, d), so query head h
    meets kv head h % kv_heads (the tiled order)."""

    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = 0 if cache is None else cache.length
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        qg = q.reshape(n, self.groups, self.num_kv_heads, length, self.head_dim)
        scores = qg @ k[:, None].transpose(-2, -1) * self.head_dim ** -0.5       # (N, G, kv, L, T)
        mask = causal_mask(total, device=x.device)[start:]
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, None]
        out = out.reshape(n, self.num_heads, length, self.head_dim)
        return self.proj(merge_heads(out))


@bug("9.6", "kept_state")
class GQAPositionFromGlobalCounter(NbGQA):
    """Keeps the position in a global dict keyed by the cache's id, reset when no cache is passed: a new cache
    that gets the id of a freed one continues from the old count."""

    def forward(self, x, cache=None):
        if cache is None:
            start = 0
        else:
            start = _POSITIONS.get(id(cache), 0)
            _POSITIONS[id(cache)] = start + x.shape[1]
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(k.shape[2], device=x.device)[start:]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(merge_heads(out))


_POSITIONS: dict[int, int] = {}


@bug("9.6", "gradient")
class GQAValuesThroughNumpy(NbGQA):
    """Repeats the values with numpy (np.repeat on axis 1), back to a tensor: right numbers, no gradient to
    self.value."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k = repeat_kv(k, self.groups)
        v = torch.from_numpy(np.repeat(v.detach().cpu().numpy(), self.groups, axis=1)).to(x.device)
        mask = causal_mask(k.shape[2], device=x.device)[start:]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(merge_heads(out))


@bug("9.6", "causal_mask")
class GQAMaskRowsOneEarly(NbGQA):
    """With a cache, takes the rows start-1 .. total-2 of causal_mask(total) (counting rows from 1): each new token
    no longer sees its own key. Without a cache, causal_mask(L) as in notebook 02."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        if cache is None or start == 0:
            mask = causal_mask(total, device=x.device)
        else:
            mask = causal_mask(total, device=x.device)[start - 1:total - 1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(merge_heads(out))


@bug("9.6", "dropout")
class GQAFunctionalDropoutAlwaysOn(NbGQA):
    """Adds attention dropout with F.dropout(weights, 0.1), whose training argument defaults to True: it runs in
    eval mode too."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~causal_mask(k.shape[2], device=x.device)[start:], float("-inf"))
        weights = F.dropout(scores.softmax(dim=-1), 0.1)
        return self.proj(merge_heads(weights @ v))


@bug("9.6", "dtype")
class GQASoftmaxInFloat32NotCastBack(NbGQA):
    """Takes the softmax and the weighted sum in float32 (.float()) and never casts back to x's dtype."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q, k, v = self._qkv(x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~causal_mask(k.shape[2], device=x.device)[start:], float("-inf"))
        out = scores.softmax(dim=-1) @ v.float()
        return self.proj(merge_heads(out))


@bug("9.6", "rope_frequencies")
class GQAThetaFromTablesRebuiltWithMaxTokens(NbGQA):
    """Rebuilds the tables in forward with rope_tables(head_dim, max_tokens): the module's rope_theta lost."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        cos, sin = modern.rope_tables(self.head_dim, self.max_tokens)
        cos, sin = cos.to(x.device), sin.to(x.device)
        q = apply_rotary(split_heads(self.query(x), self.num_heads), cos, sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), cos, sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(k.shape[2], device=x.device)[start:]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(merge_heads(out))


@correct("9.6")
class GQAWithCourseHelpers(NbGQA):
    """The notebook's own fallback: modern.apply_rotary and modern.repeat_kv (the next cell of the notebook picks
    them when the student's failed), is_causal for a full pass, the rows of the mask with a cache."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q = modern.apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = modern.apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = modern.repeat_kv(k, self.groups), modern.repeat_kv(v, self.groups)
        if start == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(k.shape[2], device=x.device)[start:])
        return self.proj(merge_heads(out))


# ============================================================================ 9.2 apply_rotary

@correct("9.2")
def rotary_first_half_tables_only(x, cos, sin, offset=0):
    """Uses only the first head_dim/2 columns of the tables (both halves are equal) and writes the pair out."""
    length, half = x.shape[-2], x.shape[-1] // 2
    c = cos[offset:offset + length, :half].to(x.dtype)
    s = sin[offset:offset + length, :half].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@correct("9.2")
def rotary_roll_with_sign(x, cos, sin, offset=0):
    """rotate_half as a roll by head_dim/2 times a sign vector (-1 on the first half), made like x."""
    length, d = x.shape[-2], x.shape[-1]
    sign = torch.ones(d, device=x.device, dtype=x.dtype)
    sign[: d // 2] = -1
    turned = torch.roll(x, shifts=d // 2, dims=-1) * sign
    return x * torch.narrow(cos, 0, offset, length).type_as(x) + turned * torch.narrow(sin, 0, offset, length).type_as(x)


@correct("9.2")
def rotary_upcast_to_float32(x, cos, sin, offset=0):
    """Turns in float32 (at least) and casts the result back to x's dtype, as the text asks."""
    length = x.shape[-2]
    work = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(work)
    out = xf * cos[offset:offset + length].to(work) + rotate_half(xf) * sin[offset:offset + length].to(work)
    return out.to(x.dtype)


@bug("9.2", "device")
def rotary_sign_vector_on_cpu(x, cos, sin, offset=0):
    """The roll-and-sign rotate_half with the sign vector built by torch.tensor on the CPU (dtype right)."""
    length, d = x.shape[-2], x.shape[-1]
    sign = torch.tensor([-1.0] * (d // 2) + [1.0] * (d // 2), dtype=x.dtype)
    turned = torch.roll(x, shifts=d // 2, dims=-1) * sign
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    return x * c + turned * s


@bug("9.2", "precision")
def rotary_tables_in_half(x, cos, sin, offset=0):
    """Casts the tables to float16 "to save memory" whatever x's dtype: float32/float64 x turned by rounded rows."""
    length = x.shape[-2]
    c, s = cos[offset:offset + length].half(), sin[offset:offset + length].half()
    return (x * c + rotate_half(x) * s).to(x.dtype)


_ROWS: dict = {}


@bug("9.2", "kept_state")
def rotary_rows_cached_without_tables(x, cache_cos, cache_sin, offset=0):
    """Caches the sliced rows in a global keyed by (head_dim, offset, L): tables of another theta (or device) with
    the same sizes get the old rows."""
    key = (x.shape[-1], offset, x.shape[-2])
    if key not in _ROWS:
        _ROWS[key] = (cache_cos[offset:offset + x.shape[-2]], cache_sin[offset:offset + x.shape[-2]])
    c, s = _ROWS[key]
    return x * c.to(x.dtype) + rotate_half(x) * s.to(x.dtype)


@bug("9.2", "rope_positions")
def rotary_offset_as_last_position(x, cos, sin, offset=0):
    """Reads offset as the position of the LAST token (rows offset-L+1 .. offset), clamped at 0 when that is
    negative."""
    length = x.shape[-2]
    first = max(offset - length + 1, 0)
    c, s = cos[first:first + length].to(x.dtype), sin[first:first + length].to(x.dtype)
    return x * c + rotate_half(x) * s


@bug("9.2", "rope_positions")
def rotary_offset_on_cos_only(x, cos, sin, offset=0):
    """Takes the rows from offset for cos, but sin[:L] from row 0 (the offset forgotten on the second table)."""
    length = x.shape[-2]
    c = cos[offset:offset + length].to(x.dtype)
    s = sin[:length].to(x.dtype)
    return x * c + rotate_half(x) * s


# ============================================================================ 9.3 RMSNorm

class NbRMSNorm(nn.Module):
    """The notebook's given constructor of 9.3."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


@correct("9.3")
class RMSNormTorchBuiltin(NbRMSNorm):
    """F.rms_norm in float32 with eps=self.eps, cast back to x's dtype."""

    def forward(self, x):
        out = F.rms_norm(x.float(), (self.dim,), self.weight.float(), eps=self.eps)
        return out.to(x.dtype)


@correct("9.3")
class RMSNormEinsumSquares(NbRMSNorm):
    """The mean of squares as an einsum dot product over the last axis divided by x.shape[-1]."""

    def forward(self, x):
        x32 = x.to(torch.float32)
        ms = torch.einsum("...i,...i->...", x32, x32)[..., None] / x.shape[-1]
        return (self.weight.to(torch.float32) * (x32 / torch.sqrt(ms + self.eps))).to(x.dtype)


@correct("9.3")
class RMSNormVectorNorm(NbRMSNorm):
    """sqrt(mean(x^2)) through torch.linalg.vector_norm: norm^2 / dim + eps under the root."""

    def forward(self, x):
        x32 = x.float()
        norm = torch.linalg.vector_norm(x32, ord=2, dim=-1, keepdim=True)
        rms = (norm.pow(2) / self.dim + self.eps).sqrt()
        return (x32 / rms * self.weight.float()).type_as(x)


@bug("9.3", "epsilon")
class RMSNormFNormalize(NbRMSNorm):
    """F.normalize(x) * sqrt(dim): the norm clamped at 1e-12, no self.eps at all."""

    def forward(self, x):
        x32 = x.float()
        out = F.normalize(x32, dim=-1) * math.sqrt(self.dim) * self.weight.float()
        return out.to(x.dtype)


@bug("9.3", "kept_state")
class RMSNormRunningStatistic(NbRMSNorm):
    """Like BatchNorm: keeps the root mean square of the training batches and uses it in eval mode."""

    def forward(self, x):
        x32 = x.float()
        rms = torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.training:
            self.running_rms = rms.detach()
        elif getattr(self, "running_rms", None) is not None and self.running_rms.shape == rms.shape:
            rms = self.running_rms
        return (x32 / rms * self.weight.float()).to(x.dtype)


@bug("9.3", "kept_state", "weights changed")
class RMSNormWeightCastKeptOnSelf(NbRMSNorm):
    """Keeps the float32 weight on self at the first call (a plain attribute, not a buffer): model.to(device)
    leaves it behind, and for a float16 layer it is a stale copy after a training step."""

    def forward(self, x):
        if getattr(self, "_weight32", None) is None:
            self._weight32 = self.weight.float()
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self._weight32).to(x.dtype)


@bug("9.3", "precision")
class RMSNormBfloat16Statistic(NbRMSNorm):
    """Takes the mean of squares in bfloat16 "as Llama does in 16 bits": the statistic is rounded."""

    def forward(self, x):
        ms = x.to(torch.bfloat16).pow(2).mean(-1, keepdim=True).float()
        x32 = x.float()
        return (x32 / torch.sqrt(ms + self.eps) * self.weight.float()).to(x.dtype)


@bug("9.3", "norm_statistic")
class RMSNormMeanOverSelfDimAxis(NbRMSNorm):
    """Divides the sum of squares by x.shape[1] (thinking of a (N, dim) batch)."""

    def forward(self, x):
        x32 = x.float()
        ms = x32.pow(2).sum(-1, keepdim=True) / x32.shape[1]
        return (x32 / torch.sqrt(ms + self.eps) * self.weight.float()).to(x.dtype)


@bug("9.3", "mutation")
class RMSNormDivideInPlace(NbRMSNorm):
    """x.float() then x32 /= rms: for a float32 x, .float() returns x itself, so the caller's x is divided."""

    def forward(self, x):
        x32 = x.float()
        rms = torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        x32 /= rms
        return (x32 * self.weight.float()).to(x.dtype)


@correct("9.3")
class RMSNormInFloat64(NbRMSNorm):
    """Computes in float64 (more than float32) and returns x's dtype."""

    def forward(self, x):
        x64 = x.double()
        out = x64 * torch.rsqrt(x64.square().mean(dim=-1, keepdim=True) + self.eps) * self.weight.double()
        return out.to(x.dtype)


# ============================================================================ 9.4 SwiGLU

class NbSwiGLU(nn.Module):
    def __init__(self, embed_dim, hidden_dim):
        super().__init__()
        self.gate = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, embed_dim, bias=False)


@correct("9.4")
class SwiGLUFunctionalLinearExpDivide(NbSwiGLU):
    """F.linear with the weights, and SiLU written as g / (1 + exp(-g))."""

    def forward(self, x):
        g = F.linear(x, self.gate.weight)
        u = F.linear(x, self.up.weight)
        return F.linear(g / (1 + torch.exp(-g)) * u, self.down.weight)


@bug("9.4", "gating")
class SwiGLUQuickGeluGate(NbSwiGLU):
    """The "quick GELU" g * sigmoid(1.702 g) on the gate, mistaken for SiLU."""

    def forward(self, x):
        g = self.gate(x)
        return self.down(g * torch.sigmoid(1.702 * g) * self.up(x))


@bug("9.4", "gating")
class SwiGLUGatedByUpThroughGlu(NbSwiGLU):
    """F.glu(cat([gate, up])): the first half times sigmoid of the second, so sigmoid(up) gates gate(x) and no SiLU."""

    def forward(self, x):
        return self.down(F.glu(torch.cat([self.gate(x), self.up(x)], dim=-1), dim=-1))


# ============================================================================ 9.5 repeat_kv

@correct("9.5")
def repeat_kv_stack_after_heads(x, groups):
    """stack the same x groups times on a new axis AFTER the heads, then flatten heads and groups."""
    return torch.stack([x] * groups, dim=2).flatten(1, 2)


@correct("9.5")
def repeat_kv_index_select(x, groups):
    """index_select with the head of each query head, h // groups, on x's device."""
    index = torch.arange(x.shape[1] * groups, device=x.device) // groups
    return x.index_select(1, index)


@bug("9.5", "kv_grouping")
def repeat_kv_batch_then_view(x, groups):
    """repeat_interleave along the batch (dim 0), then reshape to (N, kv * groups, L, d): heads come out tiled."""
    n, kv, length, d = x.shape
    return x.repeat_interleave(groups, dim=0).reshape(n, kv * groups, length, d)


@bug("9.5", "kv_grouping")
def repeat_kv_index_modulo(x, groups):
    """index_select with h % kv_heads."""
    index = torch.arange(x.shape[1] * groups, device=x.device) % x.shape[1]
    return x.index_select(1, index)


# ============================================================================ 9.1 rope_tables

@correct("9.1")
def rope_tables_polar(head_dim, max_tokens, theta=10000.0):
    """torch.polar on float64 angles, real and imaginary parts."""
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    freqs = theta ** (-i / head_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * freqs
    angles = torch.cat((angles, angles), dim=1)
    z = torch.polar(torch.ones_like(angles), angles)
    return z.real.float(), z.imag.float()


@correct("9.1")
def rope_tables_linspace_positions(head_dim, max_tokens, theta=10000.0):
    """Positions from linspace(0, max_tokens - 1, max_tokens): 0, 1, ..., max_tokens-1."""
    positions = torch.linspace(0, max_tokens - 1, max_tokens, dtype=torch.float64)
    freqs = 1.0 / torch.pow(torch.tensor(theta, dtype=torch.float64),
                            torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim)
    angles = torch.einsum("m,i->mi", positions, freqs).repeat(1, 2)
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


@bug("9.1", "rope_frequencies")
def rope_tables_pairs_from_one(head_dim, max_tokens, theta=10000.0):
    """Pairs counted from 1: omega_i = theta^(-2(i+1)/d), so pair 0 turns slower than one radian per token."""
    i = torch.arange(1, head_dim // 2 + 1, dtype=torch.float64)
    freqs = theta ** (-2 * i / head_dim)
    angles = torch.outer(torch.arange(max_tokens, dtype=torch.float64), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "rope_frequencies")
def rope_tables_exponent_over_half(head_dim, max_tokens, theta=10000.0):
    """Exponent i / (d/2) written as i / half ... with half = head_dim // 2 computed as head_dim / 2 - 1."""
    half = head_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    freqs = theta ** (-i / max(half - 1, 1))
    angles = torch.outer(torch.arange(max_tokens, dtype=torch.float64), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


# ============================================================================ 11.1 previous_token_score

@correct("11.1")
def previous_token_loop_stack(weights):
    """A loop over the queries 1 .. L-1, stacked, then a mean over batch and queries."""
    entries = torch.stack([weights[:, :, i, i - 1] for i in range(1, weights.shape[-1])], dim=-1)
    return entries.mean(dim=(0, 2))


@correct("11.1")
def previous_token_mask_sum(weights):
    """A selector of the subdiagonal made like the weights, summed and divided by N (L - 1)."""
    n, _, length, _ = weights.shape
    selector = torch.ones(length - 1, device=weights.device, dtype=weights.dtype).diag(-1)
    return (weights * selector).sum(dim=(0, 2, 3)) / (n * (length - 1))


@bug("11.1", "device")
def previous_token_selector_on_cpu(weights):
    """The subdiagonal selector made with torch.eye on the CPU and rolled."""
    n, _, length, _ = weights.shape
    selector = torch.eye(length, dtype=weights.dtype).roll(-1, dims=1)   # ones at (i, i-1)... and (0, L-1)
    selector[0] = 0
    return (weights * selector).sum(dim=(0, 2, 3)) / (n * (length - 1))


@bug("11.1", "score_offset")
def previous_token_eye_rolled_wrong_way(weights):
    """torch.eye rolled by +1 on the keys: ones at (i, i+1), above the diagonal (zeros in causal weights)."""
    n, _, length, _ = weights.shape
    selector = torch.eye(length, dtype=weights.dtype, device=weights.device).roll(1, dims=1)
    selector[-1] = 0
    return (weights * selector).sum(dim=(0, 2, 3)) / (n * (length - 1))


# ============================================================================ 11.2 induction_score

@correct("11.2")
def induction_slice_rows_then_diagonal(weights, half):
    """The rows of the second half, then the diagonal one above the main one: entry [i - half, i - half + 1]."""
    return weights[:, :, half:, :].diagonal(offset=1, dim1=-2, dim2=-1).mean(dim=(0, -1))


@correct("11.2")
def induction_index_arithmetic(weights, half):
    rows = torch.arange(half, weights.shape[-1], device=weights.device)
    return weights[:, :, rows, rows - half + 1].mean(dim=(0, 2))


@bug("11.2", "score_offset")
def induction_slice_rows_main_diagonal(weights, half):
    """The rows of the second half and their main diagonal: key i - half, the copy itself."""
    return weights[:, :, half:, :].diagonal(dim1=-2, dim2=-1).mean(dim=(0, -1))


@bug("11.2", "score_positions")
def induction_all_rows_of_the_diagonal(weights, half):
    """diagonal(offset=-(half - 1)) kept whole: its first entry is query half - 1, in the first half."""
    return weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1).mean(dim=(0, -1))


# ============================================================================ 11.3 ablate_head

@correct("11.3")
@contextlib.contextmanager
def ablate_head_keep_mask(model, layer, head):
    """A pre-hook multiplying proj's input by a keep-mask made like the input; returns a bare tensor."""
    attn = model.blocks[layer].attn
    d = attn.head_dim

    def hook(module, args):
        merged = args[0]
        keep = torch.ones(merged.shape[-1], device=merged.device, dtype=merged.dtype)
        keep[head * d:(head + 1) * d] = 0
        return merged * keep

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@bug("11.3", "ablation_slice")
@contextlib.contextmanager
def ablate_head_rows_of_proj(model, layer, head):
    """Zeroes the head's ROWS of proj.weight (its output features), not the columns its input comes through."""
    attn = model.blocks[layer].attn
    d = attn.head_dim
    saved = attn.proj.weight.detach().clone()
    with torch.no_grad():
        attn.proj.weight[head * d:(head + 1) * d] = 0
    try:
        yield
    finally:
        with torch.no_grad():
            attn.proj.weight.copy_(saved)


@bug("11.3", "not_restored")
@contextlib.contextmanager
def ablate_head_remove_without_finally(model, layer, head):
    attn = model.blocks[layer].attn
    d = attn.head_dim

    def hook(module, args):
        merged = args[0].clone()
        merged[..., head * d:(head + 1) * d] = 0
        return (merged,)

    handle = attn.proj.register_forward_pre_hook(hook)
    yield model
    handle.remove()


# ============================================================================ 12.1 sliding-window mask

@correct("12.1")
def sliding_xor_of_triangles(length, window, sinks=0):
    """tril XOR tril(-window): the causal triangle minus everything window or more behind; sinks OR'd in."""
    ones = torch.ones(length, length, dtype=torch.bool)
    band = torch.tril(ones) ^ torch.tril(ones, diagonal=-window)
    sink = torch.tril(ones)
    sink[:, sinks:] = False
    return band | sink


@correct("12.1")
def sliding_python_lists(length, window, sinks=0):
    rows = [[(0 <= i - j < window) or (j < sinks and j <= i) for j in range(length)] for i in range(length)]
    return torch.tensor(rows, dtype=torch.bool)


@correct("12.1")
def sliding_numpy_tri(length, window, sinks=0):
    """np.tri for the band, from_numpy at the end."""
    band = np.tri(length, length, 0, dtype=bool) & ~np.tri(length, length, -window, dtype=bool)
    cols = np.arange(length)
    sink = (cols[None, :] < sinks) & (cols[None, :] <= cols[:, None])
    return torch.from_numpy(band | sink)


@correct("12.1")
def sliding_abs_distance_and_causal(length, window, sinks=0):
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    return ((i - j).abs() < window) & (j <= i) | ((j < sinks) & (j <= i))


@bug("12.1", "causal_mask")
def sliding_sinks_one_too_many(length, window, sinks=0):
    """j <= sinks: one sink too many (and with sinks=0, key 0 is still kept as a sink)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return ((i - j >= 0) & (i - j < window)) | ((j <= sinks) & (j <= i))


@bug("12.1", "causal_mask")
def sliding_sinks_as_rows(length, window, sinks=0):
    """The sinks put on the first rows (queries) instead of the first columns (keys)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return ((i - j >= 0) & (i - j < window)) | ((i < sinks) & (j <= i))


@bug("12.1", "causal_mask")
def sliding_sinks_counted_in_window(length, window, sinks=0):
    """Window reduced by the sinks so each row holds at most window keys: 0 <= i - j < window - sinks."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    reach = max(window - sinks, 1)
    return ((i - j >= 0) & (i - j < reach)) | ((j < sinks) & (j <= i))


@correct("12.1")
def sliding_tril_then_triu(length, window, sinks=0):
    ones = torch.ones(length, length, dtype=torch.bool)
    mask = ones.tril().triu(1 - window)
    if sinks:
        mask[:, :sinks] |= ones[:, :sinks].tril()
    return mask


@bug("12.1", "causal_mask", "True")
def sliding_inverted_convention(length, window, sinks=0):
    """True where the key is HIDDEN (nn.MultiheadAttention's convention), the opposite of the course's."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = ((i - j >= 0) & (i - j < window)) | ((j < sinks) & (j <= i))
    return ~allowed


_BANDS: dict = {}


@bug("12.1", "kept_state")
def sliding_global_band_edited(length, window, sinks=0):
    """The band is kept in a global by (length, window) and the sinks are OR'd into it in place."""
    if (length, window) not in _BANDS:
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        _BANDS[(length, window)] = (i - j >= 0) & (i - j < window)
    band = _BANDS[(length, window)]
    if sinks:
        band[:, :sinks] |= torch.ones(length, min(sinks, length), dtype=torch.bool).tril()
    return band


@bug("12.1", "dtype")
def sliding_uint8_mask(length, window, sinks=0):
    """Returns the mask as uint8 (0/1) from a float computation."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    m = ((i - j >= 0) & (i - j < window)) | ((j < sinks) & (j <= i))
    return m.to(torch.uint8)


@functools.cache
def _band(length, window):
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return (i - j >= 0) & (i - j < window)


# ============================================================================ the same class in 12.2

def _mla_from(layer, x, cache, start):
    """MLA (rope_interleave=False) with the new tokens at positions start .. start + L - 1."""
    n, length, _ = x.shape
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q_nope, q_rope = _mla_queries(layer, x).split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    down = layer.kv_a_proj_with_mqa(x)
    latent = layer.kv_a_layernorm(down[..., :layer.kv_lora_rank])
    k_rope = modern.apply_rotary(down[..., layer.kv_lora_rank:], layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).reshape(n, total, h, dn + dv).permute(0, 2, 1, 3)      # (N, H, T, dn + dv)
    k = torch.cat([kv[..., :dn], k_rope.unsqueeze(1).repeat(1, h, 1, 1)], dim=-1)          # (N, H, T, dn + dr)
    allowed = torch.arange(total, device=x.device)[None, :] <= torch.arange(start, start + length,
                                                                            device=x.device)[:, None]
    out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], -1), k, kv[..., dn:], attn_mask=allowed,
                                         scale=layer.softmax_scale)                       # (N, H, L, dv)
    return layer.o_proj(out.permute(0, 2, 1, 3).flatten(2))


@correct("12.2")
def mla_start_from_cache_length(layer, x, cache=None):
    """start = cache.length: right in every generation."""
    return _mla_from(layer, x, cache, 0 if cache is None else cache.length)


_STARTS: dict[int, int] = {}


@bug("12.2", "kept_state", "id(cache)")
def mla_start_by_cache_id(layer, x, cache=None):
    """The start position counted in a global keyed by id(cache): a new cache that gets a freed one's id continues
    from its count (the generations with fresh caches show it)."""
    if cache is None:
        return _mla_from(layer, x, None, 0)
    start = _STARTS.get(id(cache), 0)
    _STARTS[id(cache)] = start + x.shape[1]
    return _mla_from(layer, x, cache, start)


# ============================================================================ 9.2 and 9.5: new tensors in x's dtype

@bug("9.2", "dtype", "float32")
def apply_rotary_tables_as_float(x, cos, sin, offset=0):
    """The table rows cast with .float() "for precision": float64 x promotes them away, float16 and bfloat16 x come
    out float32."""
    length = x.shape[-2]
    cos, sin = cos[offset:offset + length].float(), sin[offset:offset + length].float()
    return x * cos + rotate_half(x) * sin


@bug("9.5", "dtype", "float64")
def repeat_kv_into_a_new_buffer(x, groups):
    """Each key/value head copied into a buffer made with torch.empty (the default dtype): float64 heads do not fit
    into it, and torch's error of two dtypes meeting was named ``exception`` before round 36."""
    n, kv, length, d = x.shape
    out = torch.empty(n, kv * groups, length, d, device=x.device)
    for h in range(kv * groups):
        out[:, h] = x[:, h // groups]
    return out


@correct("9.5")
def repeat_kv_into_a_buffer_like_x(x, groups):
    """The same buffer made like x (x.new_empty): its dtype and device."""
    n, kv, length, d = x.shape
    out = x.new_empty(n, kv * groups, length, d)
    for h in range(kv * groups):
        out[:, h] = x[:, h // groups]
    return out
