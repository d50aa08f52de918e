"""Student attempts that the engine's shared probes must catch, whatever the exercise (issue 43).

Each is right on the exercise's ordinary, well-scaled inputs, in float32, and wrong only where a probe looks:
large scores, rows far below zero or of different scales (``magnitude``), a float64 notebook (``dtype``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.2, 1.3: attention's softmax
# Right on well-scaled inputs; wrong on large scores, rows far below zero, or rows of different scales.

@bug("1.2", "overflow", "maximum")
def toy_softmax_by_hand(query, keys, values):
    scores = keys @ query
    weights = torch.exp(scores) / torch.exp(scores).sum()
    return weights @ values


@bug("1.2", "overflow", "maximum")
def toy_maximum_from_zero(query, keys, values):
    scores = keys @ query
    m = torch.clamp(scores.max(), min=0.0)   # a running maximum that starts at 0
    e = torch.exp(scores - m)
    return (e / e.sum()) @ values


@bug("1.3", "nan", "each row's maximum")   # 1.3's own large case finds it first, with its own words
def sdpa_one_maximum_for_all_rows(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores - scores.max())   # the maximum of the whole tensor, not of each row
    return e / e.sum(dim=-1, keepdim=True) @ v


@bug("1.3", "overflow", "maximum")
def sdpa_maximum_from_zero(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).clamp(min=0.0)
    e = torch.exp(scores - m)
    return e / e.sum(dim=-1, keepdim=True) @ v


@bug("1.3", "dtype", "float64")
def sdpa_float32_scale(q, k, v, mask=None):
    scale = torch.tensor(q.shape[-1], dtype=torch.float32).rsqrt()   # a float32 written into the code
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).float()


@bug("1.2", "dtype", "float64")
def toy_returns_float32(query, keys, values):
    return (torch.softmax(keys @ query, dim=0) @ values).to(torch.float32)


@correct("1.2")
def toy_softmax_max_subtracted(query, keys, values):
    scores = keys @ query
    e = torch.exp(scores - scores.max())
    return (e / e.sum()) @ values


@correct("1.3")
def sdpa_rowwise_maximum_by_hand(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True) @ v


# ============================================================================ 5.2: the loss's log-softmax

@bug("5.2", "overflow", "cross_entropy")
def loss_log_of_softmax(logits, targets):
    probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    picked = probs.flatten(0, 1)[torch.arange(targets.numel()), targets.flatten().clamp(min=0)]
    keep = targets.flatten() != -100
    return -torch.log(picked)[keep].mean()


@bug("5.2", "overflow", "log_softmax")
def loss_log_softmax_by_hand_without_maximum(logits, targets):
    log_probs = logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))
    return F.nll_loss(log_probs.flatten(0, 1), targets.flatten(), ignore_index=-100)


@correct("5.2")
def loss_log_softmax_as_logsumexp(logits, targets):
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return F.nll_loss(log_probs.flatten(0, 1), targets.flatten(), ignore_index=-100)


# ============================================================================ 2.2: a module's dtype

from bank.attention_bugs import GivenMaskedAttention  # noqa: E402  (the notebook's given constructor)


@bug("2.2", "dtype", "float64")
class MaskedFloat32Scores(GivenMaskedAttention):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x).float(), self.key(x).float(), self.value(x).float()
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(
            ~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        return self.proj_dropout(self.proj((weights @ v).to(self.proj.weight.dtype))).float()


# ============================================================================ 4.2-9.6: the dtype probe of modules
# and procedures (a float64 notebook): each is right in float32 and wrong only there.

from bank.model_bugs import GivenBlock  # noqa: E402  (the notebook's given constructor)
from course_lib.attention import causal_mask, merge_heads, split_heads  # noqa: E402
from course_lib.model import GPT  # noqa: E402
from course_lib.modern import (  # noqa: E402
    GroupedQueryAttention,
    RMSNorm,
    SwiGLU,
    apply_rotary,
    repeat_kv,
    sliding_window_mask,
)
from course_lib.train import lm_loss  # noqa: E402


@bug("4.2", "dtype", "float64")
class BlockFloat32ResidualStream(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return (x + self.mlp(self.ln2(x))).to(torch.float32)   # "keep the residual stream in float32"


@bug("4.3", "dtype", "float64")
class GPTFloat32Logits(GPT):
    def forward(self, idx, cache=None):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"{length} tokens, max_tokens={self.config.max_tokens}")
        start = cache[0].length if cache else 0
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length, start))
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i])
        return self.head(self.ln_f(x)).float()   # "logits in float32 for a stable loss"


@bug("5.3", "dtype", "float64", "model.float()")
def step_makes_the_model_float32(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.float().train()   # "make sure the weights are float32"
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.4", "dtype", "float64")
def sample_top_k_scattered_into_float32(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        values, indices = logits.topk(top_k, dim=-1)
        kept = torch.full(logits.shape, float("-inf"), dtype=torch.float32)   # a fixed dtype
        logits = kept.scatter(-1, indices, values)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("6.2", "dtype", "float64", "model.float()")
@torch.no_grad()
def cached_with_the_model_made_float32(model, idx, max_new_tokens):
    model = model.to(torch.float32)   # "inference in float32": changes the caller's model
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat((idx, next_id), dim=1)
        logits = model(next_id, cache)
    return idx


@bug("7.2", "dtype", "float64")
def hf_attention_softmax_kept_in_float32(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                         **kwargs):
    scores = query @ key.transpose(-2, -1) * scaling
    if attention_mask is None:
        lq, lk = scores.shape[-2:]
        attention_mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)   # transformers' idiom, without .to(query.dtype)
    return (weights @ value).transpose(1, 2), weights


@bug("9.3", "dtype", "float64")
class RMSNormCastsBackOnlyFromHalf(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return out.half() if x.dtype == torch.float16 else out   # float64 comes back as float32


@bug("9.3", "magnitude", "own root mean square")
class RMSNormClampedMeanSquare(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        ms = x32.pow(2).mean(-1, keepdim=True).clamp(max=1e4)   # "keep the square root in range"
        return (x32 * torch.rsqrt(ms + self.eps) * self.weight.float()).to(x.dtype)


@bug("9.4", "dtype", "float64")
class SwiGLUFloat32Hidden(SwiGLU):
    def forward(self, x):
        hidden = torch.zeros(*x.shape[:-1], self.up.out_features, dtype=torch.float32, device=x.device)
        hidden.copy_(F.silu(self.gate(x)) * self.up(x))
        return self.down(hidden)


@bug("9.6", "dtype", "float64")
class GQAFloat32Scores(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k = split_heads(self.query(x), self.num_heads), split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(self.head_dim)   # "a stable softmax in float32"
        mask = causal_mask(total, device=x.device)[start:total]
        if self.sliding_window is not None:
            mask = mask & sliding_window_mask(total, self.sliding_window, device=x.device)[start:total]
        scores = scores.masked_fill(~mask, float("-inf"))
        return self.proj(merge_heads(torch.softmax(scores, dim=-1) @ v))


# ============================================================================ 11.3: the reference guard of a
# context manager: the course's manager does its work when the check enters it, after this function returned.

@bug("11.3", "calls_reference", "ablate_head")
def ablate_hands_back_the_courses_manager(model, layer, head):
    from course_lib import heads
    return heads.ablate_head(model, layer, head)


# ============================================================================ 5.4: the sampler's softmax

@bug("5.4", "overflow", "maximum")
def sample_softmax_by_hand(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    e = torch.exp(logits)                      # no maximum subtracted
    return torch.multinomial(e / e.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)
