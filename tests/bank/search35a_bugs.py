"""Round 35a (notebook 10): slips the checks of FlashAttention let through.

10.1: a running maximum that starts at a finite stand-in for -inf (-1e4, -1e9, -10000.0, -1e30 whatever the dtype)
passed: no case had a row whose every score lies below it, where m never moves from the stand-in, exp(x - m)
underflows to 0 and the row is 0/0. The check now also runs rows near -1e20 (float32) and -1e100 (float64):
``overflow``, the code the engine's magnitude probe gives a start of -100. A start below those rows stays right
(torch.finfo(x.dtype).min, or -1e30 in float32 and -1e300 in float64, flash_bugs' softmax_max_from_minus_large).

10.1 and 10.2: statistics (m, l, the accumulator) made in float32 whatever the input's dtype (torch.full without
dtype=, dtype=torch.float32, .float()) passed: the float64 probe is rescued by type promotion (float32 op float64 is
float64). Both checks now also run bfloat16 inputs (``engine.probes.in_bfloat16``), where a float32 statistic makes
a float32 output, or a float32 weight meets bfloat16 values in a matmul and raises: ``dtype``. Statistics kept in
float32 with the results cast back to the input's dtype (what FlashAttention's kernels do) stay right.

10.3: a backward that calls .view on grad_out raised once the gradient arriving is not contiguous, which it is when
a model merges the output's heads (out.transpose(1, 2).reshape(N, L, heads * d)) before its loss; every case gave
a contiguous one. The check now runs that merge: ``exception``, naming .reshape and .contiguous().
"""
from __future__ import annotations

import math

import torch

from bank.attempts import new_bank
from course_lib.flash import FlashAttentionFunction

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 10.1: a finite start for the maximum

