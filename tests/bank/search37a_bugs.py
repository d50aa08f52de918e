"""Round 37a (notebooks 06, 07, 08, 10, 12): attempts at 6.1, 6.2, 7.1, 7.2, 8.1, 10.1, 10.2, 10.3 and 12.3.

Named by this round's fixes: 10.2 a block's mask tril(ks - qs), the offset's sign reversed (``causal_mask``, no
longer "rows never written": a query loop right without causal writes every row), and a key loop that starts at the
query block's diagonal (``block_skip``); 10.1 the running sum rescaled by exp(m_old - block_max) (``online_rescale``);
6.2 a cache kept from call to call, per model or per model and batch (``kept_state``: the call is right when the
student's code starts afresh). The engine's new probes hold here too: F.dropout in 7.2, 10.1, 10.2 and 12.3 is
``dropout``, a float32 state or buffer meeting float64 inputs is ``dtype``. Left out: 10.3 a backward that
recomputes each block's weights with a softmax of the block alone (``mismatch``; a named verdict would be better).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib.attention import scaled_dot_product_attention
from course_lib.flash import FlashAttentionFunction

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 6.1 flops_per_token

@correct("6.1")
def flops_six_times_weights_plus_two_attention(config, num_weights):
    """6 factored out: 6 (N + 2 n H Q T) = 6N + 12 n H Q T."""
    return 6 * (num_weights + 2 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens)


@correct("6.1")
def flops_as_python_float(config, num_weights):
    """Floats along the way (6.0, 12.0): the same number, as a Python float."""
    per_layer = 12.0 * config.num_heads * config.head_dim * config.max_tokens
    return 6.0 * num_weights + per_layer * config.num_layers


@bug("6.1", "attention_flops")
def flops_six_factored_attention_halved(config, num_weights):
    """Factors 6 out but forgets that the attention term is 12: 6 (N + nHQT) = 6N + 6nHQT."""
    return 6 * (num_weights + config.num_layers * config.num_heads * config.head_dim * config.max_tokens)


@bug("6.1", "attention_flops")
def flops_attention_times_six_too(config, num_weights):
    """Multiplies the whole sum by 6: 6 (N + 12 nHQT)."""
    return 6 * (num_weights + 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens)


# ============================================================================ 6.2 generate_with_cache

@correct("6.2")
def generate_into_preallocated_buffer(model, idx, max_new_tokens):
    """Writes into an output buffer made by idx.new_zeros, feeds out[:, t-1:t] each step."""
    with torch.no_grad():
        n, length = idx.shape
        out = idx.new_zeros(n, length + max_new_tokens)
        out[:, :length] = idx
        cache = model.new_cache()
        logits = model(idx, cache)
        for t in range(length, length + max_new_tokens):
            out[:, t] = logits[:, -1].argmax(-1)
            if t + 1 < length + max_new_tokens:
                logits = model(out[:, t:t + 1], cache)
        return out


@correct("6.2")
def generate_topk_one_after_softmax(model, idx, max_new_tokens):
    """softmax then topk(1): the same token as argmax; feeds idx[:, -1:] after appending."""
    cache = model.new_cache()
    with torch.inference_mode():
        logits = model(idx, cache)
        for _ in range(max_new_tokens):
            probs = torch.softmax(logits[:, -1, :], dim=-1)
            next_id = torch.topk(probs, 1, dim=-1).indices          # (N, 1)
            idx = torch.cat((idx, next_id), dim=1)
            logits = model(idx[:, -1:], cache)
    return idx


@bug("6.2", "device")
def generate_into_a_cpu_buffer(model, idx, max_new_tokens):
    """The buffer is torch.zeros(..., dtype=torch.long): on the CPU whatever idx's device."""
    n, length = idx.shape
    out = torch.zeros(n, length + max_new_tokens, dtype=torch.long)
    out[:, :length] = idx
    cache = model.new_cache()
    with torch.no_grad():
        logits = model(idx, cache)
        for t in range(length, length + max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out[:, t:t + 1] = nxt
            logits = model(nxt, cache)
    return out


@bug("6.2", "dtype")
def generate_into_a_float_buffer(model, idx, max_new_tokens):
    """idx.new_zeros(..., dtype=torch.float): the tokens come back as floats."""
    n, length = idx.shape
    out = idx.new_zeros(n, length + max_new_tokens, dtype=torch.float)
    out[:, :length] = idx
    cache = model.new_cache()
    with torch.no_grad():
        logits = model(idx, cache)
        for t in range(length, length + max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out[:, t:t + 1] = nxt
            logits = model(nxt, cache)
    return out


_CACHES_37 = {}


@bug("6.2", "kept_state", "new cache")
def generate_cache_kept_per_model(model, idx, max_new_tokens):
    """One cache per model in a global dict, 'to save making a new one': the next call continues the old text."""
    cache = _CACHES_37.setdefault(id(model), model.new_cache())
    with torch.no_grad():
        logits = model(idx, cache)
        for step in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], 1)
            if step + 1 < max_new_tokens:
                logits = model(nxt, cache)
    return idx


