"""Student attempts from a fourth and a fifth scripted search (2026-11-29): scales of the scores, and sizes written
into the code that equal the notebook's (or the check's) in one configuration.

Before, each was passed, named only "mismatch" or given another cause; now each gets the diagnosis of the mistake
it makes, with the factor it uses, or the note that a size is written into the code. A few right controls with
unusual but correct code keep the checks honest.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank
from bank.flash_bugs import _backward, _tiled
from bank.model_bugs import GivenBlock
from bank.search_bugs import _GivenGQA, _GPTBody
from course_lib.attention import MaskedAttention, MultiHeadMaskedAttention, causal_mask, merge_heads, split_heads
from course_lib.flash import FlashAttentionFunction
from course_lib.modern import apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 9.6: any factor, and one size written in
class _GQAScaled(_GivenGQA):
    """The notebook's steps; ``factor`` multiplies the scores before the softmax, ``after`` the weights after it."""

    def factor(self):
        return self.head_dim ** -0.5

    def after(self):
        return 1.0

    def mask(self, start, total):
        return causal_mask(total)[start:]

    def cached(self, cache, k, v):
        return cache.append(k, v)

    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = self.cached(cache, k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        s = (q @ k.transpose(-2, -1)) * self.factor()                          # (N, heads, L, T)
        s = s.masked_fill(~self.mask(start, k.shape[2]).to(x.device), float("-inf"))
        return self.proj(merge_heads(F.softmax(s, dim=-1) * self.after() @ v))


@correct("9.6")
class GQAScaledQueriesAndKeysByAQuarterPower(_GQAScaled):
    def factor(self):
        return (self.head_dim ** -0.25) ** 2


@bug("9.6", "scale", "0.5946", "0.3536")
class GQADividedByAFourthRoot(_GQAScaled):
    def factor(self):
        return self.head_dim ** -0.25


@bug("9.6", "scale", "0.25")
class GQADividedBySqrtOfTwiceHeadDim(_GQAScaled):
    def factor(self):
        return (2 * self.head_dim) ** -0.5


@bug("9.6", "scale", "multiply")
class GQAMultipliedBySqrtHeadDim(_GQAScaled):
    def factor(self):
        return math.sqrt(self.head_dim)


@bug("9.6", "scale", "after the softmax")
class GQAScaledAfterTheSoftmax(_GQAScaled):
    def factor(self):
        return 1.0

    def after(self):
        return self.head_dim ** -0.5


@bug("9.6", "scale", "written into your code", "0.2887")
class GQAScaleOfEightWrittenIn(_GQAScaled):
    def factor(self):
        return 1 / math.sqrt(8)   # head_dim in the notebook's example


@bug("9.6", "head_split", "written into your code")
class GQAFourHeadsWrittenIn(_GQAScaled):
    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta)
        self.num_heads = 4   # the notebook's example


# ============================================================================ 2.2 and 3.3
class _MaskedScaled(MaskedAttention):
    """Notebook 02's steps, with the scores' factor of its own."""

    def factor(self, q):
        return q.shape[-1] ** -0.5

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)                      # (N, L, E)
        s = (q @ k.transpose(-2, -1) * self.factor(q)).masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(s.softmax(-1)) @ v))


@bug("2.2", "batch_mixing", "batch size")
class MaskedScaledByTheBatch(_MaskedScaled):
    def factor(self, q):
        return q.shape[0] ** -0.5   # the batch size read as the width


class _MultiScaled(MultiHeadMaskedAttention):
    """Notebook 03's steps, with the scores' factor of its own."""

    def factor(self, q):
        return q.shape[-1] ** -0.5

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(t, self.num_heads) for t in (self.query(x), self.key(x), self.value(x)))
        s = (q @ k.transpose(-2, -1) * self.factor(q)).masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(s.softmax(-1)) @ v)))


@bug("3.3", "scale", "0.3536", "1/sqrt(head_dim) = 0.5")
class MultiScaleOfEightWrittenIn(_MultiScaled):
    def factor(self, q):
        return 8 ** -0.5   # head_dim of 2 heads in embed_dim 16: right there only


@bug("3.3", "scale", "no scaling")
class MultiUnscaledWithOneHead(_MultiScaled):
    def factor(self, q):
        return q.shape[-1] ** -0.5 if self.num_heads > 1 else 1.0