def _softmax_from(x, block_size, m):
    """The right loop from the running maximum ``m`` given (the reference's guard for rows masked so far)."""
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - shift) + torch.exp(block - shift[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "overflow", "-inf", "finite")
def softmax_max_starts_at_minus_1e4(x, block_size):
    """Wrong (the tester's): m = torch.full(..., -1e4): rows whose scores are all below -1e4 are 0/0."""
    m = torch.full(x.shape[:-1], -1e4, dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(dim=-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "overflow", "-inf", "finite")
def softmax_max_new_full_minus_1e9(x, block_size):
    """Wrong: x.new_full(..., -1e9) and max(dim=-1).values, the blocks as a list comprehension."""
    m, l = x.new_full(x.shape[:-1], -1e9), x.new_zeros(x.shape[:-1])
    for block in [x[..., s:s + block_size] for s in range(0, x.shape[-1], block_size)]:
        m_new = torch.max(m, block.max(dim=-1).values)
        l = torch.exp(m - m_new) * l + torch.exp(block - m_new.unsqueeze(-1)).sum(-1)
        m = m_new
    return torch.exp(x - m.unsqueeze(-1)) / l.unsqueeze(-1)


@bug("10.1", "overflow", "-inf", "finite")
def softmax_max_minus_ten_thousand_clamped(x, block_size):
    """Wrong: the running maximum clamped from below at -10000.0 (zeros - 1e4 at the start)."""
    m = torch.zeros_like(x[..., 0]) - 10000.0
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.clamp(torch.maximum(m, block.amax(-1)), min=-10000.0)
        l = l * (m - m_new).exp() + (block - m_new[..., None]).exp().sum(-1)
        m = m_new
    return (x - m[..., None]).exp() / l[..., None]


@bug("10.1", "overflow", "-inf", "finite")
def softmax_max_minus_1e4_sum_clamped(x, block_size):
    """Wrong: m from -1e4 and the sum clamped "against 0/0": a row below -1e4 comes back as zeros, not NaN."""
    m = torch.full(x.shape[:-1], -1e4, dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l.clamp_min(1e-30)[..., None]


@bug("10.1", "overflow", "-inf", "finite")
def softmax_max_minus_1e30_any_dtype(x, block_size):
    """Wrong: -1e30 whatever x's dtype: low enough for float32's scores, not for float64's: rows near -1e100
    are 0/0."""
    return _softmax_from(x, block_size, torch.full(x.shape[:-1], -1e30, dtype=x.dtype, device=x.device))


@bug("10.1", "overflow", "-inf", "finite")
def softmax_max_float32_lowest_any_dtype(x, block_size):
    """Wrong: torch.finfo(torch.float32).min, float32's lowest number, also for float64 x, whose rows go lower."""
    lowest = torch.finfo(torch.float32).min
    return _softmax_from(x, block_size, torch.full(x.shape[:-1], lowest, dtype=x.dtype, device=x.device))


@correct("10.1")
def softmax_max_starts_at_finfo_min(x, block_size):
    """Right: torch.finfo(x.dtype).min, the lowest number of x's own dtype: no finite score is below it."""
    return _softmax_from(x, block_size, torch.full(x.shape[:-1], torch.finfo(x.dtype).min, dtype=x.dtype,
                                                   device=x.device))


@correct("10.1")
def softmax_max_starts_at_minus_math_inf(x, block_size):
    """Right: x.new_full(..., -math.inf), the loop unguarded against -inf - (-inf) by a where on the factor."""
    m, l = x.new_full(x.shape[:-1], -math.inf), x.new_zeros(x.shape[:-1])
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        seen = m_new > -math.inf
        factor = torch.where(seen, torch.exp(m - m_new), torch.zeros_like(m))
        terms = torch.where(seen[..., None], torch.exp(block - m_new[..., None]), torch.zeros_like(block))
        l = l * factor + terms.sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("10.1")
def softmax_max_from_the_first_block(x, block_size):
    """Right: m and l start as the first block's own statistics (measured against 0 while that block is all -inf),
    then the loop runs from the second block."""
    first = x[..., :block_size]
    m = first.amax(-1)
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    l = torch.exp(first - shift[..., None]).sum(-1)
    for start in range(block_size, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        new_shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(shift - new_shift) + torch.exp(block - new_shift[..., None]).sum(-1)
        m, shift = m_new, new_shift
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ 10.1: statistics made in float32

def _float32_loop(x, block_size, m, l):
    """The right loop from ``m`` and ``l`` as given: what it makes follows their dtype, promoted with x's."""
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - shift) + torch.exp(block - shift[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "dtype", "bfloat16", "float32")
def softmax_statistics_default_dtype(x, block_size):
    """Wrong (the tester's): m and l made without dtype=: float32 (the default) whatever x's dtype; float64 x
    promotes them, bfloat16 x does not: the result comes back float32."""
    m = torch.full(x.shape[:-1], float("-inf"), device=x.device)
    l = torch.zeros(x.shape[:-1], device=x.device)
    return _float32_loop(x, block_size, m, l)


@bug("10.1", "dtype", "bfloat16", "float32")
def softmax_statistics_explicit_float32(x, block_size):
    """Wrong: dtype=torch.float32 written in, "for precision", and the result never cast back."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device)
    return _float32_loop(x, block_size, m, torch.zeros_like(m))


@bug("10.1", "dtype", "bfloat16", "float32")
def softmax_sum_made_float(x, block_size):
    """Wrong: m in x's dtype, the sum made with .float(): the division gives float32."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    return _float32_loop(x, block_size, m, torch.zeros_like(m).float())


@correct("10.1")
def softmax_statistics_float32_cast_back(x, block_size):
    """Right: m and l kept in float32 at least (FlashAttention's kernels do), the result cast back to x's dtype."""
    work = torch.promote_types(x.dtype, torch.float32)
    m = torch.full(x.shape[:-1], float("-inf"), dtype=work, device=x.device)
    return _float32_loop(x, block_size, m, torch.zeros_like(m)).to(x.dtype)


@correct("10.1")
def softmax_statistics_float32_always_cast_back(x, block_size):
    """Right: dtype=torch.float32 written in (float64 x promotes it), and the result cast back with .to(x.dtype)."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device)
    return _float32_loop(x, block_size, m, torch.zeros_like(m)).to(x.dtype)


# ============================================================================ 10.2: statistics made in float32

def _flash(q, k, v, block_q, block_k, causal, *, stats=None, acc_float=False, values=lambda p, vb: p @ vb,
           cast_back=False):
    """A forward that collects its blocks with torch.cat: m and l in ``stats`` (q's dtype when None), the
    accumulator in float32 with ``acc_float``, p @ v by ``values``; the results cast to q's dtype with
    ``cast_back``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=stats or q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=stats or q.dtype, device=q.device)
        acc = acc.float() if acc_float else acc
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal and ke - 1 > qs:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + values(p, v[..., ks:ke, :])
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
    return (out.to(q.dtype), lse.to(q.dtype)) if cast_back else (out, lse)


@bug("10.2", "dtype", "bfloat16", "float32")
def flash_statistics_explicit_float32(q, k, v, *, block_q, block_k, causal=False):
    """Wrong (the tester's): m, l and acc in float32 whatever q's dtype, p @ v.float(): float32 out and lse."""
    return _flash(q, k, v, block_q, block_k, causal, stats=torch.float32, values=lambda p, vb: p @ vb.to(p.dtype))


@bug("10.2", "dtype", "bfloat16", "float32")
def flash_accumulator_made_float(q, k, v, *, block_q, block_k, causal=False):
    """Wrong: m and l in q's dtype, the accumulator made with .float(): the output comes back float32."""
    return _flash(q, k, v, block_q, block_k, causal, acc_float=True)


@bug("10.2", "dtype", "bfloat16")
def flash_statistics_default_dtype(q, k, v, *, block_q, block_k, causal=False):
    """Wrong: m, l and acc made without dtype= (float32, the default): bfloat16 values then meet float32 weights
    in p @ v, which raises."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros(qb.shape[:-1], device=q.device)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = torch.einsum("...qd,...kd->...qk", qb, k[..., ks:ke, :])
            if causal and ke - 1 > qs:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + torch.einsum("...qk,...kd->...qd", p, v[..., ks:ke, :])
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = m + torch.log(l)
    return out, lse


@bug("10.2", "dtype", "bfloat16", "log-sum-exp")
def flash_lse_left_float32(q, k, v, *, block_q, block_k, causal=False):
    """Wrong: statistics in float32, the output cast back to q's dtype but the log-sum-exp left float32."""
    out, lse = _flash(q, k, v, block_q, block_k, causal, stats=torch.float32,
                      values=lambda p, vb: p @ vb.to(p.dtype), cast_back=True)
    return out, (lse.float() if q.dtype != torch.float64 else lse)


@correct("10.2")
def flash_statistics_float32_cast_back(q, k, v, *, block_q, block_k, causal=False):
    """Right: m, l and acc in float32 at least, p @ v in float32, out and lse cast back to q's dtype at the end."""
    work = torch.promote_types(q.dtype, torch.float32)
    return _flash(q, k, v, block_q, block_k, causal, stats=work, values=lambda p, vb: p @ vb.to(p.dtype),
                  cast_back=True)


@correct("10.2")
def flash_statistics_float32_weights_cast_down(q, k, v, *, block_q, block_k, causal=False):
    """Right: m, l and acc in float32 written in; the weights cast to v's dtype for p @ v (as a kernel feeds its
    tensor cores), out and lse cast back."""
    return _flash(q, k, v, block_q, block_k, causal, stats=torch.float32, values=lambda p, vb: p.to(vb.dtype) @ vb,
                  cast_back=True)


# ============================================================================ 10.3: a gradient that is not contiguous

def _backward(ctx, grad_out, fold):
    """The reference's backward with dO given by ``fold(grad_out, q)`` as (N * heads, Lq, d) and unfolded after."""
    q, k, v, out, lse = ctx.saved_tensors
    n, heads, lq, d = q.shape
    lk = k.shape[-2]
    q, k, v, out = (t.reshape(n * heads, -1, t.shape[-1]) for t in (q, k, v, out))   # (N * heads, L, d) each
    lse = lse.reshape(n * heads, lq)
    do = fold(grad_out, q)                                                            # (N * heads, Lq, d)
    scale = 1.0 / math.sqrt(d)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (do * out).sum(-1)
    for qs in range(0, lq, ctx.block_q):
        qe = min(qs + ctx.block_q, lq)
        for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            s = q[:, qs:qe] @ k[:, ks:ke].transpose(-2, -1) * scale
            if ctx.causal and ke - 1 > qs:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
            p = torch.exp(s - lse[:, qs:qe, None])
            dv[:, ks:ke] += p.transpose(-2, -1) @ do[:, qs:qe]
            ds = p * (do[:, qs:qe] @ v[:, ks:ke].transpose(-2, -1) - delta[:, qs:qe, None])
            dq[:, qs:qe] += ds @ k[:, ks:ke] * scale
            dk[:, ks:ke] += ds.transpose(-2, -1) @ q[:, qs:qe] * scale
    return dq.view(n, heads, lq, d), dk.view(n, heads, lk, d), dv.view(n, heads, lk, d), None, None, None


@bug("10.3", "exception", "contiguous", ".reshape")
class BackwardViewsGradOut(FlashAttentionFunction):
    """Wrong (the tester's): grad_out.view(N * heads, Lq, d): raises once grad_out is a non-contiguous view."""

    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, lambda g, q: g.view(q.shape[0], g.shape[-2], g.shape[-1]))


@bug("10.3", "exception", "contiguous", ".reshape")
class BackwardViewAsFoldedQ(FlashAttentionFunction):
    """Wrong: grad_out.view_as(q) with q already folded to (N * heads, Lq, d)."""

    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, lambda g, q: g.view_as(q))


@bug("10.3", "exception", "contiguous", ".reshape")
class BackwardFlatDo(FlashAttentionFunction):
    """Wrong: do = grad_out.view(-1, d), rows of d, then shaped like the folded q."""

    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, lambda g, q: g.view(-1, g.shape[-1]).view_as(q))


@correct("10.3")
class BackwardReshapesGradOut(FlashAttentionFunction):
    """Right: grad_out.reshape(N * heads, Lq, d): a copy where a view cannot be made."""

    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, lambda g, q: g.reshape(q.shape[0], g.shape[-2], g.shape[-1]))


@correct("10.3")
class BackwardContiguousThenView(FlashAttentionFunction):
    """Right: grad_out.contiguous().view_as(q), the memory laid out in order first."""

    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, lambda g, q: g.contiguous().view_as(q))
