"""Round 40b (notebooks 01-04, 09, 10, 12): attempts at 1.3, 2.1, 3.1, 3.2, 4.1, 9.1, 9.2, 9.5, 9.6, 10.1, 10.2, 12.2.

Named by this round's fixes: the engine's "called twice" probe reads NaN as NaN (12.2 masks that hide a query's own
key were ``kept_state``; now ``causal_mask``); a numpy long double result is read in float64 (4.1, 9.5 crashed,
9.1 blamed the student); 10.1 runs the batch probe row by row (a sum over every row: ``batch_mixing``); 12.2 a
latent RMSNorm written out with an epsilon of its own (``epsilon``) or without its weight (``norm_weight``); 9.6
wrong cached outputs before a failing call are named first (tables sliced at start AND offset=start:
``rope_positions``); 4.1 positions from -1 (``positions``).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.3 scaled_dot_product_attention

@correct("1.3")
def sdpa_where_with_cpu_scalar_tensor(q, k, v, mask=None):
    """torch.where with a 0-d CPU tensor for -inf: 0-d CPU tensors are scalars to torch (work with CUDA tensors)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = torch.where(mask, scores, torch.tensor(float("-inf")))
    return scores.softmax(-1) @ v


@correct("1.3")
def sdpa_log_of_float_mask_added(q, k, v, mask=None):
    """log(1) = 0, log(0) = -inf: the mask turned additive through its log, in the scores' dtype."""
    scores = torch.einsum("...qd,...kd->...qk", q, k) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask.to(scores.dtype).log()
    return torch.einsum("...qk,...kd->...qd", scores.softmax(dim=-1), v)


@correct("1.3")
def sdpa_finfo_min_fill(q, k, v, mask=None):
    """Hugging Face's way: the most negative finite number of the dtype instead of -inf."""
    scores = (q @ k.mT) / q.size(-1) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), torch.finfo(scores.dtype).min)
    return torch.softmax(scores, -1) @ v


@correct("1.3")
def sdpa_reversed_keys(q, k, v, mask=None):
    """Keys (and values, and the mask's key axis) reversed first: attention does not care about the keys' order."""
    k, v = k.flip(-2), v.flip(-2)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask.flip(-1), float("-inf"))
    return scores.softmax(-1) @ v


@correct("1.3")
def sdpa_softmax_float32_then_back(q, k, v, mask=None):
    """The softmax in float32 at least (promote_types keeps float64), cast back to q's dtype."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)
    return (scores.to(acc).softmax(-1) @ v.to(acc)).to(q.dtype)


@correct("1.3")
def sdpa_in_place_on_own_scores(q, k, v, mask=None):
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores.div_(math.sqrt(q.shape[-1]))
    if mask is not None:
        scores.masked_fill_(~mask, -math.inf)
    weights = F.softmax(scores, dim=-1)
    return weights.matmul(v)


@correct("1.3")
def sdpa_weights_dropout_p0(q, k, v, mask=None):
    """F.dropout with p=0.0 (a student keeping a dropout hook for later): does nothing."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.dropout(scores.softmax(-1), p=0.0) @ v


@bug("1.3", "causal_mask")
def sdpa_mask_only_when_full_rank(q, k, v, mask=None):
    """Applies the mask only when it has as many axes as the scores: a (Lq, Lk) or (N, 1, Lk) mask is skipped."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None and mask.dim() == scores.dim() and mask.shape == scores.shape:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "causal_mask")
def sdpa_mask_multiplied_into_scores(q, k, v, mask=None):
    """Multiplies the scores by the mask: hidden keys get score 0, not -inf (still some weight)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores * mask
    return scores.softmax(-1) @ v


@bug("1.3", "causal_mask")
def sdpa_mask_transposed(q, k, v, mask=None):
    """mask.transpose(-2, -1): the mask read as (Lk, Lq) (square masks only; else it raises)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        m = mask.transpose(-2, -1) if mask.shape[-1] == mask.shape[-2] else mask
        scores = scores.masked_fill(~m, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "scale")
def sdpa_scale_by_sqrt_dv(q, k, v, mask=None):
    """Divides by sqrt(v.shape[-1]) (the value width) instead of sqrt(d)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(v.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "scale")
def sdpa_scale_twice_q_and_scores(q, k, v, mask=None):
    """Scales q by 1/sqrt(d), then the scores again: 1/d in all."""
    q = q / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("1.3", "normalization")