# ============================================================================ 6.2: no new token asked for
@bug("6.2", "shape", "none was asked for")
@torch.no_grad()
def generate_first_token_before_the_loop(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    next_id = logits[:, -1].argmax(dim=-1, keepdim=True)
    idx = torch.cat([idx, next_id], dim=1)
    for _ in range(max_new_tokens - 1):
        next_id = model(next_id, cache)[:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
    return idx


# ============================================================================ 7.2: a factor that is not `scaling`
def _hf_attention(module, query, key, value, attention_mask, factor):
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
    scores = (query @ key.transpose(-2, -1) * factor).masked_fill(~attention_mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return (weights @ value).transpose(1, 2), weights


@bug("7.2", "scale", "0.04419", "`scaling` argument is 0.3536")
def hf_correction_upside_down(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # step 2's correction upside down (scaling / sqrt(d), not * sqrt(d)) before a function that divides by sqrt(d)
    return _hf_attention(module, query, key, value, attention_mask, scaling / query.shape[-1])


@bug("7.2", "scale", "0.25")
def hf_scaling_over_sqrt_heads(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return _hf_attention(module, query, key, value, attention_mask, scaling / math.sqrt(query.shape[1]))


@correct("7.2")
def hf_scaling_on_the_keys(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return _hf_attention(module, query, key * scaling, value, attention_mask, 1.0)


# ============================================================================ 10.2: any factor
def _flash_times(q, k, v, block_q, block_k, causal, factor):
    """The tiled loop, its scores multiplied by ``factor`` instead of 1/sqrt(d)."""
    return _tiled(q * factor * q.shape[-1] ** 0.5, k, v, block_q, block_k, causal)


@bug("10.2", "scale", "0.5", "0.3536", "written into your code")
def flash_scale_of_four_written_in(q, k, v, *, block_q, block_k, causal=False):
    return _flash_times(q, k, v, block_q, block_k, causal, 0.5)


@bug("10.2", "scale", "multiplied by 2")
def flash_times_sqrt_d(q, k, v, *, block_q, block_k, causal=False):
    return _flash_times(q, k, v, block_q, block_k, causal, q.shape[-1] ** 0.5)


@bug("10.2", "scale", "0.4472")
def flash_scaled_by_the_key_block(q, k, v, *, block_q, block_k, causal=False):
    return _flash_times(q, k, v, block_q, block_k, causal, block_k ** -0.5)


@bug("10.2", "scale", "after the softmax")
def flash_output_scaled(q, k, v, *, block_q, block_k, causal=False):
    out, lse = _flash_times(q, k, v, block_q, block_k, causal, 1.0)
    return out * q.shape[-1] ** -0.5, lse


@correct("10.2")
def flash_quarter_power_on_queries_and_keys(q, k, v, *, block_q, block_k, causal=False):
    f = q.shape[-1] ** -0.25
    return _tiled(q * f * q.shape[-1] ** 0.5, k * f, v, block_q, block_k, causal)


# ============================================================================ 10.3: a factor in the backward
@bug("10.3", "scale", "in the recomputed weights and in dQ and dK", "written into your code")
class BackwardScaleOfFourWrittenIn(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, recompute=0.5, grads=0.5)


@bug("10.3", "scale", "recomputes the weights", "0.7071")
class BackwardRecomputedByAFourthRoot(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        d = ctx.saved_tensors[0].shape[-1]
        return _backward(ctx, grad_out, recompute=d ** -0.25)


@bug("10.3", "scale", "dQ and dK are multiplied by 2")
class BackwardGradientsTimesSqrtD(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        d = ctx.saved_tensors[0].shape[-1]
        return _backward(ctx, grad_out, grads=d ** 0.5)


# ============================================================================ 12.2: a factor of another size
def _latent(layer, x, cache, factor, after=1.0, heads=None, out_proj=None, up_proj=None):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, heads = layer.qk_nope_head_dim, layer.qk_rope_head_dim, heads or layer.num_heads
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, heads, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)   # (N, H, L, .)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], dim=-1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    k_nope, v = (up_proj or layer.kv_b_proj)(latent).view(n, total, heads, dn + layer.v_head_dim).transpose(1, 2).split(
        [dn, layer.v_head_dim], dim=-1)                                            # (N, H, T, .)
    q = torch.cat([q_nope, apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], dim=-1)
    scores = (q @ k.transpose(-2, -1) * factor).masked_fill(~causal_mask(total)[start:].to(x.device), float("-inf"))
    attended = scores.softmax(dim=-1) * after @ v                                  # (N, H, L, dv)
    return (out_proj or layer.o_proj)(attended.transpose(1, 2).reshape(n, length, heads * layer.v_head_dim))


# right before 12.2 built a layer with a softmax_scale of its own: the text asks for layer.softmax_scale, and
# (dn + dr) ** -0.5 from the widths is only its default
@bug("12.2", "scale", "softmax_scale")
def latent_scale_from_the_widths(layer, x, cache=None):
    return _latent(layer, x, cache, (layer.qk_nope_head_dim + layer.qk_rope_head_dim) ** -0.5)


@bug("12.2", "scale", "softmax_scale")
def latent_scaled_by_embed_dim(layer, x, cache=None):
    return _latent(layer, x, cache, layer.embed_dim ** -0.5)


@bug("12.2", "scale", "0.3536")
def latent_scale_written_in(layer, x, cache=None):
    return _latent(layer, x, cache, 0.35355)


@bug("12.2", "scale", "after the softmax")
def latent_scaled_after_the_softmax(layer, x, cache=None):
    return _latent(layer, x, cache, 1.0, after=layer.softmax_scale)



# ============================================================================ sizes written into the code
@bug("2.1", "shape", "(8, 8)")
def causal_mask_cut_from_eight(n):
    return torch.ones(8, 8, dtype=torch.bool).tril()[:n, :n]   # the notebook's 8 positions


@bug("2.2", "exception", "written into your code")
class MaskedOwnMaskOfEight(_MaskedScaled):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        s = (q @ k.transpose(-2, -1) * self.factor(q)).masked_fill(~causal_mask(8)[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(s.softmax(-1)) @ v))


@bug("3.3", "exception", "written into your code")
class MultiHeadsOfSixteenFeatures(_MultiScaled):
    def forward(self, x):
        n, length, _ = x.shape
        q, k, v = (t(x).view(n, length, self.num_heads, 16 // self.num_heads).transpose(1, 2)   # embed_dim 16
                   for t in (self.query, self.key, self.value))
        s = (q @ k.transpose(-2, -1) * self.factor(q)).masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(s.softmax(-1)) @ v)))


@bug("3.3", "head_split", "4 heads")
class MultiFourHeadsWrittenIn(_MultiScaled):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(t(x), 4) for t in (self.query, self.key, self.value))
        s = (q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1] // self.num_heads))
        s = s.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(s.softmax(-1)) @ v)))


