"""Student attempts that the nineteenth scripted search of the checks found misjudged (2026-11-30), one per class.

Before, each was passed while wrong, or failed with a message that named a mistake it does not make (the
weights "look right" when the keys came from the query layer, an output of all inf read as a loop that stops
early, a skipped key block read as a row never written); now each gets the diagnosis of the mistake it makes.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from bank.model_bugs import GivenBlock
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.flash import FlashAttentionFunction
from course_lib.modern import GroupedQueryAttention, apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.3, 2.2, 3.3: the scores themselves

@bug("1.3", "mismatch", "not the softmax of the scores")
def sdpa_cosine_scores(q, k, v, mask=None):
    unit_q, unit_k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    scores = unit_q @ unit_k.transpose(-2, -1) / math.sqrt(q.shape[-1])   # the slip: cosines, not dot products
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@bug("2.2", "mismatch", "not the softmax of the scores", "which layer makes each", avoids=("look right",))
class MaskedAttentionKeysFromTheQueryLayer(nn.Module):
    def __init__(self, embed_dim, max_tokens, dropout=0.0):
        super().__init__()
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout)
        self.proj_dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.ones(max_tokens, max_tokens, dtype=torch.bool).tril())

    def forward(self, x):
        length, dim = x.shape[1], x.shape[2]
        q, k, v = self.query(x), self.query(x), self.value(x)     # copied line: key is never used
        scores = q @ k.transpose(-2, -1) / math.sqrt(dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights @ v))


@bug("3.3", "mismatch", "not the softmax of the scores", "which slice each head takes")
class MultiHeadKeysSplitInterleaved(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout)
        self.proj_dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.ones(max_tokens, max_tokens, dtype=torch.bool).tril())

    def forward(self, x):
        n, length, dim = x.shape
        h, d = self.num_heads, dim // self.num_heads
        q = self.query(x).view(n, length, h, d).transpose(1, 2)            # (N, heads, L, head_dim)
        k = self.key(x).view(n, length, d, h).permute(0, 3, 1, 2)          # the slip: every h-th feature
        v = self.value(x).view(n, length, h, d).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~self.mask[:length, :length], float("-inf"))
        out = self.attn_dropout(torch.softmax(scores, dim=-1)) @ v         # (N, heads, L, head_dim)
        return self.proj_dropout(self.proj(out.transpose(1, 2).reshape(n, length, dim)))


# ============================================================================ 10.1: where the rescale goes

def _online(x, block_size, combine):
    m = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s:s + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = combine(l, torch.exp(block - m_new[..., None]).sum(-1), torch.exp(m - m_new))
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "online_rescale", "multiplies the new block's terms too", avoids=("stops before the last block",))
def online_softmax_rescaled_after_adding(x, block_size):
    return _online(x, block_size, lambda l, terms, c: (l + terms) * c)


@bug("10.1", "online_rescale", "instead of the old sum")
def online_softmax_new_terms_rescaled(x, block_size):
    return _online(x, block_size, lambda l, terms, c: l + terms * c)


@bug("10.1", "not_tiled", "one per block", "update them as each block is read", avoids=("blocks of 4 entries,",))
def online_softmax_statistics_stacked(x, block_size):
    maxima, sums = [], []
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s:s + block_size]
        maxima.append(block.amax(-1))
        sums.append(torch.exp(block - block.amax(-1, keepdim=True)).sum(-1))
    maxima, sums = torch.stack(maxima, -1), torch.stack(sums, -1)     # (..., blocks)
    m = maxima.amax(-1)
    l = (sums * torch.exp(maxima - m[..., None])).sum(-1)
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ 10.2: the tiled forward

def _forward(q, k, v, block_q, block_k, causal, *, key_stop=None, mask_when=None, factor_on="old", swap=False):
    """One tiled forward, spelled out, with one of the slips below."""
    if swap:                                                   # the slip: block_k queries, block_q keys
        block_q, block_k = block_k, block_q
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        m = torch.full(q[..., qs:qe, 0].shape, -math.inf, dtype=q.dtype)
        l = torch.zeros_like(m)
        acc = torch.zeros(*m.shape, v.shape[-1], dtype=q.dtype)
        stop = (key_stop or (lambda qs, qe, lk: min(lk, qe)))(qs, qe, lk) if causal else lk
        for ks in range(0, stop, block_k):
            ke = min(ks + block_k, lk)
            s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale          # (..., Bq, Bk)
            if causal and (mask_when is None or mask_when(qs, ks)):
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            if factor_on == "all":
                l, acc = (l + p.sum(-1)) * c, (acc + p @ v[..., ks:ke, :]) * c[..., None]
            elif factor_on == "new":
                l, acc = l + p.sum(-1) * c, acc + (p @ v[..., ks:ke, :]) * c[..., None]
            else:
                l, acc = l * c + p.sum(-1), acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = m + torch.log(l)
    return out, lse


@bug("10.2", "block_skip", "too few keys", "not qe - 1", avoids=("never written",))
def flash_key_loop_stops_at_the_last_query(q, k, v, *, block_q, block_k, causal=False):
    return _forward(q, k, v, block_q, block_k, causal, key_stop=lambda qs, qe, lk: min(lk, qe - 1))


@bug("10.2", "not_tiled", "block_k = 8 queries and block_q = 16 keys")
def flash_block_sizes_swapped(q, k, v, *, block_q, block_k, causal=False):
    return _forward(q, k, v, block_q, block_k, causal, swap=True)


@bug("10.2", "causal_mask", "the future leaks")
def flash_masks_only_blocks_from_the_query_block_on(q, k, v, *, block_q, block_k, causal=False):
    return _forward(q, k, v, block_q, block_k, causal, mask_when=lambda qs, ks: ks >= qs)


@bug("10.2", "online_rescale", "multiplies the new block's terms too")
def flash_rescaled_after_adding(q, k, v, *, block_q, block_k, causal=False):
    return _forward(q, k, v, block_q, block_k, causal, factor_on="all")


@bug("10.2", "online_rescale", "instead of the old l and acc")
def flash_new_terms_rescaled(q, k, v, *, block_q, block_k, causal=False):
    return _forward(q, k, v, block_q, block_k, causal, factor_on="new")


# ============================================================================ 10.3: the backward's loops

def _backward(ctx, grad_out, *, skip=True, swap=False):
    q, k, v, out, lse = ctx.saved_tensors
    block_q, block_k = (ctx.block_k, ctx.block_q) if swap else (ctx.block_q, ctx.block_k)
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(-1)                                            # (..., Lq)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        for ks in range(0, min(lk, qe) if ctx.causal and skip else lk, block_k):
            ke = min(ks + block_k, lk)
            s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
            if ctx.causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], -math.inf)
            p = torch.exp(s - lse[..., qs:qe, None])
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ grad_out[..., qs:qe, :]
            ds = p * (grad_out[..., qs:qe, :] @ v[..., ks:ke, :].transpose(-2, -1) - delta[..., qs:qe, None])
            dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :] * scale
    return dq, dk, dv, None, None, None


@bug("10.3", "block_skip", "computes the scores of every key block")
class BackwardNeverSkips(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, skip=False)


@bug("10.3", "not_tiled", "block_k = 8 queries and block_q = 16 keys")
class BackwardBlockSizesSwapped(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, swap=True)


@correct("10.3")
class BackwardKeyBlocksOutside(FlashAttentionFunction):
    """Key blocks in the outer loop (dk and dv finished one block at a time), the query blocks that can see
    them inside: the same blocks skipped, in another order."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out * out).sum(-1)
        for ks in range(0, lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            first = (ks // ctx.block_q) * ctx.block_q if ctx.causal else 0   # the query block holding key ks
            for qs in range(first, lq, ctx.block_q):
                qe = min(qs + ctx.block_q, lq)
                s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
                if ctx.causal:
                    s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                      > torch.arange(qs, qe, device=q.device)[:, None], -math.inf)
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ grad_out[..., qs:qe, :]
                ds = p * (grad_out[..., qs:qe, :] @ v[..., ks:ke, :].transpose(-2, -1) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :] * scale
        return dq, dk, dv, None, None, None


# ============================================================================ 11.1: the diagonal's axes

@bug("11.1", "score_offset", "dims swapped")
def previous_token_score_dims_swapped(weights):
    return weights.diagonal(offset=-1, dim1=-1, dim2=-2).mean(dim=(0, 2))   # the slip: keys as dim1


# ============================================================================ 4.2: dropout the sublayers carry

@bug("4.2", "dropout", "same random draws")
class BlockWithThePapersResidualDropout(GivenBlock):
    """The 2017 paper's "dropout on each sub-layer output, before it is added", on top of the dropout that
    self.attn and self.mlp already apply."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__(embed_dim, num_heads, max_tokens, dropout_rate)
        self.drop = nn.Dropout(dropout_rate)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


@bug("4.2", "dropout", "same random draws")
class BlockDropoutOnTheStream(GivenBlock):
    def forward(self, x):
        x = F.dropout(x + self.attn(self.ln1(x)), 0.1, self.training)
        return x + self.mlp(self.ln2(x))


# ============================================================================ 9.1: the two tables

def _angles(head_dim, max_tokens, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return torch.outer(torch.arange(max_tokens, dtype=torch.float64), inv_freq)      # (max_tokens, head_dim/2)


@bug("9.1", "rope_layout", "first head_dim/2 columns")
def rope_tables_first_half_only(head_dim, max_tokens, theta=10000.0):
    angles = torch.zeros(max_tokens, head_dim, dtype=torch.float64)
    angles[:, :head_dim // 2] = _angles(head_dim, max_tokens, theta)   # the slip: the second half left at 0
    return angles.cos().float(), angles.sin().float()


@bug("9.1", "rope_rotation", "right sign")
def rope_sines_from_the_cosines(head_dim, max_tokens, theta=10000.0):
    cos = torch.cat([_angles(head_dim, max_tokens, theta)] * 2, dim=-1).cos()
    return cos.float(), (1 - cos ** 2).sqrt().float()                 # the slip: never negative


@correct("9.1")
def rope_tables_as_a_generator(head_dim, max_tokens, theta=10000.0):
    angles = torch.cat([_angles(head_dim, max_tokens, theta)] * 2, dim=-1)
    return (table.float() for table in (angles.cos(), angles.sin()))   # `cos, sin = ...` unpacks it


# ============================================================================ 9.3: eps clamped, not added

@bug("9.3", "epsilon", "clamp")
class RMSNormClampedAtEps(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(self.eps)
        return x / rms * self.weight


# ============================================================================ 9.6: a scale right only for MHA

@bug("9.6", "scale", "num_kv_heads=2")
class GQAHeadDimFromTheKeyWidth(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        d = self.key.out_features // self.num_heads                  # the slip: the key width is num_kv_heads wide
        scores = q @ repeat_kv(k, self.groups).transpose(-2, -1) / math.sqrt(d)
        total = k.shape[2]
        scores = scores.masked_fill(~causal_mask(total)[start:total], float("-inf"))
        return self.proj(merge_heads(scores.softmax(-1) @ repeat_kv(v, self.groups)))


# ============================================================================ a twentieth search: 1.2, 1.3, 5.4, 12.2

@bug("1.2", "gradient", "leaves torch")
def toy_attention_in_numpy(query, keys, values):
    scores = keys.numpy() @ query.numpy()                            # right numbers, outside autograd
    weights = np.exp(scores - scores.max())
    weights = weights / weights.sum()
    return torch.as_tensor(weights @ values.numpy())


@bug("1.3", "exception", avoids=("only apply the mask",))
def sdpa_transposes_axes_one_and_two(q, k, v, mask=None):
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])      # the keys' last two axes only when q is 3-D
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@bug("5.4", "mismatch", "one random draw serves the whole batch", avoids=("most likely token",))
def sample_with_one_uniform_for_every_row(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    cumulative = logits.softmax(-1).cumsum(-1)
    u = torch.rand(1, generator=generator)                         # the slip: one draw for the batch
    return (cumulative < u).sum(-1).clamp_max(logits.shape[-1] - 1)
