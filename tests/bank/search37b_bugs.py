"""Round 37b (notebooks 01, 02, 03, 09, 12): attempts at 1.3, 2.2, 3.1, 3.2, 3.3, 9.2, 9.5, 9.6 and 12.2.

Aimed at this week's probes: the bfloat16 call (a float32 tensor of shape (1,) or a float32 buffer that only bfloat16
inputs show; right code that upcasts, uses numpy for a mask, or an operation without a bfloat16 kernel), a random
draw in a function exercise (noise added to break ties), two dtypes meeting on float64 inputs (a float32 selection
or rotation matrix), the first call of 2.2/3.3 failing (torch.mm / a (L, L) view for a batch of one, the length read
from the batch axis), and the start position of 9.6/12.2 kept outside the cache (on self and reset when the cache is
empty, on the layer object), with right ones kept beside the cache (a WeakKeyDictionary, an attribute on the cache).

Named by this round's fixes: 12.2 a start kept on the layer (the cache's rotary keys turned to other positions) and
one kept on the function, reset when a cache comes empty, and 9.6 the same on self (two caches used in turn:
``kept_state``); 9.6 a start kept on the class (right when the student's code starts afresh: ``kept_state``); 9.2
a float32 rotation matrix meeting float16 x (``dtype``, not ``exception``); 9.2 view_as_complex, which has no
bfloat16 kernel (right: an operation without a kernel is no dtype mistake). Left out: 1.3 a mask made through
numpy and moved back to q's device (right on a GPU; the meta-device probe cannot tell a .cpu() round trip from a
result left on the CPU, debatable).
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import modern
from course_lib.attention import KVCache, causal_mask, merge_heads, split_heads

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.3 scaled_dot_product_attention

@correct("1.3")
def sdpa_through_float64_and_back(q, k, v, mask=None):
    """Computes everything in float64 and casts the result back to q's dtype."""
    qd, kd, vd = q.double(), k.double(), v.double()
    scores = qd @ kd.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vd).to(q.dtype)


@correct("1.3")
def sdpa_scale_as_a_0d_float32_tensor(q, k, v, mask=None):
    """The scale as a 0-d float32 tensor on q's device: a 0-d tensor never promotes a bfloat16 one."""
    scale = torch.tensor(q.shape[-1], dtype=torch.float32, device=q.device).rsqrt()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), -math.inf)
    return F.softmax(scores, dim=-1) @ v


@correct("1.3")
def sdpa_exp_normalised_by_hand_with_row_max(q, k, v, mask=None):
    """A hand-written softmax, each row shifted by its own maximum; -inf rows handled by the mask (never all hidden)."""
    scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return torch.einsum("...qk,...kd->...qd", e / e.sum(dim=-1, keepdim=True), v)


@bug("1.3", "dtype", "bfloat16")
def sdpa_scale_as_a_one_element_tensor(q, k, v, mask=None):
    """The scale as torch.tensor([d]) (shape (1,), float32): float64 inputs promote it away, bfloat16 ones do not."""
    scale = torch.tensor([q.shape[-1]], dtype=torch.float32, device=q.device).sqrt()
    scores = q @ k.transpose(-2, -1) / scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


@bug("1.3", "dtype", "bfloat16")
def sdpa_where_with_a_float32_fill_on_the_device(q, k, v, mask=None):
    """torch.where with a -inf fill made by torch.full on q's device but without dtype=: float32."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        fill = torch.full(scores.shape, float("-inf"), device=q.device)
        scores = torch.where(mask, scores, fill)
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "dtype", "float64")
def sdpa_values_made_float(q, k, v, mask=None):
    """v.float() "to be safe": a matmul of float64 weights with float32 values raises on float64 inputs."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float()


@bug("1.3", "dropout", "random")
def sdpa_noise_to_break_ties(q, k, v, mask=None):
    """Adds a little noise to the scores to break ties between equal keys: the output is random."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores + 1e-2 * torch.randn_like(scores)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "softmax_dim")
def sdpa_naive_softmax_over_queries(q, k, v, mask=None):
    """A hand-written softmax without the maximum AND summed over the queries (dim=-2): the axis is the mistake to
    name, not the overflow on very large scores."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = scores.exp()
    return e / e.sum(dim=-2, keepdim=True) @ v