@bug("6.2", "mismatch")
def generate_first_from_first_position(model, idx, max_new_tokens):
    """The first token is taken from the FIRST position of the prompt's logits (logits[:, 0])."""
    cache = model.new_cache()
    with torch.no_grad():
        logits = model(idx, cache)
        nxt = logits[:, 0].argmax(-1, keepdim=True)
        for step in range(max_new_tokens):
            if step:
                nxt = logits[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], 1)
            logits = model(nxt, cache)
    return idx


# ============================================================================ 7.1 split_c_attn

@correct("7.1")
def split_unflatten_and_permute(weight):
    """(E, 3E) -> (E, 3, E) -> (3, E_out, E_in)."""
    e = weight.shape[0]
    wq, wk, wv = weight.unflatten(1, (3, e)).permute(1, 2, 0)
    return wq, wk, wv


@correct("7.1")
def split_by_index_select_with_mT(weight):
    """Columns picked with arange on the weight's device, then .mT; returned as a list."""
    e = weight.shape[0]
    cols = torch.arange(3 * e, device=weight.device).view(3, e)
    return [weight.index_select(1, c).mT.contiguous() for c in cols]


@bug("7.1", "mutation")
def split_transposes_the_weight_in_place(weight):
    """weight.t_() first (in place), then chunk the rows: the caller's weight is left (3E, E)."""
    weight.t_()
    return weight.chunk(3, dim=0)


@bug("7.1", "mismatch")
def split_unflatten_wrong_order(weight):
    """unflatten(1, (E, 3)): every third column is the query (columns interleaved)."""
    e = weight.shape[0]
    wq, wk, wv = weight.unflatten(1, (e, 3)).permute(2, 1, 0)
    return wq, wk, wv


# ============================================================================ 7.2 attention_forward

@correct("7.2")
def attention_with_functional_dropout_at_rate(module, query, key, value, attention_mask, scaling=None,
                                              dropout=0.0, **kwargs):
    """By hand, with F.dropout(weights, p=dropout): p is 0 in eval mode, so nothing is dropped."""
    lq, lk = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(attention_mask.logical_not(), float("-inf"))
    weights = F.dropout(scores.softmax(-1), p=dropout)
    return (weights @ value).permute(0, 2, 1, 3), None


@correct("7.2")
def attention_course_sdpa_with_module_is_causal(module, query, key, value, attention_mask, scaling=None,
                                                dropout=0.0, **kwargs):
    """The course's function; the causal mask only when the layer says it is causal."""
    d = query.shape[-1]
    mask = attention_mask
    if mask is None and getattr(module, "is_causal", True):
        lq, lk = query.shape[-2], key.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
    out = scaled_dot_product_attention(query * (scaling * math.sqrt(d)), key, value, mask)
    return out.transpose(1, 2).contiguous(), None


@bug("7.2", "causal_mask")
def attention_torch_is_causal_with_fewer_queries(module, query, key, value, attention_mask, scaling=None,
                                                 dropout=0.0, **kwargs):
    """None -> F.scaled_dot_product_attention(is_causal=True): torch's causal mask is top-left aligned, so with
    fewer queries than keys (a KV cache) query i sees keys 0..i only, not the last ones."""
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2), None


