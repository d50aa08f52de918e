"""FlashAttention in plain PyTorch: the online softmax, the tiled forward and the recomputing backward.

The names are the ones notebook 10 teaches. Nothing here builds the L x L score matrix: the forward
walks over blocks of queries and, for each, over blocks of keys, keeping a running maximum ``m``,
a running sum ``l`` and an output accumulator, all rescaled when the maximum grows; the backward
recomputes each block's weights from the saved per-row log-sum-exp. The Triton kernel of the same
tiling is in ``flash_triton`` (imported only when asked for: Triton is an optional extra).
"""
from __future__ import annotations

import math

import torch

from . import _validate as validate

__all__ = ["online_softmax", "flash_attention", "FlashAttentionFunction", "naive_attention",
           "causal_blocks", "score_bytes"]


def online_softmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """softmax(x) over the last axis, its statistics read one block of ``block_size`` entries at a time.

    x (..., L) -> (..., L). One pass keeps the running maximum m and the running sum
    l = sum exp(x_j - m); when a block raises the maximum, the sum so far is rescaled by
    exp(m_old - m_new). The probabilities exp(x - m) / l are formed once, at the end.

    A block whose entries are all -inf (a padded prefix) leaves m at -inf, and -inf - (-inf) is NaN:
    while nothing has been seen, the maximum is subtracted as 0 instead (every term is exp(-inf) = 0 then).
    A row that is -inf everywhere has nothing to weigh: its probabilities are all 0, as attention over no
    keys gives in :func:`naive_attention` (``torch.softmax`` would give NaN). A row holding +inf or NaN gives
    NaN, as ``torch.softmax`` does: no finite probabilities can say where an infinite score's weight goes.
    """
    validate.tensor("x", x, min_dim=1, floating=True)
    block_size = validate.positive_int("block_size", block_size)
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)   # (...,): running max
    total = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)              # (...,): running sum
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]                   # (..., B); the last may be shorter
        m_new = torch.maximum(m, block.amax(dim=-1))               # (...,)
        shift = _finite_or_zero(m_new)                             # (...,): -inf (nothing yet) counts as 0
        total = total * torch.exp(m - shift) + torch.exp(block - shift[..., None]).sum(dim=-1)
        m = m_new
    return _divide_or_zero(torch.exp(x - _finite_or_zero(m)[..., None]), total[..., None])   # (..., L)


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """The running maximum to subtract: 0 where it is still -inf, so that -inf - m is -inf and not NaN."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def _divide_or_zero(numerator: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """numerator / total, and 0 where the total is 0 (a row with no key to weigh); a NaN total (a row that
    held +inf or NaN) stays NaN, as torch.softmax and naive_attention give, rather than a silent 0."""
    some = total != 0
    return torch.where(some, numerator / torch.where(some, total, torch.ones_like(total)),
                       torch.zeros_like(numerator))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v with the full (..., Lq, Lk) score matrix, and its per-row log-sum-exp.

    The textbook version, for comparison: its memory grows as Lq * Lk. With no keys (Lk = 0) each
    output row is zeros and its log-sum-exp is -inf.
    """
    _check_qkv(q, k, v, validate.boolean("causal", causal))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])         # (..., Lq, Lk)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)   # (Lq, Lk)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                             # (..., Lq)
    return torch.softmax(scores, dim=-1) @ v, lse                     # (..., Lq, d), (..., Lq)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    validate.tensor("q", q, min_dim=2, floating=True)
    validate.tensor("k", k, min_dim=2, floating=True)
    validate.tensor("v", v, min_dim=2, floating=True)
    if q.shape[-1] == 0:
        raise ValueError(f"q: expected a head dimension d >= 1 (the scores divide by sqrt(d)), got shape {tuple(q.shape)}")
    for name, other in (("k", k), ("v", v)):
        if other.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {other.dtype}; "
                            f"convert it with .to(q.dtype)")
        if other.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (the device of q), got {other.device}")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected shape (..., Lk, {q.shape[-1]}) with the batch axes of q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: expected one value per key, shape {tuple(k.shape[:-1])} + (dv,), got {tuple(v.shape)}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal: expected as many queries as keys for a causal mask, got Lq={q.shape[-2]} and "
                         f"Lk={k.shape[-2]}")


