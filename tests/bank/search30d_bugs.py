"""Attempts of the thirtieth search's classes C6, C7, C8: rotate_half with a sign of a half (or the order of the
halves) wrong, a mask that leaves the future weighed in 7.2 (a bool mask added, a fill that is not -inf), the key/value
heads repeated by another count than the group size. Each class with variants, and right attempts a probe for it
could refuse."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.modern import GroupedQueryAttention, apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()

_NEG = float("-inf")


# ============================================================================ C6: rotate_half's signs (9.2)

def _turned(x, cos, sin, offset, rotate_half):
    length = x.shape[-2]
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    return x * c + rotate_half(x) * s


@bug("9.2", "rope_rotation", "sign")
def apply_rotary_by_roll_without_sign(x, cos, sin, offset=0):
    length, d = x.shape[-2], x.shape[-1]
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    return x * c + x.roll(d // 2, dims=-1) * s


@bug("9.2", "rope_rotation", "sign")
def apply_rotary_minus_on_both_halves(x, cos, sin, offset=0):
    """rotate_half as cat(-x2, -x1): the sign of the second half flipped too."""
    length, half = x.shape[-2], x.shape[-1] // 2
    c, s = cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)
    return x * c + torch.cat([-x[..., half:], -x[..., :half]], -1) * s


@bug("9.2", "rope_rotation", "in place", "cat(-x2, x1)")
def apply_rotary_halves_not_swapped(x, cos, sin, offset=0):
    """rotate_half as cat(-x1, x2): the minus on the first half, and the halves left where they are."""
    x1, x2 = x.chunk(2, dim=-1)
    return _turned(x, cos, sin, offset, lambda t: torch.cat([-x1, x2], -1))


@bug("9.2", "rope_rotation", "in place", "cat(-x2, x1)")
def apply_rotary_negated_in_place(x, cos, sin, offset=0):
    """x * cos - x * sin: rotate_half(x) taken as -x, both halves negated and not swapped."""
    return _turned(x, cos, sin, offset, lambda t: -t)


@bug("9.2", "rope_rotation", "minus sign")
def apply_rotary_flip_of_the_halves(x, cos, sin, offset=0):
    """The halves swapped by a flip of the (2, d/2) view, with no sign at all: cat(x2, x1)."""
    return _turned(x, cos, sin, offset, lambda t: t.unflatten(-1, (2, -1)).flip(-2).flatten(-2))


@correct("9.2")
def apply_rotary_flip_with_sign_vector(x, cos, sin, offset=0):
    """The flip of the halves, times [-1, +1] per half: cat(-x2, x1)."""
    sign = torch.tensor([-1.0, 1.0], dtype=x.dtype, device=x.device)[:, None]
    return _turned(x, cos, sin, offset, lambda t: (t.unflatten(-1, (2, -1)).flip(-2) * sign).flatten(-2))


@correct("9.2")
def apply_rotary_by_complex_halves(x, cos, sin, offset=0):
    """The pairs (x1, x2) as complex numbers x1 + i x2, turned by e^(i angle): the same rotation."""
    length, half = x.shape[-2], x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    turn = torch.complex(cos[offset:offset + length, :half].double(), sin[offset:offset + length, :half].double())
    w = z * turn
    return torch.cat([w.real, w.imag], -1).to(x.dtype)


# ============================================================================ C7: the future still weighed (7.2)

def _hf_attention(query, key, value, attention_mask, scaling, hide):
    """Attention in transformers' layout, the mask applied by ``hide(scores, mask)``."""
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    s = hide(query @ key.transpose(-1, -2) * scaling, attention_mask)
    return (s.softmax(-1) @ value).transpose(1, 2), None


@bug("7.2", "causal_mask", "-inf")
def hf_attention_mask_as_additive_after_bool_cast(module, query, key, value, attention_mask, scaling=None,
                                                  dropout=0.0, **kwargs):
    """The bool mask turned into a float and added: True adds 1, False adds 0 (no -inf)."""
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    s = query @ key.transpose(-1, -2) * scaling + attention_mask.to(query.dtype)
    return (s.softmax(-1) @ value).transpose(1, 2), None


@bug("7.2", "causal_mask", "future", "-inf")
def hf_attention_future_filled_with_zero(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                         **kwargs):
    """The hidden scores set to 0, not -inf: the future keys still get weight."""
    return _hf_attention(query, key, value, attention_mask, scaling, lambda s, m: s.masked_fill(~m, 0.0))


@bug("7.2", "causal_mask", "future", "-inf")
def hf_attention_scores_times_mask(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                   **kwargs):
    """scores * mask: the hidden scores are zero, which the softmax still weighs."""
    return _hf_attention(query, key, value, attention_mask, scaling, lambda s, m: s * m)


@bug("7.2", "causal_mask", "-inf")
def hf_attention_padding_added_as_minus_one(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                            **kwargs):
    """Causal right without a mask (sdpa's is_causal); a given mask added as mask - 1 (0 or -1): padding leaks."""
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling)
        return out.transpose(1, 2), None
    return _hf_attention(query, key, value, attention_mask, scaling, lambda s, m: s + (m.to(s.dtype) - 1))


