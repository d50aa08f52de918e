"""Student attempts at the exercises of notebook 10 (10.1-10.3), correct and buggy, as students write them.

Each buggy attempt carries the diagnosis its checker must give (and words its message must contain); each
correct attempt must pass. The backward attempts keep the notebook's given forward (they subclass the
reference) and only write ``backward``, as exercise 10.3 asks.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import flash
from course_lib.flash import FlashAttentionFunction

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 10.1 online_softmax

def _softmax_loop(x, block_size, *, rescale="ok", maximum="running", bounds="ok", every=False):
    """The shape most attempts share, with one slip switched on (each attempt below spells its own out)."""
    m = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    length = x.shape[-1]
    starts = {"ok": range(0, length, block_size), "stop_early": range(0, length - block_size, block_size)}[bounds]
    out = torch.empty_like(x)
    for s in starts:
        block = x[..., s:s + block_size]
        m_new = {"running": torch.maximum(m, block.amax(-1)), "last": block.amax(-1),
                 "none": torch.zeros_like(m)}[maximum]
        factor = {"ok": torch.exp(m - m_new), "none": 1.0, "inverted": torch.exp(m_new - m)}[rescale]
        l = l * factor + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
        if every:
            out[..., s:s + block_size] = torch.exp(block - m[..., None]) / l[..., None]
    return out if every else torch.exp(x - m[..., None]) / l[..., None]


# right before 10.1 asked for rows that start with blocks of -inf (2026-11-30): no guard, NaN there
@bug("10.1", "nan", "-inf", "guard")
def softmax_reference_loop(x, block_size):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.max(dim=-1).values)
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new.unsqueeze(-1)).sum(dim=-1)
        m = m_new
    return torch.exp(x - m.unsqueeze(-1)) / l.unsqueeze(-1)


@correct("10.1")
def softmax_logaddexp(x, block_size):
    lse = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block_size):
        lse = torch.logaddexp(lse, torch.logsumexp(x[..., start:start + block_size], dim=-1))
    return torch.exp(x - lse[..., None])


# right before 10.1 asked for rows that start with blocks of -inf (2026-11-30): no guard, NaN there
@bug("10.1", "nan", "-inf", "guard")
def softmax_split_blocks(x, block_size):
    blocks = torch.split(x, block_size, dim=-1)
    m, l = None, None
    for block in blocks:
        bm = block.amax(-1, keepdim=True)
        bl = torch.exp(block - bm).sum(-1, keepdim=True)
        if m is None:
            m, l = bm, bl
        else:
            m_new = torch.maximum(m, bm)
            l = l * torch.exp(m - m_new) + bl * torch.exp(bm - m_new)
            m = m_new
    return torch.exp(x - m) / l


@correct("10.1")
def softmax_two_passes_by_block(x, block_size):
    # first the maximum, block by block; then the sum, block by block: per-block reductions only
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block_size):
        m = torch.maximum(m, x[..., start:start + block_size].amax(-1))
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        l = l + torch.exp(x[..., start:start + block_size] - m[..., None]).sum(-1)
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "online_rescale", "exp(m_old - m_new)")
def softmax_no_rescale(x, block_size):
    return _softmax_loop(x, block_size, rescale="none")


@bug("10.1", "online_rescale", "upside down")
def softmax_rescale_inverted(x, block_size):
    return _softmax_loop(x, block_size, rescale="inverted")


@bug("10.1", "running_max", "running maximum")
def softmax_max_of_last_block(x, block_size):
    return _softmax_loop(x, block_size, maximum="last")


@bug("10.1", "overflow", "overflow")
def softmax_no_max(x, block_size):
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for start in range(0, x.shape[-1], block_size):
        l = l + torch.exp(x[..., start:start + block_size]).sum(-1)
    return torch.exp(x) / l[..., None]


@bug("10.1", "early_normalization", "at the end")
def softmax_normalise_every_block(x, block_size):
    return _softmax_loop(x, block_size, every=True)


@bug("10.1", "block_bounds", "s + block_size")
def softmax_slice_minus_one(x, block_size):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size - 1]
        if block.shape[-1] == 0:
            continue
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "block_bounds", "last block")
def softmax_range_stops_early(x, block_size):
    return _softmax_loop(x, block_size, bounds="stop_early")


@bug("10.1", "block_bounds", "shorter")
def softmax_whole_blocks_only(x, block_size):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for i in range(x.shape[-1] // block_size):
        block = x[..., i * block_size:(i + 1) * block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "not_tiled", "whole row")
def softmax_library(x, block_size):
    return torch.softmax(x, dim=-1)


@bug("10.1", "not_tiled", "block")
def softmax_safe_two_pass_whole_row(x, block_size):
    m = x.max(dim=-1, keepdim=True).values
    e = torch.exp(x - m)
    return e / e.sum(-1, keepdim=True)


@bug("10.1", "not_implemented")
def softmax_not_written(x, block_size):
    raise NotImplementedError("Exercise 10.1: online softmax")


@bug("10.1", "mutation")
def softmax_in_place(x, block_size):
    x -= x.amax(-1, keepdim=True)
    return _softmax_loop(x, block_size)


@bug("10.1", "dtype", "float64")
def softmax_always_float32(x, block_size):
    return _softmax_loop(x.float(), block_size)


@bug("10.1", "dtype")
def softmax_returns_statistics(x, block_size):
    out = _softmax_loop(x, block_size)
    return out, out.sum(-1)


# ============================================================================ 10.2 flash_attention

def _tiled(q, k, v, block_q, block_k, causal, *, skip="ok", mask_diagonal=True, rescale_acc=True, scale_power=1,
           pad_last=False, lse_kind="ok", every=False, keys_to_lq=False):
    """The loop most forward attempts share, with one slip switched on."""
    scale = q.shape[-1] ** (-0.5 * scale_power)
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for i, qs in enumerate(range(0, lq, block_q)):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :]
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for j, ks in enumerate(range(0, lq if keys_to_lq else lk, block_k)):   # the slip: the queries' count
            ke = min(ks + block_k, lk)
            if causal and not {"ok": ks < qe, "index": j <= i, "strict": ks < qs, "none": True}[skip]:
                continue
            kb, vb = k[..., ks:ke, :], v[..., ks:ke, :]
            if pad_last and ke - ks < block_k:
                kb = F.pad(kb, (0, 0, 0, block_k - (ke - ks)))
                vb = F.pad(vb, (0, 0, 0, block_k - (ke - ks)))
            s = qb @ kb.transpose(-2, -1) * scale
            if causal and mask_diagonal:
                rows = torch.arange(qs, qe, device=q.device)[:, None]
                cols = torch.arange(ks, ks + s.shape[-1], device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = (acc * c[..., None] if rescale_acc else acc) + p @ vb
            if every:
                acc, l = acc / l[..., None], torch.ones_like(l)
            m = m_new
        outs.append(acc / l[..., None])
        lses.append({"ok": m + torch.log(l), "max": m, "log_l": torch.log(l)}[lse_kind])
    return torch.cat(outs, -2), torch.cat(lses, -1)


@correct("10.2")
def flash_reference_style(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal)


@correct("10.2")
def flash_einsum_preallocated(q, k, v, *, block_q, block_k, causal=False):
    lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    for qs in range(0, lq, block_q):
        qb = q[..., qs:qs + block_q, :] / math.sqrt(d)
        n = qb.shape[-2]
        m = torch.full(qb.shape[:-1], -1e30, dtype=q.dtype, device=q.device)   # a large negative instead of -inf
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        last_key = min(lk, qs + n) if causal else lk
        for ks in range(0, last_key, block_k):
            kb, vb = k[..., ks:ks + block_k, :], v[..., ks:ks + block_k, :]
            s = torch.einsum("...qd,...kd->...qk", qb, kb)
            if causal:
                allowed = (torch.arange(ks, ks + kb.shape[-2], device=q.device)[None, :]
                           <= torch.arange(qs, qs + n, device=q.device)[:, None])
                s = torch.where(allowed, s, torch.tensor(-1e30, dtype=s.dtype, device=s.device))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + torch.einsum("...qk,...kd->...qd", p, vb)
            m = m_new
        out[..., qs:qs + n, :] = acc / l[..., None]
        lse[..., qs:qs + n] = m + l.log()
    return out, lse


@correct("10.2")
def flash_per_head_loops(q, k, v, *, block_q, block_k, causal=False):
    # one head at a time, each a 2-D problem: still never more than a block of scores
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    for n in range(q.shape[0]):
        for h in range(q.shape[1]):
            o, s = _tiled(q[n, h], k[n, h], v[n, h], block_q, block_k, causal)
            out[n, h], lse[n, h] = o, s
    return out, lse


@bug("10.2", "block_skip", "block_q == block_k")
def flash_skips_by_block_index(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, skip="index")


@bug("10.2", "block_skip", "diagonal")
def flash_skips_diagonal_block(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, skip="strict")


@bug("10.2", "block_skip", "skip")
def flash_never_skips(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, skip="none")


@bug("10.2", "causal_mask", "cross the diagonal")
def flash_diagonal_unmasked(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, mask_diagonal=False)


@bug("10.2", "causal_mask", "ignored")
def flash_ignores_causal(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, False)


@bug("10.2", "online_rescale", "accumulator")
def flash_accumulator_not_rescaled(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, rescale_acc=False)


@bug("10.2", "scale", "twice")
def flash_scale_twice(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q / math.sqrt(q.shape[-1]), k, v, block_q, block_k, causal)


@bug("10.2", "scale", "not scaled")
def flash_no_scale(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, scale_power=0)


@bug("10.2", "block_bounds", "padded")
def flash_pads_last_block(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, pad_last=True)


@bug("10.2", "block_bounds", "never read")
def flash_drops_short_block(q, k, v, *, block_q, block_k, causal=False):
    keep = k.shape[-2] // block_k * block_k
    if causal:       # a causal attempt that drops the short block drops it for keys only
        return _tiled_dropping(q, k, v, block_q, block_k, keep)
    return _tiled(q, k[..., :keep, :], v[..., :keep, :], block_q, block_k, False)


def _tiled_dropping(q, k, v, block_q, block_k, keep):
    out, lse = _tiled(q, k[..., :keep, :], v[..., :keep, :], block_q, block_k, False)
    rows = torch.arange(q.shape[-2])[:, None]
    # a causal version would also mask; rebuild it with the mask and the dropped keys
    scale = q.shape[-1] ** -0.5
    outs = []
    for qs in range(0, q.shape[-2], block_q):
        qe = min(qs + block_q, q.shape[-2])
        s = q[..., qs:qe, :] @ k[..., :keep, :].transpose(-2, -1) * scale
        s = s.masked_fill(torch.arange(keep)[None, :] > rows[qs:qe], float("-inf"))
        outs.append(torch.softmax(s, -1) @ v[..., :keep, :])
    return torch.cat(outs, -2), lse


@bug("10.2", "early_normalization", "divide once")
def flash_normalises_every_block(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, every=True)


@bug("10.2", "logsumexp", "m + log(l)")
def flash_lse_is_max(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, lse_kind="max")


@bug("10.2", "logsumexp", "log(l)")
def flash_lse_forgets_max(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal, lse_kind="log_l")


@bug("10.2", "full_scores", "materialised")
def flash_naive_with_lse(q, k, v, *, block_q, block_k, causal=False):
    return flash.naive_attention(q, k, v, causal=causal)


@bug("10.2", "full_scores", "mask")
def flash_full_causal_mask(q, k, v, *, block_q, block_k, causal=False):
    lq = q.shape[-2]
    mask = torch.ones(lq, k.shape[-2], dtype=torch.bool).tril()        # the whole L x L mask, up front
    scale = q.shape[-1] ** -0.5
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        m = torch.full(q[..., qs:qe, 0].shape, float("-inf"), dtype=q.dtype)
        l = torch.zeros_like(m)
        acc = torch.zeros(*m.shape, v.shape[-1], dtype=q.dtype)
        for ks in range(0, k.shape[-2], block_k):
            s = q[..., qs:qe, :] @ k[..., ks:ks + block_k, :].transpose(-2, -1) * scale
            if causal:
                s = s.masked_fill(~mask[qs:qe, ks:ks + block_k], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l, acc, m = l * c + p.sum(-1), acc * c[..., None] + p @ v[..., ks:ks + block_k, :], m_new
        outs.append(acc / l[..., None])
        lses.append(m + l.log())
    return torch.cat(outs, -2), torch.cat(lses, -1)


@bug("10.2", "not_tiled", "block_k")
def flash_whole_key_rows(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, k.shape[-2], causal)


@bug("10.2", "shape", "out, lse")
def flash_returns_output_only(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q, block_k, causal)[0]


@bug("10.2", "not_implemented")
def flash_not_written(q, k, v, *, block_q, block_k, causal=False):
    raise NotImplementedError("Exercise 10.2: the tiled forward")


# ============================================================================ 10.3 backward

def _backward(ctx, grad_out, *, delta="ok", ds_scale=True, dv_t=False, dk_t=False, mask=True, recompute=None,
              grads=None, blocks=None, diagonal=True):
    """The recomputing backward with one slip switched on; ``recompute`` and ``grads`` are other factors for the
    recomputed scores and for dQ and dK (1/sqrt(d) each), ``blocks`` (block_q, block_k) other than those given;
    ``diagonal`` False: a causal key loop that stops at the query block's start."""
    block_q, block_k = blocks or (ctx.block_q, ctx.block_k)
    q, k, v, out, lse = ctx.saved_tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_all = {"ok": (grad_out * out).sum(-1), "grad_only": grad_out.sum(-1),
             "zero": torch.zeros_like(lse)}[delta]
    lq, lk = q.shape[-2], k.shape[-2]
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb, dob = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, (min(lk, qe) if diagonal else qs) if ctx.causal else lk, block_k):
            ke = min(ks + block_k, lk)
            kb, vb = k[..., ks:ke, :], v[..., ks:ke, :]
            s = qb @ kb.transpose(-2, -1) * (scale if recompute is None else recompute)
            if ctx.causal and mask:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
            p = torch.exp(s - lse[..., qs:qe, None])
            # transposed, P @ dO only fits square blocks: elsewhere the attempt crashes
            dv[..., ks:ke, :] += (p @ dob) if dv_t else p.transpose(-2, -1) @ dob
            dp = dob @ vb.transpose(-2, -1)
            ds = p * (dp - d_all[..., qs:qe, None])
            f = (scale if ds_scale else 1.0) if grads is None else grads
            dq[..., qs:qe, :] += ds @ kb * f
            dk[..., ks:ke, :] += (ds @ qb if dk_t else ds.transpose(-2, -1) @ qb) * f
    return dq, dk, dv, None, None, None


