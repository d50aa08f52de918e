"""Round 32r: 7.1, 7.2, 9.1, 9.4 and 9.6 against a tester's attempts.

9.1: positions stretched by one factor (linspace(0, T, T), positions / T) were named as frequencies turning at the
wrong speed; one factor shared by every pair, pair 0 included, is the positions. The speed of each pair was read at
one position, where a pair that turns faster than asked had wrapped around the circle: an integer division
(2i // d, every frequency 1) showed factors of -1.42 and -142. The angles are now followed position by position,
and "every pair turns by 1 radian" is named. Angles in float32 (transformers' way) pass: the text says how the
reference computes, it does not ask for float64.

9.4: dropout in SwiGLU (the output drawn anew at each call, or right in eval mode only) was a bare mismatch.

9.6: a constructor that takes dropout_rate and head_dim (course_lib's does) is now built with them: dropout that
runs in eval mode, and a scale from embed_dim // num_heads where head_dim differs, are named.

7.1: a width written into the code (E = 768) was a bare shape error; the split is now tried at GPT-2's widths.

7.2: two attempts filed right, neither asked: one that fails on scaling=None (the text says what to do with the
`scaling` given, not what None means; the bank's hf_scaling_on_the_keys is right and does the same), and grouped keys
tiled with .repeat (the text gives key and value `heads` heads, as GPT-2 has; its own solution repeats nothing).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from course_lib.attention import causal_mask, merge_heads, scaled_dot_product_attention, split_heads
from course_lib.modern import GroupedQueryAttention, SwiGLU, apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()


def _tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


# ------------------------------------------------------------------ 9.1: positions stretched by one factor
@bug("9.1", "rope_positions", "position", "linspace")
def rope_linspace_positions(head_dim, max_tokens, theta=10000.0):
    """torch.linspace(0, max_tokens, max_tokens): end inclusive, so every position is stretched a little."""
    pos = torch.linspace(0, max_tokens, max_tokens, dtype=torch.float64)
    return _tables(torch.outer(pos, _frequencies(head_dim, theta)))


@bug("9.1", "rope_positions", "position")
def rope_positions_over_length(head_dim, max_tokens, theta=10000.0):
    """Positions normalised to [0, 1): m / max_tokens, as for a learned table of fractions."""
    pos = torch.arange(max_tokens, dtype=torch.float64) / max_tokens
    return _tables(pos[:, None] * _frequencies(head_dim, theta))


@bug("9.1", "rope_positions", "position")
def rope_positions_doubled(head_dim, max_tokens, theta=10000.0):
    """arange(0, 2 * max_tokens, 2)[:max_tokens]: the step of the frequencies' arange copied onto the positions."""
    pos = torch.arange(0, 2 * max_tokens, 2, dtype=torch.float64)
    return _tables(pos[:, None] * _frequencies(head_dim, theta))


@correct("9.1")
def rope_linspace_to_last(head_dim, max_tokens, theta=10000.0):
    """torch.linspace(0, max_tokens - 1, max_tokens): the positions 0 .. max_tokens-1 exactly."""
    pos = torch.linspace(0, max_tokens - 1, max_tokens, dtype=torch.float64)
    return _tables(torch.outer(pos, _frequencies(head_dim, theta)))


