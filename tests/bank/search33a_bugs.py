"""Round 33 (tester): right attempts at the function exercises that stress the new probes (device on meta, global
settings, sizes written in, batch-of-one, precision), and a few wrong ones."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib import modern, variants

BUGGY, CORRECT, bug, correct = new_bank()
NEG = float("-inf")


# ------------------------------------------------------------------ 2.1 causal_mask
@correct("2.1")
def mask_from_aranges(n):
    return torch.arange(n)[:, None] >= torch.arange(n)


@correct("2.1")
def mask_by_row_loop(n):
    """One row at a time: row i is True up to i."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, : i + 1] = True
    return mask


@correct("2.1")
def mask_from_numpy(n):
    return torch.from_numpy(np.tril(np.ones((n, n), dtype=bool)))


@correct("2.1")
def mask_tril_float_then_bool(n):
    return torch.tril(torch.ones(n, n)).bool()


@correct("2.1")
def mask_under_no_grad_decorator(n):
    with torch.no_grad():
        return ~torch.ones(n, n, dtype=torch.bool).triu(1)


# ------------------------------------------------------------------ 3.1 / 3.2
@correct("3.1")
def split_unflatten_r33(x, num_heads):
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


@correct("3.1")
def split_stack_chunks(x, num_heads):
    return torch.stack(x.chunk(num_heads, dim=-1), dim=1)