@correct("10.3")
class BackwardReference(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out)


@correct("10.3")
class BackwardDeltaPerBlock(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        # D of a query block from its own rows of out: the same numbers, computed where they are used
        q, k, v, out, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qs in range(0, q.shape[-2], ctx.block_q):
            qe = min(qs + ctx.block_q, q.shape[-2])
            dob = grad_out[..., qs:qe, :]
            d_blk = (dob * out[..., qs:qe, :]).sum(-1, keepdim=True)
            for ks in range(0, min(k.shape[-2], qe) if ctx.causal else k.shape[-2], ctx.block_k):
                ke = min(ks + ctx.block_k, k.shape[-2])
                s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
                if ctx.causal:
                    s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                      > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ dob
                ds = p * (dob @ v[..., ks:ke, :].transpose(-2, -1) - d_blk)
                dq[..., qs:qe, :] += scale * ds @ k[..., ks:ke, :]
                dk[..., ks:ke, :] += scale * ds.transpose(-2, -1) @ q[..., qs:qe, :]
        return dq, dk, dv, None, None, None


@bug("10.3", "backward_delta", "rowsum(dO * O)")
class BackwardDeltaFromGradOnly(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, delta="grad_only")


@bug("10.3", "backward_delta", "D")
class BackwardNoDelta(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, delta="zero")


@bug("10.3", "scale", "sqrt(d)")
class BackwardNoScaleInDs(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, ds_scale=False)


@bug("10.3", "transposed", "P^T")
class BackwardDvTransposed(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, dv_t=True)


@bug("10.3", "transposed", "dS^T")
class BackwardDkTransposed(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, dk_t=True)


@bug("10.3", "causal_mask", "masked")
class BackwardRecomputeUnmasked(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, mask=False)


@bug("10.3", "full_scores", "materialised")
class BackwardThroughAutograd(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            out, _ = flash.naive_attention(q, k, v, causal=ctx.causal)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
        return dq, dk, dv, None, None, None


@bug("10.3", "exception", "incorrect number")
class BackwardThreeGradients(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out)[:3]


@bug("10.3", "not_implemented")
class BackwardNotWritten(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError("Exercise 10.3: the backward")


# ============================================================================ issue 43: magnitudes (10.1, 10.2)

@bug("10.1", "running_max", "-inf")
def softmax_max_starts_at_zero(x, block_size):
    m = torch.zeros(x.shape[:-1], dtype=x.dtype)             # "the maximum so far", from 0
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "magnitude", "all rows")
def softmax_one_max_for_all_rows(x, block_size):
    m = torch.tensor(float("-inf"), dtype=x.dtype)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.max())                 # no dim: the largest score anywhere
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new).sum(-1)
        m = m_new
    return torch.exp(x - m) / l[..., None]


