"""Round 39 (notebooks 01-04, 07, 09, 10, 12): attempts at 1.1, 1.2, 2.2, 3.3, 4.2, 7.1, 7.2, 9.3, 9.4, 10.3, 12.1, 12.3.

Named by this round's fixes: 9.3 a result cast with .half() for any two-byte input (a bfloat16 layer: ``dtype``)
and eps added to the sum of squares before dividing by dim (``epsilon``); 10.3 D summed in float32 (a bfloat16
backward: ``dtype``) and the log-sum-exp read at the key block's rows (``logsumexp``); 2.2 the weights transposed
before the values (``causal_mask``, not ``softmax_dim``: the softmax is right, the future leaks). The engine's
probes hold here too: F.dropout in 1.2 (``dropout``), a float32 softmax meeting float64 values (``dtype``), ln1(x)
kept on the block (``kept_state``), float32 buffers in 7.1 (``dtype``). Left out (debatable: 9.4's text asks for no
dtype and no large inputs): a SwiGLU cast back with .half() for any two-byte input, and SiLU written as
g * exp(g) / (1 + exp(g)).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import Attempt, new_bank
from course_lib import flash
from course_lib.attention import MultiHeadMaskedAttention as _CourseMHA
from course_lib.attention import causal_mask, merge_heads, scaled_dot_product_attention, split_heads
from course_lib.model import FeedForward

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.1 my_prediction
# the result left as the weighted values, not added up
BUGGY.append(Attempt("1.1", "prediction_result_as_weighted_values_not_summed",
                     ([0.21, 0.58, 0.21], [0.21 * 1, 0.58 * 2, 0.21 * 3]), "shape"))
# percentages: 21 %, 58 %, 21 %
BUGGY.append(Attempt("1.1", "prediction_in_percent", ([21, 58, 21], 2.0), "normalization"))
# a student who took the softmax of the negated scores (closest = smallest score)
BUGGY.append(Attempt("1.1", "prediction_softmax_of_negated_scores",
                     ([math.e / (1 + 2 * math.e), 1 / (1 + 2 * math.e), math.e / (1 + 2 * math.e)], 2.0), "mismatch"))
# weights straight out of torch.softmax, still attached to the graph (requires_grad)
CORRECT.append(Attempt("1.1", "prediction_tensor_that_requires_grad",
                       (torch.softmax(torch.tensor([0.0, 1.0, 0.0], requires_grad=True), 0), torch.tensor(2.0)), None))
# a tuple of 0-d tensors and a 1-element list for the result
CORRECT.append(Attempt("1.1", "prediction_tuple_of_scalar_tensors",
                       ((torch.tensor(0.21), torch.tensor(0.58), torch.tensor(0.21)), [2.0]), None))
# bfloat16 weights: 0.5761 rounds to 0.5742 or so, within two decimals
CORRECT.append(Attempt("1.1", "prediction_in_bfloat16",
                       (torch.tensor([0.2119, 0.5761, 0.2119], dtype=torch.bfloat16), 2.0), None))


# ============================================================================ 1.2 toy_attention

@bug("1.2", "dropout")
def toy_with_functional_dropout(query, keys, values):
    """'Dropout, like the real thing': F.dropout's training defaults to True, so it always drops."""
    weights = F.dropout(torch.softmax(keys @ query, dim=0), p=0.1)
    return weights @ values


@bug("1.2", "dtype")
def toy_softmax_forced_to_float32(query, keys, values):
    """softmax(..., dtype=torch.float32): float64 weights meet float64 values as float32 -> matmul dtype error."""
    weights = torch.softmax(keys @ query, dim=0, dtype=torch.float32)
    return weights @ values


@bug("1.2", "shape")
def toy_broadcast_column_weights(query, keys, values):
    """weights[:, None] * values summed over keys: right for (n, dv), but (n,) values become an (n, n) outer sum."""
    weights = torch.softmax(keys @ query, dim=0)
    return (weights[:, None] * values).sum(dim=0)


@bug("1.2", "mismatch")
def toy_cosine_similarity(query, keys, values):
    """Cosine similarity as the score: keys and query normalised first (a scaled score)."""
    scores = F.cosine_similarity(keys, query[None, :], dim=-1)
    return torch.softmax(scores, dim=0) @ values