@correct("3.1")
def split_batch_inferred(x, num_heads):
    """-1 for the batch: N inferred from the rest."""
    _, length, embed_dim = x.shape
    return x.reshape(-1, length, num_heads, embed_dim // num_heads).permute(0, 2, 1, 3)


@correct("3.2")
def merge_cat_unbind(x):
    return torch.cat(x.unbind(1), dim=-1)


@correct("3.2")
def merge_permute_flatten(x):
    return x.permute(0, 2, 1, 3).flatten(2)


@correct("3.2")
def merge_einops_free_contiguous_view(x):
    n, h, length, d = x.shape
    return x.transpose(1, 2).contiguous().view(x.size(0), length, -1)


# ------------------------------------------------------------------ 4.1 sinusoidal_table
@correct("4.1")
def table_exp_log_r33(max_tokens, embed_dim):
    pos = torch.arange(max_tokens).unsqueeze(1)
    freq = torch.exp(torch.arange(0, embed_dim, 2) * (-math.log(10000.0) / embed_dim))
    angles = pos * freq
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


@correct("4.1")
def table_int_arange_true_division(max_tokens, embed_dim):
    """torch.arange(0, E, 2) / E on integers: / is true division, float32."""
    pos = torch.arange(max_tokens)[:, None]
    angles = pos / 10000 ** (torch.arange(0, embed_dim, 2) / embed_dim)
    table = torch.empty(max_tokens, embed_dim)
    table[:, 0::2], table[:, 1::2] = angles.sin(), angles.cos()
    return table


@correct("4.1")
def table_float64_then_float(max_tokens, embed_dim):
    pos = torch.arange(max_tokens, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, embed_dim, 2, dtype=torch.float64) / embed_dim)
    table = torch.zeros(max_tokens, embed_dim, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table.float()


@correct("4.1")
def table_python_math_rows(max_tokens, embed_dim):
    """A beginner's: math.sin of each angle, row by row (float64 arithmetic, stored in float32)."""
    rows = []
    for pos in range(max_tokens):
        row = []
        for i in range(embed_dim // 2):
            angle = pos / 10000 ** (2 * i / embed_dim)
            row += [math.sin(angle), math.cos(angle)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(max_tokens, embed_dim)


@bug("4.1", "precision", "float16")
def table_angles_in_half_r33(max_tokens, embed_dim):
    pos = torch.arange(max_tokens, dtype=torch.float16)[:, None]
    freq = (1.0 / 10000 ** (torch.arange(0, embed_dim, 2) / embed_dim)).half()
    angles = pos * freq
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(1).float()


# ------------------------------------------------------------------ 5.2 lm_loss
@correct("5.2")
def loss_flatten_default_ignore(logits, targets):
    """F.cross_entropy's ignore_index defaults to -100 already."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@correct("5.2")
def loss_classes_in_dim1(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100)


@correct("5.2")
def loss_by_hand(logits, targets):
    logp = logits.log_softmax(-1)
    keep = targets != -100
    picked = logp.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    return -(picked * keep).sum() / keep.sum()


@bug("5.2", "mismatch", "label_smoothing")
def loss_smoothed(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)


# ------------------------------------------------------------------ 5.4 sample_next_token
@correct("5.4")
def sample_kthvalue(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        k = min(top_k, logits.shape[-1])
        kth = torch.kthvalue(logits, logits.shape[-1] - k + 1, dim=-1, keepdim=True).values
        logits = torch.where(logits < kth, NEG, logits)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]


@correct("5.4")
def sample_sorted_threshold(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(dim=1)
    logits = logits / temperature
    if top_k:
        k = min(top_k, logits.size(-1))
        kth = logits.sort(dim=-1, descending=True).values[:, k - 1:k]
        logits = logits.masked_fill(logits < kth, NEG)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).view(-1)


# ------------------------------------------------------------------ 7.1 split_c_attn
@correct("7.1")
def split_transposed_chunks(weight):
    return tuple(weight.T.chunk(3, dim=0))


@correct("7.1")
def split_view_permute(weight):
    e = weight.shape[0]
    return tuple(weight.view(e, 3, e).permute(1, 2, 0).unbind(0))


@correct("7.1")
def split_by_own_width(weight):
    return tuple(w.t() for w in weight.split(weight.size(0), dim=1))


# ------------------------------------------------------------------ 9.1 rope_tables
@correct("9.1")
def rope_polar(head_dim, max_tokens, theta=10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_tokens, dtype=torch.float64), freqs)
    z = torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.real], -1).float(), torch.cat([z.imag, z.imag], -1).float()


@correct("9.1")
def rope_einsum_float32(head_dim, max_tokens, theta=10000.0):
    inv = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.einsum("m,i->mi", torch.arange(max_tokens).float(), inv).repeat(1, 2)
    return angles.cos(), angles.sin()


@correct("9.1")
def rope_default_dtype_context(head_dim, max_tokens, theta=10000.0):
    """float64 by the default dtype, set and put back in try/finally around the angles."""
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        pair = torch.arange(head_dim // 2) * 1.0
        angles = torch.arange(max_tokens)[:, None] * theta ** (-2 * pair / head_dim)
    finally:
        torch.set_default_dtype(old)
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


@bug("9.1", "global_setting", "torch.get_default_dtype()")
def rope_sets_default_and_restores_wrongly(head_dim, max_tokens, theta=10000.0):
    """Sets float64 for the angles and never puts the default back."""
    torch.set_default_dtype(torch.float64)
    pair = torch.arange(head_dim // 2) * 1.0
    angles = torch.arange(max_tokens)[:, None] * theta ** (-2 * pair / head_dim)
    angles = torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


# ------------------------------------------------------------------ 10.1 online_softmax
def _online(x, block_size, m, l, safe_fill):
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(-1))
        safe = safe_fill(m_new)
        l = l * torch.exp(m - safe) + torch.exp(b - safe[..., None]).sum(-1)
        m = m_new
    safe = safe_fill(m)
    return torch.exp(x - safe[..., None]) / l[..., None]


@correct("10.1")
def online_where_python_scalar(x, block_size):
    m = torch.full_like(x[..., 0], NEG)
    l = torch.zeros_like(m)
    return _online(x, block_size, m, l, lambda t: torch.where(t == NEG, 0.0, t))


@correct("10.1")
def online_cpu_then_to(x, block_size):
    """Made on the CPU, then .to(x): on x's device and in its dtype before use."""
    m = torch.full(x.shape[:-1], NEG).to(x)
    l = torch.zeros(x.shape[:-1]).to(device=x.device, dtype=x.dtype)
    return _online(x, block_size, m, l, lambda t: t.nan_to_num(neginf=0.0))


@correct("10.1")
def online_zero_dim_tensor_fill(x, block_size):
    """torch.where with a 0-d tensor made on x's device."""
    zero = torch.tensor(0.0, device=x.device, dtype=x.dtype)
    m = x.new_full(x.shape[:-1], NEG)
    l = x.new_zeros(x.shape[:-1])
    return _online(x, block_size, m, l, lambda t: torch.where(torch.isinf(t), zero, t))


@correct("10.1")
def online_data_branch(x, block_size):
    """A branch on the data (any row fully masked so far?): reads numbers, which meta has not."""
    m = torch.full(x.shape[:-1], NEG, device=x.device, dtype=x.dtype)
    l = torch.zeros_like(m)
    def safe(t):
        return torch.where(t == NEG, torch.zeros_like(t), t) if bool((t == NEG).any()) else t
    return _online(x, block_size, m, l, safe)


@correct("10.1")
def online_finfo_clamp(x, block_size):
    """The running max floored at finfo.min: -inf - finfo.min is -inf, exp 0, no NaN."""
    lo = torch.finfo(x.dtype).min
    m = torch.full_like(x[..., 0], lo)
    l = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        b = x[..., s:s + block_size]
        m_new = torch.maximum(m, b.amax(-1))
        l = l * torch.exp(m - m_new) + torch.exp(b - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("10.1")
def online_under_inference_mode(x, block_size):
    """Nothing needs a gradient here... but the text does not ask for one: inference_mode as a block."""
    m = x.new_full(x.shape[:-1], NEG)
    l = x.new_zeros(x.shape[:-1])
    return _online(x, block_size, m, l, lambda t: torch.where(t == NEG, 0.0, t))


@bug("10.1", "device", "device")
def online_zero_from_cpu_vector(x, block_size):
    zeros = torch.zeros(x.shape[:-1])          # CPU, used in torch.where
    m = x.new_full(x.shape[:-1], NEG)
    l = x.new_zeros(x.shape[:-1])
    return _online(x, block_size, m, l, lambda t: torch.where(t == NEG, zeros.to(t.dtype), t))


# ------------------------------------------------------------------ 10.2 flash_attention
def _flash(q, k, v, block_q, block_k, causal, *, mask_fn, fill=NEG, collect=False):
    scale = q.shape[-1] ** -0.5
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    out = torch.empty_like(q) if not collect else None
    lse = torch.empty_like(q[..., 0]) if not collect else None
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :] * scale
        m = torch.full_like(qb[..., 0], NEG)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qb)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1)
            if causal and ke - 1 > qs:
                s = mask_fn(s, qs, qe, ks, ke, q, fill)
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        if collect:
            outs.append(acc / l[..., None]); lses.append(m + l.log())
        else:
            out[..., qs:qe, :] = acc / l[..., None]
            lse[..., qs:qe] = m + torch.log(l)
    if collect:
        return torch.cat(outs, -2), torch.cat(lses, -1)
    return out, lse


def _tril_mask(s, qs, qe, ks, ke, q, fill):
    keep = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(diagonal=qs - ks)
    return s.masked_fill(~keep, fill)


def _triu_indices_mask(s, qs, qe, ks, ke, q, fill):
    r, c = torch.triu_indices(qe - qs, ke - ks, offset=qs - ks + 1, device=q.device)
    s = s.clone()
    s[..., r, c] = fill
    return s


def _where_scalar(s, qs, qe, ks, ke, q, fill):
    i = torch.arange(qs, qe, device=s.device)[:, None]
    j = torch.arange(ks, ke, device=s.device)[None, :]
    return torch.where(j > i, fill, s)


def _cpu_index_mask(s, qs, qe, ks, ke, q, fill):
    r, c = torch.triu_indices(qe - qs, ke - ks, offset=qs - ks + 1)   # CPU indices, only to index
    s = s.clone()
    s[..., r, c] = fill
    return s


@correct("10.2")
def flash_tril_block_mask(q, k, v, *, block_q, block_k, causal=False):
    return _flash(q, k, v, block_q, block_k, causal, mask_fn=_tril_mask)


@correct("10.2")
def flash_triu_indices_on_device(q, k, v, *, block_q, block_k, causal=False):
    return _flash(q, k, v, block_q, block_k, causal, mask_fn=_triu_indices_mask)


@correct("10.2")
def flash_where_python_scalar_collect(q, k, v, *, block_q, block_k, causal=False):
    return _flash(q, k, v, block_q, block_k, causal, mask_fn=_where_scalar, collect=True)


@correct("10.2")
def flash_finfo_min_fill(q, k, v, *, block_q, block_k, causal=False):
    return _flash(q, k, v, block_q, block_k, causal, mask_fn=_where_scalar, fill=torch.finfo(q.dtype).min)


@correct("10.2")
def flash_no_grad_free_autocast_off(q, k, v, *, block_q, block_k, causal=False):
    """An autocast block switched off (a habit from mixed-precision code): nothing changes."""
    with torch.autocast(device_type=q.device.type if q.device.type in ("cpu", "cuda") else "cpu", enabled=False):
        return _flash(q, k, v, block_q, block_k, causal, mask_fn=_tril_mask)


@correct("10.2")
def flash_cpu_triu_indices(q, k, v, *, block_q, block_k, causal=False):
    """CPU index tensors used only to index: a CUDA tensor takes CPU indices (the engine allows them), so this runs
    on a GPU; a CPU mask compared or multiplied with the scores would not."""
    return _flash(q, k, v, block_q, block_k, causal, mask_fn=_cpu_index_mask)


# ------------------------------------------------------------------ 11.1 / 11.2
@correct("11.1")
def prev_index_on_device(weights):
    length = weights.shape[-1]
    i = torch.arange(1, length, device=weights.device)
    return weights[:, :, i, i - 1].mean(dim=(0, 2))


@correct("11.1")
def prev_selector_einsum(weights):
    length = weights.shape[-1]
    sel = torch.ones(length, length, device=weights.device, dtype=weights.dtype).tril(-1).triu(-1)
    return torch.einsum("nhij,ij->h", weights, sel) / (weights.shape[0] * (length - 1))


@correct("11.1")
def prev_python_ranges(weights):
    """Advanced indexing with two ranges (indices only)."""
    length = weights.shape[-1]
    return weights[:, :, range(1, length), range(length - 1)].mean((0, -1))


@correct("11.1")
def prev_eye_roll(weights):
    length = weights.shape[-1]
    sel = torch.eye(length, dtype=torch.bool, device=weights.device).roll(-1, dims=1)
    sel[0] = False   # row 0 wrapped to column L-1
    sel[:, -1] = False
    return weights[..., sel].mean(dim=(0, 2))


@bug("11.1", "device", "device")
def prev_selector_on_cpu(weights):
    length = weights.shape[-1]
    sel = torch.ones(length, length).tril(-1).triu(-1).to(weights.dtype)
    return (weights * sel).sum((-1, -2)).mean(0) / (length - 1)


@correct("11.2")
def induction_index_on_device(weights, half):
    length = weights.shape[-1]
    i = torch.arange(half, length, device=weights.device)
    return weights[..., i, i - half + 1].mean((0, -1))


@correct("11.2")
def induction_mask_like(weights, half):
    length = weights.shape[-1]
    sel = torch.zeros_like(weights[0, 0], dtype=torch.bool)
    rows = torch.arange(half, length, device=weights.device)
    sel[rows, rows - half + 1] = True
    return (weights * sel).sum((-1, -2)).sum(0) / (weights.shape[0] * (length - half))


# ------------------------------------------------------------------ 12.3 linear attention
def _phi(t):
    return F.elu(t) + 1


@correct("12.3")
def linear_zeros_with_device_dtype(q, k, v):
    fq, fk = _phi(q), _phi(k)
    s = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], device=q.device, dtype=q.dtype)
    z = torch.zeros_like(q[..., 0, :])
    outs = []
    for i in range(q.shape[-2]):
        s = s + torch.einsum("...d,...e->...de", fk[..., i, :], v[..., i, :])
        z = z + fk[..., i, :]
        num = torch.einsum("...d,...de->...e", fq[..., i, :], s)
        den = torch.einsum("...d,...d->...", fq[..., i, :], z)[..., None]
        outs.append(num / (den + 1e-6))
    return torch.stack(outs, -2)