@bug("7.2", "causal_mask")
def attention_first_rows_of_a_square_mask(module, query, key, value, attention_mask, scaling=None,
                                          dropout=0.0, **kwargs):
    """nanoGPT style: a square (Lk, Lk) lower triangle, sliced [:Lq, :Lk]: the FIRST Lq rows, not the last."""
    lq, lk = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        attention_mask = torch.tril(torch.ones(lk, lk, dtype=torch.bool, device=query.device))[:lq, :lk]
    scores = query @ key.transpose(-2, -1) * scaling
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


@bug("7.2", "causal_mask")
def attention_mask_or_causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Combines the given mask with causality by OR instead of AND: the padding is let through."""
    lq, lk = query.shape[-2], key.shape[-2]
    causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    mask = causal if attention_mask is None else (attention_mask | causal)
    scores = query @ key.transpose(-2, -1) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


@bug("7.2", "dropout")
def attention_functional_dropout_fixed(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                       **kwargs):
    """F.dropout(weights, 0.1): a rate of its own, and training= defaults to True."""
    lq, lk = query.shape[-2], key.shape[-2]
    mask = attention_mask if attention_mask is not None else \
        torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    scores = (query @ key.transpose(-2, -1) * scaling).masked_fill(~mask, float("-inf"))
    weights = F.dropout(scores.softmax(-1), 0.1)
    return (weights @ value).transpose(1, 2), None


# ============================================================================ 8.1 (runs: see the end of the file)

# ============================================================================ 10.1 online_softmax

def _online_stats(x, block_size, starts):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in starts:
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe) + torch.exp(block - safe[..., None]).sum(dim=-1)
        m = m_new
    return m, l


@correct("10.1")
def online_softmax_blocks_from_the_end(x, block_size):
    """Reads the blocks last to first (the order does not matter to the statistics); the last block short is now
    the first one read."""
    starts = list(range(0, x.shape[-1], block_size))[::-1]
    m, l = _online_stats(x, block_size, starts)
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("10.1")
def online_softmax_blocks_in_random_order(x, block_size):
    """Reads the blocks in an order drawn with torch.randperm: the same statistics up to rounding."""
    starts = list(range(0, x.shape[-1], block_size))
    order = torch.randperm(len(starts)).tolist()
    m, l = _online_stats(x, block_size, [starts[i] for i in order])
    return torch.exp(x - m[..., None]) / l[..., None]


@correct("10.1")
def online_softmax_max_from_first_entry(x, block_size):
    """m starts at the row's first entry (not -inf): still a valid reference point, the rescale handles it."""
    m = x[..., 0].clone()
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        l = l * torch.exp(m - safe).nan_to_num(0.0) + torch.exp(block - safe[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


@bug("10.1", "dropout")
def online_softmax_with_functional_dropout(x, block_size):
    """Copied attention's F.dropout(p, 0.1) onto the weights (training defaults to True)."""
    m, l = _online_stats(x, block_size, range(0, x.shape[-1], block_size))
    return F.dropout(torch.exp(x - m[..., None]) / l[..., None], 0.1)


@bug("10.1", "exception")
def online_softmax_divides_by_l_unexpanded(x, block_size):
    """Forgets [..., None] on l in the last line: (..., L) / (...,) broadcasts along the wrong axis."""
    m, l = _online_stats(x, block_size, range(0, x.shape[-1], block_size))
    return torch.exp(x - m[..., None]) / l


@correct("10.1")
def online_softmax_rescale_by_min_of_differences(x, block_size):
    """Rescales the old sum by exp(min(m_old - block max, 0)): equal to exp(m_old - m_new), since
    m_new = max(m_old, block max)."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        bmax = block.amax(-1)
        m_new = torch.maximum(m, bmax)
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        bsafe = torch.where(bmax == float("-inf"), torch.zeros_like(bmax), bmax)
        l = l * torch.exp(torch.minimum(m - bsafe, torch.zeros_like(m))) + torch.exp(block - safe[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ 10.2 flash_attention

def _flash37(q, k, v, block_q, block_k, causal, *, inplace_scale=False, mask_sign=1, dropout=None,
             acc_dtype=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        if inplace_scale:
            q_blk = q[..., qs:qe, :]
            q_blk *= scale
        else:
            q_blk = q[..., qs:qe, :] * scale
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=acc_dtype or q.dtype, device=q.device)
        for ks in range(0, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = q_blk @ k[..., ks:ke, :].transpose(-2, -1)
            if causal:
                ok = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(mask_sign * (qs - ks))
                s = s.masked_fill(~ok, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            if dropout is not None:
                p = F.dropout(p, dropout)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


@correct("10.2")
def flash_tril_with_block_offset_and_cat(q, k, v, *, block_q, block_k, causal=False):
    """Mask of each block by ones(...).tril(qs - ks) on q's device; the blocks collected and concatenated."""
    return _flash37(q, k, v, block_q, block_k, causal)


@correct("10.2")
def flash_single_loop_flattened_heads(q, k, v, *, block_q, block_k, causal=False):
    """Flattens (N, heads) to one axis first (reshape, no mixing), runs the tiling, and reshapes back."""
    lead = q.shape[:-2]
    qf, kf, vf = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    out, lse = _flash37(qf, kf, vf, block_q, block_k, causal)
    return out.reshape(*lead, *out.shape[-2:]), lse.reshape(*lead, lse.shape[-1])


@bug("10.2", "mutation")
def flash_scales_the_query_block_in_place(q, k, v, *, block_q, block_k, causal=False):
    """q_blk = q[..., qs:qe, :]; q_blk *= scale: a view, so the caller's q is scaled."""
    return _flash37(q, k, v, block_q, block_k, causal, inplace_scale=True)


@bug("10.2", "causal_mask", avoids=("never written",))
def flash_tril_offset_with_the_wrong_sign(q, k, v, *, block_q, block_k, causal=False):
    """tril(ks - qs) where tril(qs - ks) is meant: the blocks below the diagonal hide keys they may see."""
    return _flash37(q, k, v, block_q, block_k, causal, mask_sign=-1)


@bug("10.2", "dropout")
def flash_with_dropout_on_the_block_weights(q, k, v, *, block_q, block_k, causal=False):
    """A dropout of 0.1 on each block's p before p @ v (copied from a training kernel)."""
    return _flash37(q, k, v, block_q, block_k, causal, dropout=0.1)


@bug("10.2", "dtype")
def flash_output_buffer_default_dtype_index_copy(q, k, v, *, block_q, block_k, causal=False):
    """out = torch.empty(..., device=q.device) (float32 whatever q's dtype), each block put in with index_copy_:
    float64 inputs raise (the source and the buffer of two dtypes)."""
    lq = q.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], device=q.device)
    lse = torch.empty(q.shape[:-1], device=q.device)
    o, s = _flash37(q, k, v, block_q, block_k, causal)
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        rows = torch.arange(qs, qe, device=q.device)
        out.index_copy_(-2, rows, o[..., qs:qe, :])
        lse.index_copy_(-1, rows, s[..., qs:qe])
    return out, lse