@correct("1.2")
def toy_softmax_without_dim(query, keys, values):
    """F.softmax with no dim: on a 1-D tensor the implicit dim is 0 (a deprecation warning only)."""
    weights = F.softmax(keys @ query)
    return weights @ values


@correct("1.2")
def toy_tensordot_and_mv(query, keys, values):
    scores = torch.mv(keys, query)
    weights = torch.softmax(scores, dim=-1)
    return torch.tensordot(weights, values, dims=1)


# ============================================================================ 2.2 MaskedAttention.forward

class _Given02(nn.Module):
    """The notebook's constructor of 2.2."""

    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)


@bug("2.2", "causal_mask")
class MaskedWeightsTransposedBeforeValues(_Given02):
    """weights.transpose(-2, -1) @ v: output i averages the values of keys j >= i, the future."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights.transpose(-2, -1) @ v))


@bug("2.2", "mismatch")
class MaskedMultipliesByTheRawWeights(_Given02):
    """x @ self.query.weight (no transpose): nn.Linear computes x @ W^T."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = x @ self.query.weight, x @ self.key.weight, x @ self.value.weight
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "exception")
class MaskedWithCapitalTOnKeys(_Given02):
    """k.T on a 3-D tensor reverses every axis (N, L, E) -> (E, L, N), as in the 2-D tutorials."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.T / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights @ v))


@bug("2.2", "causal_mask")
class MaskedRowsOnlyOfTheBuffer(_Given02):
    """self.mask[:L] then a slice of columns from the END: the (L, L) corner taken from the wrong side."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        mask = self.mask[:length, -length:]
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(weights @ v))


@correct("2.2")
class MaskedFromOneFusedProjection(_Given02):
    """The three weights stacked into one (3E, E) matrix: one matmul, then split into q, k, v."""

    def forward(self, x):
        length, e = x.shape[1], self.embed_dim
        w = torch.cat([self.query.weight, self.key.weight, self.value.weight], dim=0)   # (3E, E)
        q, k, v = F.linear(x, w).split(e, dim=-1)
        scores = torch.einsum("nqe,nke->nqk", q, k) * e ** -0.5
        scores = torch.where(self.mask[:length, :length], scores, torch.finfo(scores.dtype).min)
        weights = self.attn_dropout(F.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(torch.bmm(weights, v)))


# ============================================================================ 3.3 MultiHeadMaskedAttention.forward

class _Given03(nn.Module):
    """The notebook's constructor of 3.3."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"num_heads: embed_dim={embed_dim} must be divisible by num_heads, got {num_heads}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)


@bug("3.3", "head_split")
class MultiMergedWithHeadsLast(_Given03):
    """Merge by permute(0, 2, 3, 1): (N, L, head_dim, heads) flattened, the heads' features interleaved."""

    def forward(self, x):
        n, length, e = x.shape
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        out = (weights @ v).permute(0, 2, 3, 1).reshape(n, length, e)
        return self.proj_dropout(self.proj(out))


@bug("3.3", "scale")
class MultiScaleFloorDividedBySqrtHeads(_Given03):
    """self.embed_dim // self.num_heads ** 0.5: ** binds first, so E // sqrt(H), not sqrt(E // H)."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / (self.embed_dim // self.num_heads ** 0.5)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(merge_heads(weights @ v)))


@bug("3.3", "exception")
class MultiMaskSlicedOnHeadsAxis(_Given03):
    """The mask given a None in the wrong place, mask[:, None]: (L, 1, L) broadcast over (N, H, L, L)."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = self.mask[:length, :length][:, None]          # (L, 1, L): meant (1, L, L)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj(merge_heads(weights @ v)))


@correct("3.3")
class MultiLoopOverWeightSlices(_Given03):
    """Each head from its own rows of the projection weights, F.linear per head, heads concatenated."""

    def forward(self, x):
        length, d = x.shape[1], self.head_dim
        allowed = self.mask[:length, :length]
        outs = []
        for h in range(self.num_heads):
            rows = slice(h * d, (h + 1) * d)
            q = F.linear(x, self.query.weight[rows])
            k = F.linear(x, self.key.weight[rows])
            v = F.linear(x, self.value.weight[rows])
            s = (q @ k.mT) / math.sqrt(d)
            w = self.attn_dropout(s.masked_fill(allowed.logical_not(), -math.inf).softmax(-1))
            outs.append(w @ v)
        return self.proj_dropout(self.proj(torch.cat(outs, dim=-1)))


