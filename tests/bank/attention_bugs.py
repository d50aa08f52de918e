"""Student attempts at the exercises of notebooks 01-03, correct and buggy, as students write them.

Each buggy attempt is registered with the diagnosis its checker must give; each correct attempt
must pass. Styles vary on purpose: matmul, einsum, python loops, F.scaled_dot_product_attention,
with and without a mask buffer.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Attempt:
    exercise: str
    name: str
    candidate: Any
    expected: str | None   # the diagnosis code, None for a correct attempt

    @property
    def id(self) -> str:
        return f"{self.exercise}-{self.name}"


BUGGY: list[Attempt] = []
CORRECT: list[Attempt] = []


def bug(exercise: str, expected: str) -> Callable[[Any], Any]:
    """Register a buggy function or class under its own name."""
    def register(candidate: Any) -> Any:
        BUGGY.append(Attempt(exercise, candidate.__name__, candidate, expected))
        return candidate
    return register


def correct(exercise: str) -> Callable[[Any], Any]:
    def register(candidate: Any) -> Any:
        CORRECT.append(Attempt(exercise, candidate.__name__, candidate, None))
        return candidate
    return register


# ============================================================================ 1.1 predictions (weights, result)

_E = math.e
_RIGHT = [1 / (2 + _E), _E / (2 + _E), 1 / (2 + _E)]

for _name, _weights, _result, _expected in [
    ("raw_scores", [0.0, 1.0, 0.0], 2.0, "normalization"),
    ("scaled_by_sqrt2", [0.25, 0.50, 0.25], 2.0, "scale"),
    ("not_summing_to_one", [0.2, 0.6, 0.3], 2.0, "normalization"),
    ("query_1_0", [0.67, 0.24, 0.09], 1.42, "mismatch"),
    ("uniform", [1 / 3, 1 / 3, 1 / 3], 2.0, "mismatch"),
    ("sum_of_values", _RIGHT, 6.0, "mismatch"),
    ("still_none", None, None, "not_implemented"),
    ("words", ["low", "high", "low"], 2.0, "dtype"),
    ("nan_weight", [float("nan"), 0.5, 0.5], 2.0, "nan"),
    ("two_weights", [0.5, 0.5], 2.0, "shape"),
    ("one_decimal", [0.2, 0.6, 0.2], 2.0, "precision"),
    ("one_decimal_tuple", (0.2, 0.6, 0.2), 2, "precision"),
]:
    BUGGY.append(Attempt("1.1", _name, (_weights, _result), _expected))

for _name, _weights, _result in [
    ("exact_tensor", torch.softmax(torch.tensor([0.0, 1.0, 0.0]), dim=0), torch.tensor(2.0)),
    ("rounded_list", [0.21, 0.58, 0.21], 2),
    ("numpy", np.array(_RIGHT), np.float64(2.0)),
    ("from_math_exp", [1 / (2 + math.exp(1)), math.exp(1) / (2 + math.exp(1)), 1 / (2 + math.exp(1))], 2.0),
    ("float64_tensor", torch.tensor([0.2119, 0.5761, 0.2119], dtype=torch.float64), 2.0),
]:
    CORRECT.append(Attempt("1.1", _name, (_weights, _result), None))


# ============================================================================ 1.2 toy_attention

@correct("1.2")
def toy_matmul(query, keys, values):
    scores = keys @ query
    weights = torch.softmax(scores, dim=0)
    return weights @ values


@correct("1.2")
def toy_manual_softmax(query, keys, values):
    scores = torch.einsum("nd,d->n", keys, query)
    e = torch.exp(scores - scores.max())
    weights = e / e.sum()
    return torch.tensordot(weights, values, dims=1)


@correct("1.2")
def toy_loop(query, keys, values):
    scores = torch.stack([torch.dot(key, query) for key in keys])
    weights = F.softmax(scores, dim=-1)
    out = torch.zeros_like(values[0])
    for w, value in zip(weights, values):
        out = out + w * value
    return out


@bug("1.2", "normalization")
def toy_no_softmax(query, keys, values):
    scores = keys @ query
    return scores @ values


@bug("1.2", "normalization")
def toy_exp_only(query, keys, values):
    weights = torch.exp(keys @ query)
    return weights @ values


@bug("1.2", "scale")
def toy_scaled(query, keys, values):
    weights = torch.softmax(keys @ query / math.sqrt(len(query)), dim=0)
    return weights @ values


@bug("1.2", "softmax_dim")
def toy_softmax_over_column(query, keys, values):
    weights = torch.softmax(keys @ query[:, None], dim=1)        # (n, 1)
    return (weights * values.reshape(len(values), -1)).sum(0).squeeze()


@bug("1.2", "shape")
def toy_returns_weights(query, keys, values):
    return torch.softmax(keys @ query, dim=0)


@bug("1.2", "shape")
def toy_outer_product(query, keys, values):
    weights = torch.softmax(keys @ query, dim=0)
    return (weights[:, None] * values).sum(0)


@bug("1.2", "exception")
def toy_dot_only_vectors(query, keys, values):
    weights = torch.softmax(keys @ query, dim=0)
    return torch.dot(weights, values)


@bug("1.2", "dtype")
def toy_item(query, keys, values):
    weights = torch.softmax(keys @ query, dim=0)
    return (weights @ values).item()


@bug("1.2", "mismatch")
def toy_hard_attention(query, keys, values):
    return values[torch.argmax(keys @ query)]


@bug("1.2", "mismatch")
def toy_distance(query, keys, values):
    weights = torch.softmax(-(keys @ query), dim=0)
    return weights @ values


@bug("1.2", "not_implemented")
def toy_not_written(query, keys, values):
    raise NotImplementedError("Exercise 1.2: write toy_attention")


@bug("1.2", "shape")
def toy_forgot_return(query, keys, values):
    weights = torch.softmax(keys @ query, dim=0)
    out = weights @ values   # noqa: F841


# ============================================================================ 1.3 scaled_dot_product_attention

@correct("1.3")
def sdpa_matmul(q, k, v, mask=None):
    d = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@correct("1.3")
def sdpa_einsum_where(q, k, v, mask=None):
    scores = torch.einsum("...qd,...kd->...qk", q, k) * q.size(-1) ** -0.5
    if mask is not None:
        scores = torch.where(mask, scores, torch.tensor(float("-inf")))
    weights = scores.softmax(-1)
    return torch.einsum("...qk,...kd->...qd", weights, v)


@correct("1.3")
def sdpa_fused(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@correct("1.3")
def sdpa_big_negative(q, k, v, mask=None):
    scores = torch.matmul(q, k.transpose(-1, -2)) / torch.sqrt(torch.tensor(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    return torch.matmul(F.softmax(scores, dim=-1), v)


@correct("1.3")
def sdpa_renormalise_after(q, k, v, mask=None):
    weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
    if mask is not None:
        weights = weights * mask
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v


@correct("1.3")
def sdpa_loop_over_queries(q, k, v, mask=None):
    rows = []
    for i in range(q.shape[-2]):
        s = (q[..., i:i + 1, :] @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])   # (..., 1, Lk)
        if mask is not None:
            m = mask.expand(*s.shape[:-2], q.shape[-2], k.shape[-2])[..., i:i + 1, :]
            s = s.masked_fill(m.logical_not(), float("-inf"))
        rows.append(s.softmax(dim=-1) @ v)
    return torch.cat(rows, dim=-2)


@correct("1.3")
def sdpa_manual_softmax(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    if mask is not None:
        e = e * mask
    return (e / e.sum(dim=-1, keepdim=True)) @ v


@correct("1.3")
def sdpa_log_mask(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + torch.log(mask.to(q.dtype))   # log(0) = -inf, log(1) = 0; mask.float(): search36a
    return scores.softmax(dim=-1) @ v


@bug("1.3", "nan")
def sdpa_naive_softmax(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = torch.exp(scores)
    if mask is not None:
        e = e * mask
    return e / e.sum(dim=-1, keepdim=True) @ v


@bug("1.3", "exception")
def sdpa_sum_without_keepdim(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores - scores.max())
    return (e / e.sum(dim=-1)) @ v


@bug("1.3", "softmax_dim")
def sdpa_softmax_queries(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-2) @ v


@bug("1.3", "softmax_dim")
def sdpa_softmax_no_dim(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores) @ v   # the implicit-dim warning is the bug


@bug("1.3", "softmax_dim")
def sdpa_softmax_dim1(q, k, v, mask=None):
    scores = torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("...ij,...jd->...id", scores.softmax(dim=1), v)


@bug("1.3", "scale")
def sdpa_no_scale(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "scale")
def sdpa_scale_by_d(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / q.shape[-1]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "scale")
def sdpa_scale_after_softmax(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1) / math.sqrt(q.shape[-1])
    return weights @ v


@bug("1.3", "scale")
def sdpa_scale_by_value_dim(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(v.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "causal_mask")
def sdpa_mask_not_assigned(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores.masked_fill(~mask, float("-inf"))   # result thrown away
    return scores.softmax(-1) @ v


@bug("1.3", "causal_mask")
def sdpa_mask_inverted(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "causal_mask")
def sdpa_fill_zero(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, 0)
    return scores.softmax(-1) @ v


@bug("1.3", "causal_mask")
def sdpa_fill_tiny_positive(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, 1e-9)   # meant -1e9
    return scores.softmax(-1) @ v


@bug("1.3", "normalization")
def sdpa_mask_after_softmax(q, k, v, mask=None):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    if mask is not None:
        weights = weights * mask
    return weights @ v


@bug("1.3", "causal_mask")
def sdpa_add_bool_mask(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return scores.softmax(-1) @ v


@bug("1.3", "causal_mask")
def sdpa_fused_float_mask(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.float())


@bug("1.3", "causal_mask")
def sdpa_fused_inverted(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask)


@bug("1.3", "exception")
def sdpa_plain_T(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v


@bug("1.3", "exception")
def sdpa_mask_none_unhandled(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(mask == 0, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "dtype")
def sdpa_returns_weights_too(q, k, v, mask=None):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


@bug("1.3", "shape")
def sdpa_returns_weights(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


@bug("1.3", "not_implemented")
def sdpa_not_written(q, k, v, mask=None):
    raise NotImplementedError("Exercise 1.3: write scaled_dot_product_attention")


# ============================================================================ 2.1 causal_mask

@correct("2.1")
def mask_tril(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


@correct("2.1")
def mask_compare_positions(n):
    positions = torch.arange(n)
    return positions[:, None] >= positions[None, :]


@correct("2.1")
def mask_not_triu(n):
    return ~torch.triu(torch.ones(n, n), diagonal=1).bool()


@correct("2.1")
def mask_loops(n):
    return torch.tensor([[j <= i for j in range(n)] for i in range(n)])


@correct("2.1")
def mask_equals_one(n):
    return torch.ones(n, n).tril() == 1


@bug("2.1", "causal_mask")
def mask_triu(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool))


@bug("2.1", "causal_mask")
def mask_hide_future(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)


@bug("2.1", "causal_mask")
def mask_strict(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1)


@bug("2.1", "causal_mask")
def mask_off_by_one(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=1)


@bug("2.1", "causal_mask")
def mask_all_true(n):
    return torch.ones(n, n, dtype=torch.bool)


@bug("2.1", "causal_mask")
def mask_loop_less_than(n):
    return torch.tensor([[j < i or i == j == 0 for j in range(n)] for i in range(n)])


@bug("2.1", "dtype")
def mask_float(n):
    return torch.tril(torch.ones(n, n))


@bug("2.1", "dtype")
def mask_long(n):
    return torch.ones(n, n, dtype=torch.long).tril()


@bug("2.1", "dtype")
def mask_additive(n):
    return torch.triu(torch.full((n, n), float("-inf")), diagonal=1)


@bug("2.1", "dtype")
def mask_numpy(n):
    return np.tril(np.ones((n, n), dtype=bool))


@bug("2.1", "dtype")
def mask_list(n):
    return [[j <= i for j in range(n)] for i in range(n)]


@bug("2.1", "shape")
def mask_batched(n):
    return torch.tril(torch.ones(1, n, n, dtype=torch.bool))


@bug("2.1", "exception")
def mask_wrong_arg(n):
    return torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=0, upper=False)


# ============================================================================ 3.1 split_heads

@correct("3.1")
def split_view_transpose(x, num_heads):
    n, length, embed_dim = x.shape
    return x.view(n, length, num_heads, embed_dim // num_heads).transpose(1, 2)


@correct("3.1")
def split_permute(x, num_heads):
    n, length, _ = x.shape
    return x.reshape(n, length, num_heads, -1).permute(0, 2, 1, 3)


@correct("3.1")
def split_chunks(x, num_heads):
    return torch.stack(x.chunk(num_heads, dim=-1), dim=1)


@correct("3.1")
def split_unflatten(x, num_heads):
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


@bug("3.1", "head_split")
def split_view_only(x, num_heads):
    n, length, embed_dim = x.shape
    return x.view(n, num_heads, length, embed_dim // num_heads)


@bug("3.1", "shape")
def split_no_transpose(x, num_heads):
    n, length, embed_dim = x.shape
    return x.view(n, length, num_heads, embed_dim // num_heads)


@bug("3.1", "head_split")
def split_interleaved(x, num_heads):
    n, length, embed_dim = x.shape
    return x.view(n, length, embed_dim // num_heads, num_heads).permute(0, 3, 1, 2)


@correct("3.1")
def split_transpose_first(x, num_heads):
    n, length, embed_dim = x.shape
    return x.transpose(1, 2).reshape(n, num_heads, embed_dim // num_heads, length).transpose(2, 3)


@bug("3.1", "head_split")
def split_transpose_then_reshape(x, num_heads):
    n, length, embed_dim = x.shape
    return x.transpose(1, 2).reshape(n, num_heads, length, embed_dim // num_heads)


@bug("3.1", "shape")
def split_forgot_return(x, num_heads):
    n, length, embed_dim = x.shape
    x = x.view(n, length, num_heads, embed_dim // num_heads).transpose(1, 2)


# ============================================================================ 3.2 merge_heads

@correct("3.2")
def merge_transpose_reshape(x):
    n, heads, length, head_dim = x.shape
    return x.transpose(1, 2).reshape(n, length, heads * head_dim)


@correct("3.2")
def merge_contiguous_view(x):
    n, heads, length, head_dim = x.shape
    return x.permute(0, 2, 1, 3).contiguous().view(n, length, -1)


@correct("3.2")
def merge_cat(x):
    return torch.cat(x.unbind(dim=1), dim=-1)


@correct("3.2")
def merge_flatten(x):
    return x.transpose(1, 2).flatten(start_dim=2)


@bug("3.2", "head_split")
def merge_bare_reshape(x):
    n, heads, length, head_dim = x.shape
    return x.reshape(n, length, heads * head_dim)


@bug("3.2", "exception")
def merge_view_after_transpose(x):
    n, heads, length, head_dim = x.shape
    return x.transpose(1, 2).view(n, length, heads * head_dim)


@bug("3.2", "head_split")
def merge_interleaved(x):
    n, heads, length, head_dim = x.shape
    return x.permute(0, 2, 3, 1).reshape(n, length, heads * head_dim)


@bug("3.2", "shape")
def merge_not_flattened(x):
    return x.transpose(1, 2)


@bug("3.2", "shape")
def merge_along_sequence(x):
    return torch.cat(x.unbind(dim=1), dim=1)


# ============================================================================ 2.2 MaskedAttention

class GivenMaskedAttention(nn.Module):
    """The constructor notebook 02 gives; students write forward."""

    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.max_tokens = max_tokens
        self.dropout_rate = dropout_rate
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", torch.ones(max_tokens, max_tokens, dtype=torch.bool).tril(),
                             persistent=False)


class _MaskedBase(GivenMaskedAttention):
    """Shared steps for the buggy variants below: each overrides one piece."""

    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)

    def masked(self, scores, length):
        return scores.masked_fill(~self.mask[:length, :length], float("-inf"))

    def normalise(self, scores):
        return torch.softmax(scores, dim=-1)

    def forward(self, x):
        n, length, _ = x.shape
        q, k, v = self.query(x), self.key(x), self.value(x)            # (N, L, E)
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(weights @ v))


@correct("2.2")
class MaskedMatmul(_MaskedBase):
    pass


@correct("2.2")
class MaskedEinsum(GivenMaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = torch.einsum("nqe,nke->nqk", q, k) * self.embed_dim ** -0.5
        scores = torch.where(self.mask[:length, :length], scores, float("-inf"))
        weights = self.attn_dropout(F.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(torch.einsum("nqk,nke->nqe", weights, v)))


@correct("2.2")
class MaskedFused(GivenMaskedAttention):
    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout_rate if self.training else 0.0)
        return self.proj_dropout(self.proj(out))


@correct("2.2")
class MaskedLoopOverPositions(GivenMaskedAttention):
    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        outputs = []
        for i in range(x.shape[1]):
            s = q[:, i:i + 1] @ k[:, :i + 1].transpose(1, 2) / math.sqrt(self.embed_dim)   # (N, 1, i+1)
            w = self.attn_dropout(torch.softmax(s, dim=-1))
            outputs.append(w @ v[:, :i + 1])
        return self.proj_dropout(self.proj(torch.cat(outputs, dim=1)))


@correct("2.2")
class MaskedNoBuffer(nn.Module):
    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.dropout_rate = dropout_rate

    def forward(self, x):
        n, length, embed_dim = x.shape
        scores = self.query(x) @ self.key(x).mT / embed_dim ** 0.5
        future = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(future, -1e9)
        weights = F.dropout(scores.softmax(-1), self.dropout_rate, training=self.training)
        out = self.proj(weights @ self.value(x))
        return F.dropout(out, self.dropout_rate, training=self.training)


@correct("2.2")
class MaskedRenormalise(_MaskedBase):
    def masked(self, scores, length):
        return scores

    def normalise(self, scores):
        length = scores.shape[-1]
        weights = torch.softmax(scores, dim=-1) * self.mask[:length, :length]
        return weights / weights.sum(-1, keepdim=True)


@correct("2.2")
class MaskedSmallNegative(_MaskedBase):
    def masked(self, scores, length):
        return scores.masked_fill(self.mask[:length, :length] == False, -1e4)


@correct("2.2")
class MaskedIndexAssign(_MaskedBase):
    def masked(self, scores, length):
        scores = scores.clone()
        scores[:, ~self.mask[:length, :length]] = float("-inf")
        return scores


@bug("2.2", "mismatch")
class MaskedSwappedQK(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(k, q), length)))
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "values")
class MaskedInputAsValues(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(self.query(x), self.key(x)), length)))
        return self.proj_dropout(self.proj(weights @ x))


@bug("2.2", "softmax_dim")
class MaskedSoftmaxQueries(_MaskedBase):
    def normalise(self, scores):
        return torch.softmax(scores, dim=1)


@bug("2.2", "softmax_dim")
class MaskedSoftmaxNoDim(_MaskedBase):
    def normalise(self, scores):
        return F.softmax(scores)


@bug("2.2", "scale")
class MaskedNoScale(_MaskedBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1)


@bug("2.2", "scale")
class MaskedScaleByE(_MaskedBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / self.embed_dim


@bug("2.2", "scale")
class MaskedScaleAfter(_MaskedBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1)

    def normalise(self, scores):
        return torch.softmax(scores, dim=-1) / math.sqrt(self.embed_dim)


@bug("2.2", "causal_mask")
class MaskedNoMask(_MaskedBase):
    def masked(self, scores, length):
        return scores


@bug("2.2", "causal_mask")
class MaskedTriu(_MaskedBase):
    def masked(self, scores, length):
        mask = torch.triu(torch.ones(length, length)).bool()
        return scores.masked_fill(~mask, float("-inf"))


@bug("2.2", "causal_mask")
class MaskedInverted(_MaskedBase):
    def masked(self, scores, length):
        return scores.masked_fill(self.mask[:length, :length], float("-inf"))


@bug("2.2", "causal_mask")
class MaskedFillZero(_MaskedBase):
    def masked(self, scores, length):
        return scores.masked_fill(self.mask[:length, :length] == 0, 0.0)


@bug("2.2", "normalization")
class MaskedAfterSoftmax(_MaskedBase):
    def masked(self, scores, length):
        return scores

    def normalise(self, scores):
        length = scores.shape[-1]
        return torch.softmax(scores, dim=-1).masked_fill(~self.mask[:length, :length], 0.0)


@bug("2.2", "causal_mask")
class MaskedWrongCorner(_MaskedBase):
    def masked(self, scores, length):
        return scores.masked_fill(~self.mask[:length, -length:], float("-inf"))


@bug("2.2", "shape")
class MaskedFullMask(_MaskedBase):
    def masked(self, scores, length):
        return scores.masked_fill(~self.mask, float("-inf"))


@bug("2.2", "dropout")
class MaskedDropoutAlways(_MaskedBase):
    def normalise(self, scores):
        return F.dropout(torch.softmax(scores, dim=-1), self.dropout_rate, training=True)


@bug("2.2", "dropout")
class MaskedNoDropout(GivenMaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj(scores.softmax(-1) @ v)


@bug("2.2", "causal_mask")
class MaskedFusedNotCausal(GivenMaskedAttention):
    def forward(self, x):
        out = F.scaled_dot_product_attention(self.query(x), self.key(x), self.value(x))
        return self.proj(out)


@bug("2.2", "causal_mask")
class MaskedLoopOneAhead(GivenMaskedAttention):
    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        outputs = []
        for i in range(x.shape[1]):
            s = q[:, i:i + 1] @ k[:, :i + 2].transpose(1, 2) / math.sqrt(self.embed_dim)
            outputs.append(torch.softmax(s, dim=-1) @ v[:, :i + 2])
        return self.proj(torch.cat(outputs, dim=1))


@bug("2.2", "mismatch")
class MaskedNoProj(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        return self.normalise(self.masked(self.scores(q, k), length)) @ v


@bug("2.2", "shape")
class MaskedWithBias(_MaskedBase):
    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__(embed_dim, max_tokens, dropout_rate)
        self.query = nn.Linear(embed_dim, embed_dim)


@bug("2.2", "shape")
class MaskedRenamed(nn.Module):
    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.W_q = nn.Linear(embed_dim, embed_dim, bias=False)
        self.W_k = nn.Linear(embed_dim, embed_dim, bias=False)
        self.W_v = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x):
        return self.proj(F.scaled_dot_product_attention(self.W_q(x), self.W_k(x), self.W_v(x), is_causal=True))


@bug("2.2", "dtype")
class MaskedReturnsWeights(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = self.normalise(self.masked(self.scores(q, k), length))
        return self.proj(weights @ v), weights


@bug("2.2", "not_implemented")
class MaskedNotWritten(GivenMaskedAttention):
    def forward(self, x):
        raise NotImplementedError("Exercise 2.2: write MaskedAttention.forward")


# ============================================================================ 3.3 MultiHeadMaskedAttention

class GivenMultiHeadAttention(nn.Module):
    """The constructor notebook 03 gives; students write forward."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.max_tokens = max_tokens
        self.dropout_rate = dropout_rate
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", torch.ones(max_tokens, max_tokens, dtype=torch.bool).tril(),
                             persistent=False)


