"""Student attempts from a thirteenth scripted search (2026-11-29): code the exercise's text allows that a check
refused (a prompt fed in chunks, a cache per row), and messages that said something false of the code that
reached them, in notebooks 04, 06, 07, 09 and 12.

Before, the correct ones below were refused and the buggy ones were told of a mistake they do not make (or passed).
Now each correct one passes and each buggy one gets the diagnosis of what it does, in words that hold for it.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from bank.attempts import Attempt, new_bank
from course_lib import GPT, modern, scaled_dot_product_attention, variants
from course_lib import train as train_module
from course_lib.flash import flash_attention, naive_attention
from course_lib.modern import RMSNorm, SwiGLU
from course_lib.train import lm_loss
from course_lib.variants.sliding import rope_rows, window_mask_at

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 4.3: the error the text asks for
@bug("4.3", "context_limit", "raise a ValueError", "python -O")
class GPTAssertsTheLength(GPT):
    """An assert where the text asks for a ValueError: it passed (any exception was taken)."""

    def forward(self, idx):
        length = idx.shape[1]
        assert length <= self.config.max_tokens, "crop it: idx[:, -max_tokens:]"
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length))   # (N, L, E)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                                # (N, L, V)


# ============================================================================ 9.1 and 9.3: what the text asks
def _angles(head_dim, max_tokens, theta):
    pair = torch.arange(head_dim // 2, dtype=torch.float64)
    return torch.outer(torch.arange(max_tokens, dtype=torch.float64), theta ** (-2 * pair / head_dim))  # (T, d/2)


@bug("9.1", "rope_layout", "reverse order")
def rope_tables_flip_the_second_half(head_dim, max_tokens, theta=10000.0):
    """It was told to check the base, the exponent and the positions, which are right."""
    angles = _angles(head_dim, max_tokens, theta)
    angles = torch.cat([angles, angles.flip(-1)], dim=-1)                                  # (T, d)
    return angles.cos().float(), angles.sin().float()


_KEPT_TABLES = {}


@bug("9.1", "kept_state", "leaves theta out")
def rope_tables_kept_by_size(head_dim, max_tokens, theta=10000.0):
    """Tables memoised on the sizes alone: it passed (each size was asked with one theta)."""
    if (head_dim, max_tokens) not in _KEPT_TABLES:
        angles = torch.cat([_angles(head_dim, max_tokens, theta)] * 2, dim=-1)
        _KEPT_TABLES[head_dim, max_tokens] = angles.cos().float(), angles.sin().float()
    return _KEPT_TABLES[head_dim, max_tokens]


_TABLES_BY_HEAD_DIM = {}


@bug("9.1", "kept_state", "leaves theta out")
def rope_tables_kept_by_head_dim(head_dim, max_tokens, theta=10000.0):
    """Long tables memoised on head_dim alone, cut to max_tokens: the theta of the first call stays."""
    if head_dim not in _TABLES_BY_HEAD_DIM:
        angles = torch.cat([_angles(head_dim, 4096, theta)] * 2, dim=-1)
        _TABLES_BY_HEAD_DIM[head_dim] = angles.cos().float(), angles.sin().float()
    cos, sin = _TABLES_BY_HEAD_DIM[head_dim]
    return cos[:max_tokens], sin[:max_tokens]

@bug("9.3", "dtype", "x's dtype")
class RMSNormReturnsTheWeightsDtype(RMSNorm):
    """The weight's dtype where the text asks for x's: it passed (x always had the layer's dtype)."""

    def forward(self, x):
        x32 = x.float()
        normed = x32 / (x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()   # (..., dim)
        return (normed * self.weight.float()).to(self.weight.dtype)


# ============================================================================ 6.1: one count matched by chance
def _attention_term(config, context):
    return 12 * config.num_layers * config.num_heads * config.head_dim * context


@bug("6.1", "attention_flops", "grows by 6 for every weight", "12·n·H·Q·T")
def flops_counts_one_key_more(config, num_weights):
    """T + 1 keys: it was told it uses vocab_size where T belongs (65 = 64 + 1 on one configuration)."""
    return 6 * num_weights + _attention_term(config, config.max_tokens + 1)


@bug("6.1", "attention_flops", "grows by 6 for every weight")
def flops_counts_the_mean_causal_context(config, num_weights):
    """(T + 1) / 2 keys on average under the causal mask: it was told it leaves out the layers and uses vocab_size."""
    return 6 * num_weights + _attention_term(config, (config.max_tokens + 1) / 2)


@bug("6.1", "weights_count", "subtract the position embeddings")
def flops_subtracts_the_position_embeddings(config, num_weights):
    """It was told three slips of the attention term, which is right."""
    return 6 * (num_weights - config.max_tokens * config.embed_dim) + _attention_term(config, config.max_tokens)


@bug("6.1", "weights_count", "add the position embeddings")
def flops_adds_the_position_embeddings(config, num_weights):
    """It was told to look at the attention term, which is right."""
    return 6 * (num_weights + config.max_tokens * config.embed_dim) + _attention_term(config, config.max_tokens)


@bug("6.1", "attention_flops", "grows by 6 for every weight")
def flops_caps_the_context_at_64(config, num_weights):
    """Right on the configurations of up to 64 tokens; at 128 it was told it subtracts the position embeddings,
    whose 6·T·E equals the 12·n·H·Q·(T - 64) it leaves out there."""
    return 6 * num_weights + _attention_term(config, min(config.max_tokens, 64))

# ============================================================================ 6.2: what each cache holds
@correct("6.2")
@torch.no_grad()
def generation_feeds_the_prompt_in_two_chunks(model, idx, max_new_tokens):
    """The prompt in two calls, then one token a step: the cache holds every token once."""
    cache = model.new_cache()
    half = max(1, idx.shape[1] // 2)
    logits = model(idx[:, :half], cache)
    if idx.shape[1] > half:   # a one-token prompt is one chunk
        logits = model(idx[:, half:], cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)   # (N, 1)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx


@correct("6.2")
@torch.no_grad()
def generation_row_by_row(model, idx, max_new_tokens):
    """Each sequence with a cache of its own (it was told it makes a new cache at every step)."""
    rows = []
    for row in idx:
        row, cache = row[None], model.new_cache()          # (1, L)
        logits = model(row, cache)
        for _ in range(max_new_tokens):
            next_id = logits[:, -1].argmax(-1, keepdim=True)
            row = torch.cat([row, next_id], dim=1)
            logits = model(next_id, cache)
        rows.append(row)
    return torch.cat(rows, dim=0)                            # (N, L + new)


def _loop(model, logits, idx, cache, max_new_tokens):
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, cache)
    return idx


@bug("6.2", "kv_cache", "never held the prompt")
@torch.no_grad()
def generation_runs_the_prompt_without_the_cache(model, idx, max_new_tokens):
    """It was told it starts a new cache at every step: it makes one, once, after the prompt."""
    return _loop(model, model(idx), idx, model.new_cache(), max_new_tokens)


@bug("6.2", "kv_cache", "never held the prompt")
@torch.no_grad()
def generation_resets_the_cache_after_the_prompt(model, idx, max_new_tokens):
    logits = model(idx, model.new_cache())
    return _loop(model, logits, idx, model.new_cache(), max_new_tokens)


@bug("6.2", "kv_cache", "only from its token")
@torch.no_grad()
def generation_caches_the_last_prompt_token_only(model, idx, max_new_tokens):
    cache = model.new_cache()
    return _loop(model, model(idx[:, -1:], cache), idx, cache, max_new_tokens)


@correct("6.2")
@torch.no_grad()
def generation_hands_over_a_new_list_of_the_same_layers(model, idx, max_new_tokens):
    """model(t, [*cache]): one cache in a new list each call (it was told it starts a new cache at every step)."""
    cache = model.new_cache()
    logits = model(idx, [*cache])
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        logits = model(next_id, [*cache])
    return idx


@bug("6.2", "no_kv_cache", "never pass a cache")
@torch.no_grad()
def generation_calls_forward_itself_without_a_cache(model, idx, max_new_tokens):
    """model.forward(idx) skips the model's hooks: it passed, no cache and all."""
    for _ in range(max_new_tokens):
        idx = torch.cat([idx, model.forward(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@bug("6.2", "no_kv_cache", "the same one emptied")
@torch.no_grad()
def generation_empties_the_cache_at_every_step(model, idx, max_new_tokens):
    """It was told its cache already holds every token before the newest, and stores them twice."""
    cache = model.new_cache()
    for _ in range(max_new_tokens):
        for layer in cache:
            layer.length = 0
        idx = torch.cat([idx, model(idx, cache)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@bug("6.2", "no_kv_cache", "more than the newest token")
@torch.no_grad()
def generation_fills_a_cache_it_never_reads(model, idx, max_new_tokens):
    """It was told the new token sees no earlier token; its calls without the cache see them all."""
    cache = model.new_cache()
    model(idx, cache)
    logits = model(idx)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
        model(next_id, cache)
        logits = model(idx)
    return idx

# ============================================================================ 7.2: the layer that calls it
def _hf_attention(module, query, key, value, attention_mask, scaling, head_dim, diagonal):
    lq, lk = query.shape[2], key.shape[2]
    mask = attention_mask if attention_mask is not None else \
        torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=diagonal(lq, lk))   # (Lq, Lk)
    out = scaled_dot_product_attention(query * (scaling * head_dim ** 0.5), key, value, mask)   # (N, heads, Lq, d)
    return out.transpose(1, 2), None                                                            # (N, Lq, heads, d)


@correct("7.2")
def attention_reads_head_dim_from_the_layer(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                            **kwargs):
    """module.head_dim is query.shape[-1] in every real call (it was told a size is written into its code)."""
    return _hf_attention(module, query, key, value, attention_mask, scaling, module.head_dim, lambda q, k: k - q)


@bug("7.2", "causal_mask", "fewer queries than keys", "tril(diagonal=Lk - Lq)")
def attention_flips_the_diagonals_sign(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                       **kwargs):
    """tril(diagonal=Lq - Lk): right while Lq = Lk, no key at all for the first queries of a cached call."""
    return _hf_attention(module, query, key, value, attention_mask, scaling, query.shape[-1], lambda q, k: q - k)


@bug("7.2", "causal_mask", "lost its heads axis")
def attention_squeezes_the_heads_axis_of_the_mask(module, query, key, value, attention_mask, scaling=None,
                                                  dropout=0.0, **kwargs):
    """(N, Lq, Lk) lines the batch up with the heads: it was told only that the output differs."""
    mask = attention_mask.squeeze(1) if attention_mask is not None else None
    return _hf_attention(module, query, key, value, mask, scaling, query.shape[-1], lambda q, k: k - q)


# ============================================================================ 9.4: one more activation
@bug("9.4", "gating", "beta = 2")
class SwiGLUSwishBetaTwo(SwiGLU):
    """z * sigmoid(2z) on the gate: it was told only that the output differs."""

    def forward(self, x):
        gate = self.gate(x)                                                   # (..., hidden)
        return self.down(gate * torch.sigmoid(2 * gate) * self.up(x))        # (..., E)


# ============================================================================ 7.1: a reshape for a split
@bug("7.1", "mismatch", "reshaped the (E, 3E) weight into (3, E, E)")
def split_c_attn_by_reshape(weight):
    """It was told only that the matrices differ."""
    embed_dim = weight.shape[0]
    wq, wk, wv = weight.reshape(3, embed_dim, embed_dim)   # three blocks of whole rows, not of columns
    return wq.T, wk.T, wv.T


# ============================================================================ 9.3: two square roots
@bug("9.3", "epsilon", "sqrt(eps)")
class RMSNormTakesTheRootOfEpsApart(RMSNorm):
    """sqrt(mean(x^2)) + sqrt(eps): it was told only that the output differs."""

    def forward(self, x):
        x32 = x.float()
        rms = x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps ** 0.5   # (..., 1)
        return (x32 / rms * self.weight.float()).to(x.dtype)


# ============================================================================ 11.1: a sum over the batch
@bug("11.1", "scale", "grows with the batch size")
def previous_token_score_summed_over_the_batch(weights):
    """A mean over the queries, a sum over the batch: it was told only that the scores differ."""
    below = weights.diagonal(offset=-1, dim1=-2, dim2=-1)   # (N, heads, L-1)
    return below.sum(dim=(0, 2)) / below.shape[-1]          # (heads,)


# ============================================================================ an audit of the texts (second)
# What the exercise's text asks, and no check held: 4.3's error "says what to do", 5.3's loss "as a plain float".
@bug("4.3", "context_limit", "says nothing")
class GPTRaisesABareValueError(GPT):
    """ValueError() with nothing in it: it passed (any ValueError was taken)."""

    def forward(self, idx):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))   # (N, L, E)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                                     # (N, L, V)


@bug("5.3", "dtype", "holds the graph")
def train_step_returns_the_loss_tensor(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The loss itself, graph and all: it passed with a note (a loop that sums these keeps every graph)."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss


# ============================================================================ 4.3, 12.2, 12.3: the parts a check never built
# A fifteenth search: options the constructor or the layer accepts that every case left at one value.
@bug("4.3", "exception", "sinusoidal positions")
class GPTReadsTheLearnedTable(GPT):
    """The learned table's weight read directly: right for learned positions only, the only kind the check built."""

    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx: {length} tokens, max_tokens={self.config.max_tokens}; crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding.embedding.weight[:length])   # (N, L, E)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                                                # (N, L, V)


@bug("4.3", "final_norm", "post-norm blocks")
class GPTSkipsTheFinalNormAfterPostNormBlocks(GPT):
    """No ln_f when the blocks are post-norm: the text's logits = LN_f(h) W^T holds for every block."""

    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx: {length} tokens, max_tokens={self.config.max_tokens}; crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length))   # (N, L, E)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x) if self.config.norm_first else x)               # (N, L, V)


@bug("4.3", "scale", "sqrt(embed_dim)")
class GPTScalesTokensForSinusoids(GPT):
    """The 2017 paper's sqrt(E) on the token embeddings, with sinusoidal positions only."""

    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx: {length} tokens, max_tokens={self.config.max_tokens}; crop it")
        tokens = self.token_embedding(idx)                                             # (N, L, E)
        if self.config.positional != "learned":
            tokens = tokens * self.config.embed_dim ** 0.5
        x = self.dropout(tokens + self.position_encoding(length))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                                 # (N, L, V)


def _latent_attention(layer, x, cache=None, *, biases=True, tables=None):
    """MLA from the layer's weights, with one of the layer's own settings replaced by what a student assumed."""
    def project(linear, t):
        return linear(t) if biases else t @ linear.weight.T

    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, heads, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    cos, sin = tables if tables is not None else (layer.rope_cos, layer.rope_sin)
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(project(layer.q_a_proj, x)))
    q = q.view(n, length, heads, dn + dr).transpose(1, 2)                              # (N, H, L, dn + dr)
    q_nope, q_rope = q.split([dn, dr], -1)
    q_rope = modern.apply_rotary(q_rope, cos, sin, offset=start)
    latent, k_rope = project(layer.kv_a_proj_with_mqa, x).split([layer.kv_lora_rank, dr], -1)
    latent = layer.kv_a_layernorm(latent)
    k_rope = modern.apply_rotary(k_rope, cos, sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, heads, dn + dv).transpose(1, 2)          # (N, H, T, dn + dv)
    k_nope, v = kv.split([dn, dv], -1)
    k = torch.cat([k_nope, k_rope[:, None].expand(n, heads, total, dr)], -1)              # (N, H, T, dn + dr)
    scores = torch.cat([q_nope, q_rope], -1) @ k.transpose(-2, -1) * layer.softmax_scale   # (N, H, L, T)
    scores = scores.masked_fill(~torch.ones(length, total, dtype=torch.bool).tril(start), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, length, heads * dv)          # (N, L, H * dv)
    return project(layer.o_proj, out)


@bug("12.2", "bias", "biases")
def latent_attention_without_biases(layer, x, cache=None):
    """Every projection as x @ W.T: right while the layer has no biases, the only kind the check built."""
    return _latent_attention(layer, x, cache, biases=False)


@bug("12.2", "rope_frequencies", "rope_theta")
def latent_attention_with_tables_of_its_own(layer, x, cache=None):
    """Tables with the default theta where the text names layer.rope_cos and layer.rope_sin."""
    return _latent_attention(layer, x, cache, tables=modern.rope_tables(layer.qk_rope_head_dim, layer.max_tokens))


@bug("12.3", "calls_reference", "linear_attention")
def linear_attention_recurrent_by_the_course_parallel_form(q, k, v):
    """The course's parallel form called: the same numbers, none of the recurrence the exercise asks for."""
    return variants.linear_attention(q, k, v)


# ============================================================================ the course's work under other names
# A ninth attack on the grader: course functions that do an exercise's whole work, not in its same-work table.
@bug("2.1", "calls_reference", "window_mask_at")
def causal_mask_by_the_courses_window_mask(n):
    positions = torch.arange(n)
    return window_mask_at(positions, positions, max(n, 1))   # a window of n is the causal mask


@bug("5.2", "calls_reference", "_cross_entropy")
def lm_loss_by_the_courses_helper(logits, targets, reduction="mean"):
    return train_module._cross_entropy(logits, targets, reduction)


@bug("5.3", "calls_reference", "update")
def train_step_by_the_courses_update(model, optimizer, inputs, targets, max_grad_norm=1.0):
    return train_module.update(model, optimizer, inputs, targets, max_grad_norm).item()


@bug("9.1", "calls_reference", "rope_rows")
def rope_tables_by_the_courses_rows(head_dim, max_tokens, theta=10000.0, **kwargs):
    return rope_rows(head_dim, 0, max_tokens, theta, **kwargs)


@bug("1.3", "calls_reference", "naive_attention")
def attention_by_the_courses_naive_attention_when_unmasked(q, k, v, mask=None):
    if mask is None:
        return naive_attention(q, k, v)[0]
    scores = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))   # (..., Lq, Lk)
    return torch.softmax(scores, dim=-1) @ v