# ============================================================================ 4.2 TransformerBlock.forward

class _Given04(nn.Module):
    """The notebook's constructor of 4.2."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__()
        self.norm_first = norm_first
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = _CourseMHA(embed_dim, num_heads, max_tokens, dropout_rate)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)


@bug("4.2", "kept_state")
class BlockKeepsItsNormalisedInputByShape(_Given04):
    """ln1(x) kept on the block and recomputed only when the shape changes: a new x of the same shape is ignored."""

    def forward(self, x):
        if self.norm_first:
            if getattr(self, "_h", None) is None or self._h.shape != x.shape:
                self._h = self.ln1(x)
            x = x + self.attn(self._h)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


@bug("4.2", "residual")
class BlockResidualFromTheBlocksInputTwice(_Given04):
    """Pre-norm, the feed-forward reads ln2 of the updated stream but adds to the block's ORIGINAL input."""

    def forward(self, x):
        if self.norm_first:
            h = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(h))
        h = self.ln1(x + self.attn(x))
        return self.ln2(h + self.mlp(h))


@bug("4.2", "norm_placement", norm_first=False)
class PostBlockNormalisesOnlyTheSublayerInput(_Given04):
    """Post-norm written as ln(x) + sublayer(ln(x))... no: x = ln1(x) then x + attn(x): the norm before, unnormalised after."""

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x)
        x = x + self.attn(x)
        x = self.ln2(x)
        return x + self.mlp(x)