# ============================================================================ 10.3 FlashAttentionFunction

def _bwd37(ctx, grad_out, *, local_softmax=False, delta_dim=-1, delta_unexpanded=False, f64=False):
    q, k, v, out, lse = ctx.saved_tensors
    dtype = q.dtype
    if f64:
        q, k, v, out, lse, grad_out = (t.double() for t in (q, k, v, out, lse, grad_out))
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(dim=delta_dim)
    for qs in range(0, lq, ctx.block_q):
        qe = min(qs + ctx.block_q, lq)
        q_blk, do_blk = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        d_blk = delta[..., qs:qe] if delta_dim == -1 else delta
        for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            k_blk, v_blk = k[..., ks:ke, :], v[..., ks:ke, :]
            s = q_blk @ k_blk.transpose(-2, -1) * scale
            if ctx.causal:
                ok = torch.arange(ks, ke, device=q.device)[None, :] <= torch.arange(qs, qe, device=q.device)[:, None]
                s = s.masked_fill(~ok, float("-inf"))
            if local_softmax:
                p = torch.softmax(s, dim=-1)
            else:
                p = torch.exp(s - lse[..., qs:qe, None])
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ do_blk
            dp = do_blk @ v_blk.transpose(-2, -1)
            if delta_dim != -1:
                ds = p * (dp - d_blk[..., None, :ke - ks] if d_blk.shape[-1] >= ke - ks else dp)
            elif delta_unexpanded:
                ds = p * (dp - d_blk)
            else:
                ds = p * (dp - d_blk[..., None])
            dq[..., qs:qe, :] += ds @ k_blk * scale
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q_blk * scale
    if f64:
        dq, dk, dv = dq.to(dtype), dk.to(dtype), dv.to(dtype)
    return dq, dk, dv, None, None, None