# ------------------------------------------------------------------ 9.1: every frequency 1
@bug("9.1", "rope_frequencies", "integer division", avoids=("-1.42", "-14.2"))
def rope_integer_division(head_dim, max_tokens, theta=10000.0):
    """arange(0, d, 2) // d: integer division makes every exponent 0, so every pair turns at speed 1."""
    inv = theta ** -(torch.arange(0, head_dim, 2) // head_dim).double()
    ang = torch.arange(max_tokens, dtype=torch.float64)[:, None] * inv
    return _tables(ang)


@bug("9.1", "rope_frequencies", "integer division")
def rope_floor_division_of_pair(head_dim, max_tokens, theta=10000.0):
    """(2 * i) // head_dim with i the pair index: 0 for every pair, so theta ** 0 = 1 everywhere."""
    i = torch.arange(head_dim // 2)
    inv = 1.0 / theta ** ((2 * i) // head_dim).to(torch.float64)
    return _tables(torch.arange(max_tokens, dtype=torch.float64)[:, None] * inv)


@bug("9.1", "rope_frequencies", "times its speed", avoids=("pair 1: -", "pair 2: -", "pair 3: -"))
def rope_exponent_over_four(head_dim, max_tokens, theta=10000.0):
    """2i / (4d): every pair but 0 turns faster than asked, past a half turn per position for none of them."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv = theta ** (-2 * i / (4 * head_dim))
    return _tables(torch.arange(max_tokens, dtype=torch.float64)[:, None] * inv)


# ------------------------------------------------------------------ 9.1: float32 angles (not asked)
@correct("9.1")
def rope_all_float32(head_dim, max_tokens, theta=10000.0):
    """transformers' way, all in float32: the text says the reference computes in float64, it does not ask it."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.arange(max_tokens, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


# ------------------------------------------------------------------ 9.4: dropout
@bug("9.4", "dropout", "dropout")
class SwiGLUWithDropout(SwiGLU):
    """GPT-2's MLP habit: dropout 0.1 on the hidden product, in training mode (the layer has no dropout)."""
    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x)
        return self.down(F.dropout(h, p=0.1, training=self.training))


@bug("9.4", "dropout", "dropout")
class SwiGLUDropoutAlways(SwiGLU):
    """F.dropout on the output without training=: F.dropout's default is training=True, so it is always on."""
    def forward(self, x):
        return F.dropout(self.down(F.silu(self.gate(x)) * self.up(x)), 0.1)


@bug("9.4", "dropout", "dropout")
class SwiGLUDropoutModule(SwiGLU):
    """An nn.Dropout(0.2) added in the constructor, on the gate: it follows train()/eval(), but SwiGLU has none."""
    def __init__(self, embed_dim, hidden_dim):
        super().__init__(embed_dim, hidden_dim)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.down(self.drop(F.silu(self.gate(x))) * self.up(x))


@correct("9.4")
class SwiGLUDropoutZero(SwiGLU):
    """nn.Dropout(0.0) kept from a template: it drops nothing."""
    def __init__(self, embed_dim, hidden_dim):
        super().__init__(embed_dim, hidden_dim)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))


# ------------------------------------------------------------------ 9.6: dropout in eval mode, head_dim
def _proj(self, x, start):
    q = split_heads(self.query(x), self.num_heads)
    k = split_heads(self.key(x), self.num_kv_heads)
    v = split_heads(self.value(x), self.num_kv_heads)
    if self.q_norm is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
    k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
    return q, k, v


def _mask(self, start, total, device):
    mask = causal_mask(total, device=device)[start:total]
    if self.sliding_window is not None:
        i = torch.arange(start, total, device=device)[:, None]
        j = torch.arange(total, device=device)[None, :]
        mask = mask & (i - j < self.sliding_window)
    return mask


def _attend(self, x, cache, **sdpa):
    start = 0 if cache is None else cache.length
    q, k, v = _proj(self, x, start)
    if cache is not None:
        k, v = cache.append(k, v)
    k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(self, start, k.shape[2], x.device), **sdpa)
    return self.proj(merge_heads(out))


@bug("9.6", "dropout", "dropout", "eval")
class GQADropoutAlways(GroupedQueryAttention):
    """dropout_p=self.dropout_rate passed to F.sdpa without checking self.training: dropout in eval mode too."""
    def forward(self, x, cache=None):
        return _attend(self, x, cache, dropout_p=self.dropout_rate)


@bug("9.6", "dropout", "dropout", "eval")
class GQADropoutOnOutput(GroupedQueryAttention):
    """F.dropout(out, self.dropout_rate) after the projection: F.dropout's training defaults to True."""
    def forward(self, x, cache=None):
        return F.dropout(_attend(self, x, cache), self.dropout_rate)


@correct("9.6")
class GQADropoutInTraining(GroupedQueryAttention):
    """dropout_p=self.dropout_rate if self.training else 0.0: the reference's way."""
    def forward(self, x, cache=None):
        return _attend(self, x, cache, dropout_p=self.dropout_rate if self.training else 0.0)