@correct("4.2", norm_first=False)
class PostBlockWithTorchAddAndFunctionalNorms(_Given04):
    def forward(self, x):
        if self.norm_first:
            x = torch.add(x, self.attn(self.ln1(x)))
            return torch.add(x, self.mlp(self.ln2(x)))
        for ln, sub in ((self.ln1, self.attn), (self.ln2, self.mlp)):
            x = F.layer_norm(x + sub(x), ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        return x


# ============================================================================ 7.1 split_c_attn

@bug("7.1", "dtype", "length 8")
def split_c_attn_split_of_three_columns(weight):
    """weight.split(3, dim=1): pieces 3 columns wide (split's argument is a size), not 3 pieces."""
    parts = weight.split(3, dim=1)
    return tuple(p.T for p in parts)


@bug("7.1", "dtype")
def split_c_attn_into_default_dtype_buffers(weight):
    """Buffers on the weight's device as the text says, but in the default float32 whatever the weight's dtype."""
    e = weight.shape[0]
    out = []
    for i in range(3):
        buf = torch.empty(e, e, device=weight.device)
        buf.copy_(weight[:, i * e:(i + 1) * e].T)
        out.append(buf)
    return tuple(out)


@correct("7.1")
def split_c_attn_transpose_then_reshape(weight):
    """weight.T is (3E, E): its rows are q's, then k's, then v's output features; reshape to (3, E, E)."""
    e = weight.shape[0]
    return tuple(weight.T.reshape(3, e, e))


@correct("7.1")
def split_c_attn_with_tensor_split(weight):
    wq, wk, wv = torch.tensor_split(weight, 3, dim=-1)
    return wq.t().contiguous(), wk.t().contiguous(), wv.t().contiguous()


# ============================================================================ 7.2 attention_forward

def _causal(q_len, k_len, device):
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


@bug("7.2", "scale")
def attention_forward_correction_with_power_precedence(module, query, key, value, attention_mask, scaling=None,
                                                      dropout=0.0, **kwargs):
    """scaling * d ** 1/2: ** binds first, so (scaling * d) / 2 instead of scaling * sqrt(d)."""
    q_len, k_len, d = query.shape[2], key.shape[2], query.shape[3]
    mask = _causal(q_len, k_len, query.device) if attention_mask is None else attention_mask
    query = query * (scaling * d ** 1 / 2)
    return scaled_dot_product_attention(query, key, value, mask).transpose(1, 2), None


@bug("7.2", "scale")
def attention_forward_head_dim_from_axis_two(module, query, key, value, attention_mask, scaling=None,
                                            dropout=0.0, **kwargs):
    """d read as query.shape[2] (the query length) instead of shape[3]."""
    q_len, k_len, d = query.shape[2], key.shape[2], query.shape[2]
    mask = _causal(q_len, k_len, query.device) if attention_mask is None else attention_mask
    query = query * (scaling * d ** 0.5)
    return scaled_dot_product_attention(query, key, value, mask).transpose(1, 2), None


@bug("7.2", "causal_mask")
def attention_forward_is_causal_ignores_padding(module, query, key, value, attention_mask, scaling=None,
                                               dropout=0.0, **kwargs):
    """module.is_causal read first: a causal layer always gets the plain causal mask, the padding mask dropped."""
    q_len, k_len, d = query.shape[2], key.shape[2], query.shape[3]
    if getattr(module, "is_causal", True) or attention_mask is None:
        mask = _causal(q_len, k_len, query.device)
    else:
        mask = attention_mask
    query = query * (scaling * d ** 0.5)
    return scaled_dot_product_attention(query, key, value, mask).transpose(1, 2), None


@correct("7.2")
def attention_forward_scaling_split_over_query_and_key(module, query, key, value, attention_mask, scaling=None,
                                                      dropout=0.0, **kwargs):
    """The correction scaling * sqrt(d) shared: its square root on the queries and on the keys."""
    q_len, k_len, d = query.shape[-2], key.shape[-2], query.shape[-1]
    if attention_mask is None:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    else:
        mask = attention_mask.to(torch.bool)
    if scaling is not None:
        root = math.sqrt(scaling * math.sqrt(d))
        query, key = query * root, key * root
    out = scaled_dot_product_attention(query, key, value, mask)
    return out.permute(0, 2, 1, 3).contiguous(), None


# ============================================================================ 9.3 RMSNorm.forward

class _Given09Norm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


@bug("9.3", "dtype")
class RMSNormCastsTwoByteInputsToHalf(_Given09Norm):
    """'Back to 16 bits': any two-byte input comes back as float16, a bfloat16 one too."""

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return out.half() if x.element_size() == 2 else out.to(x.dtype)


@bug("9.3", "epsilon")
class RMSNormEpsScaledByTheWidth(_Given09Norm):
    """The sum of squares plus eps, divided by dim: eps / dim inside the root instead of eps."""

    def forward(self, x):
        x32 = x.float()
        ms = (x32.pow(2).sum(-1, keepdim=True) + self.eps) / self.dim
        return (x32 / ms.sqrt() * self.weight.float()).to(x.dtype)


@correct("9.3")
class RMSNormInPlaceOnItsIntermediates(_Given09Norm):
    """Sum over dim / self.dim, then add_ and rsqrt_ in place on the statistic (a new tensor, not x)."""

    def forward(self, x):
        x32 = x.to(torch.float32)
        ms = x32.square().sum(dim=-1, keepdim=True) / self.dim
        ms.add_(self.eps).rsqrt_()
        return (x32 * ms * self.weight.to(torch.float32)).to(x.dtype)


@correct("9.3")
class RMSNormWeightAppliedInTheInputDtype(_Given09Norm):
    """Hugging Face's Llama order with the weight cast too: normalised in float32, cast back, then times the weight."""

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


# ============================================================================ 9.4 SwiGLU.forward

class _Given09Glu(nn.Module):
    def __init__(self, embed_dim, hidden_dim):
        super().__init__()
        self.gate = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, embed_dim, bias=False)


@bug("9.4", "gating")
class SwiGLUMishGate(_Given09Glu):
    """Mish, g * tanh(softplus(g)), as the gate's activation: close to SiLU but another function."""

    def forward(self, x):
        g = self.gate(x)
        return self.down(g * torch.tanh(F.softplus(g)) * self.up(x))