@bug("7.2", "causal_mask", "padding", "-inf")
def hf_attention_padding_filled_with_zero(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                          **kwargs):
    """Causal right without a mask (sdpa's is_causal); the hidden scores of a given mask set to 0, not -inf."""
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling)
        return out.transpose(1, 2), None
    return _hf_attention(query, key, value, attention_mask, scaling, lambda s, m: s.masked_fill(~m, 0.0))


@correct("7.2")
def hf_attention_float_mask_added(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The bool mask made additive first: 0 where allowed, -inf where hidden, then added."""
    return _hf_attention(query, key, value, attention_mask, scaling,
                         lambda s, m: s + torch.zeros(m.shape, dtype=s.dtype, device=s.device).masked_fill(~m, _NEG))


@correct("7.2")
def hf_attention_log_of_the_mask_added(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                       **kwargs):
    """log(mask) added: log 1 = 0 where allowed, log 0 = -inf where hidden."""
    return _hf_attention(query, key, value, attention_mask, scaling, lambda s, m: s + m.to(s.dtype).log())


@correct("7.2")
def hf_attention_where_finfo_min(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """torch.where(mask, scores, finfo.min), as transformers' eager code: exp underflows to exactly 0."""
    return _hf_attention(query, key, value, attention_mask, scaling,
                         lambda s, m: torch.where(m, s, torch.finfo(s.dtype).min))


# ============================================================================ C8: heads repeated by another count (9.6)

class _GQA(GroupedQueryAttention):
    """GQA as the notebook asks, the keys and values matched to the query heads by ``grouped``."""

    def grouped(self, t):
        return repeat_kv(t, self.groups)

    def turn(self, t, start):
        return apply_rotary(t, self.rope_cos, self.rope_sin, offset=start)

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.turn(q, start), self.turn(k, start)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        k, v = self.grouped(k), self.grouped(v)
        keep = causal_mask(total, device=x.device)[start:total]
        if self.sliding_window is not None:
            pos_q = torch.arange(start, total, device=x.device)[:, None]
            keep = keep & (pos_q - torch.arange(total, device=x.device)[None, :] < self.sliding_window)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        return self.proj(merge_heads(s.masked_fill(~keep, _NEG).softmax(-1) @ v))


@bug("9.6", "rope_rotation", "sign", "cat(-x2, x1)")
class GQARotatedWithoutTheSign(_GQA):
    """9.2's family in the module: its own rotate_half, the halves swapped by a roll with no minus, cat(x2, x1)."""

    def turn(self, t, start):
        c, s = self.rope_cos[start:start + t.shape[-2]], self.rope_sin[start:start + t.shape[-2]]
        return t * c + t.roll(self.head_dim // 2, dims=-1) * s


@bug("9.6", "kv_grouping", "groups")
class GQARepeatedByTheKvCount(_GQA):
    """repeat_kv(k, num_kv_heads) where num_heads // num_kv_heads belongs: right when they are equal."""

    def grouped(self, t):
        return repeat_kv(t, self.num_kv_heads)


@bug("9.6", "kv_grouping", "num_heads", "groups")
class GQARepeatedByTheHeadCount(_GQA):
    """repeat_interleave by num_heads: num_kv_heads * num_heads key/value heads."""

    def grouped(self, t):
        return t.repeat_interleave(self.num_heads, dim=1)


@bug("9.6", "kv_grouping", "groups")
class GQARepeatedOnceMore(_GQA):
    """groups + 1 copies of each key/value head (a count off by one)."""

    def grouped(self, t):
        return t.repeat_interleave(self.num_heads // self.num_kv_heads + 1, dim=1)


@bug("9.6", "kv_grouping", "tiles")
class GQAExpandedInTheTiledOrder(_GQA):
    """The right count, expanded on a new axis before the heads: [0, 1, 0, 1, ...], tiled."""

    def grouped(self, t):
        n, kv, length, d = t.shape
        return t[:, None].expand(n, self.groups, kv, length, d).reshape(n, kv * self.groups, length, d)


@correct("9.6")
class GQAExpandedAfterTheHeads(_GQA):
    """The right count and order: expanded on a new axis after the heads, [0, 0, 1, 1, ...]."""

    def grouped(self, t):
        n, kv, length, d = t.shape
        return t[:, :, None].expand(n, kv, self.groups, length, d).reshape(n, kv * self.groups, length, d)


@correct("9.6")
class GQAQueriesGroupedInstead(_GQA):
    """No repeat: the queries viewed as (N, kv, groups * L, d) meet their key/value head by broadcasting."""

    def grouped(self, t):
        return t

    def forward(self, x, cache=None):
        n, length, _ = x.shape
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k, v = split_heads(self.key(x), self.num_kv_heads), split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        keep = causal_mask(total, device=x.device)[start:total]
        if self.sliding_window is not None:
            pos_q = torch.arange(start, total, device=x.device)[:, None]
            keep = keep & (pos_q - torch.arange(total, device=x.device)[None, :] < self.sliding_window)
        grouped_q = q.reshape(n, self.num_kv_heads, self.groups, length, self.head_dim)
        s = grouped_q @ k[:, :, None].transpose(-2, -1) / math.sqrt(self.head_dim)   # (N, kv, groups, L, total)
        out = s.masked_fill(~keep, _NEG).softmax(-1) @ v[:, :, None]
        return self.proj(merge_heads(out.reshape(n, self.num_heads, length, self.head_dim)))