def causal_blocks(length: int, block_q: int, block_k: int) -> tuple[int, int]:
    """(key blocks a causal tiled forward computes, key blocks there are) for a length-``length`` sequence.

    Query block i (rows i*block_q .. i*block_q + block_q - 1) needs key block j when the block's first
    key is not after the block's last query: j*block_k <= last query.
    """
    length, block_q, block_k = (validate.positive_int(n, v) for n, v in
                                (("length", length), ("block_q", block_q), ("block_k", block_k)))
    key_blocks = math.ceil(length / block_k)
    needed = 0
    for q_start in range(0, length, block_q):
        last_query = min(q_start + block_q, length) - 1
        needed += last_query // block_k + 1
    return needed, math.ceil(length / block_q) * key_blocks


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_q: int = 64, block_k: int = 64,
                    causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed tile by tile, never holding more than a (block_q, block_k) block of scores.

    q (..., Lq, d), k (..., Lk, d), v (..., Lk, dv) -> out (..., Lq, dv), lse (..., Lq), where
    lse = log sum_j exp(s_ij) is the log-sum-exp of each query's scaled scores (what the backward needs).
    With ``causal``, query i sees keys 0..i, and key blocks wholly in a query block's future are skipped.
    """
    _check_qkv(q, k, v, validate.boolean("causal", causal))
    block_q = validate.positive_int("block_q", block_q)
    block_k = validate.positive_int("block_k", block_k)
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)   # (..., Lq, dv)
    lse = torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)                 # (..., Lq)
    for q_start in range(0, lq, block_q):
        q_end = min(q_start + block_q, lq)
        q_blk = q[..., q_start:q_end, :] * scale                      # (..., Bq, d): scaled once, here
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)   # (..., Bq)
        total = torch.zeros_like(m)                                   # (..., Bq)
        acc = torch.zeros(*q_blk.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)   # (..., Bq, dv)
        # causal: key blocks that start after this block's last query see nothing; stop there
        k_stop = min(lk, q_end) if causal else lk
        for k_start in range(0, k_stop, block_k):
            k_end = min(k_start + block_k, lk)
            s = q_blk @ k[..., k_start:k_end, :].transpose(-2, -1)   # (..., Bq, Bk)
            if causal and k_end - 1 > q_start:                        # the block crosses the diagonal
                rows = torch.arange(q_start, q_end, device=q.device)[:, None]    # (Bq, 1)
                cols = torch.arange(k_start, k_end, device=q.device)[None, :]    # (1, Bk)
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))                  # (..., Bq)
            shift = _finite_or_zero(m_new)                            # (..., Bq): -inf - -inf would be NaN
            p = torch.exp(s - shift[..., None])                       # (..., Bq, Bk)
            correction = torch.exp(m - shift)                         # (..., Bq): old terms shrink
            total = total * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + p @ v[..., k_start:k_end, :]   # (..., Bq, dv)
            m = m_new
        out[..., q_start:q_end, :] = _divide_or_zero(acc, total[..., None])   # no keys: zeros, as naive
        lse[..., q_start:q_end] = m + torch.log(total)
    return out, lse


class FlashAttentionFunction(torch.autograd.Function):
    """FlashAttention with a backward that recomputes each block's weights instead of storing them.

    ``FlashAttentionFunction.apply(q, k, v, causal, block_q, block_k)`` -> out. Saved for the backward:
    q, k, v, out and the per-row log-sum-exp, O(L) numbers per head; never the L x L weights.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out * out).sum(dim=-1)                          # (..., Lq): D = rowsum(dO * O)
        for q_start in range(0, lq, ctx.block_q):
            q_end = min(q_start + ctx.block_q, lq)
            q_blk, do_blk = q[..., q_start:q_end, :], grad_out[..., q_start:q_end, :]   # (..., Bq, d), (..., Bq, dv)
            k_stop = min(lk, q_end) if ctx.causal else lk
            for k_start in range(0, k_stop, ctx.block_k):
                k_end = min(k_start + ctx.block_k, lk)
                k_blk, v_blk = k[..., k_start:k_end, :], v[..., k_start:k_end, :]
                s = q_blk @ k_blk.transpose(-2, -1) * scale           # (..., Bq, Bk)
                if ctx.causal and k_end - 1 > q_start:
                    rows = torch.arange(q_start, q_end, device=q.device)[:, None]
                    cols = torch.arange(k_start, k_end, device=q.device)[None, :]
                    s = s.masked_fill(cols > rows, float("-inf"))
                p = torch.exp(s - lse[..., q_start:q_end, None])      # (..., Bq, Bk): the weights, recomputed
                dv[..., k_start:k_end, :] += p.transpose(-2, -1) @ do_blk          # (..., Bk, dv)
                dp = do_blk @ v_blk.transpose(-2, -1)                 # (..., Bq, Bk)
                ds = p * (dp - delta[..., q_start:q_end, None])       # (..., Bq, Bk): softmax's backward
                dq[..., q_start:q_end, :] += ds @ k_blk * scale       # (..., Bq, d)
                dk[..., k_start:k_end, :] += ds.transpose(-2, -1) @ q_blk * scale   # (..., Bk, d)
        return dq, dk, dv, None, None, None


def score_bytes(length: int, *, heads: int = 1, batch: int = 1, bytes_per_number: int = 4) -> int:
    """Bytes of one L x L matrix per head (the scores; the weights are another as many)."""
    for name, value in (("length", length), ("heads", heads), ("batch", batch), ("bytes_per_number", bytes_per_number)):
        validate.positive_int(name, value)
    return batch * heads * length * length * bytes_per_number