@bug("4.2", "exception", "written into your code")
class BlockLayerNormOfSixteen(GivenBlock):
    def forward(self, x):
        norm = lambda layer, t: F.layer_norm(t, (16,), layer.weight, layer.bias, layer.eps)   # embed_dim 16
        x = x + self.attn(norm(self.ln1, x))
        return x + self.mlp(norm(self.ln2, x))


@bug("4.3", "block_chain", "last block is never applied")
class GPTTwoBlocksByIndex(_GPTBody):
    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for i in range(2):   # the notebook's two layers
            x = self.blocks[i](x)
        return self.head(self.ln_f(x))


@bug("4.3", "context_limit", "written into your code")
class GPTLimitOfSixtyFour(_GPTBody):
    def forward(self, idx):
        if idx.shape[1] > 64:   # GPTConfig's default max_tokens
            raise ValueError("crop idx to its last 64 tokens")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        return self.head(self.ln_f(self.body(x)))


@bug("6.1", "attention_flops", "2 layers written")
def flops_of_two_layers(config, num_weights):
    return 6 * num_weights + 12 * 2 * config.num_heads * config.head_dim * config.max_tokens


@correct("7.2")
def hf_returns_a_list(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return list(_hf_attention(module, query, key, value, attention_mask, scaling))   # transformers unpacks a pair


@bug("7.2", "exception", "written into your code")
def hf_two_heads_of_eight(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out, weights = _hf_attention(module, query, key, value, attention_mask, scaling)
    return out.reshape(query.shape[0], query.shape[2], 2, 8), weights   # GPT-2's tiny model in the notebook


@bug("9.6", "exception", "written into your code")
class GQAMaskOfTen(_GQAScaled):
    def mask(self, start, total):
        return causal_mask(10)[start:total, :total]   # max_tokens of the notebook's example


@bug("10.1", "not_tiled", "not block_size")
def online_softmax_blocks_of_four(x, block_size):
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)
    total = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for start in range(0, x.shape[-1], 4):   # block_size ignored
        block = x[..., start:start + 4]
        m_new = torch.maximum(m, block.amax(-1))
        total = total * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / total[..., None]


@bug("10.2", "not_tiled", "(4, 4)")
def flash_blocks_of_four(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, 4, 4, causal)   # block_q and block_k ignored


@bug("10.3", "not_tiled", "(4, 4)")
class BackwardBlocksOfFour(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, blocks=(4, 4))


@bug("11.3", "ablation_method", "head_dim")
@contextlib.contextmanager
def ablate_heads_of_eight(model, layer, head):
    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * 8:(head + 1) * 8] = 0   # head_dim 8 of notebook 11's model
        return (x,)

    handle = model.blocks[layer].attn.proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@bug("12.2", "exception", "written into it")
def latent_two_heads_written_in(layer, x, cache=None):
    return _latent(layer, x, cache, layer.softmax_scale, heads=2)
