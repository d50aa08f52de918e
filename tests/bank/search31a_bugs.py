"""Round 31 (fix A): notebook 10's classes that were passed or given a generic mismatch.

- 10.2: exponentials taken against the old running maximum, p = exp(s - m_old) (online_rescale).
- 10.3: state kept on the class or a global instead of ctx, found with two forwards before their backwards
  (kept_state); dq (or dk, dv) assigned where it is summed over blocks (gradient); the causal mask in block
  coordinates (causal_mask, in the words 10.2 uses).

Right attempts that the new probes could wrongly refuse come with them: state on ctx attributes only, the whole
forward recomputed in backward, a call counter on the class that the backward never reads.
"""
from __future__ import annotations

import math

import torch

from bank.attempts import Attempt, new_bank
from course_lib import flash

BUGGY, CORRECT, bug, correct = new_bank()
_NEG = float("-inf")


# ============================================================================ 10.2 flash_attention


def _flash(q, k, v, block_q, block_k, causal, *, against_old=False, rescale=True, lazy=False):
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], _NEG, dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal and ke - 1 > qs:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], _NEG)
            if against_old:   # p before the maximum is updated; the first block against its own maximum
                p = torch.exp(s - torch.where(torch.isinf(m), s.amax(-1), m)[..., None])
            m_new = torch.maximum(m, s.amax(-1))
            if not against_old:
                p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            if lazy:          # rescale only the rows whose maximum grew (FA-style); exp(0) = 1 elsewhere anyway
                c = torch.where(m_new > m, c, torch.ones_like(c))
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = m + torch.log(l)
    return out, lse


@bug("10.2", "online_rescale", "m_old", "m_new")
def flash_exps_against_the_old_max(q, k, v, *, block_q=64, block_k=64, causal=False):
    """p = exp(s - m_old) and no correction (r31)."""
    return _flash(q, k, v, block_q, block_k, causal, against_old=True, rescale=False)


@bug("10.2", "online_rescale", "m_old", "exp(s - m_new)")
def flash_exps_before_the_max_update_rescaled(q, k, v, *, block_q=64, block_k=64, causal=False):
    """p taken before m is updated, but l and acc rescaled by exp(m_old - m_new): the new terms too large."""
    return _flash(q, k, v, block_q, block_k, causal, against_old=True)


@bug("10.2", "online_rescale", "m_old")
def flash_exps_against_the_previous_block_max(q, k, v, *, block_q=64, block_k=64, causal=False):
    """Keeps `prev` = the running maximum before the block in its own variable and exponentiates against it."""
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :]
        m = l = acc = None
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = (qb @ k[..., ks:ke, :].transpose(-2, -1)) * scale
            if causal:
                s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], _NEG)
            prev = s.amax(-1) if m is None else m
            p = torch.exp(s - prev[..., None])
            m = prev if m is None else torch.maximum(m, s.amax(-1))
            l = p.sum(-1) if l is None else l + p.sum(-1)
            acc = p @ v[..., ks:ke, :] if acc is None else acc + p @ v[..., ks:ke, :]
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, -2), torch.cat(lses, -1)


@correct("10.2")
def flash_lazy_rescale(q, k, v, *, block_q=64, block_k=64, causal=False):
    """Rescales only the rows whose maximum grew (torch.where): the same numbers."""
    return _flash(q, k, v, block_q, block_k, causal, lazy=True)


# ============================================================================ 10.3 FlashAttentionFunction


def _backward_loops(ctx, grad_out, q, k, v, out, lse, *, assign="", local_mask="", causal=None, blocks=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = ctx.causal if causal is None else causal
    block_q, block_k = blocks or (ctx.block_q, ctx.block_k)
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(-1)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb, dob = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            kb, vb = k[..., ks:ke, :], v[..., ks:ke, :]
            s = qb @ kb.transpose(-2, -1) * scale
            if causal and (local_mask == "every" or ke - 1 > qs):
                if local_mask:
                    hide = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).triu(1)
                else:
                    hide = (torch.arange(ks, ke, device=q.device)[None, :]
                            > torch.arange(qs, qe, device=q.device)[:, None])
                s = s.masked_fill(hide, _NEG)
            p = torch.exp(s - lse[..., qs:qe, None])
            ds = p * (dob @ vb.transpose(-2, -1) - delta[..., qs:qe, None])
            if assign == "dv":
                dv[..., ks:ke, :] = p.transpose(-2, -1) @ dob
            else:
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ dob
            if assign == "dq":
                dq[..., qs:qe, :] = ds @ kb * scale
            else:
                dq[..., qs:qe, :] += ds @ kb * scale
            if assign == "dk":
                dk[..., ks:ke, :] = ds.transpose(-2, -1) @ qb * scale
            else:
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ qb * scale
    return dq, dk, dv, None, None, None


