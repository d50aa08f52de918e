"""Round 42a (notebooks 01-06): attempts at 1.1-6.2, slips pasted from the famous from-scratch tutorials.

Named by this round's fixes: 6.2 a prefill of every prompt token but the last, on a prompt of one token (a call of
no tokens), was taken for a cache started over (``no_kv_cache``): right now; 5.3 nanoGPT's zero_grad at the END of
the step, which adds gradients the model already held into its first update (``zero_grad``); 4.1 the TensorFlow
tutorial's get_angles with 2 * i for 2 * (i // 2) (``scale``), and a mismatch now names the first entry that differs,
not the largest. Karpathy's random window starts in 5.1 are ``dropout`` (something random runs), as before.
"""
from __future__ import annotations

import decimal
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import Attempt, new_bank
from course_lib.attention import MultiHeadMaskedAttention as _CourseMHA
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.model import FeedForward, LearnedPositionalEncoding, SinusoidalPositionalEncoding
from course_lib.model import TransformerBlock as _CourseBlock
from course_lib.train import lm_loss as _lm_loss

BUGGY, CORRECT, bug, correct = new_bank()
_E = math.e

# ============================================================================ 1.1 my_prediction

# scaled by sqrt(d) = sqrt(2) as in "Attention is all you need": e^(1/sqrt2) = 2.028
_s = math.exp(1 / math.sqrt(2))
BUGGY.append(Attempt("1.1", "prediction_scaled_by_sqrt_two", ([1 / (_s + 2), _s / (_s + 2), 1 / (_s + 2)], 2.0),
                     "scale", ("scal",)))
# the weights written as percentages
BUGGY.append(Attempt("1.1", "prediction_as_percentages", ([21, 58, 21], 2.0), "normalization", ("sum",)))
# the weighted sum of the KEYS (a vector) given as the result
BUGGY.append(Attempt("1.1", "prediction_result_from_the_keys", ([0.21, 0.58, 0.21], [0.0, 0.58]), "shape",
                     ("single number",)))
# right: numpy weights, numpy scalar result
CORRECT.append(Attempt("1.1", "prediction_numpy_array_and_float64",
                       (np.array([1.0, _E, 1.0]) / (_E + 2), np.float64(2.0)), None))
# right: Decimal numbers from a student who likes exact arithmetic
CORRECT.append(Attempt("1.1", "prediction_decimals",
                       ([decimal.Decimal("0.21"), decimal.Decimal("0.58"), decimal.Decimal("0.21")],
                        decimal.Decimal("2.00")), None))


# ============================================================================ 1.2 toy_attention

@correct("1.2")
def toy_alammar_loop_of_dot_products(query, keys, values):
    """Right: Jay Alammar's step by step: one dot product per key in a loop, softmax, the sum of weighted values."""
    scores = torch.stack([torch.dot(k, query) for k in keys])
    weights = F.softmax(scores, dim=-1)
    out = weights[0] * values[0]
    for i in range(1, len(keys)):
        out = out + weights[i] * values[i]
    return out


@correct("1.2")
def toy_broadcast_sum_reshaped(query, keys, values):
    """Right: scores as (keys * query).sum(-1), values flattened to (n, -1) and summed with broadcast weights."""
    weights = torch.softmax((keys * query).sum(-1), dim=-1)
    flat = values.reshape(values.shape[0], -1)
    return (weights[:, None] * flat).sum(0).reshape(values.shape[1:])


@bug("1.2", "scale", "scal")
def toy_scaled_like_the_paper(query, keys, values):
    """Wrong: divides by sqrt(d) as in the paper; the text says no scaling here."""
    weights = torch.softmax(keys @ query / math.sqrt(query.shape[-1]), dim=0)
    return weights @ values


@bug("1.2", "normalization")
def toy_karpathy_normalised_by_sum(query, keys, values):
    """Wrong: weights = scores / scores.sum() (the 'weighted average' of Karpathy's version 2 with raw scores)."""
    scores = keys @ query
    weights = scores / scores.sum()
    return weights @ values


# ============================================================================ 1.3 scaled_dot_product_attention

@bug("1.3", "dtype", "tuple")
def sdpa_annotated_transformer_returns_weights_too(q, k, v, mask=None):
    """Wrong: the Annotated Transformer's attention() pasted as is: -1e9 fill and it returns (output, p_attn)."""
    d_k = q.size(-1)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, v), p_attn


@bug("1.3", "exception")
def sdpa_d2l_bmm(q, k, v, mask=None):
    """Wrong: d2l's DotProductAttention: torch.bmm and keys.transpose(1, 2), which hold for 3-D inputs only."""
    d = q.shape[-1]
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v)


