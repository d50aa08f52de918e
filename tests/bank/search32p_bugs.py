"""Round 32b (a tester's attempts at notebooks 10 and 12, and more of the same kinds).

What the round found:
- Tensors made on the CPU passed 10.1, 10.2, 10.3 and 12.3 (statistics, buffers, the positions of a causal mask, dq,
  dk, dv, the state S and z made without device=): their texts now ask for the inputs' device and dtype, and their
  checks run the device probe (10.3 also returns its gradients' own dtype: autograd casts a float32 dq back).
- 12.2: no case built a layer with a softmax_scale of its own, so (dn + dr) ** -0.5 passed where the text asks for
  layer.softmax_scale; a bias left out of one projection (o_proj alone) was an unexplained mismatch.
- 12.3: the 1e-6 the text adds to the denominator, left out or added after the division, passed (every case's
  denominator was far above 1e-6).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import modern
from course_lib.attention import merge_heads
from course_lib.flash import FlashAttentionFunction

BUGGY, CORRECT, bug, correct = new_bank()
NEG = float("-inf")


# ------------------------------------------------------------------ 10.1 online_softmax
def _softmax(x, block_size, *, make_m, make_l):
    m, l = make_m(x), make_l(x)
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(-1))
        safe = torch.where(m_new == NEG, torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe) + torch.exp(b - safe[..., None]).sum(-1)
        m = m_new
    safe = torch.where(m == NEG, torch.zeros_like(m), m)
    return torch.exp(x - safe[..., None]) / l[..., None]


@bug("10.1", "device", "device", "torch.zeros_like")
def online_softmax_stats_on_cpu(x, block_size):
    """The tester's: torch.full / torch.zeros without device= (and dtype=), as the notebook's demo cell did."""
    return _softmax(x, block_size, make_m=lambda x: torch.full(x.shape[:-1], NEG),
                    make_l=lambda x: torch.zeros(x.shape[:-1]))


@bug("10.1", "device", "device")
def online_softmax_stats_in_dtype_only(x, block_size):
    """dtype=x.dtype but no device=, as the course's own solution was written."""
    return _softmax(x, block_size, make_m=lambda x: torch.full(x.shape[:-1], NEG, dtype=x.dtype),
                    make_l=lambda x: torch.zeros(x.shape[:-1], dtype=x.dtype))


@correct("10.1")
def online_softmax_stats_from_new_full(x, block_size):
    """x.new_full and x.new_zeros: x's device and dtype."""
    return _softmax(x, block_size, make_m=lambda x: x.new_full(x.shape[:-1], NEG),
                    make_l=lambda x: x.new_zeros(x.shape[:-1]))


