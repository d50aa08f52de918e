"""Student attempts from the twenty-sixth search of the checks (2026-11-30), a tester's bank in styles this one did
not hold: each was misjudged before.

Right tiled code refused as "the full score matrix" for one buffer of q, k, v or of dq, dk, dv (10.2, 10.3);
results kept between calls where the inputs are integers or no tensors (5.1, 5.2, 5.4, 6.1: passed); a part of a
result kept (1.2, 1.3, 9.2, 10.1, 12.3: "precision", "right for values of shape ..." or "none of the mistakes");
Hugging Face's RMSNorm order with a float32 weight on float16 x (9.3: passed); sequences or heads summed together
in 12.3 (not named); a ValueError that says nothing of what to do (4.3: passed). And mistakes told only "wrong
values" (4.3, 5.2, 7.1, 9.4, 9.6, 10.3, 11.3, 12.3), now named.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from bank.flash_bugs import _backward, _tiled
from bank.modern_bugs import _attend, _GQAPlain
from bank.pairs_bugs import _latent
from course_lib.flash import FlashAttentionFunction
from course_lib.model import GPT
from course_lib.modern import (
    RMSNorm,
    SwiGLU,
    repeat_kv,
    rotate_half,
)

BUGGY, CORRECT, bug, correct = new_bank()

_KEPT: dict = {}


def _kept(key, compute):
    if key not in _KEPT:
        _KEPT[key] = compute()
    return _KEPT[key]


# ============================================================================ 10.2, 10.3: a buffer is no score matrix

@correct("10.2")
def flash_through_one_stack_in_float64(q, k, v, *, block_q, block_k, causal=False):
    """q, k and v cast together: a (3, N, H, L, d) tensor, as many numbers as L x L on the probe, no score in it."""
    q2, k2, v2 = torch.stack((q, k, v)).double().unbind(0) if q.shape == k.shape == v.shape else \
        (q.double(), k.double(), v.double())
    out, lse = _tiled(q2, k2, v2, block_q, block_k, causal)
    return out.to(q.dtype), lse.to(q.dtype)


@correct("10.3")
class BackwardIntoOneGradientBuffer(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        dq, dk, dv = _backward(ctx, grad_out)[:3]
        if dq.shape == dk.shape == dv.shape:
            dq, dk, dv = torch.stack((dq, dk, dv)).unbind(0)   # (3, N, H, L, d): as many numbers as L x L
        return dq, dk, dv, None, None, None


# ============================================================================ kept where the inputs are integers

@bug("5.1", "kept_state", "returned what it returned the first time")
def windows_kept_by_length(ids, max_tokens):
    def make():
        windows = ids.unfold(0, max_tokens + 1, max_tokens)
        return windows[:, :-1], windows[:, 1:]
    return _kept(("5.1", len(ids), max_tokens), make)


@bug("5.2", "kept_state", "earlier call")
def loss_with_the_padding_kept_by_shape(logits, targets):
    keep = _kept(("5.2", targets.shape), lambda: targets != -100)   # the first call's padding, for every later one
    picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return -(picked * keep).sum() / keep.sum()


@bug("5.4", "kept_state", "same top_k")
def sample_with_the_threshold_kept(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    z = logits / temperature
    if top_k is not None:
        kth = _kept(("5.4", z.shape, top_k), lambda: z.topk(min(top_k, z.shape[-1]), -1).values[:, -1:])
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.multinomial(z.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("6.1", "kept_state", "another GPTConfig")
def flops_kept_by_weights(config, num_weights):
    return _kept(("6.1", num_weights), lambda: 6 * num_weights + 12 * config.num_layers * config.num_heads
                 * config.head_dim * config.max_tokens)


# ============================================================================ a part of a result kept

@bug("1.2", "kept_state", "earlier call", avoids=("values of shape",))
def toy_scores_kept_by_shape(query, keys, values):
    return _kept(("1.2", keys.shape), lambda: torch.softmax(keys @ query, 0)) @ values


@bug("1.3", "kept_state", "earlier call", avoids=("precision", "half"))
def sdpa_mask_kept_by_shape(q, k, v, mask=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(_kept(("1.3", mask.shape), lambda: ~mask), float("-inf"))
    return s.softmax(-1) @ v


@bug("9.2", "kept_state", "earlier call")
def rotary_rows_kept(x, cos, sin, offset=0):
    length = x.shape[-2]
    c, s = _kept(("9.2", offset, length, x.dtype),
                 lambda: (cos[offset:offset + length].to(x.dtype), sin[offset:offset + length].to(x.dtype)))
    return x * c + rotate_half(x) * s


def online_softmax_carried(x, block_size):
    """m and l live on the function and carry on from the last call of the same shape."""
    me = online_softmax_carried
    if getattr(me, "l", None) is None or me.l.shape != x.shape[:-1]:
        me.m, me.l = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype), torch.zeros(x.shape[:-1], dtype=x.dtype)
    m, l = me.m, me.l
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        new = torch.maximum(m, block.amax(-1))
        l, m = l * torch.exp(m - new) + torch.exp(block - new[..., None]).sum(-1), new
    me.m, me.l = m, l
    return torch.exp(x - m[..., None]) / l[..., None]


bug("10.1", "kept_state", "called twice")(online_softmax_carried)


def _linear(fq, fk, v, s, z, total=False):
    outs = []
    for i in range(fq.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        den = (fq[..., i, :] * z).sum() if total else (fq[..., i, :] * z).sum(-1, keepdim=True)
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / (den + 1e-6))
    return torch.stack(outs, -2), s, z


def _empty_state(q, v):
    return q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1]), q.new_zeros(*q.shape[:-2], q.shape[-1])


@bug("12.3", "kept_state", "earlier call")
def linear_phi_k_kept_by_shape(q, k, v):
    return _linear(F.elu(q) + 1, _kept(("12.3", k.shape, k.dtype), lambda: F.elu(k) + 1), v, *_empty_state(q, v))[0]


_STATE: dict = {}


@bug("12.3", "kept_state", "called twice")
def linear_state_carried_over(q, k, v):
    key = (q.shape, v.shape)
    out, s, z = _linear(F.elu(q) + 1, F.elu(k) + 1, v, *_STATE.get(key, _empty_state(q, v)))
    _STATE[key] = (s.detach(), z.detach())
    return out


# ============================================================================ 12.3: the batch and the heads together

@bug("12.3", "batch_mixing", "than alone")
def linear_denominator_over_everything(q, k, v):
    return _linear(F.elu(q) + 1, F.elu(k) + 1, v, *_empty_state(q, v), total=True)[0]


@bug("12.3", "batch_mixing", "than alone")
def linear_one_state_for_the_batch(q, k, v):
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    s, z, outs = q.new_zeros(q.shape[-1], v.shape[-1]), q.new_zeros(q.shape[-1]), []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :].reshape(-1, fk.shape[-1]).T @ v[..., i, :].reshape(-1, v.shape[-1])
        z = z + fk[..., i, :].reshape(-1, fk.shape[-1]).sum(0)
        outs.append((fq[..., i, :] @ s) / ((fq[..., i, :] @ z)[..., None] + 1e-6))
    return torch.stack(outs, -2)


# ============================================================================ 9.3: x's dtype, whatever the weight's
# (Hugging Face's order without the last cast is modern_bugs' RMSNormHFStyle, now a bug)

@correct("9.3")
class RMSNormHuggingFaceCastBack(RMSNorm):
    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype)).to(x.dtype)


# ============================================================================ 4.3: an error that says what to do

class _Limited(GPT):
    said = ""

    def forward(self, idx):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError(self.said.format(length=idx.shape[1], limit=self.config.max_tokens))
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "context_limit", "nothing of what to do")
class GPTSaysOnlyTooLong(_Limited):
    said = "sequence too long"


@correct("4.3")
class GPTNamesTheLimit(_Limited):
    said = "got {length} tokens but the model takes {limit}"


@correct("4.3")
class GPTSaysCrop(_Limited):
    said = "too long: crop the input"


# ============================================================================ named now, not "wrong values"

@bug("5.2", "softmax_dim", "positions (dim=1)")
def loss_log_softmax_over_the_positions(logits, targets):
    picked = logits.log_softmax(dim=1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return -picked[targets != -100].mean()


@bug("5.2", "logits", "perplexity")
def loss_returns_the_perplexity(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).exp()


@bug("7.1", "split_transpose", "Wk and Wv are still")
def split_transposes_the_query_only(weight):
    q, k, v = weight.chunk(3, dim=1)
    return q.T, k, v


@bug("9.4", "gating", "in-place sigmoid")
class SwiGLUSigmoidInPlace(SwiGLU):
    def forward(self, x):
        g = self.gate(x)
        return self.down(g * g.sigmoid_() * self.up(x))   # g is sigmoid(g) by the time it is multiplied


@bug("9.4", "gating", "multiply first")
class SwiGLUDownOnEachBranch(SwiGLU):
    def forward(self, x):
        return self.down(F.silu(self.gate(x))) * self.down(self.up(x))


@bug("10.3", "scale", "-1 times")
class BackwardWithDSNegated(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, grads=-ctx.saved_tensors[0].shape[-1] ** -0.5)   # dS = P * (D - dP)


@bug("12.3", "normalization", "phi(k_j)")
def linear_normaliser_of_the_queries(q, k, v):
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    s, z = _empty_state(q, v)
    outs = []
    for i in range(q.shape[-2]):
        s, z = s + fk[..., i, :, None] * v[..., i, None, :], z + fq[..., i, :]
        outs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outs, -2)


@bug("4.3", "mismatch", "tied head")
class GPTTiedHead(GPT):
    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.token_embedding.weight.T



@contextlib.contextmanager
def _zeroed(blocks, columns):
    """A pre-hook on proj of each of ``blocks`` zeroing ``columns`` of its input, removed on the way out."""
    def zero(module, args):
        x = args[0].clone()
        x[..., columns] = 0.0
        return (x, *args[1:])
    hooks = [block.attn.proj.register_forward_pre_hook(zero) for block in blocks]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@bug("11.3", "ablation_slice", "every layer")
@contextlib.contextmanager
def ablate_head_in_every_layer(model, layer, head):
    size = model.blocks[layer].attn.head_dim
    with _zeroed(list(model.blocks), slice(head * size, (head + 1) * size)):
        yield model


@bug("11.3", "ablation_slice", "one column too many")
@contextlib.contextmanager
def ablate_head_and_one_more_column(model, layer, head):
    size = model.blocks[layer].attn.head_dim
    with _zeroed([model.blocks[layer]], slice(head * size, (head + 1) * size + 1)):
        yield model


# ============================================================================ 9.6: keys and values grouped apart

@bug("9.6", "kv_grouping", "another order")
class GQAValuesTiledKeysInterleaved(_GQAPlain):
    """Keys shared with repeat_kv (each key head next to its queries), values tiled with .repeat: query head h reads
    the keys of one group and the values of another."""

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k, v = self.normed(x)
        q, k = self.turn(q, k, start, x.shape[1])
        if cache is not None:
            k, v = cache.append(k, v)
        return _attend(self, q, repeat_kv(k, self.groups), v.repeat(1, self.groups, 1, 1), start)


# ============================================================================ 10.3, 12.2: mistakes the search named

@bug("10.3", "block_skip", "skips the diagonal block")
class BackwardKeyLoopStopsBeforeTheDiagonal(FlashAttentionFunction):
    """The causal backward's key loop runs to the query block's start: the diagonal block's keys get no gradient."""

    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, diagonal=False)


@bug("12.2", "norm_placement", "query latent is not normalised")
def latent_queries_without_their_norm(layer, x, cache=None):
    """q_b_proj(q_a_proj(x)): the query latent never meets q_a_layernorm."""
    return _latent(layer, x, cache, q_norm=False)


@bug("12.2", "head_split", "interleaves the heads")
def latent_heads_merged_with_the_heads_last(layer, x, cache=None):
    """(N, H, L, dv) permuted to (N, L, dv, H) before the reshape: one feature of every head side by side."""
    return _latent(layer, x, cache, merge="heads_last")