def _function(name, doc, **opts):
    class _F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
            out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
            return out

        @staticmethod
        def backward(ctx, grad_out):
            return _backward_loops(ctx, grad_out, *ctx.saved_tensors, **opts)
    _F.__name__ = _F.__qualname__ = name
    _F.__doc__ = doc
    return _F


for _name, _says, _opts in (
    ("BackwardDqAssignedNotAdded", ("dq", "+="), {"assign": "dq"}),      # r31
    ("BackwardDkAssignedNotAdded", ("dk", "+=", "query block"), {"assign": "dk"}),
    ("BackwardDvAssignedNotAdded", ("dv", "+=", "query block"), {"assign": "dv"}),
):
    BUGGY.append(Attempt("10.3", _name, _function(_name, f"{_opts['assign']} = where += is meant", **_opts),
                                "gradient", _says))

for _name, _opts in (
    ("BackwardMaskInBlockCoordinates", {"local_mask": "diagonal"}),      # r31: triu(1) where a block crosses
    ("BackwardMaskInBlockCoordinatesEveryBlock", {"local_mask": "every"}),   # triu(1) in every block computed
):
    BUGGY.append(Attempt("10.3", _name, _function(_name, "causal mask counted from the block's corner",
                                                         **_opts), "causal_mask", ("block's corner", "ks + col")))


class BackwardLseOnTheClass(torch.autograd.Function):
    """Keeps lse on the class (not ctx): a second forward before the backward overwrites it (r31)."""
    last_lse = None

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        BackwardLseOnTheClass.last_lse = lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, _ = ctx.saved_tensors
        return _backward_loops(ctx, grad_out, q, k, v, out, BackwardLseOnTheClass.last_lse)


BUGGY.append(Attempt("10.3", "BackwardLseOnTheClass", BackwardLseOnTheClass, "kept_state",
                            ("ctx.save_for_backward", "last_lse")))

_SAVED = {}


class BackwardEverythingInAGlobal(torch.autograd.Function):
    """Everything the backward needs in a module dict: ctx is left empty."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        _SAVED["tensors"] = (q, k, v, out, lse)
        _SAVED["settings"] = (causal, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        causal, block_q, block_k = _SAVED["settings"]
        return _backward_loops(ctx, grad_out, *_SAVED["tensors"], causal=causal, blocks=(block_q, block_k))


BUGGY.append(Attempt("10.3", "BackwardEverythingInAGlobal", BackwardEverythingInAGlobal, "kept_state",
                            ("ctx.save_for_backward", "second forward")))


class BackwardCausalOnTheClass(torch.autograd.Function):
    """The tensors on ctx, but causal and the block sizes on the class: a later call's causal wins."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        BackwardCausalOnTheClass.settings = (causal, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        causal, block_q, block_k = BackwardCausalOnTheClass.settings
        return _backward_loops(ctx, grad_out, *ctx.saved_tensors, causal=causal, blocks=(block_q, block_k))


BUGGY.append(Attempt("10.3", "BackwardCausalOnTheClass", BackwardCausalOnTheClass, "kept_state",
                            ("ctx.causal", "settings")))


class BackwardOnlyCtxAttributes(torch.autograd.Function):
    """Everything as ctx attributes, no save_for_backward: each call's ctx is its own, so it is right."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse = q.detach(), k.detach(), v.detach(), out.detach(), lse.detach()
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _backward_loops(ctx, grad_out, ctx.q, ctx.k, ctx.v, ctx.out, ctx.lse)


CORRECT.append(Attempt("10.3", "BackwardOnlyCtxAttributes", BackwardOnlyCtxAttributes, None))


class BackwardRecomputesTheWholeForward(torch.autograd.Function):
    """Saves q, k and v only; the backward runs the tiled forward again for out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, _ = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        out, lse = flash.flash_attention(q, k, v, block_q=ctx.block_q, block_k=ctx.block_k, causal=ctx.causal)
        return _backward_loops(ctx, grad_out, q, k, v, out, lse)


CORRECT.append(Attempt("10.3", "BackwardRecomputesTheWholeForward", BackwardRecomputesTheWholeForward, None))


class BackwardCountsItsCalls(torch.autograd.Function):
    """A call counter on the class (for logging): state the backward never reads, so it is right."""
    calls = 0

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        BackwardCountsItsCalls.calls += 1
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _backward_loops(ctx, grad_out, *ctx.saved_tensors)


CORRECT.append(Attempt("10.3", "BackwardCountsItsCalls", BackwardCountsItsCalls, None))