@correct("10.3")
class FlashBackwardComputedInFloat64(FlashAttentionFunction):
    """Everything in float64 inside, the gradients cast back to the inputs' dtype."""
    @staticmethod
    def backward(ctx, grad_out):
        return _bwd37(ctx, grad_out, f64=True)


@correct("10.3")
class FlashBackwardTransposeOfProducts(FlashAttentionFunction):
    """dv and dk as transposes of products ((do^T p)^T, (q^T ds)^T), scale applied once at the end."""
    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        qs_scaled = q / math.sqrt(q.shape[-1])
        delta = torch.einsum("...id,...id->...i", grad_out, out)
        for qs in range(0, lq, ctx.block_q):
            qe = min(qs + ctx.block_q, lq)
            for ks in range(0, lk, ctx.block_k):
                if ctx.causal and ks > qe - 1:
                    break
                ke = min(ks + ctx.block_k, lk)
                s = qs_scaled[..., qs:qe, :] @ k[..., ks:ke, :].mT
                if ctx.causal:
                    rows = torch.arange(qs, qe, device=q.device).unsqueeze(-1)
                    cols = torch.arange(ks, ke, device=q.device).unsqueeze(0)
                    s = torch.where(cols > rows, float("-inf"), s)
                p = (s - lse[..., qs:qe].unsqueeze(-1)).exp()
                do = grad_out[..., qs:qe, :]
                dv[..., ks:ke, :] += (do.mT @ p).mT
                ds = p * (do @ v[..., ks:ke, :].mT - delta[..., qs:qe].unsqueeze(-1))
                dq[..., qs:qe, :] += ds @ k[..., ks:ke, :]
                dk[..., ks:ke, :] += (q[..., qs:qe, :].mT @ ds).mT
        scale = q.shape[-1] ** -0.5
        return dq * scale, dk * scale, dv, None, None, None


@bug("10.3", "exception")
class FlashBackwardDeltaUnexpanded(FlashAttentionFunction):
    """dp - D_blk without [..., None]: D lined up with the keys of the block, not the queries."""
    @staticmethod
    def backward(ctx, grad_out):
        return _bwd37(ctx, grad_out, delta_unexpanded=True)


@bug("10.3", "exception")
class FlashBackwardCapitalTOnFourDims(FlashAttentionFunction):
    """p.T on a 4-d tensor: reverses every axis (N, heads, Bq, Bk) -> (Bk, Bq, heads, N)."""
    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out * out).sum(-1)
        for qs in range(0, lq, ctx.block_q):
            qe = min(qs + ctx.block_q, lq)
            for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
                ke = min(ks + ctx.block_k, lk)
                s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
                if ctx.causal:
                    ok = torch.arange(ks, ke)[None, :] <= torch.arange(qs, qe)[:, None]
                    s = s.masked_fill(~ok.to(q.device), float("-inf"))
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += p.T @ grad_out[..., qs:qe, :]
                ds = p * (grad_out[..., qs:qe, :] @ v[..., ks:ke, :].transpose(-2, -1) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :] * scale
        return dq, dk, dv, None, None, None


# ============================================================================ 12.3 linear_attention_recurrent

def _phi(x):
    return F.elu(x) + 1