@bug("4.3", "context_limit", "says nothing")
class GPTRaisesAValueErrorThatSaysNothing(GPT):
    """A message of one dot: it passed once the empty message was refused."""

    def forward(self, idx):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError(".")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))   # (N, L, E)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                                     # (N, L, V)


# ============================================================================ 10.3: fewer queries than keys
class _FlashBackwardOfOneLength(torch.autograd.Function):
    """The backward loops over the keys as far as the queries go, and sizes dk and dv like q: right while Lq == Lk,
    the only kind of case the check built (10.2's forward takes fewer queries than keys without causal)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        length = q.shape[-2]                                          # the slip: one length for both loops
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(q)
        delta = (grad_out * out).sum(dim=-1)                          # (N, heads, Lq)
        for qs in range(0, length, ctx.block_q):
            qe = min(qs + ctx.block_q, length)
            q_blk, do_blk = q[..., qs:qe, :], grad_out[..., qs:qe, :]
            for ks in range(0, min(length, qe) if ctx.causal else length, ctx.block_k):
                ke = min(ks + ctx.block_k, length)
                k_blk, v_blk = k[..., ks:ke, :], v[..., ks:ke, :]
                s = q_blk @ k_blk.transpose(-2, -1) * scale          # (N, heads, Bq, Bk)
                if ctx.causal and ke - 1 > qs:
                    s = s.masked_fill(torch.arange(ks, ke)[None, :] > torch.arange(qs, qe)[:, None], float("-inf"))
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ do_blk
                ds = p * (do_blk @ v_blk.transpose(-2, -1) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += ds @ k_blk * scale
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q_blk * scale
        return dq, dk, dv, None, None, None


bug("10.3", "exception", "k of shape (1, 2, 10, 8)")(_FlashBackwardOfOneLength)


# ============================================================================ a seventeenth search: right code refused
# Weights truncated to two decimals and the result worked out from them: "two decimals are enough".
CORRECT.append(Attempt("1.1", "prediction_truncated_and_its_own_average",
                       ([0.21, 0.57, 0.21], 0.21 * 1 + 0.57 * 2 + 0.21 * 3), None))


@correct("4.3")
class GPTSaysTruncateInItsOwnWords(GPT):
    """The error says what to do without the words max_tokens or crop: it was refused by a list of words."""

    def forward(self, idx):
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError("idx is longer than the model's context window: truncate it to its last tokens")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))   # (N, L, E)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                                     # (N, L, V)


@bug("9.2", "precision", "float16")
def apply_rotary_through_complex_numbers(x, cos, sin, offset=0):
    """Angles recovered from the tables, pairs turned as complex numbers in float64: right in full precision, one
    float16 step off in half precision. It was told the offset was wrong."""
    length, half = x.shape[-2], x.shape[-1] // 2
    angles = torch.atan2(sin[offset:offset + length, :half], cos[offset:offset + length, :half]).double()   # (L, d/2)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], -1).to(x.dtype)


# ============================================================================ an eighteenth search (R18)
# 1.1's result left as NaN (a placeholder): every comparison with NaN is false, so it passed.
BUGGY.append(Attempt("1.1", "prediction_with_a_nan_result", ([0.21, 0.58, 0.21], float("nan")), "nan", ("`result`",)))
# Weights in numpy's long double, which torch cannot read: they were "not numbers".
CORRECT.append(Attempt("1.1", "prediction_in_long_double",
                       (np.array([1 / (2 + math.e), math.e / (2 + math.e), 1 / (2 + math.e)], dtype=np.longdouble), 2.0), None))


@bug("3.1", "device", "copies numbers to the CPU")
def split_heads_then_to_the_cpu(x, num_heads):
    """Right on a CPU; on a GPU its heads came back on the CPU. It passed (3.1 had no device probe)."""
    n, length, embed_dim = x.shape
    return x.reshape(n, length, num_heads, embed_dim // num_heads).transpose(1, 2).cpu()   # (N, heads, L, d)


@bug("3.2", "device", "copies numbers to the CPU")
def merge_heads_into_a_new_buffer(x):
    """Each head written into torch.zeros(...) made without device= or dtype=: it passed."""
    n, heads, length, head_dim = x.shape
    out = torch.zeros(n, length, heads * head_dim)                                          # (N, L, E)
    for h in range(heads):
        out[:, :, h * head_dim:(h + 1) * head_dim] = x[:, h]
    return out


@bug("9.5", "dtype", "with float64 inputs", "without one")
def repeat_kv_into_a_buffer_of_the_default_dtype(x, groups):
    """A buffer made on x's device but in the default dtype: float32 out for float16 in. It passed, since the
    float64 probe made float64 the default too."""
    n, kv_heads, length, head_dim = x.shape
    out = torch.zeros(n, kv_heads * groups, length, head_dim, device=x.device)           # (N, H, L, d)
    for h in range(kv_heads * groups):
        out[:, h] = x[:, h // groups]
    return out


@bug("9.4", "exception", "SwiGLU(8, 24)")
class SwiGLUOfTheProbedWidth(SwiGLU):
    """The width of the one size the check built written in: it passed."""

    def forward(self, x):
        flat = x.reshape(-1, 16)                                                             # (N*L, 16)
        return self.down(F.silu(self.gate(flat)) * self.up(flat)).view(*x.shape[:-1], 16)


@bug("5.1", "shape", "the first starts at token 4")
def lm_windows_without_the_first(ids, max_tokens, stride=None):
    """The first window dropped: it was told the last one was missing."""
    stride = stride or max_tokens
    starts = range(stride, len(ids) - max_tokens, stride)
    return (torch.stack([ids[s:s + max_tokens] for s in starts]),
            torch.stack([ids[s + 1:s + max_tokens + 1] for s in starts]))


@correct("7.1")
def split_c_attn_as_a_generator(weight):
    """Unpacks into three like a tuple (the notebook unpacks it): it was refused as "returned generator"."""
    return (third.T for third in weight.chunk(3, dim=1))