@bug("1.3", "scale")
def sdpa_naive_softmax_unscaled(q, k, v, mask=None):
    """A hand-written softmax without the maximum AND no 1/sqrt(d): the scale is the mistake to name."""
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores)
    return (e / e.sum(-1, keepdim=True)) @ v


@bug("1.3", "mutation")
def sdpa_transposes_k_in_place(q, k, v, mask=None):
    """k.transpose_(-2, -1): the caller's k comes back transposed."""
    k.transpose_(-2, -1)
    scores = q @ k / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("1.3", "softmax_dim")
def sdpa_shifted_by_each_keys_max(q, k, v, mask=None):
    """A hand-written softmax whose shift is each key's maximum over the queries (amax(dim=-2)), then normalised over
    the keys: on ordinary scores it agrees with softmax only where the column maxima are equal."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    shift = scores.amax(dim=-2, keepdim=True).clamp(min=-1e30)
    e = torch.exp(scores - shift)
    return e / e.sum(dim=-1, keepdim=True) @ v


# ============================================================================ 3.1 split_heads

@correct("3.1")
def split_heads_by_column_index(x, num_heads):
    """Gathers each head's columns with an index table (x[..., idx] -> (N, L, heads, hd)), then moves the heads."""
    n, length, e = x.shape
    idx = torch.arange(e, device=x.device).view(num_heads, e // num_heads)
    return x[..., idx].permute(0, 2, 1, 3)


@correct("3.1")
def split_heads_through_float64_and_back(x, num_heads):
    """Rearranges a float64 copy and casts it back: exact in every dtype."""
    n, length, e = x.shape
    return x.double().reshape(n, length, num_heads, -1).transpose(1, 2).to(x.dtype)


@bug("3.1", "dtype", "float64")
def split_heads_into_a_default_dtype_buffer(x, num_heads):
    """Copies each head into a buffer made by torch.empty on x's device, without dtype=."""
    n, length, e = x.shape
    hd = e // num_heads
    out = torch.empty(n, num_heads, length, hd, device=x.device)
    for h in range(num_heads):
        out[:, h] = x[..., h * hd:(h + 1) * hd]
    return out


@bug("3.1", "exception")
def split_heads_true_division(x, num_heads):
    """head_dim = E / num_heads: a float, which view() refuses."""
    n, length, e = x.shape
    return x.view(n, length, num_heads, e / num_heads).transpose(1, 2)


@bug("3.1", "mutation")
def split_heads_unsqueezes_in_place(x, num_heads):
    """Reshapes x itself with in-place view ops (x.unsqueeze_ then as_strided_ style): the caller's x changes shape."""
    n, length, e = x.shape
    x.resize_(n, length, num_heads, e // num_heads)
    return x.transpose(1, 2)


# ============================================================================ 3.2 merge_heads

@correct("3.2")
def merge_heads_by_einsum_permutation(x):
    n, heads, length, hd = x.shape
    return torch.einsum("nhld->nlhd", x).reshape(n, length, heads * hd)


@correct("3.2")
def merge_heads_through_float64_and_back(x):
    n, heads, length, hd = x.shape
    return x.double().permute(0, 2, 1, 3).reshape(n, length, -1).to(x.dtype)


@bug("3.2", "dtype", "float64")
def merge_heads_into_a_zeros_buffer_on_the_device(x):
    """Writes each head into torch.zeros(..., device=x.device): right device, default dtype."""
    n, heads, length, hd = x.shape
    out = torch.zeros(n, length, heads * hd, device=x.device)
    for h in range(heads):
        out[:, :, h * hd:(h + 1) * hd] = x[:, h]
    return out


@bug("3.2", "mutation")
def merge_heads_transposes_in_place(x):
    """x.transpose_(1, 2): the caller's tensor comes back with its axes swapped."""
    n, heads, length, hd = x.shape
    x.transpose_(1, 2)
    return x.reshape(n, length, heads * hd)


@bug("3.2", "dtype", "float64")
def merge_heads_by_a_float32_permutation_matrix(x):
    """Puts the heads side by side by cat, then multiplies by an identity made without dtype= (a "no-op" left in):
    float64 inputs raise in the matmul."""
    n, heads, length, hd = x.shape
    flat = torch.cat(x.unbind(1), dim=-1)
    return flat @ torch.eye(heads * hd, device=x.device)


# ============================================================================ 9.2 apply_rotary

def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@correct("9.2")
def rotary_sign_vector_from_numpy(x, cos, sin, offset=0):
    """rotate_half as a roll of the halves times a sign vector built with numpy, made in x's dtype on x's device."""
    length, d = x.shape[-2], x.shape[-1]
    sign = torch.as_tensor(np.concatenate([-np.ones(d // 2), np.ones(d // 2)]), dtype=x.dtype, device=x.device)
    c = cos[offset:offset + length].to(x.dtype)
    s = sin[offset:offset + length].to(x.dtype)
    return x * c + torch.roll(x, d // 2, dims=-1) * sign * s


@correct("9.2")
def rotary_by_view_as_complex(x, cos, sin, offset=0):
    """The half-split pairs (x_i, x_{i+d/2}) as complex numbers via view_as_complex of the stacked halves, turned by
    cos + i sin (float16 computed in float32, where complex32 has no CPU kernels), back to x's dtype. view_as_complex
    has no bfloat16 kernel: a right attempt that cannot run in bfloat16."""
    length, half = x.shape[-2], x.shape[-1] // 2
    work = x.float() if x.dtype == torch.float16 else x
    pairs = torch.stack([work[..., :half], work[..., half:]], dim=-1).contiguous()
    z = torch.view_as_complex(pairs)
    turn = torch.complex(cos[offset:offset + length, :half].to(work.dtype), sin[offset:offset + length, :half].to(work.dtype))
    w = torch.view_as_real(z * turn)
    return torch.cat([w[..., 0], w[..., 1]], dim=-1).to(x.dtype)


@bug("9.2", "dtype", "float32")
def rotary_sign_vector_in_default_dtype(x, cos, sin, offset=0):
    """The roll-and-sign rotate_half with a sign vector made on x's device but without dtype=: float32."""
    length, d = x.shape[-2], x.shape[-1]
    sign = torch.cat([-torch.ones(d // 2, device=x.device), torch.ones(d // 2, device=x.device)])
    c = cos[offset:offset + length].to(x.dtype)
    s = sin[offset:offset + length].to(x.dtype)
    return x * c + torch.roll(x, d // 2, dims=-1) * sign * s


@bug("9.2", "dtype", "x.dtype")
def rotary_by_a_float32_rotation_matrix(x, cos, sin, offset=0):
    """Builds each position's (d, d) rotation matrix from the tables (float32, x's dtype forgotten) and multiplies:
    right on float32, raises on float64 (two dtypes meet in the matmul)."""
    length, d = x.shape[-2], x.shape[-1]
    half = d // 2
    c = cos[offset:offset + length]
    s = sin[offset:offset + length]
    rot = torch.zeros(length, d, d, device=x.device, dtype=c.dtype)
    i = torch.arange(half, device=x.device)
    rot[:, i, i] = c[:, :half]
    rot[:, i + half, i + half] = c[:, half:]
    rot[:, i + half, i] = -s[:, :half]       # x'_i = x_i cos - x_{i+h} sin  (row-vector convention: x @ rot)
    rot[:, i, i + half] = s[:, half:]
    return (x.unsqueeze(-2) @ rot).squeeze(-2)


@bug("9.2", "rope_positions")
def rotary_rows_one_late(x, cos, sin, offset=0):
    """cos[offset + 1 : offset + L + 1]: the positions counted from 1."""
    length = x.shape[-2]
    c = cos[offset + 1:offset + length + 1].to(x.dtype)
    s = sin[offset + 1:offset + length + 1].to(x.dtype)
    return x * c + rotate_half(x) * s


@bug("9.2", "dropout", "random")
def rotary_with_random_jitter(x, cos, sin, offset=0):
    """"Regularises" the rotation with a tiny random jitter on the angles' tables."""
    length = x.shape[-2]
    c = cos[offset:offset + length].to(x.dtype)
    s = sin[offset:offset + length].to(x.dtype)
    c = c + 1e-2 * torch.randn_like(c)
    return x * c + rotate_half(x) * s


# ============================================================================ 9.5 repeat_kv

@correct("9.5")
def repeat_kv_by_selection_matrix_in_x_dtype(x, groups):
    """A 0/1 selection matrix (query head h <- kv head h // groups) in x's dtype on x's device, applied by einsum."""
    kv = x.shape[1]
    sel = torch.eye(kv, dtype=x.dtype, device=x.device).repeat_interleave(groups, dim=0)   # (kv*groups, kv)
    return torch.einsum("hk,nkld->nhld", sel, x)


@correct("9.5")
def repeat_kv_by_a_cpu_index(x, groups):
    """Advanced indexing with a CPU index (allowed on a GPU): x[:, [0, 0, 1, 1, ...]]."""
    index = torch.arange(x.shape[1] * groups) // groups
    return x[:, index]


@correct("9.5")
def repeat_kv_itself_for_one_group(x, groups):
    """groups == 1 returns x itself (as Hugging Face's repeat_kv does), else repeat_interleave on dim=-3."""
    if groups == 1:
        return x
    return torch.repeat_interleave(x, groups, dim=-3)


@bug("9.5", "dtype", "float64")
def repeat_kv_by_a_float32_selection_matrix(x, groups):
    """The selection matrix made without dtype=: einsum of float32 with float64 inputs raises."""
    kv = x.shape[1]
    sel = torch.eye(kv, device=x.device).repeat_interleave(groups, dim=0)
    return torch.einsum("hk,nkld->nhld", sel, x)


@bug("9.5", "shape")
def repeat_kv_two_written_in(x, groups):
    """repeat_interleave(2, ...): the group size of the notebook's example written in."""
    return x.repeat_interleave(2, dim=1)


@bug("9.5", "shape")
def repeat_kv_on_the_batch_axis(x, groups):
    """repeat_interleave along dim=0, the batch."""
    return x.repeat_interleave(groups, dim=0)


@bug("9.5", "dtype", "float64")
def repeat_kv_through_float_and_not_back(x, groups):
    """x.float() first ("repeat_interleave is safer in float32") and never cast back: float64 is caught as lower
    precision, bfloat16 comes back float32."""
    return x.float().repeat_interleave(groups, dim=1)


# ============================================================================ 2.2 MaskedAttention

class NbMasked(nn.Module):
    """The notebook's given constructor of exercise 2.2."""

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
class MaskedAdditiveBiasInXDtype(NbMasked):
    """An additive 0/-inf bias made from the buffer's corner, in x's dtype on x's device."""

    def forward(self, x):
        n, length, e = x.shape
        q, k, v = self.query(x), self.key(x), self.value(x)
        bias = torch.zeros(length, length, dtype=x.dtype, device=x.device).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        scores = torch.baddbmm(bias.expand(n, length, length), q, k.transpose(1, 2), alpha=e ** -0.5)
        weights = self.attn_dropout(scores.softmax(dim=-1))
        return self.proj_dropout(self.proj(torch.bmm(weights, v)))


@correct("2.2")
class MaskedQueriesPrescaled(NbMasked):
    """Scales the queries by embed_dim ** -0.5 before the product (the same scores), mask via torch.where."""

    def forward(self, x):
        length = x.size(1)
        q = self.query(x) * self.embed_dim ** -0.5
        k, v = self.key(x), self.value(x)
        scores = torch.where(self.mask[:length, :length], q @ k.mT, float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(F.softmax(scores, -1)) @ v))


@bug("2.2", "shape", "batch of one")
class MaskedWithTorchMm(NbMasked):
    """torch.mm on q.squeeze(0): right for a batch of one, raises for any other batch."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x).squeeze(0), self.key(x).squeeze(0), self.value(x).squeeze(0)
        scores = torch.mm(q, k.t()) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(torch.mm(weights, v))).unsqueeze(0)


@bug("2.2", "shape", "batch of one")
class MaskedScoresViewedAsSquare(NbMasked):
    """scores.view(L, L) "to get the (L, L) matrix": a batch of one only."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(-2, -1)).view(length, length) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "causal_mask", "batch axis")
class MaskedOwnMaskFromTheBatchAxis(NbMasked):
    """Builds its own mask with tril(ones(T, T)) where T = x.size(0), the batch."""

    def forward(self, x):
        t = x.size(0)
        q, k, v = self.query(x), self.key(x), self.value(x)
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(~allowed, float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))


@bug("2.2", "dropout")
class MaskedDropoutMadeInForward(NbMasked):
    """nn.Dropout(0.2) made inside forward: a new module, in training mode, at every call (eval never reaches it)."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = nn.Dropout(self.attn_dropout.p)(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights @ v))


# ============================================================================ 3.3 MultiHeadMaskedAttention

class NbMulti(nn.Module):
    """The notebook's given constructor of exercise 3.3."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError("sizes")
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


@correct("3.3")
class MultiTriuFutureMaskBaddbmm(NbMulti):
    """Heads folded into the batch for baddbmm-free bmm, the future hidden with a triu(diagonal=1) mask on x.device."""

    def forward(self, x):
        n, length, e = x.shape
        h, d = self.num_heads, self.head_dim
        q = self.query(x).view(n, length, h, d).transpose(1, 2).reshape(n * h, length, d)
        k = self.key(x).view(n, length, h, d).transpose(1, 2).reshape(n * h, length, d)
        v = self.value(x).view(n, length, h, d).transpose(1, 2).reshape(n * h, length, d)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(diagonal=1)
        scores = torch.bmm(q, k.transpose(1, 2)).div(math.sqrt(d)).masked_fill(future, float("-inf"))
        weights = self.attn_dropout(scores.softmax(-1))
        out = torch.bmm(weights, v).view(n, h, length, d).transpose(1, 2).reshape(n, length, e)
        return self.proj_dropout(self.proj(out))


@correct("3.3")
class MultiScaleFromKeysWidth(NbMulti):
    """The scale read from k.size(-1) (head_dim after the split), with the course's split/merge helpers."""

    def forward(self, x):
        length = x.shape[-2]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / k.size(-1) ** 0.5
        scores = scores.masked_fill(self.mask[:length, :length] == 0, float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(scores.softmax(-1)) @ v)))


@bug("3.3", "causal_mask", "batch axis")
class MultiLengthFromXSize0(NbMulti):
    """length = x.size(0) for the mask (the split reads its sizes with -1): the mask is cut to N x N."""

    def forward(self, x):
        length = x.size(0)
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(scores.softmax(-1)) @ v)))


@bug("3.3", "shape", "batch of one")
class MultiHeadsAsTheBatchOfBmm(NbMulti):
    """reshape(num_heads, L, head_dim) for bmm: no batch axis, right for a batch of one only."""

    def forward(self, x):
        length = x.shape[1]
        h, d = self.num_heads, self.head_dim
        q = self.query(x).reshape(length, h, d).transpose(0, 1)
        k = self.key(x).reshape(length, h, d).transpose(0, 1)
        v = self.value(x).reshape(length, h, d).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        out = torch.bmm(self.attn_dropout(scores.softmax(-1)), v)          # (h, L, d)
        out = out.transpose(0, 1).reshape(1, length, h * d)
        return self.proj_dropout(self.proj(out))


@bug("3.3", "scale", "head_dim")
class MultiScaleFromAxisOne(NbMulti):
    """Divides by sqrt(q.size(1)), the number of heads (read as the head size): right only when heads == head_dim."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(1))
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(scores.softmax(-1)) @ v)))


@bug("3.3", "dropout")
class MultiZeroesDropoutRateInEval(NbMulti):
    """"Switches dropout off" in eval by setting its rate to 0: the rate never comes back in training."""

    def forward(self, x):
        if not self.training:
            self.attn_dropout.p = 0.0
            self.proj_dropout.p = 0.0
        length = x.shape[1]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(scores.softmax(-1)) @ v)))


# ============================================================================ 9.6 GroupedQueryAttention

def apply_rotary(x, cos, sin, offset=0):
    length = x.shape[-2]
    return x * cos[offset:offset + length].to(x.dtype) + rotate_half(x) * sin[offset:offset + length].to(x.dtype)


def repeat_kv(x, groups):
    return x.repeat_interleave(groups, dim=1)


class NbGQA37(nn.Module):
    """The notebook's given constructor of exercise 9.6."""

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

    def _attend(self, x, start, cache):
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(total, device=x.device)[start:total]
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


_GQA_STARTS = weakref.WeakKeyDictionary()


@correct("9.6")
class GQAStartInAWeakDictionaryOfCaches(NbGQA37):
    """Counts each cache's tokens in a WeakKeyDictionary keyed by the cache itself: the count lives and dies with the
    cache (a freed cache's entry goes with it), so it always equals cache.length."""

    def forward(self, x, cache=None):
        start = 0 if cache is None else _GQA_STARTS.get(cache, 0)
        out = self._attend(x, start, cache)
        if cache is not None:
            _GQA_STARTS[cache] = start + x.shape[1]
        return out


@correct("9.6")
class GQAStartWrittenOnTheCache(NbGQA37):
    """Keeps its own count as an attribute of the cache object (cache.seen): in the cache, as the text asks."""

    def forward(self, x, cache=None):
        start = getattr(cache, "seen", 0) if cache is not None else 0
        out = self._attend(x, start, cache)
        if cache is not None:
            cache.seen = start + x.shape[1]
        return out


@bug("9.6", "kept_state")
class GQAPositionOnSelfResetOnEmptyCache(NbGQA37):
    """self._pos counts the tokens seen, reset when a cache arrives empty: right for one generation at a time, but
    a position kept outside the cache (two caches used in turn on one layer share it)."""

    def forward(self, x, cache=None):
        if cache is None:
            return self._attend(x, 0, None)
        if cache.length == 0:
            self._pos = 0
        start = getattr(self, "_pos", 0)
        out = self._attend(x, start, cache)
        self._pos = start + x.shape[1]
        return out


@bug("9.6", "kept_state")
class GQAPositionKeptOnTheClass(NbGQA37):
    """The start kept on the class (GQAPositionKeptOnTheClass.pos), advanced at every cached call, never reset."""

    pos = 0

    def forward(self, x, cache=None):
        if cache is None:
            return self._attend(x, 0, None)
        start = type(self).pos
        out = self._attend(x, start, cache)
        type(self).pos = start + x.shape[1]
        return out


@bug("9.6", "dropout", "dropout")
class GQADropoutModuleMadeInForward(NbGQA37):
    """nn.Dropout(0.1) made in forward on the weights (the layer has no dropout rate): always in training mode."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[2]
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~causal_mask(total, device=x.device)[start:], float("-inf"))
        weights = nn.Dropout(0.1)(scores.softmax(-1))
        return self.proj(merge_heads(weights @ v))


@bug("9.6", "causal_mask")
class GQAStartReadAfterAppendForTheMask(NbGQA37):
    """Rotates at cache.length, but reads start again after cache.append for the mask: rows start+L.. of a larger
    mask, (L, start + 2L) against (L, start + L) scores."""

    def forward(self, x, cache=None):
        length = x.shape[1]
        start = cache.length if cache is not None else 0
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
            start = cache.length
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(start + length, device=x.device)[start:start + length]
        mask = mask[:, :k.shape[2]]
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


# ============================================================================ 12.2 latent_attention

def _mla37(layer, x, start, cache, extra=None):
    """A student's MLA given its start position; ``extra(weights)`` changes the weights (for the dropout attempt)."""
    n, length, _ = x.shape
    dn, dr, heads, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q = q.view(n, length, heads, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, heads, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    scores = (q_nope @ k_nope.transpose(-2, -1) + q_rope @ k_rope[:, None].transpose(-2, -1)) * layer.softmax_scale
    mask = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[total - length:]
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    if extra is not None:
        weights = extra(weights)
    out = weights @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, heads * dv))


_MLA_STARTS = weakref.WeakKeyDictionary()


@correct("12.2")
def latent_start_in_a_weak_dictionary_of_caches(layer, x, cache=None):
    """The start counted per cache in a WeakKeyDictionary keyed by the cache object: it follows the cache."""
    start = 0 if cache is None else _MLA_STARTS.get(cache, 0)
    out = _mla37(layer, x, start, cache)
    if cache is not None:
        _MLA_STARTS[cache] = start + x.shape[1]
    return out


@correct("12.2")
def latent_start_from_the_held_latents(layer, x, cache=None):
    """start read from what the cache holds (cache.latent.shape[1], None before the first append)."""
    start = 0 if cache is None or cache.latent is None else cache.latent.shape[1]
    return _mla37(layer, x, start, cache)


@bug("12.2", "kept_state")
def latent_start_kept_on_the_layer(layer, x, cache=None):
    """The start kept on the layer object (layer.seen_tokens), never reset for a new cache."""
    if cache is None:
        return _mla37(layer, x, 0, None)
    start = getattr(layer, "seen_tokens", 0)
    out = _mla37(layer, x, start, cache)
    layer.seen_tokens = start + x.shape[1]
    return out


@bug("12.2", "kept_state")
def latent_start_on_the_function_reset_when_empty(layer, x, cache=None):
    """The start kept on the function itself, reset when a cache arrives empty: a position outside the cache."""
    if cache is None:
        return _mla37(layer, x, 0, None)
    if cache.length == 0:
        latent_start_on_the_function_reset_when_empty.pos = 0
    start = getattr(latent_start_on_the_function_reset_when_empty, "pos", 0)
    out = _mla37(layer, x, start, cache)
    latent_start_on_the_function_reset_when_empty.pos = start + x.shape[1]
    return out


@bug("12.2", "dropout", "random")
def latent_with_attention_dropout(layer, x, cache=None):
    """F.dropout(weights, 0.1) on the attention weights, as DeepSeek's training code does: training=True always."""
    start = 0 if cache is None else cache.length
    return _mla37(layer, x, start, cache, extra=lambda w: F.dropout(w, 0.1))


# ============================================================================ added after the first run

@bug("3.1", "dtype", "bfloat16")
def split_heads_cat_onto_an_empty_start(x, num_heads):
    """Starts from torch.empty(N, 0, L, hd, device=x.device) and cats each head on: torch.cat promotes, so float64
    inputs give float64, but bfloat16 ones come back float32."""
    n, length, e = x.shape
    hd = e // num_heads
    out = torch.empty(n, 0, length, hd, device=x.device)
    for h in range(num_heads):
        out = torch.cat([out, x[:, None, :, h * hd:(h + 1) * hd]], dim=1)
    return out


@bug("3.2", "dtype", "bfloat16")
def merge_heads_cat_onto_an_empty_start(x):
    """Starts from torch.empty(N, L, 0, device=x.device) and cats each head on (float32 with bfloat16 inputs)."""
    n, heads, length, hd = x.shape
    out = torch.empty(n, length, 0, device=x.device)
    for h in range(heads):
        out = torch.cat([out, x[:, h]], dim=-1)
    return out


@bug("9.5", "dtype", "bfloat16")
def repeat_kv_cat_onto_an_empty_start(x, groups):
    """Starts from torch.empty(N, 0, L, d, device=x.device) and cats each head `groups` times."""
    n, kv, length, d = x.shape
    out = torch.empty(n, 0, length, d, device=x.device)
    for j in range(kv):
        for _ in range(groups):
            out = torch.cat([out, x[:, j:j + 1]], dim=1)
    return out


@bug("9.6", "kept_state")
class GQAPositionOnSelfMaskFromTheEnd(NbGQA37):
    """self._pos counts every cached token, never reset; the mask takes the last L rows of causal_mask(total), so the
    shifted start only moves every query and key alike (RoPE scores see offsets only) until the tables run out."""

    def forward(self, x, cache=None):
        length = x.shape[1]
        start = getattr(self, "_pos", 0) if cache is not None else 0
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
            self._pos = start + length
        total = k.shape[2]
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = causal_mask(total, device=x.device)[total - length:]
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