# ------------------------------------------------------------------ 10.2 flash_attention
def _flash(q, k, v, block_q, block_k, causal, *, out_factory=None, lse_keepdim=False, fill=NEG, mask_device=True):
    lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    out = out_factory(q) if out_factory else torch.empty_like(q)
    lse = out_factory(q)[..., 0] if out_factory else torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full(qb.shape[:-1], NEG, dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        k_stop = min(lk, qe) if causal else lk
        for ks in range(0, k_stop, block_k):
            ke = min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal and ke - 1 > qs:
                dev = q.device if mask_device else None
                i = torch.arange(qs, qe, device=dev)[:, None]
                j = torch.arange(ks, ke, device=dev)[None, :]
                s = s.masked_fill(j > i, fill)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l[..., None]
        lse[..., qs:qe] = m + torch.log(l)
    if lse_keepdim:
        lse = lse[..., None]
    return out, lse



@bug("10.2", "device", "device", "causal=True")
def flash_causal_positions_on_cpu(q, k, v, *, block_q, block_k, causal=False):
    """The tester's (written here through the shared loop): the block's positions from torch.arange without device=."""
    return _flash(q, k, v, block_q, block_k, causal, mask_device=False)


@bug("10.2", "device", "device")
def flash_buffers_without_device(q, k, v, *, block_q, block_k, causal=False):
    """out and lse from torch.empty(shape, dtype=q.dtype): the dtype kept, the device not."""
    return _flash(q, k, v, block_q, block_k, causal, out_factory=lambda t: torch.empty(t.shape, dtype=t.dtype))


@correct("10.2")
def flash_buffers_from_new_empty(q, k, v, *, block_q, block_k, causal=False):
    """out and lse from q.new_empty: q's device and dtype."""
    return _flash(q, k, v, block_q, block_k, causal, out_factory=lambda t: t.new_empty(t.shape))


# ------------------------------------------------------------------ 10.3 FlashAttentionFunction
def _backward(ctx, grad_out, *, zeros=torch.zeros_like, local_mask=False, mask_device=True):
    q, k, v, out, lse = ctx.saved_tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = zeros(q), zeros(k), zeros(v)
    delta = (grad_out * out).sum(-1)
    for qs in range(0, lq, ctx.block_q):
        qe = min(qs + ctx.block_q, lq)
        qb, dob = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            kb, vb = k[..., ks:ke, :], v[..., ks:ke, :]
            s = qb @ kb.transpose(-2, -1) * scale
            if ctx.causal:
                if local_mask:
                    rows = torch.arange(qe - qs, device=q.device)[:, None]
                    cols = torch.arange(ke - ks, device=q.device)[None, :]
                else:
                    dev = q.device if mask_device else None
                    rows = torch.arange(qs, qe, device=dev)[:, None]
                    cols = torch.arange(ks, ke, device=dev)[None, :]
                s = s.masked_fill(cols > rows, NEG)
            p = torch.exp(s - lse[..., qs:qe, None])
            dv[..., ks:ke, :] += torch.einsum("...qk,...qd->...kd", p, dob)
            dp = dob @ vb.transpose(-2, -1)
            ds = p * (dp - delta[..., qs:qe, None])
            dq[..., qs:qe, :] += ds @ kb * scale
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ qb * scale
    return dq, dk, dv, None, None, None



@bug("10.3", "device", "device", "torch.zeros_like")
class BackwardGradientsInDefaultDtype(FlashAttentionFunction):
    """The tester's: dq, dk, dv = torch.zeros(t.shape): float32 on the CPU whatever q is."""
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, zeros=lambda t: torch.zeros(t.shape))


@bug("10.3", "dtype", "dq", "float32", "torch.zeros_like")
class BackwardGradientsOnDeviceInDefaultDtype(FlashAttentionFunction):
    """torch.zeros(t.shape, device=t.device): the device kept, the dtype not (autograd casts dq back: only the sums
    ran in float32)."""
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, zeros=lambda t: torch.zeros(t.shape, device=t.device))


@bug("10.3", "device", "device", "backward")
class BackwardMaskPositionsOnCpu(FlashAttentionFunction):
    """The causal mask's positions from torch.arange without device=, as the course's solution was written."""
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, mask_device=False)


@correct("10.3")
class BackwardGradientsFromNewZeros(FlashAttentionFunction):
    """dq, dk, dv from t.new_zeros(t.shape): the inputs' device and dtype."""
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, zeros=lambda t: t.new_zeros(t.shape))


# ------------------------------------------------------------------ 12.2 latent_attention
def _mla(layer, x, cache=None, *, scale=None, causal="rows", o_bias=True, absorb=False, mask_device=True,
         kv_bias=True):
    n, length, _ = x.shape
    start = cache.length if cache is not None else 0
    total = start + length
    dn, dr, dv, h = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim, layer.num_heads
    if layer.q_lora_rank is None:
        q = layer.q_proj(x)
    else:
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q = q.view(n, length, h, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    kv_a = layer.kv_a_proj_with_mqa(x) if kv_bias else x @ layer.kv_a_proj_with_mqa.weight.T
    latent, k_rope = kv_a.split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    scale = layer.softmax_scale if scale is None else scale
    if absorb:
        w = layer.kv_b_proj.weight.view(h, dn + dv, layer.kv_lora_rank)
        w_uk, w_uv = w[:, :dn], w[:, dn:]
        scores = torch.einsum("nhld,hdr,ntr->nhlt", q_nope, w_uk, latent) + torch.einsum("nhld,ntd->nhlt", q_rope, k_rope)
    else:
        kv = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)
        scores = q_nope @ k_nope.transpose(-2, -1) + q_rope @ k_rope[:, None].transpose(-2, -1)
    scores = scores * scale
    if causal == "rows":
        dev = x.device if mask_device else None
        i = torch.arange(start, total, device=dev)[:, None]
        j = torch.arange(total, device=dev)[None, :]
        scores = scores.masked_fill(j > i, float("-inf"))
    elif causal == "top_left":
        scores = scores.masked_fill(torch.ones(length, total, dtype=torch.bool, device=x.device).triu(1),
                                    float("-inf"))
    weights = scores.softmax(dim=-1)
    if absorb:
        out = torch.einsum("nhlt,ntr,hvr->nhlv", weights, latent, w_uv)
    else:
        out = weights @ v
    out = merge_heads(out)
    if o_bias:
        return layer.o_proj(out)
    return out @ layer.o_proj.weight.T