@bug("1.3", "scale", "scal")
def sdpa_alammar_divide_by_eight(q, k, v, mask=None):
    """Wrong: 'divide the scores by 8, the square root of the key size 64' from the Illustrated Transformer."""
    scores = q @ k.transpose(-2, -1) / 8
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "scale", "dv")
def sdpa_karpathy_C_from_the_values(q, k, v, mask=None):
    """Wrong: `C**-0.5` with C read from the wrong tensor (the values' width dv)."""
    C = v.shape[-1]
    wei = q @ k.transpose(-2, -1) * C ** -0.5
    if mask is not None:
        wei = wei.masked_fill(mask == 0, float("-inf"))
    return F.softmax(wei, dim=-1) @ v


@bug("1.3", "exception")
def sdpa_persson_softmax_dim_three(q, k, v, mask=None):
    """Wrong: the einsum tutorial's softmax(energy / sqrt(d), dim=3): a fixed axis, right for 4-D inputs only."""
    energy = torch.einsum("...qd,...kd->...qk", q, k)
    if mask is not None:
        energy = energy.masked_fill(mask == 0, float("-1e20"))
    attention = torch.softmax(energy / (q.shape[-1] ** 0.5), dim=3)
    return attention @ v


@correct("1.3")
def sdpa_d2l_bmm_fixed_by_flattening(q, k, v, mask=None):
    """Right: d2l's bmm, made general by flattening the leading axes (mask expanded to the scores first)."""
    lead, lq, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    lk, dv = k.shape[-2], v.shape[-1]
    q3, k3, v3 = q.reshape(-1, lq, d), k.reshape(-1, lk, d), v.reshape(-1, lk, dv)
    scores = torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d)
    if mask is not None:
        m = torch.broadcast_to(mask, (*lead, lq, lk)).reshape(-1, lq, lk)
        scores = scores.masked_fill(~m, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v3).reshape(*lead, lq, dv)


@correct("1.3")
def sdpa_torch_fused_kernel(q, k, v, mask=None):
    """Right (if lazy): torch's own F.scaled_dot_product_attention, same mask convention (True = may attend)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@correct("1.3")
def sdpa_annotated_mask_eq_zero_neg_inf(q, k, v, mask=None):
    """Right: the Annotated Transformer's function with -inf instead of -1e9 and only the output returned."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


# ============================================================================ 2.1 causal_mask

@bug("2.1", "shape", "(1,")
def causal_mask_annotated_subsequent_mask(n):
    """Wrong: the Annotated Transformer's subsequent_mask: right pattern, but shape (1, n, n)."""
    attn_shape = (1, n, n)
    subsequent = torch.triu(torch.ones(attn_shape), diagonal=1).type(torch.uint8)
    return subsequent == 0


@bug("2.1", "causal_mask", "invert")
def causal_mask_karpathy_condition(n):
    """Wrong: the condition of Karpathy's masked_fill, tril == 0, returned as the mask: True = hidden (inverted)."""
    tril = torch.tril(torch.ones(n, n))
    return tril == 0


@bug("2.1", "shape")
def causal_mask_mingpt_bias_buffer(n):
    """Wrong: minGPT's bias buffer, viewed (1, 1, n, n)."""
    return torch.tril(torch.ones(n, n)).view(1, 1, n, n).bool()


@correct("2.1")
def causal_mask_from_an_additive_float_mask(n):
    """Right: HF's additive mask (-inf above the diagonal), read back as bool."""
    additive = torch.full((n, n), float("-inf")).triu(1)
    return additive == 0


# ============================================================================ 2.2 MaskedAttention

class _Given02(nn.Module):
    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)