@bug("10.1", "magnitude", "dim=-1")
def softmax_global_max_two_passes(x, block_size):
    m = max(float(x[..., s:s + block_size].max()) for s in range(0, x.shape[-1], block_size))
    l = sum(torch.exp(x[..., s:s + block_size] - m).sum(-1) for s in range(0, x.shape[-1], block_size))
    return torch.exp(x - m) / l[..., None]


@bug("10.1", "overflow", "maximum")
def softmax_running_sum_of_exp(x, block_size):
    chunks = [torch.exp(x[..., s:s + block_size]) for s in range(0, x.shape[-1], block_size)]
    total = sum(c.sum(-1, keepdim=True) for c in chunks)
    return torch.cat([c / total for c in chunks], -1)


@correct("10.1")
def softmax_max_from_minus_large(x, block_size):
    # a very negative finite start instead of -inf: exp(m - m_new) is 0 at the first block, as it should be
    m = torch.full(x.shape[:-1], -1e30 if x.dtype == torch.float32 else -1e300, dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def _tiled_43(q, k, v, block_q, block_k, causal, *, m_start=float("-inf"), row_max=True, subtract=True,
              lse_kind="ok"):
    """A forward that writes into zeros, with the magnitude slips of issue 43 switched on."""
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], m_start, dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        raw = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
            if not subtract:
                m_new = torch.zeros_like(m)
            elif row_max:
                m_new = torch.maximum(m, s.amax(-1))
            else:
                m_new = torch.maximum(m, s.max())
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            raw = raw + torch.exp(s).sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = m + torch.log(l) if lse_kind == "ok" else torch.log(raw)
    return out, lse