@bug("12.2", "scale", "softmax_scale", "0.15")
def latent_default_scale_not_the_layers(layer, x, cache=None):
    """The tester's: (dn + dr) ** -0.5 from the sizes, the layer's own softmax_scale ignored."""
    return _mla(layer, x, cache, scale=(layer.qk_nope_head_dim + layer.qk_rope_head_dim) ** -0.5)


@bug("12.2", "scale", "layer.softmax_scale")
def latent_scale_as_a_division(layer, x, cache=None):
    """Divides by math.sqrt(dn + dr), as the text's formula reads."""
    return _mla(layer, x, cache, scale=1 / math.sqrt(layer.qk_nope_head_dim + layer.qk_rope_head_dim))


@bug("12.2", "bias", "o_proj", "o_proj.bias")
def latent_output_without_bias(layer, x, cache=None):
    """The tester's: out @ o_proj.weight.T drops o_proj's bias only."""
    return _mla(layer, x, cache, o_bias=False)


@bug("12.2", "bias", "kv_a_proj_with_mqa", "kv_a_proj_with_mqa.bias")
def latent_kv_a_without_bias(layer, x, cache=None):
    """x @ kv_a_proj_with_mqa.weight.T: the latent and k_rope miss kv_a_proj_with_mqa's bias."""
    return _mla(layer, x, cache, kv_bias=False)


@correct("12.2")
def latent_bias_added_by_hand(layer, x, cache=None):
    """o_proj as out @ weight.T + bias: the same as calling it."""
    out = _mla(layer, x, cache, o_bias=False)
    return out + layer.o_proj.bias if layer.o_proj.bias is not None else out


# ------------------------------------------------------------------ 12.3 linear_attention_recurrent
def _phi(t):
    return F.elu(t) + 1


def _recurrent(q, k, v, *, make=lambda q, *shape: q.new_zeros(*shape), read=lambda num, den: num / (den + 1e-6)):
    fq, fk = _phi(q), _phi(k)
    s = make(q, *q.shape[:-2], q.shape[-1], v.shape[-1])
    z = make(q, *q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append(read((fq[..., i, None, :] @ s).squeeze(-2), (fq[..., i, :] * z).sum(-1, keepdim=True)))
    return torch.stack(outs, dim=-2)


@bug("12.3", "device", "device", "torch.zeros_like")
def linear_state_on_cpu(q, k, v):
    """The tester's: S = torch.zeros(d, d_v) and z made on the CPU (no batch: the values broadcast right)."""
    return _recurrent(q, k, v, make=lambda q, *shape: torch.zeros(shape[-2:] if len(shape) > 1 else shape))


@bug("12.3", "device", "device")
def linear_state_in_dtype_only(q, k, v):
    """torch.zeros(..., dtype=q.dtype): the dtype kept, the device not."""
    return _recurrent(q, k, v, make=lambda q, *shape: torch.zeros(*shape, dtype=q.dtype))


@bug("12.3", "normalization", "denominator", "1e-6")
def linear_eps_added_to_the_output(q, k, v):
    """The tester's: num / den + 1e-6, the 1e-6 after the division."""
    return _recurrent(q, k, v, read=lambda num, den: num / den + 1e-6)


@bug("12.3", "normalization", "denominator", "1e-6")
def linear_eps_left_out(q, k, v):
    """num / den: no 1e-6 at all."""
    return _recurrent(q, k, v, read=lambda num, den: num / den)


@bug("12.3", "normalization", "numerator", "1e-6")
def linear_eps_on_both(q, k, v):
    """(num + 1e-6) / (den + 1e-6): the numerator gets it too."""
    return _recurrent(q, k, v, read=lambda num, den: (num + 1e-6) / (den + 1e-6))


@correct("12.3")
def linear_eps_in_the_denominator_by_torch_add(q, k, v):
    """torch.add(den, 1e-6) and torch.zeros(..., dtype=q.dtype, device=q.device): the text's normaliser."""
    return _recurrent(q, k, v, make=lambda q, *shape: torch.zeros(*shape, dtype=q.dtype, device=q.device),
                      read=lambda num, den: num / torch.add(den, 1e-6))