@correct("12.3")
def linear_prealloc_output(q, k, v):
    """Outputs written into a buffer from v.new_empty; the state itself never in place."""
    fq, fk = variants.elu_feature_map(q), variants.elu_feature_map(k)
    out = v.new_empty(v.shape)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(q.shape[:-2] + q.shape[-1:])
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        out[..., i, :] = (fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6)
    return out


@correct("12.3")
def linear_eps_new_tensor(q, k, v):
    """The epsilon as a 0-d tensor on q's device."""
    eps = q.new_tensor(1e-6)
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :].unsqueeze(-1) * v[..., i, :].unsqueeze(-2)
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s)[..., 0, :] / (fq[..., i, None, :] @ z[..., None])[..., 0, :].add(eps))
    return torch.stack(outs, dim=-2)


@bug("12.3", "normalization", "1e-6", "clamp_min")
def linear_eps_clamped(q, k, v):
    """den.clamp_min(1e-6) where the text adds 1e-6."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / (fq[..., i, :] * z).sum(-1, keepdim=True).clamp_min(1e-6))
    return torch.stack(outs, -2)


# ------------------------------------------------------------------ 12.2 latent attention
def _latent(layer, x, cache, *, absorbed=False, sdpa=False, mask_kind="tril"):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, h, dn + dr).transpose(1, 2).split([dn, dr], -1)
    q_rope = modern.apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], -1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    i = torch.arange(start, total, device=x.device)[:, None]
    j = torch.arange(total, device=x.device)[None, :]
    mask = j <= i                                                         # (L, T)
    w = layer.kv_b_proj.weight.view(h, dn + dv, layer.kv_lora_rank)
    w_uk, w_uv = w[:, :dn], w[:, dn:]                                     # (H, dn, r), (H, dv, r)
    if absorbed:
        q_lat = torch.einsum("nhld,hdr->nhlr", q_nope, w_uk)              # queries in the latent space
        scores = q_lat @ latent[:, None].transpose(-2, -1) + q_rope @ k_rope[:, None].transpose(-2, -1)
        scores = scores * layer.softmax_scale
        p = scores.masked_fill(~mask, NEG).softmax(-1)
        out = torch.einsum("nhlt,ntr,hdr->nhld", p, latent, w_uv)
    else:
        kv = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], -1)
        k = torch.cat([k_nope, k_rope[:, None].expand(n, h, total, dr)], -1)
        qq = torch.cat([q_nope, q_rope], -1)
        if sdpa:
            out = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=layer.softmax_scale)
        else:
            out = (qq @ k.transpose(-2, -1)).mul(layer.softmax_scale).masked_fill(~mask, NEG).softmax(-1) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(n, length, h * dv))


@correct("12.2")
def latent_absorbed(layer, x, cache=None):
    """W_UK absorbed into the queries and W_UV applied after the weighting: the same numbers, never a full key."""
    return _latent(layer, x, cache, absorbed=True)


@correct("12.2")
def latent_sdpa_with_scale(layer, x, cache=None):
    return _latent(layer, x, cache, sdpa=True)


@correct("12.2")
def latent_positions_mask(layer, x, cache=None):
    return _latent(layer, x, cache)