@correct("2.2")
class MaskedKarpathyHead(_Given02):
    """Right: Karpathy's Head.forward (B, T, C; C**-0.5; tril[:T, :T] == 0) plus the projection and dropout."""

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * C ** -0.5
        wei = wei.masked_fill(self.mask[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        wei = self.attn_dropout(wei)
        v = self.value(x)
        out = wei @ v
        return self.proj_dropout(self.proj(out))


@bug("2.2", "mismatch", "proj")
class MaskedKarpathyHeadWithoutProjection(_Given02):
    """Wrong: Karpathy's Head pasted as is: no output projection (and no proj_dropout)."""

    def forward(self, x):
        B, T, C = x.shape
        k, q, v = self.key(x), self.query(x), self.value(x)
        wei = q @ k.transpose(-2, -1) * C ** -0.5
        wei = wei.masked_fill(self.mask[:T, :T] == 0, float("-inf"))
        wei = self.attn_dropout(F.softmax(wei, dim=-1))
        return wei @ v


@bug("2.2", "dropout", "dropout")
class MaskedDropoutOnTheScores(_Given02):
    """Wrong: attn_dropout applied to the masked scores before the softmax: in training it turns some -inf into 0,
    so the future leaks, and the weights are not dropped."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(~self.mask[:T, :T], float("-inf"))
        weights = torch.softmax(self.attn_dropout(scores), dim=-1)
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "scale", "scal")
class MaskedScaledBySequenceLength(_Given02):
    """Wrong: 'the dimension of the keys' read as the number of keys: divides by sqrt(L)."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = torch.einsum("nqe,nke->nqk", q, k) / math.sqrt(T)
        scores = scores.masked_fill(~self.mask[:T, :T], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))


@correct("2.2")
class MaskedPerssonMinusOneE20(_Given02):
    """Right: the einsum tutorial's -1e20 fill on mask == 0, scaled inside the softmax call."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        energy = torch.einsum("nqe,nke->nqk", q, k)
        energy = energy.masked_fill(self.mask[:T, :T] == 0, float("-1e20"))
        attention = self.attn_dropout(torch.softmax(energy / (self.embed_dim ** (1 / 2)), dim=2))
        return self.proj_dropout(self.proj(torch.einsum("nqk,nke->nqe", attention, v)))


# ============================================================================ 3.1 split_heads

@bug("3.1", "shape")
def split_heads_d2l_transpose_qkv(x, num_heads):
    """Wrong: d2l's transpose_qkv pasted whole: the heads folded into the batch, (N * heads, L, head_dim)."""
    X = x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    X = X.permute(0, 2, 1, 3)
    return X.reshape(-1, X.shape[2], X.shape[3])


@bug("3.1", "shape", "transpose")
def split_heads_einsum_style_no_transpose(x, num_heads):
    """Wrong: the einsum tutorial keeps (N, L, heads, head_dim), which its einsum strings expect; here the head
    axis must come before the positions."""
    n, length, e = x.shape
    return x.reshape(n, length, num_heads, e // num_heads)


@bug("3.1", "exception")
def split_heads_chunks_of_positions(x, num_heads):
    """Wrong: torch.chunk along dim=1 (the positions) where the features (dim=-1) are meant, then reshaped."""
    n, length, e = x.shape
    return torch.stack(x.chunk(num_heads, dim=1), dim=1).reshape(n, num_heads, length, e // num_heads)


@correct("3.1")
def split_heads_karpathy_chunks_of_features(x, num_heads):
    """Right: each head's block of features as in Karpathy's list of Heads, stacked on a new head axis."""
    return torch.stack(x.chunk(num_heads, dim=-1), dim=1)


@correct("3.1")
def split_heads_unflatten_transpose_negative_axes(x, num_heads):
    """Right: unflatten the features, then swap axes -3 and -2."""
    return x.unflatten(-1, (num_heads, -1)).transpose(-3, -2)


# ============================================================================ 3.2 merge_heads

@correct("3.2")
def merge_heads_d2l_transpose_output(x):
    """Right: d2l's transpose_output; its first reshape is a no-op on (N, heads, L, head_dim)."""
    num_heads = x.shape[1]
    X = x.reshape(-1, num_heads, x.shape[2], x.shape[3])
    X = X.permute(0, 2, 1, 3)
    return X.reshape(X.shape[0], X.shape[1], -1)


@bug("3.2", "exception", "contiguous")
def merge_heads_nanogpt_without_contiguous(x):
    """Wrong: nanoGPT's y.transpose(1, 2).contiguous().view(B, T, C) with the .contiguous() lost."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).view(B, T, H * D)


@bug("3.2", "head_split")
def merge_heads_einsum_output_layout_nhqd(x):
    """Wrong: an einsum that keeps (N, heads, L, d) and a reshape straight to (N, L, E)."""
    n, h, length, d = x.shape
    out = torch.einsum("nhqd->nhqd", x)
    return out.reshape(n, length, h * d)


@correct("3.2")
def merge_heads_movedim_flatten(x):
    """Right: movedim(1, -2) then flatten(-2)."""
    return x.movedim(1, -2).flatten(-2)


# ============================================================================ 3.3 MultiHeadMaskedAttention

class _Given03(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError("num_heads must divide embed_dim")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)


@bug("3.3", "scale", "head_dim")
class MultiKarpathyCFromX(_Given03):
    """Wrong: Karpathy's `B, T, C = x.shape ... * C**-0.5` kept in the multi-head version: sqrt(E), not
    sqrt(head_dim)."""

    def forward(self, x):
        B, T, C = x.shape
        q = self.query(x).view(B, T, self.num_heads, -1).transpose(1, 2)
        k = self.key(x).view(B, T, self.num_heads, -1).transpose(1, 2)
        v = self.value(x).view(B, T, self.num_heads, -1).transpose(1, 2)
        wei = q @ k.transpose(-2, -1) * C ** -0.5
        wei = wei.masked_fill(self.mask[:T, :T] == 0, float("-inf"))
        wei = self.attn_dropout(F.softmax(wei, dim=-1))
        y = (wei @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj_dropout(self.proj(y))


@correct("3.3")
class MultiKarpathyListOfHeads(_Given03):
    """Right: Karpathy's MultiHeadAttention as a loop of heads, each with its slice of the weight rows."""

    def forward(self, x):
        B, T, C = x.shape
        outs = []
        for h in range(self.num_heads):
            rows = slice(h * self.head_dim, (h + 1) * self.head_dim)
            q = F.linear(x, self.query.weight[rows])
            k = F.linear(x, self.key.weight[rows])
            v = F.linear(x, self.value.weight[rows])
            wei = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
            wei = wei.masked_fill(self.mask[:T, :T] == 0, float("-inf"))
            wei = self.attn_dropout(F.softmax(wei, dim=-1))
            outs.append(wei @ v)
        return self.proj_dropout(self.proj(torch.cat(outs, dim=-1)))


@bug("3.3", "exception")
class MultiNanoGPTFourDimBias(_Given03):
    """Wrong: nanoGPT's self.bias[:, :, :T, :T] indexing on the course's 2-D mask buffer."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.query(x), self.key(x), self.value(x)
        k = k.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
        q = q.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
        v = v.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj_dropout(self.proj(y))


@correct("3.3")
class MultiNanoGPTFlashPath(_Given03):
    """Right?: nanoGPT's flash path: F.scaled_dot_product_attention(is_causal=True) with dropout_p from
    attn_dropout in training (the module's own dropout layer is not called)."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (split_heads(t, self.num_heads) for t in (self.query(x), self.key(x), self.value(x)))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.attn_dropout.p if self.training else 0, is_causal=True)
        return self.proj_dropout(self.proj(merge_heads(y)))


@bug("3.3", "scale", "head_dim")
class MultiPerssonEinsumScaledByEmbedSize(_Given03):
    """Wrong: the einsum tutorial: energy 'nqhd,nkhd->nhqk', -1e20 fill, softmax(energy / embed_size ** 0.5)."""

    def forward(self, x):
        N, L, E = x.shape
        queries = self.query(x).reshape(N, L, self.num_heads, self.head_dim)
        keys = self.key(x).reshape(N, L, self.num_heads, self.head_dim)
        values = self.value(x).reshape(N, L, self.num_heads, self.head_dim)
        energy = torch.einsum("nqhd,nkhd->nhqk", queries, keys)
        energy = energy.masked_fill(self.mask[:L, :L] == 0, float("-1e20"))
        attention = self.attn_dropout(torch.softmax(energy / (self.embed_dim ** (1 / 2)), dim=3))
        out = torch.einsum("nhql,nlhd->nqhd", attention, values).reshape(N, L, self.num_heads * self.head_dim)
        return self.proj_dropout(self.proj(out))


@correct("3.3")
class MultiAnnotatedKeepsAttnForPlots(_Given03):
    """Right: the Annotated Transformer's habit of keeping the last weights on the module (self.attn) for plots."""

    def forward(self, x):
        nbatches, L = x.shape[0], x.shape[1]
        query, key, value = [lin(x).view(nbatches, -1, self.num_heads, self.head_dim).transpose(1, 2)
                             for lin in (self.query, self.key, self.value)]
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.mask[:L, :L] == 0, float("-inf"))
        p_attn = self.attn_dropout(scores.softmax(dim=-1))
        self.attn = p_attn.detach()
        out = torch.matmul(p_attn, value).transpose(1, 2).contiguous().view(nbatches, -1, self.embed_dim)
        return self.proj_dropout(self.proj(out))


# ============================================================================ 4.1 sinusoidal_table

@bug("4.1", "scale", "exponent")
def sinusoidal_tensor2tensor_increment(max_tokens, embed_dim):
    """Wrong: tensor2tensor's timing signal (interleaved here): log_timescale_increment = log(10000) / (E/2 - 1)."""
    num_timescales = embed_dim // 2
    increment = math.log(10000.0) / max(num_timescales - 1, 1)
    inv_timescales = torch.exp(torch.arange(num_timescales, dtype=torch.float32) * -increment)
    angles = torch.arange(max_tokens, dtype=torch.float32)[:, None] * inv_timescales[None, :]
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table


@bug("4.1", "shape", "(1,")
def sinusoidal_d2l_with_batch_axis(max_tokens, embed_dim):
    """Wrong: d2l's PositionalEncoding.P: shape (1, max_len, num_hiddens)."""
    P = torch.zeros((1, max_tokens, embed_dim))
    X = torch.arange(max_tokens, dtype=torch.float32).reshape(-1, 1) / torch.pow(
        10000, torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)
    P[:, :, 0::2] = torch.sin(X)
    P[:, :, 1::2] = torch.cos(X)
    return P


@bug("4.1", "scale", "2 * (i // 2)")
def sinusoidal_tf_tutorial_without_floor_div(max_tokens, embed_dim):
    """Wrong: the TF tutorial's get_angles with 2 * i where 2 * (i // 2) is meant: every column its own frequency."""
    pos = np.arange(max_tokens)[:, np.newaxis]
    i = np.arange(embed_dim)[np.newaxis, :]
    angle_rads = pos / np.power(10000, (2 * i) / np.float32(embed_dim))
    angle_rads[:, 0::2] = np.sin(angle_rads[:, 0::2])
    angle_rads[:, 1::2] = np.cos(angle_rads[:, 1::2])
    return torch.tensor(angle_rads, dtype=torch.float32)


@correct("4.1")
def sinusoidal_tf_tutorial(max_tokens, embed_dim):
    """Right: the TF tutorial's get_angles with 2 * (i // 2), in numpy, returned as float32."""
    pos = np.arange(max_tokens)[:, np.newaxis]
    i = np.arange(embed_dim)[np.newaxis, :]
    angle_rads = pos / np.power(10000, (2 * (i // 2)) / np.float32(embed_dim))
    angle_rads[:, 0::2] = np.sin(angle_rads[:, 0::2])
    angle_rads[:, 1::2] = np.cos(angle_rads[:, 1::2])
    return torch.from_numpy(angle_rads).float()


@correct("4.1")
def sinusoidal_annotated_transformer(max_tokens, embed_dim):
    """Right: the Annotated Transformer's PositionalEncoding, int64 positions, exp(-log(10000)/d) frequencies."""
    pe = torch.zeros(max_tokens, embed_dim)
    position = torch.arange(0, max_tokens).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, embed_dim, 2) * -(math.log(10000.0) / embed_dim))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


# ============================================================================ 4.2 TransformerBlock

class _Given04(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__()
        self.norm_first = norm_first
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = _CourseMHA(embed_dim, num_heads, max_tokens, dropout_rate)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)


@correct("4.2")
class BlockAnnotatedSublayerConnections(_Given04):
    """Right: the Annotated Transformer's SublayerConnection pattern, a helper taking the sublayer as a lambda."""

    def _sublayer(self, x, norm, sublayer):
        if self.norm_first:
            return x + sublayer(norm(x))
        return norm(x + sublayer(x))

    def forward(self, x):
        x = self._sublayer(x, self.ln1, lambda x: self.attn(x))
        return self._sublayer(x, self.ln2, self.mlp)


@correct("4.2", norm_first=False)
class BlockAnnotatedSublayerConnectionsPostNorm(BlockAnnotatedSublayerConnections):
    """The same class, judged as a post-norm block."""


@bug("4.2", "mismatch")
class BlockAnnotatedHandWrittenLayerNorm(_Given04):
    """Wrong: the Annotated Transformer's LayerNorm written out with ln1/ln2's parameters:
    a_2 * (x - mean) / (std + eps) + b_2, torch.std unbiased and eps outside the root."""

    @staticmethod
    def _ln(ln, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return ln.weight * (x - mean) / (std + ln.eps) + ln.bias

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self._ln(self.ln1, x))
            return x + self.mlp(self._ln(self.ln2, x))
        x = self._ln(self.ln1, x + self.attn(x))
        return self._ln(self.ln2, x + self.mlp(x))


@bug("4.2", "residual", "residual")
class BlockResidualFromTheNormalisedX(_Given04):
    """Wrong: x = ln1(x) overwrites the stream, so the residual adds the normalised x (pre-norm)."""

    def forward(self, x):
        if self.norm_first:
            x = self.ln1(x)
            x = x + self.attn(x)
            x = self.ln2(x)
            return x + self.mlp(x)
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


# ============================================================================ 4.3 GPT

class _GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        positions = LearnedPositionalEncoding if c.positional == "learned" else SinusoidalPositionalEncoding
        self.position_encoding = positions(c.max_tokens, c.embed_dim)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.blocks = nn.ModuleList(
            _CourseBlock(c.embed_dim, c.num_heads, c.max_tokens, c.dropout_rate, c.norm_first)
            for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.embed_dim)
        self.head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)


@bug("4.3", "shape", "(2, 1, 13)")
class GPTNanoGPTLastPositionAtInference(_GPT):
    """Wrong: nanoGPT's 'inference-time mini-optimization': without targets only x[:, [-1], :] goes to the head."""

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.max_tokens, f"Cannot forward sequence of length {t}"
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(t))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            return self.head(x)
        return self.head(x[:, [-1], :])


@bug("4.3", "dtype", "tuple")
class GPTNanoGPTReturnsLogitsAndLoss(_GPT):
    """Wrong: nanoGPT's forward returns (logits, loss); loss is None without targets."""

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        if t > self.config.max_tokens:
            raise ValueError(f"idx has {t} tokens; crop it to the last {self.config.max_tokens}")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(t))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@bug("4.3", "scale", "embed")
class GPTAnnotatedEmbeddingsTimesSqrtE(_GPT):
    """Wrong: the Annotated Transformer's Embeddings: lut(x) * sqrt(d_model)."""

    def forward(self, idx):
        t = idx.shape[1]
        if t > self.config.max_tokens:
            raise ValueError(f"idx has {t} tokens; crop it to the last {self.config.max_tokens}")
        x = self.token_embedding(idx) * math.sqrt(self.config.embed_dim) + self.position_encoding(t)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@correct("4.3")
class GPTKarpathyBigram(_GPT):
    """Right: Karpathy's BigramLanguageModel.forward shape: B, T = idx.shape; tok_emb + pos_emb; blocks as a
    Sequential built on the fly; ln_f; lm_head; the length check left to position_encoding."""

    def forward(self, idx):
        B, T = idx.shape
        tok_emb = self.token_embedding(idx)
        pos_emb = self.position_encoding(T)
        x = self.dropout(tok_emb + pos_emb)
        x = nn.Sequential(*self.blocks)(x)
        x = self.ln_f(x)
        return self.head(x)


# ============================================================================ 5.1 lm_windows

@correct("5.1")
def lm_windows_karpathy_get_batch_sequential(ids, max_tokens):
    """Right: Karpathy's get_batch with the random ix replaced by every max_tokens-th start."""
    block_size = max_tokens
    ix = torch.arange(0, len(ids) - block_size, block_size)
    x = torch.stack([ids[i:i + block_size] for i in ix])
    y = torch.stack([ids[i + 1:i + block_size + 1] for i in ix])
    return x.long(), y.long()


@bug("5.1", "dropout", "nothing random")
def lm_windows_karpathy_random_starts(ids, max_tokens):
    """Wrong: Karpathy's get_batch pasted with its random starts (as many windows as fit)."""
    block_size = max_tokens
    count = (len(ids) - 1) // block_size
    ix = torch.randint(len(ids) - block_size, (count,))
    x = torch.stack([ids[i:i + block_size] for i in ix])
    y = torch.stack([ids[i + 1:i + block_size + 1] for i in ix])
    return x.long(), y.long()


@bug("5.1", "shape")
def lm_windows_one_window_too_few(ids, max_tokens):
    """Wrong: range(0, len(ids) - max_tokens - 1, max_tokens) drops the last window when it fits exactly."""
    starts = range(0, len(ids) - max_tokens - 1, max_tokens)
    chunks = torch.stack([ids[s:s + max_tokens + 1] for s in starts])
    return chunks[:, :-1].long(), chunks[:, 1:].long()


@bug("5.1", "shape", "apart")
def lm_windows_d2l_disjoint_chunks(ids, max_tokens):
    """Wrong: disjoint chunks of max_tokens + 1 tokens (stride max_tokens + 1): the pair across two chunks is
    never a target."""
    step = max_tokens + 1
    starts = range(0, len(ids) - max_tokens, step)
    chunks = torch.stack([ids[s:s + step] for s in starts])
    return chunks[:, :-1].long(), chunks[:, 1:].long()


# ============================================================================ 5.2 lm_loss

@bug("5.2", "loss_reduction", "padding")
def lm_loss_d2l_masked_softmax_ce(logits, targets):
    """Wrong: d2l's MaskedSoftmaxCELoss: per-token losses times a 0/1 weight, mean over ALL positions of each
    sequence (padding included in the count), then mean over the batch."""
    weights = (targets != -100).to(logits.dtype)
    unweighted = F.cross_entropy(logits.permute(0, 2, 1), targets.clamp(min=0), reduction="none")
    return (unweighted * weights).mean(dim=1).mean()


@bug("5.2", "loss_reduction", "padding")
def lm_loss_karpathy_fancy_index(logits, targets):
    """Wrong: makemore's -logprobs[range(n), Y].mean(): a target of -100 indexes the 100th class from the end."""
    logprobs = F.log_softmax(logits.flatten(0, 1), dim=-1)
    y = targets.flatten()
    return -logprobs[torch.arange(y.shape[0]), y].mean()


@correct("5.2")
def lm_loss_karpathy_view(logits, targets):
    """Right: Karpathy's B, T, C = logits.shape; logits.view(B*T, C); targets.view(B*T)."""
    B, T, C = logits.shape
    return F.cross_entropy(logits.view(B * T, C), targets.view(B * T))


@correct("5.2")
def lm_loss_karpathy_fancy_index_masked(logits, targets):
    """Right: makemore's log-prob gather, with the padding masked out and the mean over the real targets."""
    logprobs = F.log_softmax(logits.flatten(0, 1).float(), dim=-1)
    y = targets.flatten()
    keep = y != -100
    picked = logprobs[torch.arange(y.shape[0], device=y.device), y.clamp(min=0)]
    return (-(picked * keep).sum() / keep.sum()).to(logits.dtype)


# ============================================================================ 5.3 train_step

@bug("5.3", "clipping", "is not None")
def train_step_nanogpt_clip_unless_zero(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Wrong: nanoGPT's `if grad_clip != 0.0:`: max_grad_norm=None is not 0.0, so clip_grad_norm_(.., None)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = _lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "zero_grad")
def train_step_nanogpt_zero_grad_at_the_end(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Doubtful: nanoGPT clears the gradients after the step, not before backward: old gradients present on entry
    are added to."""
    model.train()
    loss = _lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@correct("5.3")
def train_step_d2l_grad_clipping_by_hand(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Right: d2l's grad_clipping: the global norm by hand, every gradient scaled by theta / norm above it."""
    model.train()
    optimizer.zero_grad()
    loss = _lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
        norm = torch.sqrt(sum(torch.sum(p.grad ** 2) for p in params))
        if norm > max_grad_norm:
            for p in params:
                p.grad[:] *= max_grad_norm / norm
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "accumulation")
def train_step_nanogpt_accumulation_scaling(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Wrong: nanoGPT's loss / gradient_accumulation_steps kept with one micro-step: gradients 8x too small
    (clipping then sees a smaller norm); the logged loss multiplied back."""
    gradient_accumulation_steps = 8
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = _lm_loss(model(inputs), targets) / gradient_accumulation_steps
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item() * gradient_accumulation_steps


@correct("5.3")
def train_step_model_zero_grad_and_flag(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Right: model.zero_grad() (the same parameters), `if max_grad_norm:` as the guard."""
    model.train(True)
    model.zero_grad(set_to_none=False)
    logits = model(inputs)
    B, T, C = logits.shape
    loss = F.cross_entropy(logits.view(B * T, C), targets.view(B * T))
    loss.backward()
    if max_grad_norm:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_grad_norm)
    optimizer.step()
    return float(loss.detach())


# ============================================================================ 5.4 sample_next_token

@correct("5.4")
def sample_nanogpt_generate_body(logits, temperature=1.0, top_k=None, generator=None):
    """Right: nanoGPT's generate() body, for one step."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("Inf")
    probs = F.softmax(logits, dim=-1)
    idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
    return idx_next.squeeze(-1)


@bug("5.4", "shape")
def sample_mingpt_greedy_by_topk(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: minGPT's greedy branch `_, ix = torch.topk(probs, k=1, dim=-1)`: (N, 1) at temperature 0."""
    if temperature == 0:
        _, ix = torch.topk(F.softmax(logits, dim=-1), k=1, dim=-1)
        return ix
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, top_k)
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator).squeeze(-1)