@correct("9.4")
class SwiGLUFromOneStackedMatrix(_Given09Glu):
    """gate and up in one matmul (their weights stacked), chunked, SiLU by a module made in forward."""

    def forward(self, x):
        g, u = F.linear(x, torch.cat([self.gate.weight, self.up.weight], dim=0)).chunk(2, dim=-1)
        return self.down(nn.SiLU()(g) * u)


# ============================================================================ 10.3 FlashAttentionFunction.backward

class _FlashGiven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out


def _flash_backward(ctx, grad_out, *, delta_fn=None, lse_by_keys=False, mask_after_exp=False):
    q, k, v, out, lse = ctx.saved_tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(dim=-1) if delta_fn is None else delta_fn(grad_out, out)
    for qs in range(0, lq, ctx.block_q):
        qe = min(qs + ctx.block_q, lq)
        q_blk, do_blk = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            k_blk, v_blk = k[..., ks:ke, :], v[..., ks:ke, :]
            s = q_blk @ k_blk.transpose(-2, -1) * scale
            future = None
            if ctx.causal and ke - 1 > qs:
                keys = torch.arange(ks, ke, device=q.device)
                future = keys[None, :] > torch.arange(qs, qe, device=q.device)[:, None]
                if not mask_after_exp:
                    s = s.masked_fill(future, float("-inf"))
            rows = lse[..., ks:ke, None] if lse_by_keys else lse[..., qs:qe, None]
            p = torch.exp(s - rows)
            if mask_after_exp and future is not None:
                p = torch.where(future, torch.zeros((), dtype=p.dtype, device=p.device), p)
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ do_blk
            ds = p * (do_blk @ v_blk.transpose(-2, -1) - delta[..., qs:qe, None])
            dq[..., qs:qe, :] += ds @ k_blk * scale
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q_blk * scale
    return dq, dk, dv, None, None, None


@bug("10.3", "exception")
class FlashBackwardDeltaSummedOverPositions(_FlashGiven):
    """D = (dO * O).sum(-2): summed over the positions instead of the features."""

    @staticmethod
    def backward(ctx, grad_out):
        return _flash_backward(ctx, grad_out, delta_fn=lambda do, o: (do * o).sum(dim=-2))


@bug("10.3", "exception")
class FlashBackwardDeltaWithKeepdim(_FlashGiven):
    """D kept as (..., L, 1), then indexed delta[..., qs:qe, None] as if it were (..., L): slices the size-1 axis."""

    @staticmethod
    def backward(ctx, grad_out):
        return _flash_backward(ctx, grad_out, delta_fn=lambda do, o: (do * o).sum(dim=-1, keepdim=True))


@bug("10.3", "logsumexp")
class FlashBackwardLseOfTheKeyBlock(_FlashGiven):
    """The log-sum-exp sliced by the KEY block's positions, lse[..., ks:ke]."""

    @staticmethod
    def backward(ctx, grad_out):
        return _flash_backward(ctx, grad_out, lse_by_keys=True)


@correct("10.3")
class FlashBackwardMaskedAfterTheExp(_FlashGiven):
    """The future zeroed in P after the exponential (torch.where) instead of -inf in the scores before."""

    @staticmethod
    def backward(ctx, grad_out):
        return _flash_backward(ctx, grad_out, mask_after_exp=True)


# ============================================================================ 12.1 sliding_window_mask

@bug("12.1", "causal_mask")
def sliding_window_by_loop_slice_one_too_far_back(length, window, sinks=0):
    """mask[i, max(0, i - window):i + 1]: window + 1 keys, the slice starts one too early."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        mask[i, max(0, i - window):i + 1] = True
        mask[i, :min(sinks, i + 1)] = True
    return mask


@bug("12.1", "causal_mask")
def sliding_window_sinks_added_as_a_triangle(length, window, sinks=0):
    """The sinks as the top-left sinks x sinks corner only: rows past the sinks never see them."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    mask = (i - j >= 0) & (i - j < window)
    mask[:sinks, :sinks] |= torch.ones(sinks, sinks, dtype=torch.bool).tril()[:length, :length]
    return mask


@correct("12.1")
@functools.cache
def sliding_window_cached_with_lru(length, window, sinks=0):
    """The mask cached per (length, window, sinks), as transformers does; the same tensor every call."""
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    return ((j <= i) & ((i - j < window) | (j < sinks)))