def sdpa_sigmoid_weights(q, k, v, mask=None):
    """Sigmoid attention instead of softmax (weights do not sum to one)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.sigmoid(scores) @ v


@bug("1.3", "nan", "maximum")
def sdpa_softmax_by_hand_shift_by_row_mean(q, k, v, mask=None):
    """A 'stable' softmax by hand that subtracts each row's mean, not its max: overflows on large scores."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    finite = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))
    e = torch.exp(scores - finite.mean(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True) @ v


@bug("1.3", "normalization", "another tensor")
def sdpa_weights_times_k(q, k, v, mask=None):
    """Weights times k instead of v (wrong tensor as values); shapes differ when dv != d, so only when equal."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = scores.softmax(-1)
    return w @ (k[..., : v.shape[-1]])


# ============================================================================ 2.1 causal_mask

@correct("2.1")
def causal_mask_ge_of_meshgrid(n):
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    return i >= j


@correct("2.1")
def causal_mask_cumsum_of_eye(n):
    """Running sum down each column of the identity: 1 on and below the diagonal."""
    return torch.eye(n, dtype=torch.long).cumsum(0).bool()


@correct("2.1")
def causal_mask_with_device_keyword(n, device=None):
    """A device= keyword as course_lib's own has (used in 9.6)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


@correct("2.1")
def causal_mask_not_upper(n):
    return torch.logical_not(torch.ones(n, n).triu(diagonal=1).bool())


@bug("2.1", "causal_mask")
def causal_mask_sliding_window_of_eight(n):
    """A band: each position sees itself and the 7 before (a sliding window, not a causal mask)."""
    i = torch.arange(n)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < 8)


@bug("2.1", "dtype")
def causal_mask_int8(n):
    return torch.tril(torch.ones(n, n, dtype=torch.int8))


@bug("2.1", "shape")
def causal_mask_batched(n):
    """Returns a (1, 1, n, n) mask, ready to broadcast: not the (n, n) asked."""
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


@bug("2.1", "causal_mask")
def causal_mask_anti_diagonal(n):
    """fliplr of the right mask: True on and above the anti-diagonal."""
    return torch.ones(n, n, dtype=torch.bool).tril().fliplr()


@bug("2.1", "dtype")
def causal_mask_numpy_bool(n):
    """A numpy array, not a tensor."""
    return np.tril(np.ones((n, n), dtype=bool))


# ============================================================================ 3.1 split_heads

@correct("3.1")
def split_heads_unflatten(x, num_heads):
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


@correct("3.1")
def split_heads_stack_of_splits(x, num_heads):
    head_dim = x.shape[-1] // num_heads
    return torch.stack(x.split(head_dim, dim=-1), dim=1)