@correct("12.3")
def linear_recurrent_state_as_value_by_key(q, k, v):
    """Keeps the state transposed, S^T = sum v_i phi(k_i)^T (d_v x d), and reads S^T phi(q_i)."""
    fq, fk = _phi(q), _phi(k)
    st = q.new_zeros(*q.shape[:-2], v.shape[-1], q.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        st = st + v[..., i, :].unsqueeze(-1) * fk[..., i, :].unsqueeze(-2)
        z = z + fk[..., i, :]
        num = (st @ fq[..., i, :].unsqueeze(-1)).squeeze(-1)
        den = torch.einsum("...d,...d->...", fq[..., i, :], z).unsqueeze(-1)
        outs.append(num / (den + 1e-6))
    return torch.stack(outs, dim=-2)


@correct("12.3")
def linear_recurrent_with_unbind_and_lists(q, k, v):
    """unbind(-2) the tokens, elu computed by torch.where by hand (the exp's argument clamped at 0, so the branch not
    taken cannot overflow), the outputs stacked on -2."""
    phi = lambda x: torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))
    qs, ks, vs = phi(q).unbind(-2), phi(k).unbind(-2), v.unbind(-2)
    s = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=q.dtype, device=q.device)
    z = torch.zeros(*q.shape[:-2], q.shape[-1], dtype=q.dtype, device=q.device)
    outs = []
    for qi, ki, vi in zip(qs, ks, vs):
        s = s + torch.einsum("...d,...e->...de", ki, vi)
        z = z + ki
        outs.append(torch.einsum("...d,...de->...e", qi, s) / (torch.einsum("...d,...d->...", qi, z)[..., None] + 1e-6))
    return torch.stack(outs, -2)


@bug("12.3", "dtype")
def linear_state_float32_meets_float64_in_einsum(q, k, v):
    """S = torch.zeros(..., device=q.device) (float32 whatever q's dtype), read with an einsum: float64 inputs raise."""
    fq, fk = _phi(q), _phi(k)
    s = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], device=q.device)
    z = torch.zeros(*q.shape[:-2], q.shape[-1], device=q.device)
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        num = torch.einsum("...d,...de->...e", fq[..., i, :], s)
        outs.append(num / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=-2)


@bug("12.3", "exception")
def linear_tokens_on_axis_two(q, k, v):
    """Written for (N, heads, L, d): loops over q.shape[2] and stacks on dim=2; any other rank goes wrong."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=2)


@bug("12.3", "exception")
def linear_denominator_without_keepdim(q, k, v):
    """(phi(q_i) * z).sum(-1) without keepdim: (..., d_v) / (...) lines the batch up with d_v."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1) + 1e-6))
    return torch.stack(outs, dim=-2)


@bug("12.3", "dropout")
def linear_with_dropout_on_the_features(q, k, v):
    """F.dropout on phi(k) ('regularise the features'): training defaults to True."""
    fq, fk = _phi(q), F.dropout(_phi(k), 0.1)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=-2)


# ============================================================================ more, second round

_CACHES_BY_BATCH_37 = {}


@bug("6.2", "kept_state", avoids=("crop it",))
def generate_cache_kept_per_model_and_batch(model, idx, max_new_tokens):
    """One cache per (model, batch size) in a global dict: the next call of the same batch size continues the old
    text (its tokens sit after the earlier call's)."""
    cache = _CACHES_BY_BATCH_37.setdefault((id(model), idx.shape[0]), model.new_cache())
    with torch.no_grad():
        logits = model(idx, cache)
        for step in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], 1)
            if step + 1 < max_new_tokens:
                logits = model(nxt, cache)
    return idx


@correct("6.2")
def generate_puts_model_in_eval_first(model, idx, max_new_tokens):
    """Calls model.eval() first ('generation is inference'): the model given is already in eval mode."""
    model.eval()
    cache = model.new_cache()
    out = [idx]
    with torch.no_grad():
        logits = model(idx, cache)
        for step in range(max_new_tokens):
            nxt = logits[:, -1].max(dim=-1, keepdim=True).indices
            out.append(nxt)
            if step < max_new_tokens - 1:
                logits = model(nxt, cache)
    return torch.cat(out, dim=1)