class _MultiBase(GivenMultiHeadAttention):
    """Shared steps for the buggy variants below: each overrides one piece."""

    def split(self, t):
        n, length, _ = t.shape
        return t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)   # (N, h, L, hd)

    def merge(self, t):
        n, _, length, _ = t.shape
        return t.transpose(1, 2).reshape(n, length, self.embed_dim)               # (N, L, E)

    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)

    def masked(self, scores, length):
        return scores.masked_fill(~self.mask[:length, :length], float("-inf"))

    def normalise(self, scores):
        return torch.softmax(scores, dim=-1)

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@correct("3.3")
class MultiMatmul(_MultiBase):
    pass


@correct("3.3")
class MultiFused(GivenMultiHeadAttention):
    def forward(self, x):
        n, length, embed_dim = x.shape
        q, k, v = (t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (self.query(x), self.key(x), self.value(x)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout_rate if self.training else 0.0)
        out = out.transpose(1, 2).contiguous().view(n, length, embed_dim)
        return self.proj_dropout(self.proj(out))


@correct("3.3")
class MultiEinsum(GivenMultiHeadAttention):
    def forward(self, x):
        n, length, _ = x.shape
        q = self.query(x).reshape(n, length, self.num_heads, self.head_dim)
        k = self.key(x).reshape(n, length, self.num_heads, self.head_dim)
        v = self.value(x).reshape(n, length, self.num_heads, self.head_dim)
        scores = torch.einsum("nqhd,nkhd->nhqk", q, k) / self.head_dim ** 0.5
        scores = scores.masked_fill(self.mask[:length, :length].logical_not(), float("-inf"))
        weights = self.attn_dropout(scores.softmax(dim=-1))
        out = torch.einsum("nhqk,nkhd->nqhd", weights, v).reshape(n, length, self.embed_dim)
        return self.proj_dropout(self.proj(out))


@correct("3.3")
class MultiLoopOverHeads(GivenMultiHeadAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        mask = torch.tril(torch.ones(length, length, device=x.device)) == 0
        heads = []
        for h in range(self.num_heads):
            cols = slice(h * self.head_dim, (h + 1) * self.head_dim)
            s = q[..., cols] @ k[..., cols].transpose(1, 2) / math.sqrt(self.head_dim)
            w = self.attn_dropout(torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1))
            heads.append(w @ v[..., cols])
        return self.proj_dropout(self.proj(torch.cat(heads, dim=-1)))


@correct("3.3")
class MultiRenormalise(_MultiBase):
    def masked(self, scores, length):
        return scores

    def normalise(self, scores):
        length = scores.shape[-1]
        weights = torch.softmax(scores, dim=-1).masked_fill(~self.mask[:length, :length], 0.0)
        return weights / weights.sum(dim=-1, keepdim=True)


@correct("3.3")
class MultiFunctionalDropout(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.num_heads, self.p = num_heads, dropout_rate
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x):
        n, length, embed_dim = x.shape
        split = lambda t: t.unflatten(-1, (self.num_heads, -1)).permute(0, 2, 1, 3)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
        allowed = torch.arange(length, device=x.device)[:, None] >= torch.arange(length, device=x.device)
        scores = torch.where(allowed, scores, torch.full_like(scores, -1e9))
        weights = F.dropout(scores.softmax(-1), self.p, self.training)
        out = torch.matmul(weights, v).permute(0, 2, 1, 3).flatten(2)
        return F.dropout(self.proj(out), self.p, self.training)


@bug("3.3", "dropout")   # step 4 of the spec puts self.attn_dropout on the weights
class MultiOnlyOutputDropout(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        weights = self.normalise(self.masked(self.scores(q, k), length))
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@bug("3.3", "scale")
class MultiScaleTimes(_MultiBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) * math.sqrt(self.head_dim)


@bug("3.3", "causal_mask")
class MultiMaskTransposed(_MultiBase):
    def masked(self, scores, length):
        return scores.masked_fill(~self.mask[:length, :length].T, float("-inf"))


@bug("3.3", "softmax_dim")
class MultiSoftmaxQueriesEmbedScale(_MultiBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)

    def normalise(self, scores):
        return scores.softmax(dim=2)


@bug("3.3", "head_split")
class MultiViewNoTranspose(_MultiBase):
    def split(self, t):
        n, length, _ = t.shape
        return t.view(n, self.num_heads, length, self.head_dim)


@bug("3.3", "head_split")
class MultiMergeBareReshape(_MultiBase):
    def merge(self, t):
        n, _, length, _ = t.shape
        return t.reshape(n, length, self.embed_dim)


@bug("3.3", "head_split")
class MultiNoTransposeAnywhere(_MultiBase):
    def split(self, t):
        return t.reshape(t.shape[0], self.num_heads, t.shape[1], self.head_dim)

    def merge(self, t):
        return t.reshape(t.shape[0], t.shape[2], self.embed_dim)


@bug("3.3", "head_split")
class MultiInterleaved(_MultiBase):
    def split(self, t):
        n, length, _ = t.shape
        return t.view(n, length, self.head_dim, self.num_heads).permute(0, 3, 1, 2)


@bug("3.3", "head_split")
class MultiOneBigHead(GivenMultiHeadAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(1, 2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj(self.attn_dropout(scores.softmax(-1)) @ v)


@bug("3.3", "head_split")
class MultiSameSliceEveryHead(GivenMultiHeadAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        mask = torch.tril(torch.ones(length, length, dtype=torch.bool))
        heads = []
        for h in range(self.num_heads):
            cols = slice(0, self.head_dim)   # should move with h
            s = q[..., cols] @ k[..., cols].transpose(1, 2) / math.sqrt(self.head_dim)
            w = self.attn_dropout(torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1))
            heads.append(w @ v[..., h * self.head_dim:(h + 1) * self.head_dim])
        return self.proj(torch.cat(heads, dim=-1))


@bug("3.3", "scale")
class MultiScaleEmbedDim(_MultiBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)


@bug("3.3", "scale")
class MultiNoScale(_MultiBase):
    def scores(self, q, k):
        return torch.einsum("nhqd,nhkd->nhqk", q, k)


@bug("3.3", "scale")
class MultiLoopScaleEmbedDim(GivenMultiHeadAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        heads = []
        for h in range(self.num_heads):
            cols = slice(h * self.head_dim, (h + 1) * self.head_dim)
            s = q[..., cols] @ k[..., cols].transpose(1, 2) / self.embed_dim ** 0.5
            s = s.masked_fill(~self.mask[:length, :length], float("-inf"))
            heads.append(self.attn_dropout(s.softmax(-1)) @ v[..., cols])
        return self.proj_dropout(self.proj(torch.cat(heads, dim=-1)))


@bug("3.3", "softmax_dim")
class MultiSoftmaxQueries(_MultiBase):
    def normalise(self, scores):
        return torch.softmax(scores, dim=-2)


@bug("3.3", "softmax_dim")
class MultiSoftmaxHeads(_MultiBase):
    def normalise(self, scores):
        return torch.softmax(scores, dim=1)


@bug("3.3", "causal_mask")
class MultiNoMask(_MultiBase):
    def masked(self, scores, length):
        return scores


@bug("3.3", "causal_mask")
class MultiFusedNotCausal(GivenMultiHeadAttention):
    def forward(self, x):
        n, length, embed_dim = x.shape
        q, k, v = (t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (self.query(x), self.key(x), self.value(x)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, length, embed_dim))


@bug("3.3", "causal_mask")
class MultiFillZero(_MultiBase):
    def masked(self, scores, length):
        return scores.masked_fill(~self.mask[:length, :length], 0)


@bug("3.3", "normalization")
class MultiAfterSoftmax(_MultiBase):
    def masked(self, scores, length):
        return scores

    def normalise(self, scores):
        length = scores.shape[-1]
        return torch.softmax(scores, dim=-1) * self.mask[:length, :length]


@bug("3.3", "shape")
class MultiFullMask(_MultiBase):
    def masked(self, scores, length):
        return scores.masked_fill(self.mask == 0, float("-inf"))


@bug("3.3", "shape")
class MultiFusedFullMask(GivenMultiHeadAttention):
    def forward(self, x):
        n, length, embed_dim = x.shape
        q, k, v = (t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (self.query(x), self.key(x), self.value(x)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.proj(out.transpose(1, 2).reshape(n, length, embed_dim))


@bug("3.3", "dropout")
class MultiDropoutAlways(_MultiBase):
    def normalise(self, scores):
        return F.dropout(torch.softmax(scores, dim=-1), p=self.dropout_rate, training=True)


@bug("3.3", "dropout")
class MultiFusedDropoutAlways(GivenMultiHeadAttention):
    def forward(self, x):
        n, length, embed_dim = x.shape
        q, k, v = (t.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in (self.query(x), self.key(x), self.value(x)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout_rate)
        return self.proj(out.transpose(1, 2).reshape(n, length, embed_dim))


@bug("3.3", "dropout")
class MultiNoDropout(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        weights = self.normalise(self.masked(self.scores(q, k), length))
        return self.proj(self.merge(weights @ v))


@bug("3.3", "exception")
class MultiMergeWithView(_MultiBase):
    def merge(self, t):
        n, _, length, _ = t.shape
        return t.transpose(1, 2).view(n, length, self.embed_dim)


@bug("3.3", "shape")
class MultiForgotReturn(_MultiBase):
    def forward(self, x):
        out = super().forward(x)   # noqa: F841


@bug("3.3", "not_implemented")
class MultiNotWritten(GivenMultiHeadAttention):
    def forward(self, x):
        raise NotImplementedError("Exercise 3.3: write MultiHeadMaskedAttention.forward")


# ============================================================================ issue 11: inputs changed in place,
# float64 and in-place-safe styles (each under the exercise it belongs to)

@bug("1.3", "mutation")
def sdpa_divides_q_in_place(q, k, v, mask=None):
    q /= math.sqrt(q.shape[-1])                 # changes the caller's q
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "mutation")
def sdpa_masks_k_in_place(q, k, v, mask=None):
    k.mul_(1 / math.sqrt(k.shape[-1]))          # scale folded into k, in place
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@correct("1.3")
def sdpa_in_place_on_its_own_copy(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)            # a new tensor: changing it in place is fine
    scores /= math.sqrt(q.shape[-1])
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


@correct("1.3")
def sdpa_in_float64(q, k, v, mask=None):
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.double()).to(q.dtype)   # back to the inputs' dtype


@bug("1.2", "mutation")
def toy_rescales_values_in_place(query, keys, values):
    weights = torch.softmax(keys @ query, dim=0)
    values *= weights.sum()                     # "harmless" (the sum is one), but in place
    return weights @ values


@correct("1.2")
def toy_in_float64(query, keys, values):
    weights = torch.softmax(keys.double() @ query.double(), dim=0)
    return (weights @ values.double()).to(values.dtype)


# ============================================================================ issue 11: where dropout sits (2.2, 3.3)

@bug("2.2", "dropout")
class MaskedDropoutOnMaskedScores(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = self.attn_dropout(self.masked(self.scores(q, k), length))   # -inf * 0 = NaN in training
        return self.proj_dropout(self.proj(scores.softmax(-1) @ v))


@bug("2.2", "dropout")
class MaskedDropoutOnRawScores(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = self.attn_dropout(self.scores(q, k))                        # before the mask and softmax
        return self.proj_dropout(self.proj(self.masked(scores, length).softmax(-1) @ v))


@bug("2.2", "dropout")
class MaskedDropoutBeforeProj(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = self.attn_dropout(self.masked(self.scores(q, k), length).softmax(-1))
        return self.proj(self.proj_dropout(weights @ v))                     # proj_dropout before proj


@bug("2.2", "dropout")
class MaskedOnlyWeightDropout(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = self.attn_dropout(self.masked(self.scores(q, k), length).softmax(-1))
        return self.proj(weights @ v)                                        # proj_dropout forgotten


@correct("2.2")
class MaskedFunctionalDropoutFloat64(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = (layer(x).double() for layer in (self.query, self.key, self.value))   # (N, L, E) in float64
        scores = (q @ k.transpose(1, 2)) * self.embed_dim ** -0.5
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = F.dropout(scores.softmax(-1), self.dropout_rate, training=self.training)
        out = self.proj((weights @ v).to(x.dtype))
        return F.dropout(out, self.dropout_rate, training=self.training)


@bug("3.3", "dropout")
class MultiDropoutOnMaskedScores(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = self.attn_dropout(self.masked(self.scores(q, k), length))
        return self.proj_dropout(self.proj(self.merge(self.normalise(scores) @ v)))


# ============================================================================ issue 11: values and batch mixing

@bug("2.2", "values")
class MaskedValuesFromKey(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k = self.query(x), self.key(x)
        v = self.key(x)                                                      # copy-paste slip
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(weights @ v))


@bug("3.3", "values")
class MultiValuesFromKey(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.key(x))
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@bug("3.3", "head_split")
class MultiValueSplitWithoutTranspose(_MultiBase):
    def forward(self, x):
        n, length, _ = x.shape
        q, k = self.split(self.query(x)), self.split(self.key(x))
        v = self.value(x).view(n, self.num_heads, length, self.head_dim)     # forgot the transpose for v
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@bug("3.3", "batch_mixing")
class MultiHeadsFirstReshape(_MultiBase):
    def split(self, t):
        n, length, _ = t.shape
        # positions first, then a reshape to (N, heads, L, hd): each "head" holds pieces of every sequence
        return t.transpose(0, 1).reshape(n, self.num_heads, length, self.head_dim)

    def merge(self, t):
        n, _, length, _ = t.shape
        return t.reshape(length, n, self.embed_dim).transpose(0, 1)         # (N, L, E), the inverse


@correct("3.3")
class MultiEinsumFloat64(_MultiBase):
    def forward(self, x):
        n, length, _ = x.shape
        q, k, v = (self.split(layer(x)).double() for layer in (self.query, self.key, self.value))  # (N, h, L, hd)
        scores = torch.einsum("nhqd,nhkd->nhqk", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(scores.softmax(-1))
        out = torch.einsum("nhqk,nhkd->nqhd", weights, v).reshape(n, length, self.embed_dim)   # (N, L, E)
        return self.proj_dropout(self.proj(out.to(x.dtype)))


# ============================================================================ issue 20: code that cannot learn
# Each computes the right numbers, so only the gradient probe sees it.

@bug("1.2", "gradient")
def toy_weights_under_no_grad(query, keys, values):
    with torch.no_grad():
        weights = torch.softmax(keys @ query, dim=0)
    return weights @ values


@bug("1.2", "gradient")
def toy_values_detached(query, keys, values):
    return torch.softmax(keys @ query, dim=0) @ values.detach()


@bug("1.2", "gradient")
def toy_rebuilt_from_python_numbers(query, keys, values):
    weights = torch.tensor([w.item() for w in torch.softmax(keys @ query, dim=0)])
    return weights.to(values.dtype) @ values


@correct("1.2")
def toy_written_out_softmax(query, keys, values):
    scores = keys @ query
    e = torch.exp(scores - scores.max())
    return (e / e.sum()) @ values


@bug("1.3", "gradient")
def sdpa_v_detached(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v.detach()


@bug("1.3", "gradient")
def sdpa_scores_under_no_grad(q, k, v, mask=None):
    with torch.no_grad():   # "the scores are only an intermediate step"
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "gradient")
def sdpa_key_data(q, k, v, mask=None):
    scores = q @ k.data.transpose(-2, -1) / math.sqrt(q.shape[-1])   # .data: an old idiom, cuts the graph
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@correct("1.3")
def sdpa_baddbmm_style(q, k, v, mask=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q * scale, k.transpose(-2, -1))                # scaling q first: same numbers
    if mask is not None:
        scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@bug("3.1", "gradient")
def split_detached(x, num_heads):
    n, length, embed_dim = x.shape
    return x.detach().view(n, length, num_heads, embed_dim // num_heads).transpose(1, 2)


@bug("3.2", "gradient")
def merge_through_numpy(x):
    n, heads, length, head_dim = x.shape
    merged = x.detach().numpy().transpose(0, 2, 1, 3).reshape(n, length, heads * head_dim)
    return torch.from_numpy(merged.copy())


@bug("2.2", "gradient")
class MaskedProjectionsUnderNoGrad(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        with torch.no_grad():   # copied from notebook 02's section 1, where it is right for a demonstration
            q, k, v = self.query(x), self.key(x), self.value(x)
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "gradient")
class MaskedKeyDetached(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x).detach(), self.value(x)
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(weights @ v))


@bug("3.3", "gradient")
class MultiValuesDetached(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x)).detach()
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@bug("3.3", "gradient")
class MultiProjectionWeightDetached(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(F.linear(self.merge(weights @ v), self.proj.weight.detach()))


@bug("3.3", "gradient")
class MultiProjectionsUnderNoGrad(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        with torch.no_grad():
            q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        weights = self.attn_dropout(self.normalise(self.masked(self.scores(q, k), length)))
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@bug("3.3", "gradient")
class MultiScoresInPlaceOnSavedTensor(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        weights = self.normalise(self.masked(self.scores(q, k), length))
        out = weights @ v
        weights.mul_(1.0)   # "harmless" in place: but the matmul saved weights for backward
        return self.proj_dropout(self.proj(self.merge(out)))


# ============================================================================ issue 20: dropout one-hot probes miss

@bug("3.3", "dropout")
class MultiDropoutOnMergedHeads(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        weights = self.normalise(self.masked(self.scores(q, k), length))
        merged = self.attn_dropout(self.merge(weights @ v))       # dropout on the heads' outputs, not the weights
        return self.proj_dropout(self.proj(merged))


@bug("3.3", "dropout")
class MultiDropoutOnValues(_MultiBase):
    def forward(self, x):
        length = x.shape[1]
        q, k = self.split(self.query(x)), self.split(self.key(x))
        v = self.attn_dropout(self.split(self.value(x)))          # dropout on v instead of the weights
        weights = self.normalise(self.masked(self.scores(q, k), length))
        return self.proj_dropout(self.proj(self.merge(weights @ v)))


@bug("2.2", "dropout")
class MaskedDropoutOnOutputBeforeProj(_MaskedBase):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        weights = self.normalise(self.masked(self.scores(q, k), length))
        return self.proj_dropout(self.proj(self.attn_dropout(weights @ v)))


@correct("3.3")
class MultiFusedDropoutFromModule(GivenMultiHeadAttention):
    def forward(self, x):
        n, length, _ = x.shape
        q, k, v = (layer(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for layer in (self.query, self.key, self.value))                    # (N, h, L, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.attn_dropout.p if self.training else 0.0)
        return self.proj_dropout(self.proj(out.transpose(1, 2).reshape(n, length, self.embed_dim)))


@bug("2.2", "gradient")
class MaskedOutputDetached(_MaskedBase):
    def forward(self, x):
        return super().forward(x).detach()                  # "the caller only needs the numbers"


@bug("3.3", "gradient")
class MultiWholeForwardUnderNoGrad(_MultiBase):
    @torch.no_grad()
    def forward(self, x):
        return super().forward(x)


@bug("1.3", "gradient")
def sdpa_weights_through_a_list(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.tensor(scores.softmax(-1).tolist(), dtype=q.dtype)   # rebuilt from Python numbers
    return weights @ v


# ============================================================================ the mistake rows 1.3 and the modules share
# (one table of scale rows, one of mask rows, since issue 42): a row of each that no attempt above reached

@bug("1.3", "scale")
def sdpa_scale_times_sqrt_d(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) * math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "softmax_dim")
def sdpa_softmax_over_batch(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=0) @ v


@bug("3.3", "causal_mask")
class MultiMaskHidesDiagonal(_MultiBase):
    def masked(self, scores, length):
        return scores.masked_fill(~self.mask[:length, :length].tril(-1), float("-inf"))


@bug("3.3", "scale")
class MultiScaleTimesSqrt(_MultiBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) * math.sqrt(self.head_dim)


@bug("2.2", "scale")
class MaskedScaleByEmbedDim(_MaskedBase):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / q.shape[-1]