@correct("3.1")
def split_heads_einsum_identity(x, num_heads):
    n, length, e = x.shape
    return torch.einsum("nlhd->nhld", x.reshape(n, length, num_heads, e // num_heads))


@correct("3.1")
def split_heads_movedim_contiguous(x, num_heads):
    n, length, e = x.shape
    return x.view(n, length, num_heads, e // num_heads).movedim(2, 1).contiguous()


@bug("3.1", "gradient")
def split_heads_detached(x, num_heads):
    """Detaches the result (a student avoiding 'views'): no gradient flows back."""
    n, length, e = x.shape
    return x.detach().view(n, length, num_heads, e // num_heads).transpose(1, 2).clone()


@correct("3.1")
def split_heads_transpose_then_reshape(x, num_heads):
    """Transposes (N, L, E) -> (N, E, L) first, then reshapes into (N, heads, L, head_dim)."""
    n, length, e = x.shape
    return x.transpose(1, 2).reshape(n, num_heads, e // num_heads, length).transpose(2, 3)


@bug("3.1", "head_split")
def split_heads_chunk_over_positions(x, num_heads):
    """Stacks chunks of the sequence axis... no: chunks of the last axis stacked after the positions then viewed."""
    n, length, e = x.shape
    return torch.stack(x.chunk(num_heads, dim=-1), dim=2).reshape(n, num_heads, length, e // num_heads)


# ============================================================================ 3.2 merge_heads

@correct("3.2")
def merge_heads_cat_of_unbind(x):
    return torch.cat(x.unbind(dim=1), dim=-1)


@correct("3.2")
def merge_heads_permute_flatten(x):
    return x.permute(0, 2, 1, 3).flatten(start_dim=2)


@correct("3.2")
def merge_heads_einsum_contiguous_view(x):
    n, h, length, d = x.shape
    return torch.einsum("nhld->nlhd", x).contiguous().view(n, length, h * d)


@bug("3.2", "shape")
def merge_heads_cat_along_positions(x):
    """torch.cat of the heads along dim 1: the heads stacked along the sequence."""
    return torch.cat(x.unbind(dim=1), dim=1)


@bug("3.2", "head_split")
def merge_heads_permute_head_last(x):
    """(N, L, head_dim, heads) flattened: the heads' features interleaved."""
    n, h, length, d = x.shape
    return x.permute(0, 2, 3, 1).reshape(n, length, h * d)


@bug("3.2", "head_split")
def merge_heads_reversed_heads(x):
    """The heads merged in reverse order (flip of the head axis)."""
    return torch.cat(x.unbind(dim=1)[::-1], dim=-1)


@bug("3.2", "shape")
def merge_heads_sum_of_heads(x):
    """Adds the heads instead of placing them side by side."""
    return x.sum(dim=1)


# ============================================================================ 4.1 sinusoidal_table

@correct("4.1")
def sinusoidal_table_logspace(max_tokens, embed_dim):
    """The frequencies as torch.logspace: 10^(-4 * 2i/d)."""
    half = embed_dim // 2
    freq = torch.logspace(0, -4 * (embed_dim - 2) / embed_dim, half, dtype=torch.float64)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * freq
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(max_tokens, embed_dim)
    return table.float()


@correct("4.1")
def sinusoidal_table_complex_exponential(max_tokens, embed_dim):
    """e^{i angle}: view_as_real gives (cos, sin); flipped to (sin, cos) and flattened."""
    two_i = torch.arange(0, embed_dim, 2, dtype=torch.float64)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] / 10000 ** (two_i / embed_dim)
    z = torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(z).flip(-1).reshape(max_tokens, embed_dim).float()


@correct("4.1")
def sinusoidal_table_numpy(max_tokens, embed_dim):
    pos = np.arange(max_tokens)[:, None]
    i = np.arange(embed_dim)[None, :]
    angle = pos / np.power(10000, (2 * (i // 2)) / np.float32(embed_dim))
    table = np.where(i % 2 == 0, np.sin(angle), np.cos(angle))
    return torch.from_numpy(table.astype(np.float32))


@bug("4.1", "scale", "positions")
def sinusoidal_table_linspace_positions(max_tokens, embed_dim):
    """Positions from torch.linspace(0, max_tokens, max_tokens): steps of T/(T-1), not 1."""
    position = torch.linspace(0, max_tokens, max_tokens)[:, None]
    two_i = torch.arange(0, embed_dim, 2, dtype=torch.float32)
    angles = position / 10000 ** (two_i / embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()
    return table


@bug("4.1", "dtype")
def sinusoidal_table_integer_buffer(max_tokens, embed_dim):
    """torch.zeros(..., dtype=torch.long): the sines and cosines truncated to integers on assignment."""
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    angles = position / 10000 ** (torch.arange(0, embed_dim, 2) / embed_dim)
    table = torch.zeros(max_tokens, embed_dim, dtype=torch.long)
    table[:, 0::2] = angles.sin().long()
    table[:, 1::2] = angles.cos().long()
    return table


@bug("4.1", "scale")
def sinusoidal_table_floor_divided_angles(max_tokens, embed_dim):
    """Integer positions // the wavelengths: the angles floored to whole radians."""
    position = torch.arange(max_tokens)[:, None]
    wavelength = 10000 ** (torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)
    angles = torch.div(position, wavelength, rounding_mode="floor")
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()
    return table


@bug("4.1", "positions")
def sinusoidal_table_last_row_dropped(max_tokens, embed_dim):
    """Positions 1 .. max_tokens-1 prepended with zeros? no: arange(max_tokens) - 1 (a position -1 first row)."""
    position = (torch.arange(max_tokens, dtype=torch.float32) - 1)[:, None]
    angles = position / 10000 ** (torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()
    return table


# ============================================================================ 9.1 rope_tables

@correct("9.1")
def rope_tables_cumprod_frequencies(head_dim, max_tokens, theta=10000.0):
    """Each frequency the previous one times theta^(-2/d): a running product."""
    ratio = torch.full((head_dim // 2,), theta ** (-2 / head_dim), dtype=torch.float64)
    freq = torch.cat([torch.ones(1, dtype=torch.float64), ratio[1:]]).cumprod(0)
    angles = torch.outer(torch.arange(max_tokens, dtype=torch.float64), freq).tile(1, 2)
    return angles.cos().float(), angles.sin().float()


@correct("9.1")
def rope_tables_list_and_float32_arange_step(head_dim, max_tokens, theta=10000.0):
    """All float32, the angles with .repeat(1, 2) (the same as cat), returned as a list."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(max_tokens).type_as(inv)
    freqs = torch.einsum("i,j->ij", t, inv).repeat(1, 2)
    return [freqs.cos(), freqs.sin()]


@bug("9.1", "shape")
def rope_tables_arguments_swapped(max_tokens, head_dim, theta=10000.0):
    """The signature's first two arguments in the other order: tables of (head_dim, max_tokens)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * inv
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "dtype")
def rope_tables_as_a_dict(head_dim, max_tokens, theta=10000.0):
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * inv
    angles = torch.cat([angles, angles], -1)
    return {"cos": angles.cos().float(), "sin": angles.sin().float()}


@bug("9.1", "rope_frequencies")
def rope_tables_ntk_scaled_theta(head_dim, max_tokens, theta=10000.0):
    """'NTK-aware' context extension: theta scaled by 2^(d/(d-2)) (a factor 2 on the context)."""
    base = theta * 2.0 ** (head_dim / (head_dim - 2)) if head_dim > 2 else theta
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * inv
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "rope_layout")
def rope_tables_second_half_reversed(head_dim, max_tokens, theta=10000.0):
    """The second half holds the angles in reverse order (cat([a, a.flip(-1)]))."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] * inv
    angles = torch.cat([angles, angles.flip(-1)], -1)
    return angles.cos().float(), angles.sin().float()


# ============================================================================ 9.2 apply_rotary

def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@correct("9.2")
def rotary_addcmul_narrow(x, cos, sin, offset=0):
    length = x.shape[-2]
    c = cos.narrow(0, offset, length).to(x.dtype)
    s = sin.narrow(0, offset, length).to(x.dtype)
    return torch.addcmul(x * c, _rotate_half(x), s)


@correct("9.2")
def rotary_in_place_on_new_tensors(x, cos, sin, offset=0):
    """In-place ops only on tensors made in this call (x * cos and rotate_half(x))."""
    rows = slice(offset, offset + x.size(-2))
    out = x.mul(cos[rows].to(x.dtype))
    out.add_(_rotate_half(x).mul_(sin[rows].to(x.dtype)))
    return out


@correct("9.2")
def rotary_halves_written_out(x, cos, sin, offset=0):
    """x'_i = x_i cos - x_{i+d/2} sin, x'_{i+d/2} = x_{i+d/2} cos + x_i sin, from the first half of the tables."""
    half = x.shape[-1] // 2
    c = cos[offset:offset + x.shape[-2], :half].to(x.dtype)
    s = sin[offset:offset + x.shape[-2], :half].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@bug("9.2", "rope_positions")
def rotary_tables_sliced_and_offset_again(x, cos, sin, offset=0):
    """Slices the tables from offset, then takes rows offset.. of the slice again: positions 2*offset .."""
    cos, sin = cos[offset:], sin[offset:]
    length = x.shape[-2]
    c = cos[offset:offset + length].to(x.dtype)
    s = sin[offset:offset + length].to(x.dtype)
    return x * c + _rotate_half(x) * s


@bug("9.2", "rope_rotation")
def rotary_rotate_half_applied_twice(x, cos, sin, offset=0):
    """rotate_half(rotate_half(x)) = -x: the sine term negates x instead of turning it."""
    length = x.shape[-2]
    c = cos[offset:offset + length].to(x.dtype)
    s = sin[offset:offset + length].to(x.dtype)
    return x * c + _rotate_half(_rotate_half(x)) * s


@bug("9.2", "rope_positions")
def rotary_rows_counted_back_from_offset(x, cos, sin, offset=0):
    """Rows offset - L + 1 .. offset: the offset read as the position of the LAST token (clamped at 0)."""
    length = x.shape[-2]
    first = max(offset - length + 1, 0)
    c = cos[first:first + length].to(x.dtype)
    s = sin[first:first + length].to(x.dtype)
    return x * c + _rotate_half(x) * s


# ============================================================================ 9.5 repeat_kv

@bug("9.5", "exception", "contiguous")
def repeat_kv_kron(x, groups):
    """Kronecker product with ones (1, groups, 1, 1): the right order, but torch.kron views its input and raises on
    the non-contiguous x that split_heads hands over (a real crash in 9.6)."""
    return torch.kron(x, torch.ones(1, groups, 1, 1, dtype=x.dtype, device=x.device))


@correct("9.5")
def repeat_kv_interleave_by_tensor(x, groups):
    """repeat_interleave with a tensor of repeats (one per kv head), on x's device."""
    repeats = torch.full((x.shape[1],), groups, dtype=torch.long, device=x.device)
    return x.repeat_interleave(repeats, dim=1, output_size=x.shape[1] * groups)


@correct("9.5")
def repeat_kv_broadcast_add(x, groups):
    """x[:, :, None] plus zeros (1, 1, groups, 1, 1) broadcasts to the groups, then flattened."""
    n, kv, length, d = x.shape
    z = x.new_zeros(1, 1, groups, 1, 1)
    return (x[:, :, None] + z).reshape(n, kv * groups, length, d)


@bug("9.5", "kv_grouping")
def repeat_kv_kron_other_order(x, groups):
    """kron(ones, x): the heads come out tiled [0, 1, 0, 1]."""
    return torch.kron(torch.ones(1, groups, 1, 1, dtype=x.dtype, device=x.device), x)


@bug("9.5", "kv_grouping")
def repeat_kv_flip_within_groups(x, groups):
    """Builds [0, 0, 1, 1] then reverses the whole head axis: [1, 1, 0, 0]."""
    return x.repeat_interleave(groups, dim=1).flip(1)


@bug("9.5", "dtype")
def repeat_kv_by_matmul_default_dtype(x, groups):
    """A 0/1 selection matrix made in float32 (no dtype=): promotes bfloat16/float16 x, fails on float64."""
    kv = x.shape[1]
    sel = (torch.arange(kv * groups, device=x.device)[:, None] // groups
           == torch.arange(kv, device=x.device)[None, :]).float()
    return torch.einsum("hk,nkld->nhld", sel.to(torch.promote_types(sel.dtype, x.dtype)), x.to(torch.promote_types(sel.dtype, x.dtype)))


# ============================================================================ 9.6 GroupedQueryAttention

from course_lib import modern as _modern
from course_lib.attention import KVCache as _KVCache
from course_lib.attention import causal_mask as _causal_mask
from course_lib.attention import merge_heads as _merge_heads
from course_lib.attention import split_heads as _split_heads


def apply_rotary(x, cos, sin, offset=0):
    length = x.shape[-2]
    return x * cos[offset:offset + length].to(x.dtype) + _rotate_half(x) * sin[offset:offset + length].to(x.dtype)


def repeat_kv(x, groups):
    return x.repeat_interleave(groups, dim=1)


class _NbGQA40(nn.Module):
    """The notebook's given constructor of 9.6."""

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


@correct("9.6")
class GQAPerHeadLoopMaskFromTheEnd(_NbGQA40):
    """Each query head in a Python loop against its kv head h // groups; mask rows [-L:] of causal_mask(total)."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        q = _split_heads(self.query(x), self.num_heads)
        k = _split_heads(self.key(x), self.num_kv_heads)
        v = _split_heads(self.value(x), self.num_kv_heads)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        total = k.shape[-2]
        mask = _causal_mask(total, device=x.device)[-x.shape[1]:]
        outs = []
        for h in range(self.num_heads):
            kh, vh = k[:, h // self.groups], v[:, h // self.groups]
            s = q[:, h] @ kh.transpose(-2, -1) / math.sqrt(self.head_dim)
            s = s.masked_fill(~mask, float("-inf"))
            outs.append(s.softmax(-1) @ vh)
        return self.proj(torch.cat(outs, dim=-1))


@bug("9.6", "rope_positions")
class GQATablesSlicedAndOffset(_NbGQA40):
    """Slices the tables from start AND passes offset=start: the new tokens turn to positions 2*start .."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        total = start + x.shape[1]
        cos, sin = self.rope_cos[start:], self.rope_sin[start:]
        q = apply_rotary(_split_heads(self.query(x), self.num_heads), cos, sin, offset=start)
        k = apply_rotary(_split_heads(self.key(x), self.num_kv_heads), cos, sin, offset=start)
        v = _split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = _causal_mask(total, device=x.device)[start:total]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(_merge_heads(out))


@bug("9.6", "kv_grouping")
class GQAGroupsOfHeadsByModulo(_NbGQA40):
    """Query heads grouped h % num_kv_heads through a reshape (N, groups, kv, L, d): the tiled order."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        total = start + x.shape[1]
        q = apply_rotary(_split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(_split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = _split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        n, _, length, d = q.shape
        qg = q.reshape(n, self.groups, self.num_kv_heads, length, d)
        mask = _causal_mask(total, device=x.device)[start:total]
        s = qg @ k[:, None].transpose(-2, -1) / math.sqrt(d)
        s = s.masked_fill(~mask, float("-inf"))
        out = (s.softmax(-1) @ v[:, None]).reshape(n, self.num_heads, length, d)
        return self.proj(_merge_heads(out))


@bug("9.6", "scale")
class GQAScaleFromKvWidth(_NbGQA40):
    """Scale from the key projection's width: 1/sqrt(num_kv_heads * head_dim)."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        total = start + x.shape[1]
        q = apply_rotary(_split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(_split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = _split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = _causal_mask(total, device=x.device)[start:total]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             scale=1 / math.sqrt(self.key.out_features))
        return self.proj(_merge_heads(out))


# ============================================================================ 10.1 online_softmax

@correct("10.1")
def online_softmax_exp2(x, block_size):
    """FlashAttention-2's exp2: scores times log2(e), base-2 exponentials throughout."""
    log2e = 1.4426950408889634
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size] * log2e
        m_new = torch.maximum(m, b.amax(-1))
        safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        l = l * torch.exp2(m - safe) + torch.exp2(b - safe[..., None]).sum(-1)
        m = m_new
    return torch.exp2(x * log2e - m[..., None]) / l[..., None]


@correct("10.1")
def online_softmax_guard_by_equal_maxima(x, block_size):
    """The rescale is 1 where the maximum did not move (both -inf included); the block is measured against a
    clamped maximum (finite), which is the same where the maximum is finite."""
    m = x.new_full(x.shape[:-1], float("-inf"))
    l = x.new_zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(dim=-1))
        c = torch.where(m == m_new, torch.ones_like(m), torch.exp(m - m_new))
        ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        l = l * c + torch.exp(b - ref[..., None]).sum(dim=-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "exception", "non-zero size")
def online_softmax_whole_blocks_then_tail(x, block_size):
    """Whole blocks, then the tail x[..., L - L % B:] as a last block: an empty tail when B divides L."""
    L = x.shape[-1]
    m = x.new_full(x.shape[:-1], float("-inf"))
    l = x.new_zeros(x.shape[:-1])
    starts = list(range(0, L - L % block_size, block_size))
    blocks = [x[..., s:s + block_size] for s in starts] + [x[..., L - L % block_size:]]
    for b in blocks:
        m_new = torch.maximum(m, b.amax(-1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe) + torch.exp(b - safe[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "batch_mixing")
def online_softmax_one_sum_for_all_rows(x, block_size):
    """A running maximum per row, but the sum of every row's block added into one number."""
    m = x.new_full(x.shape[:-1], float("-inf"))
    l = x.new_zeros(())
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(-1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = (l * torch.exp(m - safe) + torch.exp(b - safe[..., None]).sum(-1)).sum()
        m = m_new
    return torch.exp(x - m[..., None]) / l


@bug("10.1", "online_rescale")
def online_softmax_rescale_only_first_block(x, block_size):
    """Rescales l only after the first block (a flag), later maxima growths leave l measured against old ones."""
    m = x.new_full(x.shape[:-1], float("-inf"))
    l = x.new_zeros(x.shape[:-1])
    for i, s in enumerate(range(0, x.shape[-1], block_size)):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(-1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        c = torch.exp(m - safe) if i <= 1 else torch.ones_like(m)
        l = l * c + torch.exp(b - safe[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ 10.2 flash_attention

def _flash40(q, k, v, block_q, block_k, causal, *, exp2=False, lse_units="e", scale_inside=False):
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    log2e = 1.4426950408889634
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        q_blk = q[..., qs:qe, :] if scale_inside else q[..., qs:qe, :] * scale
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = q_blk @ k[..., ks:ke, :].transpose(-2, -1)
            if exp2:
                s = s * log2e
            if causal and ke - 1 > qs:
                future = torch.arange(ks, ke, device=q.device)[None, :] > torch.arange(qs, qe, device=q.device)[:, None]
                s = s.masked_fill(future, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            if exp2:
                p, c = torch.exp2(s - m_new[..., None]), torch.exp2(m - m_new)
            elif scale_inside:
                p, c = torch.exp((s - m_new[..., None]) * scale), torch.exp((m - m_new) * scale)
            else:
                p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        outs.append(acc / l[..., None])
        if exp2:
            lses.append((m + torch.log2(l)) / log2e if lse_units == "e" else m + torch.log2(l))
        elif scale_inside:
            lses.append(m * scale + torch.log(l) if lse_units == "e" else m + torch.log(l))
        else:
            lses.append(m + torch.log(l))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


@correct("10.2")
def flash_exp2_natural_lse(q, k, v, *, block_q, block_k, causal=False):
    """exp2 throughout (scores times log2 e), lse converted back to natural log at the end."""
    return _flash40(q, k, v, block_q, block_k, causal, exp2=True)


@correct("10.2")
def flash_scale_inside_the_exp(q, k, v, *, block_q, block_k, causal=False):
    """Unscaled scores and maxima, the scale applied inside each exp (as FlashAttention-2's kernel does); the lse
    scales the maximum."""
    return _flash40(q, k, v, block_q, block_k, causal, scale_inside=True)


@bug("10.2", "logsumexp")
def flash_exp2_lse_in_bits(q, k, v, *, block_q, block_k, causal=False):
    """exp2 throughout, but the lse left in base 2 (m + log2 l)."""
    return _flash40(q, k, v, block_q, block_k, causal, exp2=True, lse_units="2")


@bug("10.2", "logsumexp")
def flash_scale_inside_lse_unscaled_max(q, k, v, *, block_q, block_k, causal=False):
    """The scale inside the exps, but the lse adds the UNSCALED maximum: m + log l."""
    return _flash40(q, k, v, block_q, block_k, causal, scale_inside=True, lse_units="raw")


@bug("10.2", "scale")
def flash_exp2_without_log2e(q, k, v, *, block_q, block_k, causal=False):
    """exp2 of the natural-log scores (no log2 e factor): a softmax of base 2, i.e. the scores times ln 2."""
    out, lse = _flash40(q, k * 0.6931471805599453, v, block_q, block_k, causal, exp2=True)
    return out, lse


@bug("10.1", "batch_mixing")
def online_softmax_block_sum_without_dim(x, block_size):
    """The block's exps summed with .sum() (no dim): every row's sum gets all rows' terms."""
    m = x.new_full(x.shape[:-1], float("-inf"))
    l = x.new_zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(-1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe) + torch.exp(b - safe[..., None]).sum()
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ 12.2 latent_attention

from course_lib import modern as _m12


def _mla40(layer, x, cache=None, *, mask_kind="bool", softmax_f32=False, k_rope_repeat=False, v_tail=False,
           loop_heads=False):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, heads, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q = q.view(n, length, heads, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = _m12.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = _m12.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, heads, dn + dv).transpose(1, 2)
    k_nope = kv[..., :dn]
    v = kv[..., -dn:] if v_tail else kv[..., dn:]
    kr = k_rope[:, None].repeat(1, heads, 1, 1) if k_rope_repeat else k_rope[:, None].expand(n, heads, total, dr)
    k = torch.cat([k_nope, kr], dim=-1)
    scores = torch.cat([q_nope, q_rope], dim=-1) @ k.transpose(-2, -1) * layer.softmax_scale
    if mask_kind == "bool":
        mask = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:]
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask_kind == "triu_inf":
        scores = scores + torch.full((length, total), float("-inf"), dtype=x.dtype, device=x.device).triu(start + 1)
    elif mask_kind == "triu_inf_off":
        scores = scores + torch.full((length, total), float("-inf"), dtype=x.dtype, device=x.device).triu(start)
    if softmax_f32:
        w = scores.float().softmax(-1).to(scores.dtype)
    else:
        w = scores.softmax(-1)
    out = w @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, heads * dv))


@correct("12.2")
def latent_additive_mask_by_triu_of_inf(layer, x, cache=None):
    """An additive mask: a (L, T) tensor of -inf in x's dtype, triu(start + 1) zeroes the visible part."""
    return _mla40(layer, x, cache, mask_kind="triu_inf")


@correct("12.2")
def latent_softmax_in_float32_cast_back(layer, x, cache=None):
    return _mla40(layer, x, cache, softmax_f32=True)


@correct("12.2")
def latent_rotary_key_repeated_per_head(layer, x, cache=None):
    """The shared rotary key copied for every head with .repeat (expand's values, as a real copy)."""
    return _mla40(layer, x, cache, k_rope_repeat=True)


@bug("12.2", "causal_mask")
def latent_additive_triu_hides_the_diagonal(layer, x, cache=None):
    """triu(start) instead of triu(start + 1): each query's own key hidden too."""
    return _mla40(layer, x, cache, mask_kind="triu_inf_off")


@bug("12.2", "exception")
def latent_values_from_the_tail_by_dn(layer, x, cache=None):
    """v = kv[..., -dn:]: the last dn numbers (right only when dn == dv)."""
    return _mla40(layer, x, cache, v_tail=True)


@bug("12.2", "causal_mask")
def latent_bool_mask_below_the_diagonal(layer, x, cache=None):
    """tril(diagonal=-1) for the bool mask (strictly below the diagonal): a query may not see its own key, the
    first query sees nothing (NaN there)."""
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    total = start + length
    out_mask = torch.ones(total, total, dtype=torch.bool, device=x.device).tril(-1)[start:]

    dn, dr, heads, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q = q.view(n, length, heads, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = _m12.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = _m12.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    kv = layer.kv_b_proj(latent).view(n, total, heads, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], dim=-1)
    scores = torch.cat([q_nope, q_rope], -1) @ k.transpose(-2, -1) * layer.softmax_scale
    w = scores.masked_fill(~out_mask, float("-inf")).softmax(-1)
    return layer.o_proj((w @ v).transpose(1, 2).reshape(n, length, heads * dv))


@bug("12.2", "dtype", "tuple")
def latent_returns_output_and_cache(layer, x, cache=None):
    """Returns (output, cache), as some Hugging Face layers return a tuple."""
    return _mla40(layer, x, cache), cache


# ---------------------------------------------------------------- odd return values and combinations

@bug("10.2", "shape")
def flash_lse_keepdim(q, k, v, *, block_q, block_k, causal=False):
    """lse of shape (N, heads, Lq, 1): the statistics kept with keepdim."""
    out, lse = _flash40(q, k, v, block_q, block_k, causal)
    return out, lse[..., None]


@bug("10.2", "shape", "dict")
def flash_returns_a_dict(q, k, v, *, block_q, block_k, causal=False):
    out, lse = _flash40(q, k, v, block_q, block_k, causal)
    return {"out": out, "lse": lse}


@bug("10.2", "nan", "key 0")
def flash_local_coordinates_hiding_own_key(q, k, v, *, block_q, block_k, causal=False):
    """Diagonal blocks masked in block coordinates with >= (col >= row): the own key hidden, and the wrong keys
    where the blocks do not line up."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        q_blk = q[..., qs:qe, :] * scale
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = q_blk @ k[..., ks:ke, :].transpose(-2, -1)
            if causal and ke - 1 > qs:
                r = torch.arange(qe - qs, device=q.device)[:, None]
                c = torch.arange(ke - ks, device=q.device)[None, :]
                s = s.masked_fill(c >= r, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p, cc = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l = l * cc + p.sum(-1)
            acc = acc * cc[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, -2), torch.cat(lses, -1)


@bug("1.3", "softmax_dim")
def sdpa_softmax_over_queries_and_scaled_by_d(q, k, v, mask=None):
    """Two slips: the softmax over the queries (dim=-2) and the scores divided by d."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-2) @ v


@bug("9.2", "rope_rotation")
def rotary_sign_flipped_and_offset_ignored(x, cos, sin, offset=0):
    """Two slips: cat(x2, -x1) (turns backwards) and the offset ignored."""
    length = x.shape[-2]
    x1, x2 = x.chunk(2, -1)
    return x * cos[:length].to(x.dtype) + torch.cat([x2, -x1], -1) * sin[:length].to(x.dtype)


@correct("4.1")
def sinusoidal_table_as_a_buffer_parameter(max_tokens, embed_dim):
    """Returns the table wrapped in nn.Parameter(requires_grad=False) (a student preparing a module buffer)."""
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    angles = position * torch.exp(torch.arange(0, embed_dim, 2, dtype=torch.float32) * (-math.log(10000.0) / embed_dim))
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)
    return nn.Parameter(table, requires_grad=False)


@bug("9.6", "dtype", "tuple")
class GQAReturnsOutputAndCache(_NbGQA40):
    """forward returns (output, cache), Hugging Face style."""

    def forward(self, x, cache=None):
        start = cache.length if cache is not None else 0
        total = start + x.shape[1]
        q = apply_rotary(_split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(_split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = _split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        mask = _causal_mask(total, device=x.device)[start:total]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(_merge_heads(out)), cache


# ---------------------------------------------------------------- data-dependent branches (valid on any device)

@correct("1.3")
def sdpa_skips_a_mask_that_hides_nothing(q, k, v, mask=None):
    """Masks only when the mask hides something (a data-dependent branch: fine on a GPU, unreadable on meta)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None and not bool(mask.all()):
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@correct("10.1")
def online_softmax_guard_only_when_needed(x, block_size):
    """The -inf guard taken only when a row's maximum is still -inf (checked with .any())."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(-1))
        ref = m_new
        if torch.isneginf(m_new).any():
            ref = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - ref) + torch.exp(b - ref[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("10.2")
def flash_skips_blocks_by_data(q, k, v, *, block_q, block_k, causal=False):
    """The reference loop; the causal diagonal mask applied only when it hides something (checked with .any())."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        q_blk = q[..., qs:qe, :] * scale
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = q_blk @ k[..., ks:ke, :].transpose(-2, -1)
            if causal:
                future = torch.arange(ks, ke, device=q.device)[None, :] > torch.arange(qs, qe, device=q.device)[:, None]
                if future.any():
                    s = s.masked_fill(future, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p, c = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, -2), torch.cat(lses, -1)


# ---------------------------------------------------------------- 12.2 the latent's RMSNorm written by hand

def _mla_hand_norm(layer, x, cache=None, *, eps=None, weight=True, wide=True):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, heads, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q = q.view(n, length, heads, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = _m12.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    norm = layer.kv_a_layernorm
    h = latent.to(torch.promote_types(latent.dtype, torch.float32)) if wide else latent
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + (norm.eps if eps is None else eps))
    if weight:
        h = h * norm.weight.to(h.dtype)
    latent = h.to(x.dtype)
    k_rope = _m12.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, heads, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], dim=-1)
    scores = torch.cat([q_nope, q_rope], -1) @ k.transpose(-2, -1) * layer.softmax_scale
    mask = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:]
    w = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return layer.o_proj((w @ v).transpose(1, 2).reshape(n, length, heads * dv))


@correct("12.2")
def latent_norm_by_hand_with_the_layers_eps(layer, x, cache=None):
    """The latent's RMSNorm written out with kv_a_layernorm's own eps and weight, in float32 at least."""
    return _mla_hand_norm(layer, x, cache)


@bug("12.2", "epsilon")
def latent_norm_by_hand_eps_written_in(layer, x, cache=None):
    """The latent's RMSNorm by hand with eps=1e-6 written in (the layer's norm_eps may differ)."""
    return _mla_hand_norm(layer, x, cache, eps=1e-6)


@bug("12.2", "norm_weight")
def latent_norm_by_hand_without_weight(layer, x, cache=None):
    """The latent's RMSNorm by hand, its learned weight left out."""
    return _mla_hand_norm(layer, x, cache, weight=False)


@bug("1.3", "exception")
def sdpa_padding_mask_unsqueezed(q, k, v, mask=None):
    """Hugging Face habit: a padding mask (N, Lk) unsqueezed to (N, 1, Lk) -- here it already is broadcastable."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return scores.softmax(-1) @ v


# ---------------------------------------------------------------- odd containers

@bug("2.1", "dtype")
def causal_mask_sparse(n):
    """A sparse COO bool tensor (only the True entries stored)."""
    return torch.ones(n, n, dtype=torch.bool).tril().to_sparse()


@correct("4.1")  # or a dtype verdict; never checker_error
def sinusoidal_table_numpy_longdouble(max_tokens, embed_dim):
    """numpy in extended precision (np.longdouble) all the way, returned as that array."""
    pos = np.arange(max_tokens, dtype=np.longdouble)[:, None]
    two_i = np.arange(0, embed_dim, 2, dtype=np.longdouble)
    angles = pos / np.power(np.longdouble(10000), two_i / embed_dim)
    table = np.empty((max_tokens, embed_dim), dtype=np.longdouble)
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return table


@bug("4.1", "precision")
def sinusoidal_table_numpy_float16(max_tokens, embed_dim):
    """numpy in float16 throughout."""
    pos = np.arange(max_tokens, dtype=np.float16)[:, None]
    two_i = np.arange(0, embed_dim, 2, dtype=np.float16)
    angles = pos / np.power(np.float16(10000), two_i / np.float16(embed_dim))
    table = np.empty((max_tokens, embed_dim), dtype=np.float16)
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return table


@correct("9.5")
def repeat_kv_numpy_free_gather(x, groups):
    """torch.gather along the heads with an index expanded to the output's shape (made on x's device)."""
    n, kv, length, d = x.shape
    idx = (torch.arange(kv * groups, device=x.device) // groups).view(1, -1, 1, 1).expand(n, -1, length, d)
    return torch.gather(x, 1, idx)


@bug("9.1", "dtype")
def rope_tables_numpy_longdouble(head_dim, max_tokens, theta=10000.0):
    """numpy in extended precision, tables returned as np.longdouble arrays (not float32)."""
    inv = np.power(np.longdouble(theta), -np.arange(0, head_dim, 2, dtype=np.longdouble) / head_dim)
    angles = np.arange(max_tokens, dtype=np.longdouble)[:, None] * inv
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)


@bug("9.5", "dtype")
def repeat_kv_through_numpy_longdouble(x, groups):
    """Through numpy in extended precision (a student 'keeping every digit')."""
    a = x.detach().cpu().numpy().astype(np.longdouble)
    return np.repeat(a, groups, axis=1)
