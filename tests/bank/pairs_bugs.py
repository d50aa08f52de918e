"""Student attempts from an eighth scripted search (2026-11-29): the write-ups' famous bugs in every exercise where
they can occur, and two mistakes at once.

Before, each single bug here was "mismatch", and each pair a "mismatch" whose message said the code was like no
mistake we know; now a single bug is named, and one of two is named on an input where the other has no effect.
"""
from __future__ import annotations

import math

import torch

from bank.attempts import new_bank
from course_lib import flash, modern

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 7.2: the mask after the softmax
@bug("7.2", "normalization", "after the softmax")
def hf_attention_masked_after_softmax(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The hidden weights zeroed after the softmax: rows no longer sum to one (2.2 and 3.3 named it already)."""
    q_len, k_len = query.shape[2], key.shape[2]
    allowed = (torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len) if attention_mask is None
               else attention_mask)
    weights = torch.softmax(query @ key.transpose(-2, -1) * scaling, dim=-1).masked_fill(~allowed, 0.0)
    return (weights @ value).transpose(1, 2), None


# ============================================================================ 10.3: the diagonal hidden in the backward
def _backward_hiding_the_diagonal(ctx, grad_out):
    q, k, v, out, lse = ctx.saved_tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(-1)
    for qs in range(0, q.shape[-2], ctx.block_q):
        qe = min(qs + ctx.block_q, q.shape[-2])
        q_block, do_block = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, min(k.shape[-2], qe) if ctx.causal else k.shape[-2], ctx.block_k):
            ke = min(ks + ctx.block_k, k.shape[-2])
            k_block, v_block = k[..., ks:ke, :], v[..., ks:ke, :]
            scores = q_block @ k_block.transpose(-2, -1) * scale
            if ctx.causal:   # >= where > is meant: each query's own key hidden too
                scores = scores.masked_fill(torch.arange(ks, ke)[None, :] >= torch.arange(qs, qe)[:, None],
                                            float("-inf"))
            p = torch.exp(scores - lse[..., qs:qe, None])
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ do_block
            ds = p * (do_block @ v_block.transpose(-2, -1) - delta[..., qs:qe, None])
            dq[..., qs:qe, :] += ds @ k_block * scale
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q_block * scale
    return dq, dk, dv, None, None, None


@bug("10.3", "causal_mask", "own key")
class FlashBackwardHidesTheDiagonal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _backward_hiding_the_diagonal(ctx, grad_out)


# ============================================================================ 12.2: .view without the transpose, and pairs
def _latent(layer, x, cache=None, *, kv_view=False, mask="ok", merge="ok", q_norm=True):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, heads = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(
        (layer.q_a_layernorm if q_norm else torch.nn.Identity())(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, heads, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent)
    kv = (kv.view(n, heads, total, dn + layer.v_head_dim) if kv_view                      # the famous one
          else kv.view(n, total, heads, dn + layer.v_head_dim).transpose(1, 2))            # (N, H, T, dn + dv)
    k_nope, v = kv.split([dn, layer.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], dim=-1)
    scores = torch.cat([q_nope, q_rope], dim=-1) @ k.transpose(-2, -1) * layer.softmax_scale
    allowed = (torch.ones(length, total, dtype=torch.bool).tril() if mask == "top_left"
               else torch.ones(total, total, dtype=torch.bool).tril()[start:])
    out = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v                  # (N, H, L, dv)
    out = {"bare": out, "heads_last": out.permute(0, 2, 3, 1)}.get(merge, out.transpose(1, 2))
    return layer.o_proj(out.reshape(n, length, heads * layer.v_head_dim))


@bug("12.2", "split_transpose", "without the transpose")
def latent_kv_viewed_without_transpose(layer, x, cache=None):
    """kv_b_proj's output viewed straight as (N, H, T, ...)."""
    return _latent(layer, x, cache, kv_view=True)


@bug("12.2", "head_split", "second mistake")
def latent_top_left_mask_and_bare_merge(layer, x, cache=None):
    """Two mistakes: a mask cut from the top left (right without a cache) and heads merged by a bare reshape. No
    single mistake explains every case; the merge alone explains the cases without a cache."""
    return _latent(layer, x, cache, mask="top_left", merge="bare")