@bug("7.2", "mutation")
def attention_scales_the_query_in_place(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                        **kwargs):
    """query *= scaling * sqrt(d): the caller's query tensor is changed in place."""
    d = query.shape[-1]
    lq, lk = query.shape[-2], key.shape[-2]
    mask = attention_mask if attention_mask is not None else \
        torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    query *= scaling * d ** 0.5
    return scaled_dot_product_attention(query, key, value, mask).transpose(1, 2), None


@bug("10.2", "block_skip", avoids=("never written",))
def flash_key_loop_starts_at_the_diagonal(q, k, v, *, block_q, block_k, causal=False):
    """Causal: the key loop starts at qs (the diagonal block) instead of 0: the blocks below the diagonal, which
    every query of the block may see, are skipped."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        q_blk = q[..., qs:qe, :] * scale
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        start = (qs // block_k) * block_k if causal else 0
        for ks in range(start, min(lk, qe) if causal else lk, block_k):
            ke = min(ks + block_k, lk)
            s = q_blk @ k[..., ks:ke, :].transpose(-2, -1)
            if causal:
                ok = torch.arange(ks, ke, device=q.device)[None, :] <= torch.arange(qs, qe, device=q.device)[:, None]
                s = s.masked_fill(~ok, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


@bug("10.2", "causal_mask")
def flash_off_diagonal_blocks_fully_masked(q, k, v, *, block_q, block_k, causal=False):
    """Masks every computed block with the block's own lower triangle, counted from its corner only when the block
    is on the diagonal; off the diagonal it uses ones(...).tril(0) too: the keys below the diagonal partly hidden."""
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
                ok = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril()
                s = s.masked_fill(~ok, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            c = torch.exp(m - m_new)
            l = l * c + p.sum(-1)
            acc = acc * c[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


@bug("12.3", "mismatch")
def linear_reads_state_times_query(q, k, v):
    """Reads S @ phi(q_i) (d x d_v times d) instead of phi(q_i)^T S: right shape only when d == d_v, wrong numbers."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        num = (s.transpose(-2, -1) @ fq[..., i, :, None]).squeeze(-1) if s.shape[-1] != s.shape[-2] else \
            (s @ fq[..., i, :, None]).squeeze(-1)
        outs.append(num / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=-2)


@bug("10.1", "online_rescale", avoids=("no maximum is subtracted",))
def online_softmax_rescales_before_the_max_update(x, block_size):
    """Rescales l by exp(m_old - block max) (not the running max): wrong when a block's max is below the running
    one (the old sum is then blown up)."""
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        bmax = block.amax(-1)
        m_new = torch.maximum(m, bmax)
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        bsafe = torch.where(bmax == float("-inf"), torch.zeros_like(bmax), bmax)
        l = l * torch.exp(m - bsafe).nan_to_num(0.0) + torch.exp(block - safe[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


# ============================================================================ 8.1 (synthetic runs, as search31c)
from bank.attempts import Attempt  # noqa: E402
from course_lib.classroom.training_runs import TrainingRun  # noqa: E402


def _run37(label, val, train=(3.0, 2.5, 2.2), **kw):
    return TrainingRun(label, [1, 2, 3], list(train), [50, 100], list(val), trained_on=("names", 0, 3e-3), **kw)


_REF37 = _run37("reference", [2.4, 2.0], yours_asked=())
CORRECT.append(Attempt("8.1", "runs_a_little_above_within_tolerance",
                       (_run37("yours", [2.42, 2.015], not_yours=()), _REF37), None))
BUGGY.append(Attempt("8.1", "runs_a_little_below_past_tolerance",
                     (_run37("yours", [2.38, 1.97], not_yours=()), _REF37), "mismatch", ("below",)))
BUGGY.append(Attempt("8.1", "runs_with_an_infinite_train_loss",
                     (_run37("yours", [2.4, 2.0], train=(3.0, float("inf"), 2.2), not_yours=()), _REF37), "nan"))