@bug("10.2", "running_max", "-inf")
def flash_max_starts_at_zero(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_43(q, k, v, block_q, block_k, causal, m_start=0.0)


@bug("10.2", "magnitude", "dim=-1")
def flash_one_max_per_block(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_43(q, k, v, block_q, block_k, causal, row_max=False)


@bug("10.2", "overflow", "maximum")
def flash_no_max_at_all(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_43(q, k, v, block_q, block_k, causal, subtract=False)


@bug("10.2", "overflow", "log-sum-exp")
def flash_lse_from_raw_exp(q, k, v, *, block_q, block_k, causal=False):
    # the output is stable, but the log-sum-exp sums exp(s) itself
    return _tiled_43(q, k, v, block_q, block_k, causal, lse_kind="raw")


@correct("10.2")
def flash_zeros_and_finite_start(q, k, v, *, block_q, block_k, causal=False):
    big = torch.finfo(q.dtype).max
    return _tiled_43(q, k, v, block_q, block_k, causal, m_start=-big)


@bug("10.1", "overflow", "-inf")   # a maximum from a constant: the engine's magnitude verdict
def softmax_max_starts_at_minus_100(x, block_size):
    # "low enough": right for the well-scaled cases, 0/0 once every score is below -200
    m = torch.full(x.shape[:-1], -100.0, dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ issue 43: saved tensors (10.3)

@bug("10.3", "mutation", "changed q in place")
class BackwardScalesSavedQInPlace(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        # scale q once, up front, "to save a multiplication per block": the gradients are right, q is not
        q, k, v, out, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        q.mul_(scale)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out * out).sum(-1)
        for qs in range(0, q.shape[-2], ctx.block_q):
            qe = min(qs + ctx.block_q, q.shape[-2])
            dob = grad_out[..., qs:qe, :]
            for ks in range(0, min(k.shape[-2], qe) if ctx.causal else k.shape[-2], ctx.block_k):
                ke = min(ks + ctx.block_k, k.shape[-2])
                s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1)
                if ctx.causal:
                    s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], float("-inf"))
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ dob
                ds = p * (dob @ v[..., ks:ke, :].transpose(-2, -1) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :]
        return dq, dk, dv, None, None, None


@bug("10.3", "mutation", "changed k in place")
class BackwardShiftsKeysAndBack(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        k.add_(1.0)                      # a scratch use of k...
        k.sub_(1.0)                      # ...undone, but not bit for bit
        k.mul_(3.0).div_(3.0)
        k.add_(1e-3)
        return _backward(ctx, grad_out)


@bug("10.3", "mutation", "grad_out")
class BackwardEditsGradOut(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        grads = _backward(ctx, grad_out)
        grad_out.zero_()                 # "free" the incoming gradient
        return grads


@bug("10.3", "mutation", "output")
class BackwardReusesSavedOutput(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(ctx, grad_out)
        out.mul_(grad_out)               # D's product written into the saved output, after use
        return grads


@bug("10.3", "mutation", "saved for backward")
class BackwardExponentiatesLseInPlace(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        grads = _backward(ctx, grad_out)
        q, k, v, out, lse = ctx.saved_tensors
        lse.neg_()                       # scratch space, after the gradients are computed
        return grads


@bug("10.3", "gradient", "None for dk")
class BackwardNoneForDk(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        dq, dk, dv, *rest = _backward(ctx, grad_out)
        return (dq, None, dv, *rest)


# ============================================================================ issue 43: names (10.1-10.3)

@bug("10.1", "block_bounds", "overlap")
def softmax_blocks_overlap(x, block_size):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size + 1]          # "inclusive" end: one entry read twice
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "block_bounds", "last entry")
def softmax_stops_one_short(x, block_size):
    length = x.shape[-1]
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, length - 1, block_size):
        block = x[..., start:min(start + block_size, length - 1)]   # the last index is L - 1... excluded
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "early_normalization", "at the end")
def softmax_normalise_blocks_and_cat(x, block_size):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    pieces = []
    for block in torch.split(x, block_size, dim=-1):
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
        pieces.append(torch.exp(block - m[..., None]) / l[..., None])   # normalised with what is known now
    return torch.cat(pieces, -1)


@bug("10.1", "precision", "half")
def softmax_in_half(x, block_size):
    h = x.half()
    m = torch.full(h.shape[:-1], float("-inf"), dtype=h.dtype)
    l = torch.zeros_like(m)
    for start in range(0, h.shape[-1], block_size):
        block = h[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return (torch.exp(h - m[..., None]) / l[..., None]).to(x.dtype)


def _tiled_names(q, k, v, block_q, block_k, causal, *, q_stop=None, q_end=None, k_end=None, k_stop=None,
                 local_mask=False, always_causal=False, from_keys=False, half=False, init=torch.empty):
    """A forward written into a preallocated out and lse (as the notebook suggests), with the slips of issue 43."""
    dtype = q.dtype
    if half:
        q, k, v = q.half(), k.half(), v.half()
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    out = init(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = init(q.shape[:-1], dtype=q.dtype, device=q.device)
    for qs in range(0, q_stop(lq) if q_stop else lq, block_q):
        qe = q_end(qs, lq) if q_end else min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        stop = k_stop(lk) if k_stop else lk
        for ks in range(0, min(stop, qe) if causal else stop, block_k):
            ke = k_end(ks, lk) if k_end else min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal or always_causal:
                if local_mask:
                    future = (torch.arange(ke - ks, device=q.device)[None, :]
                              > torch.arange(qe - qs, device=q.device)[:, None])
                else:
                    future = (torch.arange(ks, ke, device=q.device)[None, :]
                              > torch.arange(qs, qe, device=q.device)[:, None])
                s = s.masked_fill(future, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ (k if from_keys else v)[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = m + torch.log(l)
    return out.to(dtype), lse.to(dtype)


@bug("10.2", "block_bounds", "never written")
def flash_query_blocks_one_short(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, q_end=lambda qs, lq: min(qs + block_q - 1, lq))


@bug("10.2", "block_bounds", "never written")
def flash_drops_last_query_block(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, q_stop=lambda lq: lq - lq % block_q or lq)


@bug("10.2", "block_bounds", "never written")
def flash_query_loop_stops_early_zeros(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, q_stop=lambda lq: lq - block_q, init=torch.zeros)


@bug("10.2", "block_bounds", "overlap")
def flash_key_blocks_overlap(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, k_end=lambda ks, lk: min(ks + block_k + 1, lk))


@bug("10.2", "block_bounds", "last key")
def flash_key_loop_stops_one_block_early(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, k_stop=lambda lk: lk - block_k)


@bug("10.2", "block_bounds", "last key")
def flash_key_blocks_one_short(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, k_end=lambda ks, lk: min(ks + block_k, lk - 1))


@bug("10.2", "causal_mask", "position")
def flash_mask_in_block_coordinates(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, local_mask=True)


@bug("10.2", "causal_mask", "causal=False")
def flash_always_causal(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, always_causal=True)


@bug("10.2", "values", "v")
def flash_weights_times_keys(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, from_keys=True)


@bug("10.2", "precision", "half")
def flash_in_half(q, k, v, *, block_q, block_k, causal=False):
    return _tiled_names(q, k, v, block_q, block_k, causal, half=True)


@correct("10.2")
def flash_normalised_accumulator(q, k, v, *, block_q, block_k, causal=False):
    # acc kept normalised at every step, renormalising the old part by l_old * c / l_new: right
    scale = q.shape[-1] ** -0.5
    outs, lses = [], []
    for qs in range(0, q.shape[-2], block_q):
        qe = min(qs + block_q, q.shape[-2])
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        o = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for ks in range(0, min(k.shape[-2], qe) if causal else k.shape[-2], block_k):
            ke = min(ks + block_k, k.shape[-2])
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            l_new = l * torch.exp(m - m_new) + p.sum(-1)
            o = o * (l * torch.exp(m - m_new) / l_new)[..., None] + p @ v[..., ks:ke, :] / l_new[..., None]
            m, l = m_new, l_new
        outs.append(o)
        lses.append(m + l.log())
    return torch.cat(outs, -2), torch.cat(lses, -1)


@bug("10.2", "early_normalization", "divide once")
def flash_normalised_accumulator_not_renormalised(q, k, v, *, block_q, block_k, causal=False):
    scale = q.shape[-1] ** -0.5
    outs, lses = [], []
    for qs in range(0, q.shape[-2], block_q):
        qe = min(qs + block_q, q.shape[-2])
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype)
        l = torch.zeros_like(m)
        o = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype)
        for ks in range(0, min(k.shape[-2], qe) if causal else k.shape[-2], block_k):
            ke = min(ks + block_k, k.shape[-2])
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            o = o * c[..., None] + p @ v[..., ks:ke, :] / l[..., None]    # old part never renormalised
            m = m_new
        outs.append(o)
        lses.append(m + l.log())
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _backward_names(ctx, grad_out, *, delta="ok", dk_scale=True, dq_scale=True, dp="ok", always_causal=False,
                    from_keys=False, half=False):
    """The backward with the slips of issue 43 switched on."""
    q, k, v, out, lse = ctx.saved_tensors
    dtype = q.dtype
    if half:
        q, k, v, out, lse, grad_out = (t.half() for t in (q, k, v, out, lse, grad_out))
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_all = {"ok": (grad_out * out).sum(-1), "everything": (grad_out * out).sum().expand(lse.shape)}.get(delta)
    lq, lk = q.shape[-2], k.shape[-2]
    for qs in range(0, lq, ctx.block_q):
        qe = min(qs + ctx.block_q, lq)
        qb, dob = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            kb, vb = k[..., ks:ke, :], (k if from_keys else v)[..., ks:ke, :]
            s = qb @ kb.transpose(-2, -1) * scale
            if ctx.causal or always_causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], float("-inf"))
            p = torch.exp(s - lse[..., qs:qe, None])
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ dob
            dp_blk = dob @ vb if dp == "no_t" else dob @ vb.transpose(-2, -1)
            if delta == "block":
                d_blk = (p * dp_blk).sum(-1, keepdim=True)       # over this key block only
            elif delta == "query_block":
                d_blk = (dob * out[..., qs:qe, :]).sum((-2, -1), keepdim=True)   # one number per block
            else:
                d_blk = d_all[..., qs:qe, None]
            ds = p * (dp_blk - d_blk)
            dq[..., qs:qe, :] += ds @ kb * (scale if dq_scale else 1.0)
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ qb * (scale if dk_scale else 1.0)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


@bug("10.3", "backward_delta", "one number per query")
class BackwardDeltaOverEverything(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, delta="everything")


@bug("10.3", "backward_delta", "every key")
class BackwardDeltaPerKeyBlock(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, delta="block")


@bug("10.3", "backward_delta", "one number per query")
class BackwardDeltaPerQueryBlock(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, delta="query_block")


@bug("10.3", "scale", "dK")
class BackwardDkUnscaled(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, dk_scale=False)


@bug("10.3", "scale", "dQ")
class BackwardDqUnscaled(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, dq_scale=False)


@bug("10.3", "transposed", "dP")
class BackwardDpNotTransposed(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, dp="no_t")


@bug("10.3", "causal_mask", "causal=False")
class BackwardAlwaysCausal(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, always_causal=True)


@bug("10.3", "values", "V")
class BackwardValuesFromKeys(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, from_keys=True)


@bug("10.3", "precision", "half")
class BackwardInHalf(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward_names(ctx, grad_out, half=True)


@bug("10.2", "causal_mask", "position")
def flash_local_mask_on_diagonal_blocks(q, k, v, *, block_q, block_k, causal=False):
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.zeros(q.shape[:-1], dtype=q.dtype)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        q_blk = q[..., qs:qe, :] * scale
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=q.dtype)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = q_blk @ k[..., ks:ke, :].transpose(-2, -1)
            if causal and ke - 1 > qs:
                future = torch.ones(qe - qs, ke - ks, dtype=torch.bool).triu(1)   # the block's own diagonal
                s = s.masked_fill(future, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(dim=-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = m + torch.log(l)
    return out, lse


@bug("10.1", "precision", "half")
def softmax_bfloat16_blocks(x, block_size):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size].bfloat16()            # "to save memory"
        m_new = torch.maximum(m, block.amax(-1).to(x.dtype))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None].bfloat16()).sum(-1).to(x.dtype)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("10.3")
class BackwardScalesACopyInPlace(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        # in place, but on copies: the saved tensors and grad_out are untouched
        q, k, v, out, lse = (t.clone() for t in ctx.saved_tensors)
        do = grad_out.clone()
        scale = q.shape[-1] ** -0.5
        q.mul_(scale)
        delta = (do * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qs in range(0, q.shape[-2], ctx.block_q):
            qe = min(qs + ctx.block_q, q.shape[-2])
            for ks in range(0, min(k.shape[-2], qe) if ctx.causal else k.shape[-2], ctx.block_k):
                ke = min(ks + ctx.block_k, k.shape[-2])
                s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1)
                if ctx.causal:
                    s.masked_fill_(torch.arange(ks, ke, device=q.device)[None, :]
                                   > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
                p = s.sub_(lse[..., qs:qe, None]).exp_()
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ do[..., qs:qe, :]
                ds = p * (do[..., qs:qe, :] @ v[..., ks:ke, :].transpose(-2, -1) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :]
        return dq, dk, dv, None, None, None


@correct("10.3")
class BackwardEinsum(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = torch.einsum("...qd,...qd->...q", grad_out, out)
        for qs in range(0, q.shape[-2], ctx.block_q):
            qe = min(qs + ctx.block_q, q.shape[-2])
            for ks in range(0, min(k.shape[-2], qe) if ctx.causal else k.shape[-2], ctx.block_k):
                ke = min(ks + ctx.block_k, k.shape[-2])
                s = torch.einsum("...qd,...kd->...qk", q[..., qs:qe, :], k[..., ks:ke, :]) * scale
                if ctx.causal:
                    s = torch.where(torch.arange(ks, ke, device=q.device)[None, :]
                                    <= torch.arange(qs, qe, device=q.device)[:, None], s,
                                    torch.tensor(float("-inf"), dtype=s.dtype, device=s.device))
                p = torch.exp(s - lse[..., qs:qe].unsqueeze(-1))
                dv[..., ks:ke, :] += torch.einsum("...qk,...qd->...kd", p, grad_out[..., qs:qe, :])
                dp = torch.einsum("...qd,...kd->...qk", grad_out[..., qs:qe, :], v[..., ks:ke, :])
                ds = p * (dp - delta[..., qs:qe].unsqueeze(-1)) * scale
                dq[..., qs:qe, :] += torch.einsum("...qk,...kd->...qd", ds, k[..., ks:ke, :])
                dk[..., ks:ke, :] += torch.einsum("...qk,...qd->...kd", ds, q[..., qs:qe, :])
        return dq, dk, dv, None, None, None


@correct("10.2")
def flash_accumulates_in_float64(q, k, v, *, block_q, block_k, causal=False):
    # more precise than asked, returned in the inputs' dtype
    out, lse = _tiled_names(q.double(), k.double(), v.double(), block_q, block_k, causal, init=torch.zeros)
    return out.to(q.dtype), lse.to(q.dtype)