# ============================================================================ 12.3 linear_attention_recurrent

def _phi(x):
    return F.elu(x) + 1


@bug("12.3", "shape")
def linear_outputs_stacked_on_the_last_axis(q, k, v):
    """torch.stack(outputs, dim=-1): (..., d_v, L) instead of (..., L, d_v)."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        num = (fq[..., i, None, :] @ s).squeeze(-2)
        outs.append(num / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=-1)


@bug("12.3", "exception")
def linear_state_update_with_torch_outer(q, k, v):
    """torch.outer(phi(k_i), v_i): only for 1-D vectors, so batched inputs raise."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + torch.outer(fk[..., i, :], v[..., i, :])
        z = z + fk[..., i, :]
        num = (fq[..., i, None, :] @ s).squeeze(-2)
        outs.append(num / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=-2)


@bug("12.3", "feature_map")
def linear_phi_as_exp(q, k, v):
    """phi(x) = exp(x): positive, but it is softmax attention's kernel, not elu + 1."""
    fq, fk = torch.exp(q), torch.exp(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=-2)


@correct("12.3")
def linear_recurrent_with_vecdot_and_matmul_of_unsqueezed(q, k, v):
    fq, fk = F.elu(q) + 1.0, F.elu(k) + 1.0
    batch = q.shape[:-2]
    s = torch.zeros(*batch, q.shape[-1], v.shape[-1], dtype=q.dtype, device=q.device)
    z = torch.zeros(*batch, q.shape[-1], dtype=q.dtype, device=q.device)
    out = []
    for fq_i, fk_i, v_i in zip(fq.unbind(-2), fk.unbind(-2), v.unbind(-2)):
        s = s + fk_i.unsqueeze(-1) @ v_i.unsqueeze(-2)
        z = z + fk_i
        den = torch.linalg.vecdot(fq_i, z).unsqueeze(-1) + 1e-6
        out.append((fq_i.unsqueeze(-2) @ s).squeeze(-2) / den)
    return torch.stack(out, dim=-2)


# ============================================================================ a second pass

@bug("10.3", "dtype")
class FlashBackwardDeltaInFloat32(_FlashGiven):
    """D accumulated in float32 (sum(..., dtype=torch.float32)) "for accuracy": float16 P - D turns float32, then
    meets the float16 keys in a matmul."""

    @staticmethod
    def backward(ctx, grad_out):
        return _flash_backward(ctx, grad_out, delta_fn=lambda do, o: (do * o).sum(dim=-1, dtype=torch.float32))


@correct("9.4")
class SwiGLUInPlaceSilu(_Given09Glu):
    """F.silu(..., inplace=True) on the gate's fresh output (a new tensor, not x)."""

    def forward(self, x):
        return self.down(F.silu(self.gate(x), inplace=True) * self.up(x))


@correct("2.2")
class MaskedScaleFromATensorSqrt(_Given02):
    """The scale as torch.sqrt(torch.tensor(E)): a 0-d float32 tensor, which does not change the scores' dtype."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(1, 2) / torch.sqrt(torch.tensor(self.embed_dim, device=x.device))
        scores = scores.masked_fill(self.mask[:length, :length] == 0, float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(dim=2)) @ v))


@bug("3.3", "dropout")
class MultiRenormalisesAfterDropout(_Given03):
    """The weights renormalised to sum to one AFTER attn_dropout: undoes dropout's 1 / (1 - p) and moves the weight."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(layer(x), self.num_heads) for layer in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        return self.proj_dropout(self.proj(merge_heads(weights @ v)))


@bug("7.1", "shape")
def split_c_attn_transposed_then_chunked_on_columns(weight):
    """weight.T (3E, E) chunked along dim=1: three (3E, E/3) pieces, where the rows should be split."""
    return tuple(weight.T.chunk(3, dim=1))


@bug("12.3", "feature_map")
def linear_phi_elu_of_x_plus_one(q, k, v):
    """F.elu(x + 1) instead of F.elu(x) + 1: the +1 inside, so phi can go down to -1."""
    fq, fk = F.elu(q + 1), F.elu(k + 1)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, dim=-2)