@bug("9.6", "scale", "head_dim")
class GQAScaleFromEmbedDim(GroupedQueryAttention):
    """Scores scaled by 1/sqrt(embed_dim // num_heads): wrong for a layer built with an explicit head_dim."""
    def forward(self, x, cache=None):
        return _attend(self, x, cache, scale=1.0 / math.sqrt(self.embed_dim // self.num_heads))


@bug("9.6", "scale", "head_dim")
class GQAScaleFromProjection(GroupedQueryAttention):
    """The scale from the projection's width over the heads, computed by hand with einsum: embed_dim // heads."""
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k, v = _proj(self, x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        scores = torch.einsum("nhld,nhtd->nhlt", q, k) / (x.shape[-1] // self.num_heads) ** 0.5
        scores = scores.masked_fill(~_mask(self, start, k.shape[2], x.device), float("-inf"))
        return self.proj(merge_heads(scores.softmax(-1) @ v))


@correct("9.6")
class GQAScaleFromQuery(GroupedQueryAttention):
    """The scale from q.shape[-1], whatever the constructor's head_dim."""
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k, v = _proj(self, x, start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~_mask(self, start, k.shape[2], x.device), float("-inf"))
        return self.proj(merge_heads(scores.softmax(-1) @ v))


# ------------------------------------------------------------------ 7.1: a width written into the code
@bug("7.1", "shape", "written into your code", "768")
def split_gpt2_small_only(weight):
    """E = 768 written in (GPT-2 small): wrong at any other width."""
    return tuple(weight[:, i * 768:(i + 1) * 768].T for i in range(3))


@bug("7.1", "shape", "written into your code", "1024")
def split_gpt2_medium_view(weight):
    """weight.view(E, 3, E) with E = 1024 (GPT-2 medium) written in: raises at any other width."""
    return tuple(weight.view(1024, 3, 1024).permute(1, 2, 0).unbind(0))


@bug("7.1", "shape", "written into your code", "768")
def split_by_fixed_size(weight):
    """weight.split(768, dim=1): one block where the width is not 768."""
    return tuple(block.T for block in weight.split(768, dim=1))


@correct("7.1")
def split_width_from_columns(weight):
    """E read from the columns, weight.shape[1] // 3."""
    e = weight.shape[1] // 3
    return tuple(weight[:, i * e:(i + 1) * e].T for i in range(3))


# ------------------------------------------------------------------ 7.2: scaling=None, grouped keys
def _bool_mask(query, key, attention_mask):
    lq, lk = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        return torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


@correct("7.2")
def attention_scaling_none_crashes(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """scaling=None multiplies None (TypeError): not asked. The text says what to do with the `scaling` given, not
    what None means; transformers passes a number (GPT-2 always), and the bank's hf_scaling_on_the_keys does the same."""
    query = query * (scaling * query.shape[-1] ** 0.5)
    return scaled_dot_product_attention(query, key, value, _bool_mask(query, key, attention_mask)).transpose(1, 2), None


@correct("7.2")
def attention_scaling_none_from_module(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                       **kwargs):
    """scaling None: module.head_dim ** -0.5, as transformers' eager attention does; explicit scores."""
    if scaling is None:
        scaling = module.head_dim ** -0.5
    scores = query @ key.transpose(-2, -1) * scaling
    scores = scores.masked_fill(~_bool_mask(query, key, attention_mask), float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


@correct("7.2")
def attention_tiles_kv_heads(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Grouped keys tiled with .repeat (h % kv_heads): wrong for a grouped-query model, but 7.2 gives key and value
    (N, heads, Lk, d), as many heads as the query (GPT-2), and the course's own solution repeats nothing."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat(1, groups, 1, 1), value.repeat(1, groups, 1, 1)
    if scaling is not None:
        query = query * (scaling * query.shape[-1] ** 0.5)
    return scaled_dot_product_attention(query, key, value, _bool_mask(query, key, attention_mask)).transpose(1, 2), None