@bug("5.4", "scale", "temperature")
def sample_temperature_multiplied_r42(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: logits * temperature (so T = 2 sharpens instead of flattening)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits * temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "top_k")
def sample_hf_filter_with_le(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: HF's top_k_top_p_filtering with `<=` where `<` is meant: the k-th token removed too."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        indices_to_remove = logits <= torch.topk(logits, top_k)[0][..., -1, None]
        logits = logits.masked_fill(indices_to_remove, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


# ============================================================================ 6.1 flops_per_token

@correct("6.1")
def flops_nanogpt_estimate_mfu(config, num_weights):
    """Right: nanoGPT's estimate_mfu: L, H, Q, T with Q = n_embd // n_head."""
    N = num_weights
    L, H, Q, T = config.num_layers, config.num_heads, config.embed_dim // config.num_heads, config.max_tokens
    return 6 * N + 12 * L * H * Q * T


@bug("6.1", "attention_flops")
def flops_kaplan_context_term(config, num_weights):
    """Wrong: Kaplan et al.'s 6N + 6 n_layer n_ctx d_attn (only the QK logits counted): half the attention term."""
    d_attn = config.num_heads * config.head_dim
    return 6 * num_weights + 6 * config.num_layers * config.max_tokens * d_attn


@bug("6.1", "flops_units")
def flops_nanogpt_per_fwdbwd(config, num_weights):
    """Wrong: nanoGPT's flops_per_fwdbwd = flops_per_token * T returned: per window, not per token."""
    L, H, Q, T = config.num_layers, config.num_heads, config.head_dim, config.max_tokens
    flops_per_token = 6 * num_weights + 12 * L * H * Q * T
    return flops_per_token * T


@bug("6.1", "attention_flops")
def flops_head_size_is_embed_dim(config, num_weights):
    """Wrong: Q taken as embed_dim (the head size multiplied by the heads twice)."""
    return 6 * num_weights + 12 * config.num_layers * config.num_heads * config.embed_dim * config.max_tokens


# ============================================================================ 6.2 generate_with_cache

@correct("6.2")
@torch.no_grad()
def gen_hf_prefill_all_but_the_last(model, idx, max_new_tokens):
    """Right: the HF pattern: prefill all the prompt but its last token, then always feed one token."""
    cache = model.new_cache()
    if idx.shape[1] > 1:
        model(idx[:, :-1], cache)
    nxt = idx[:, -1:]
    for _ in range(max_new_tokens):
        logits = model(nxt, cache)
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


@correct("6.2")
@torch.no_grad()
def gen_hf_prefill_unguarded(model, idx, max_new_tokens):
    """Right: the HF prefill without a guard: for a one-token prompt model(idx[:, :-1], cache) gets (N, 0) tokens,
    which the model accepts and which leaves the cache empty; the tokens come out right."""
    cache = model.new_cache()
    model(idx[:, :-1], cache)
    nxt = idx[:, -1:]
    for _ in range(max_new_tokens):
        nxt = model(nxt, cache)[:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


@bug("6.2", "kv_cache")
@torch.no_grad()
def gen_feeds_the_last_two_tokens(model, idx, max_new_tokens):
    """Wrong: after the prompt, feeds idx[:, -2:] (the previous token again with the new one)."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
        if cache[0].length + 2 <= model.config.max_tokens:
            logits = model(idx[:, -2:], cache)
    return idx


@bug("6.2", "greedy")
@torch.no_grad()
def gen_karpathy_multinomial(model, idx, max_new_tokens):
    """Wrong: Karpathy's generate loop pasted with its softmax + multinomial draw, though greedy is asked."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        probs = F.softmax(logits[:, -1, :], dim=-1)
        idx_next = torch.multinomial(probs, num_samples=1)
        idx = torch.cat((idx, idx_next), dim=1)
        logits = model(idx_next, cache)
    return idx


# ============================================================================ second batch

@bug("1.3", "causal_mask")
def sdpa_karpathy_tril_always(q, k, v, mask=None):
    """Wrong: Karpathy's Head pasted: its own tril mask applied always, the mask argument ignored."""
    wei = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    tril = torch.tril(torch.ones(q.shape[-2], k.shape[-2], device=q.device))
    wei = wei.masked_fill(tril == 0, float("-inf"))
    return F.softmax(wei, dim=-1) @ v


@correct("1.3")
def sdpa_fourth_root_on_q_and_k(q, k, v, mask=None):
    """Right: the scale split as d**-0.25 on q and on k before the product (as some fused kernels do)."""
    s = q.shape[-1] ** -0.25
    scores = (q * s) @ (k * s).transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    return scores.softmax(-1) @ v


@correct("2.1")
def causal_mask_karpathy_tril_eq_one(n):
    """Right: Karpathy's tril buffer, compared with 1."""
    return torch.tril(torch.ones(n, n)) == 1


@bug("4.2", "residual", "input", norm_first=False)
class BlockPostNormSecondResidualFromTheInput(_Given04):
    """Wrong (post-norm): the second residual adds the block's input x, not the first sublayer's result."""

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        y = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(y))


@bug("4.3", "context_limit", "crop")
class GPTNanoGPTIdxCondInForward(_GPT):
    """Wrong: nanoGPT generate()'s idx_cond line moved into forward: too long an idx is cropped silently."""

    def forward(self, idx):
        T = self.config.max_tokens
        idx = idx if idx.size(1) <= T else idx[:, -T:]
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@correct("5.1")
def lm_windows_as_strided(ids, max_tokens):
    """Right: windows of max_tokens + 1 as an as_strided view of a contiguous long copy."""
    flat = ids.long().contiguous()
    count = (len(flat) - 1) // max_tokens
    windows = flat.as_strided((count, max_tokens + 1), (max_tokens, 1))
    return windows[:, :-1].clone(), windows[:, 1:].clone()


@correct("5.2")
def lm_loss_classes_moved_to_dim_one(logits, targets):
    """Right: the K-dimensional form of F.cross_entropy, (N, V, L) against (N, L)."""
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100)


@correct("5.3")
def train_step_karpathy_video_order(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Right: the video's order: forward and loss first, then zero_grad(set_to_none=True), backward, step."""
    model.train()
    logits = model(inputs)
    loss = _lm_loss(logits, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@correct("5.4")
def sample_hf_top_k_filtering(logits, temperature=1.0, top_k=None, generator=None):
    """Right: HF's top_k_top_p_filtering (top-k part) on a clone, filter_value=-inf."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    logits = logits.clone() / temperature
    if top_k is not None and top_k > 0:
        top_k = min(max(top_k, 1), logits.size(-1))
        indices_to_remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
        logits[indices_to_remove] = -float("Inf")
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).view(-1)


@correct("6.1")
def flops_float_arithmetic(config, num_weights):
    """Right: in floats, head size recomputed as embed_dim / num_heads."""
    q = config.embed_dim / config.num_heads
    return 6.0 * num_weights + 12.0 * config.num_layers * config.num_heads * q * config.max_tokens


@bug("6.2", "exception", "whole sequence")
@torch.no_grad()
def gen_nanogpt_idx_cond_with_cache(model, idx, max_new_tokens):
    """Wrong: nanoGPT's loop (idx_cond = idx[:, -block_size:]) with the cache simply passed along."""
    cache = model.new_cache()
    block_size = model.config.max_tokens
    for _ in range(max_new_tokens):
        idx_cond = idx if idx.size(1) <= block_size else idx[:, -block_size:]
        logits = model(idx_cond, cache)
        idx_next = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


@correct("6.2")
@torch.no_grad()
def gen_mingpt_greedy_by_topk_of_probs(model, idx, max_new_tokens):
    """Right: minGPT's do_sample=False branch, _, ix = torch.topk(probs, k=1, dim=-1), with the cache."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for i in range(max_new_tokens):
        probs = F.softmax(logits[:, -1, :], dim=-1)
        _, ix = torch.topk(probs, k=1, dim=-1)
        idx = torch.cat((idx, ix), dim=1)
        if i < max_new_tokens - 1:
            logits = model(ix, cache)
    return idx
