"""Student attempts that a scripted search for misjudged code found (2026-11-29), one per class of mistake.

Before, each was passed, refused while right, or named only "mismatch" (or a wrong cause); now each gets the
diagnosis of the mistake it makes. The search wrote about 560 attempts over every exercise, in two rounds (the
second after the first round's fixes, aimed at unusual right code, unusual shapes and misleading messages);
these are the ones whose verdict changed, as one representative of each class, with a few right controls.
"""
from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import Attempt, new_bank
from bank.model_bugs import GivenBlock
from course_lib import modern
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.model import GPT
from course_lib.modern import RMSNorm, SwiGLU, apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 1.1, 1.2
_E = Fraction(271828, 100000)   # e to five digits, in exact fractions: numbers torch cannot read as they are
BUGGY.append(Attempt("1.1", "prediction_in_base_two", ([0.25, 0.5, 0.25], 2.0), "scale", ("not 2",)))
CORRECT.append(Attempt("1.1", "prediction_in_fractions", ([1 / (2 + _E), _E / (2 + _E), 1 / (2 + _E)], Fraction(2)),
                       None))


@bug("1.2", "shape", "(1,)")
def toy_squeezes_one_value_feature(query, keys, values):
    weights = torch.softmax(keys @ query, 0)
    return (weights[:, None] * values.reshape(values.shape[0], -1)).sum(0).squeeze()   # (1,) becomes ()


# ============================================================================ 1.3: the course's helper
@bug("1.3", "calls_reference", "attention_weights")
def sdpa_course_attention_weights(q, k, v, mask=None):
    from course_lib.attention import attention_weights
    return attention_weights(q, k, mask) @ v   # the whole exercise but the last product


@bug("1.3", "exception", "q (4, 8)")
def sdpa_needs_a_batch_axis(q, k, v, mask=None):
    s = torch.bmm(q.flatten(0, -3), k.flatten(0, -3).mT) / math.sqrt(q.shape[-1])   # no batch axis: IndexError
    s = s.view(*q.shape[:-1], k.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


@bug("1.3", "shape", "(2, 1, 6)")
def sdpa_loop_reads_mask_rows(q, k, v, mask=None):
    rows = []
    for i in range(q.shape[-2]):
        s = q[..., i:i + 1, :] @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask[..., i:i + 1, :], float("-inf"))   # a (N, 1, Lk) mask has one row only
        rows.append(s.softmax(-1) @ v)
    return torch.cat(rows, dim=-2)


# ============================================================================ 2.2
class _GivenMasked(nn.Module):
    """Notebook 02's constructor, as given."""

    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.query, self.key, self.value, self.proj = (nn.Linear(embed_dim, embed_dim, bias=False) for _ in range(4))
        self.attn_dropout, self.proj_dropout = nn.Dropout(dropout_rate), nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens))


@bug("2.2", "scale", "written into your code")
class MaskedScaleWrittenIn(_GivenMasked):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        s = (q @ k.mT / 4.0).masked_fill(~self.mask[:length, :length], float("-inf"))   # sqrt(16), at any width
        return self.proj_dropout(self.proj(self.attn_dropout(s.softmax(-1)) @ v))


@bug("2.2", "shape", "batch of 1")
class MaskedSqueezesTheBatch(_GivenMasked):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        s = (q @ k.mT / math.sqrt(self.embed_dim)).masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj((self.attn_dropout(s.softmax(-1)) @ v).squeeze()))


@bug("2.2", "scale", "1/sqrt(embed_dim)")
class MaskedScaledByTheLength(_GivenMasked):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        kt = k.transpose(-2, -1)
        s = (q @ kt / math.sqrt(kt.size(-1))).masked_fill(~self.mask[:length, :length], float("-inf"))   # sqrt(L)
        return self.proj_dropout(self.proj(self.attn_dropout(s.softmax(-1)) @ v))


# ============================================================================ 4.1: no dtype is asked
@correct("4.1")
def table_float32_stacked(max_tokens, embed_dim):
    position = torch.arange(max_tokens)[:, None].float()                              # float32, written in
    angles = position * torch.pow(10000.0, -torch.arange(0, embed_dim, 2).float() / embed_dim)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)             # (max_tokens, embed_dim)


@bug("4.1", "sincos_layout", "COSINE")
def table_sines_twice(max_tokens, embed_dim):
    angles = torch.arange(max_tokens)[:, None].float() * 10000 ** (-torch.arange(0, embed_dim, 2).float() / embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.sin(angles)   # sin again where the cosine belongs
    return table


@bug("4.1", "scale", "own index j")
def table_column_index_exponent(max_tokens, embed_dim):
    table = torch.zeros(max_tokens, embed_dim)
    for pos in range(max_tokens):
        for j in range(embed_dim):
            angle = pos / 10000 ** (j / embed_dim)   # j, not 2 * (j // 2): the cosine columns turn too slowly
            table[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return table


# ============================================================================ 4.2: norms and residuals
@bug("4.2", "norm_placement", "ln2")
class BlockNormsTheOutput(GivenBlock):
    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(x)
        return self.ln2(x)   # ln2 moved from the feed-forward's input to the block's output


@bug("4.2", "residual", "attention")
class BlockSecondResidualFromInput(GivenBlock):
    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(h))   # added to the block's input: the attention's update is lost


@bug("4.2", "residual", "residual stream")
class BlockMlpReadsAttentionOutput(GivenBlock):
    def forward(self, x):
        a = self.attn(self.ln1(x))
        x = x + a
        return x + self.mlp(self.ln2(a))


@bug("4.2", "norm_placement", "NORMALISED", norm_first=False)
class PostBlockAddsToNormalised(GivenBlock):
    def forward(self, x):
        x = self.ln1(x) + self.attn(x)
        return self.ln2(x) + self.mlp(x)


@bug("4.2", "norm_placement", "at the end", norm_first=False)
class PostBlockNormsAtTheEnd(GivenBlock):
    def forward(self, x):
        x = x + self.attn(x)
        x = x + self.mlp(x)
        return self.ln2(self.ln1(x))


# ============================================================================ 4.3: where dropout and ln_f go
class _GPTBody(GPT):
    def body(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@bug("4.3", "dropout", "once")
class GPTDropoutAfterTheBlocks(_GPTBody):
    def forward(self, idx):
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])
        return self.head(self.ln_f(self.dropout(self.body(x))))


@bug("4.3", "dropout", "token embeddings alone")
class GPTDropoutOnTokensOnly(_GPTBody):
    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx)) + self.position_encoding(idx.shape[1])
        return self.head(self.ln_f(self.body(x)))


@bug("4.3", "final_norm", "before the blocks")
class GPTNormBeforeTheBlocks(_GPTBody):
    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        return self.head(self.body(self.ln_f(x)))


@bug("4.3", "positions", "backwards")
class GPTPositionsReversed(_GPTBody):
    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]).flip(0))
        return self.head(self.ln_f(self.body(x)))


@bug("4.3", "context_limit", "not >=")
class GPTLimitOffByOne(_GPTBody):
    def forward(self, idx):
        if idx.shape[1] >= self.config.max_tokens:
            raise ValueError("sequence too long")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        return self.head(self.ln_f(self.body(x)))


@bug("4.3", "context_limit", "written into your code")
class GPTLimitWrittenIn(_GPTBody):
    def forward(self, idx):
        if idx.shape[1] > 8:   # the checker's first config has max_tokens=8
            raise ValueError("sequence longer than 8 tokens: crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        return self.head(self.ln_f(self.body(x)))


@correct("4.3")
class GPTRefusesACache(_GPTBody):
    def forward(self, idx, cache=None):   # the text: the cache is notebook 06's, "you can leave it out here"
        if cache is not None:
            raise ValueError("this GPT has no KV cache yet (notebook 06)")
        if idx.shape[1] > self.config.max_tokens:
            raise ValueError("sequence longer than max_tokens: crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        return self.head(self.ln_f(self.body(x)))


# ============================================================================ 5.1
@correct("5.1")
def windows_with_options_unused(ids, max_tokens, **options):   # **options is not a stride
    starts = range(0, len(ids) - max_tokens, max_tokens)
    chunks = torch.stack([ids[s:s + max_tokens + 1] for s in starts])
    return chunks[:, :-1].long(), chunks[:, 1:].long()


# ============================================================================ 5.2
@bug("5.2", "target_shift", "two ahead")
def loss_shifts_again(logits, targets):
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets[:, 1:].reshape(-1))   # as a HF model does


@bug("5.2", "loss_reduction", "ignore_index=0")
def loss_ignores_token_zero(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=0)


@bug("5.2", "loss_reduction", "each position")
def loss_mean_of_position_means(logits, targets):
    per = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")   # (N, L)
    real = (targets != -100).float()
    return ((per * real).sum(0) / real.sum(0).clamp(min=1)).mean()


# ============================================================================ 5.4: the generator on every path
@bug("5.4", "generator", "top_k=3")
def sample_generator_lost_with_top_k(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is None:
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    kth = logits.topk(top_k, -1).values[:, -1:]
    probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
    return torch.multinomial(probs, 1).squeeze(-1)   # the generator forgotten here


@bug("5.3", "loss_reduction", "SUM")
def step_backward_on_the_sum(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    total = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
    total.backward()
    if max_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return total.item() / int((targets != -100).sum())   # the mean reported, the sum trained on


@bug("5.4", "exception", "top_k=6")
def sample_threshold_past_the_vocabulary(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    z = logits / temperature
    if top_k is not None:
        nxt = z.sort(-1, descending=True).values[:, top_k:top_k + 1]   # empty when top_k is the vocabulary
        z = z.masked_fill(z <= nxt, float("-inf"))
    return torch.multinomial(z.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "exception", "temperature=0.0")
def sample_zero_by_identity(logits, temperature=1.0, top_k=None, generator=None):
    zero = 0
    if temperature is zero:   # the slip itself: identity, so the float 0.0 is not the int 0
        return logits.argmax(-1)
    return torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).squeeze(-1)


# ============================================================================ 6.1: one term off
def _lhqt(c):
    return c.num_layers * c.num_heads * c.head_dim * c.max_tokens


@bug("6.1", "attention_flops", "twice")
def flops_attention_doubled(config, num_weights):
    return 6 * num_weights + 24 * _lhqt(config)


@bug("6.1", "attention_flops", "head size")
def flops_without_head_size(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.num_heads * config.max_tokens


@bug("6.1", "attention_flops", "embed_dim where the context")
def flops_width_for_context(config, num_weights):
    return 6 * num_weights + 12 * config.num_layers * config.embed_dim * config.embed_dim


@bug("6.1", "attention_flops", "18·n·H·Q·T")
def flops_attention_eighteen(config, num_weights):
    return 6 * num_weights + 18 * _lhqt(config)


@bug("6.1", "weights_count", "subtract", "the token embedding included")
def flops_minus_token_embeddings(config, num_weights):
    return 6 * (num_weights - config.vocab_size * config.embed_dim) + 12 * _lhqt(config)


@bug("6.1", "flops_factor", "3N")
def flops_three_n(config, num_weights):
    return 3 * num_weights + 12 * _lhqt(config)


# ============================================================================ 6.2
@bug("6.2", "shape", "swapped")
@torch.no_grad()
def cached_new_token_on_the_batch_axis(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for i in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1).unsqueeze(0)     # (1, N), not (N, 1)
        idx = torch.cat([idx, next_id.view(-1, 1)], dim=1)
        if i + 1 < max_new_tokens:
            logits = model(next_id, cache)
    return idx


@bug("6.2", "calls_reference", "generate")
def cached_course_generate(model, idx, max_new_tokens):
    from course_lib.generate import generate
    return generate(model, idx, max_new_tokens, temperature=0)


# ============================================================================ 7.2 attention for transformers
def _hf_mask(query, key, attention_mask):
    lq, lk = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        return torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    return attention_mask


@bug("7.2", "softmax_dim", "heads")
def hf_softmax_over_heads(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    s = (query @ key.transpose(-1, -2)) * scaling
    s = s.masked_fill(~_hf_mask(query, key, attention_mask), float("-inf"))
    return (s.softmax(dim=1) @ value).transpose(1, 2), None   # dim=1 is the heads axis


@bug("7.2", "scale", "after the softmax")
def hf_scale_after_softmax(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    s = (query @ key.transpose(-1, -2)).masked_fill(~_hf_mask(query, key, attention_mask), float("-inf"))
    return ((s.softmax(-1) * scaling) @ value).transpose(1, 2), None


@bug("7.2", "scale", "divided")
def hf_scaling_divides(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    s = (query @ key.transpose(-1, -2) / scaling).masked_fill(~_hf_mask(query, key, attention_mask), float("-inf"))
    return (s.softmax(-1) @ value).transpose(1, 2), None


@bug("7.2", "causal_mask", "one future key")
def hf_mask_one_ahead(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    lq, lk = query.shape[-2], key.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq + 1) if attention_mask is None else attention_mask
    s = (query @ key.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ value).transpose(1, 2), None


@bug("7.2", "scale", "scale twice")
def hf_scaling_on_top_of_the_courses(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from course_lib.attention import scaled_dot_product_attention  # divides by sqrt(d) itself
    mask = _hf_mask(query, key, attention_mask)
    return scaled_dot_product_attention(query * scaling, key, value, mask).transpose(1, 2), None


@bug("7.2", "head_split", "transpose(1, 2)")
def hf_reshape_instead_of_transpose(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    n, h, lq, d = query.shape
    s = (query @ key.transpose(-1, -2) * scaling).masked_fill(~_hf_mask(query, key, attention_mask), float("-inf"))
    return (s.softmax(-1) @ value).reshape(n, lq, h, d), None


# ============================================================================ 9.2
@bug("9.2", "rope_positions", "one row")
def rotary_one_row(x, cos, sin, offset=0):
    return (x * cos[offset] + modern.rotate_half(x) * sin[offset]).to(x.dtype)   # every token turned to `offset`


# ============================================================================ 9.3, 9.4
@bug("9.3", "norm_weight", "before normalising")
class RMSNormWeightFirst(RMSNorm):
    def forward(self, x):
        y = x.float() * self.weight   # the weight applied first: the normalisation divides it out
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


@bug("9.3", "epsilon", "eps ** 2")
class RMSNormEpsSquared(RMSNorm):
    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps ** 2) * self.weight).to(x.dtype)


@correct("9.4")
class SwiGLUEinsumOverThreeAxes(SwiGLU):
    def forward(self, x):   # right for x of shape (N, L, E), as the exercise asks
        g = torch.einsum("nle,he->nlh", x, self.gate.weight)
        u = torch.einsum("nle,he->nlh", x, self.up.weight)
        return torch.einsum("nlh,eh->nle", nn.SiLU()(g) * u, self.down.weight)


@bug("9.4", "gating", "Hardswish")
class SwiGLUHardswish(SwiGLU):
    def forward(self, x):
        return self.down(F.hardswish(self.gate(x)) * self.up(x))


@bug("9.4", "gating", "before the projections")
class SwiGLUSiluOnTheInput(SwiGLU):
    def forward(self, x):
        return self.down(self.gate(F.silu(x)) * self.up(x))


# ============================================================================ 9.6: a softmax over the heads
class _GivenGQA(nn.Module):
    """Notebook 09's constructor, as given."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0):
        super().__init__()
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.max_tokens = max_tokens
        self.query = nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.key = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.value = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=False)
        cos, sin = modern.rope_tables(self.head_dim, max_tokens, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self):
        from course_lib.generate import KVCache
        return KVCache(self.max_tokens)


@bug("9.6", "softmax_dim", "heads")
class GQASoftmaxOverHeads(_GivenGQA):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        s = s.masked_fill(~causal_mask(k.shape[2])[start:], float("-inf"))
        return self.proj(merge_heads(F.softmax(s, dim=1) @ v))


@bug("9.6", "causal_mask", "rows start")
class GQAMaskOfTheNewTokensOnly(_GivenGQA):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        s = s.masked_fill(~causal_mask(x.shape[1]), float("-inf"))   # (L, L): right without a cache, or for one token
        return self.proj(merge_heads(F.softmax(s, dim=-1) @ v))


# ============================================================================ 10.1: a NaN gradient is not a cut one
@bug("10.1", "gradient", "NaN")
def online_rescale_by_division(x, block_size):
    m = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype)
    total = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s:s + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        # right values, but at the first block 0 / exp(inf): its gradient is NaN
        total = total / torch.exp(m_new - m) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / total[..., None]


@bug("10.1", "online_rescale", "own maximum")
def online_rescale_by_the_block_maximum(x, block_size):
    m = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype)
    total = torch.zeros_like(m)
    for s in range(0, x.shape[-1], block_size):
        block = x[..., s:s + block_size]
        m_new = torch.maximum(m, block.amax(-1))
        total = total * torch.exp(block.amax(-1) - m_new) + torch.exp(block - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / total[..., None]


# ============================================================================ 10.2, 10.3: the tiled loops
def _tiled(q, k, v, *, block_q, block_k, causal=False, slip=""):
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    outs, lses = [], []
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        qb = q[..., qs:qe, :]
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        total = torch.zeros_like(m)
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        stop = (min(lk, qs + 1) if slip == "stop_at_first_query" else min(lk, qe)) if causal else lk
        for ks in range(0, stop, block_k):
            ke = min(ks + block_k, lk)
            s = qb @ k[..., ks:ke, :].transpose(-2, -1) * scale                  # (..., Bq, Bk)
            if causal:
                rows = torch.arange(qs, qe, device=q.device)[:, None]
                cols = torch.arange(ks, ke, device=q.device)[None, :]
                future = cols >= rows if slip == "hides_own_key" else cols > rows
                s = s.masked_fill(future, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)
            total = total * correction + p.sum(-1)
            acc = acc * correction[..., None] + p @ v[..., ks:ke, :]
            m = m_new
        outs.append(acc / total[..., None])
        lses.append(m + torch.log(total))
    return torch.cat(outs, -2), torch.cat(lses, -1)


@bug("10.2", "block_skip", "FIRST query")
def flash_stops_at_the_first_query(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q=block_q, block_k=block_k, causal=causal, slip="stop_at_first_query")


@bug("10.2", "causal_mask", "own key")
def flash_hides_the_own_key(q, k, v, *, block_q, block_k, causal=False):
    return _tiled(q, k, v, block_q=block_q, block_k=block_k, causal=causal, slip="hides_own_key")


class _Backward(torch.autograd.Function):
    """FlashAttentionFunction's forward as given; the backward is ``_backward`` with one slip."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = _tiled(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out


def _backward(slip, ctx, grad_out):
    q, k, v, out, lse = ctx.saved_tensors
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(-1)                                            # (..., Lq)
    for qs in range(0, lq, ctx.block_q):
        qe = min(qs + ctx.block_q, lq)
        qb, dob = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, lk, ctx.block_k):
            if ctx.causal and ks > qe - 1:
                continue
            ke = min(ks + ctx.block_k, lk)
            kb, vb = k[..., ks:ke, :], v[..., ks:ke, :]
            s = qb @ kb.transpose(-2, -1) * (1.0 if slip == "unscaled_scores" else scale)
            if ctx.causal:
                s = s.masked_fill(torch.arange(ks, ke, device=q.device)[None, :]
                                  > torch.arange(qs, qe, device=q.device)[:, None], float("-inf"))
            p = torch.exp(s - lse[..., qs:qe, None])
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ dob
            dp = dob @ vb.transpose(-2, -1)
            if slip == "delta_outside":
                ds = p * dp - delta[..., qs:qe, None]
            else:
                ds = p * (dp - delta[..., qs:qe, None])
            factor = scale * scale if slip == "scale_twice" else scale
            dq[..., qs:qe, :] += ds @ kb * factor
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ qb * factor
    return dq, dk, dv, None, None, None


def _backward_class(name, slip=""):
    """A FlashAttentionFunction whose backward is ``_backward`` with ``slip``, under the attempt's own name."""
    def backward(ctx, grad_out):
        return _backward(slip, ctx, grad_out)
    return type(name, (_Backward,), {"backward": staticmethod(backward)})


BackwardUnscaledScores = bug("10.3", "scale", "recomputed scores")(
    _backward_class("BackwardUnscaledScores", "unscaled_scores"))
BackwardDeltaOutside = bug("10.3", "backward_delta", "outside")(_backward_class("BackwardDeltaOutside", "delta_outside"))
BackwardScaleTwice = bug("10.3", "scale", "twice")(_backward_class("BackwardScaleTwice", "scale_twice"))
BackwardRight = correct("10.3")(_backward_class("BackwardRight"))


# ============================================================================ 11.2
@bug("11.2", "score_offset", "ABOVE")
def induction_above_the_diagonal(weights, half):
    return weights.diagonal(offset=half - 1, dim1=-2, dim2=-1)[..., 1:].mean(dim=(0, 2))   # the sign forgotten


@bug("11.2", "score_positions", "[..., :half]")
def induction_keeps_the_first_entries(weights, half):
    return weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., :half].mean(dim=(0, 2))


@correct("11.2")
def induction_as_the_formula(weights, half):
    after_copy = weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:]      # (N, heads, L - half)
    return after_copy.sum(dim=(0, 2)) / (weights.shape[0] * (weights.shape[-1] - half))


# ============================================================================ 12.1
@bug("12.1", "causal_mask", "sinks=4")
def window_sinks_capped_by_the_window(length, window, sinks=0):
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return ((i - j >= 0) & (i - j < window)) | ((j < min(sinks, window)) & (j <= i))


# ============================================================================ 12.2 multi-head latent attention
def _mla(layer, x, cache=None, slip=""):
    n, length, _ = x.shape
    start = 0 if cache is None else cache.length
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, h, dn + dr).transpose(1, 2).split([dn, dr], -1)   # (N, H, L, dn), (.., dr)
    if slip != "queries_unturned":
        q_rope = apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], -1)
    if slip != "norm_after_cache":
        latent = layer.kv_a_layernorm(latent)
    if slip == "keys_interleaved":   # pairs (0, 1), (2, 3), ... turned with the half-split tables
        c, s = layer.rope_cos[start:start + length], layer.rope_sin[start:start + length]
        k_rope = k_rope * c + torch.stack([-k_rope[..., 1::2], k_rope[..., ::2]], -1).flatten(-2) * s
    else:
        k_rope = apply_rotary(k_rope, layer.rope_cos, layer.rope_sin, offset=start)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)
    if slip == "norm_after_cache":   # the same outputs: the norm is per token
        latent = layer.kv_a_layernorm(latent)
    total = latent.shape[1]
    kv = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2)
    if slip == "values_first":
        v, k_nope = kv.split([dv, dn], -1)   # kv_b_proj's numbers read values first
    else:
        k_nope, v = kv.split([dn, dv], -1)
    s = (q_nope @ k_nope.transpose(-2, -1) + q_rope @ k_rope[:, None].transpose(-2, -1)) * layer.softmax_scale
    ahead = 1 if slip == "mask_ahead" else 0
    s = s.masked_fill(~torch.ones(length, total, dtype=torch.bool, device=x.device).tril(diagonal=start + ahead),
                     float("-inf"))
    out = s.softmax(-1) @ v                                                   # (N, H, L, dv)
    out = out if slip == "merge_unmoved" else out.transpose(1, 2)
    return layer.o_proj(out.reshape(n, length, h * dv))


@correct("12.2")
def mla_two_part_scores(layer, x, cache=None):
    return _mla(layer, x, cache)


@bug("12.2", "kv_cache", "before RoPE")
def mla_caches_unturned_keys(layer, x, cache=None):
    n, length, _ = x.shape
    dn, dr, h, dv = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.num_heads, layer.v_head_dim
    start = 0 if cache is None else cache.length
    q = layer.q_proj(x) if layer.q_lora_rank is None else layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
    q_nope, q_rope = q.view(n, length, h, dn + dr).transpose(1, 2).split([dn, dr], -1)
    q_rope = apply_rotary(q_rope, layer.rope_cos, layer.rope_sin, offset=start)
    latent, k_rope = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, dr], -1)
    latent = layer.kv_a_layernorm(latent)
    if cache is not None:
        latent, k_rope = cache.append(latent, k_rope)   # cached before RoPE ...
    k_rope = apply_rotary(k_rope, layer.rope_cos, layer.rope_sin)   # ... and the whole cache turned at every call
    total = latent.shape[1]
    k_nope, v = layer.kv_b_proj(latent).view(n, total, h, dn + dv).transpose(1, 2).split([dn, dv], -1)
    s = (q_nope @ k_nope.transpose(-2, -1) + q_rope @ k_rope[:, None].transpose(-2, -1)) * layer.softmax_scale
    s = s.masked_fill(~torch.ones(length, total, dtype=torch.bool, device=x.device).tril(diagonal=start),
                     float("-inf"))
    return layer.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(n, length, h * dv))


@bug("12.2", "rope_layout", "interleaved")
def mla_keys_interleaved(layer, x, cache=None):
    return _mla(layer, x, cache, "keys_interleaved")


@bug("12.2", "rope_missing", "q_rope")
def mla_queries_unturned(layer, x, cache=None):
    return _mla(layer, x, cache, "queries_unturned")


@bug("12.2", "values", "split")
def mla_values_first(layer, x, cache=None):
    return _mla(layer, x, cache, "values_first")


@bug("12.2", "causal_mask", "one future key")
def mla_mask_one_ahead(layer, x, cache=None):
    return _mla(layer, x, cache, "mask_ahead")


@bug("12.2", "head_split", "transpose(1, 2)")
def mla_heads_merged_unmoved(layer, x, cache=None):
    return _mla(layer, x, cache, "merge_unmoved")


# ============================================================================ 12.3 recurrent linear attention
def _recurrent(q, k, v, phi=lambda t: F.elu(t) + 1, slip=""):
    fq, fk = phi(q), phi(k)
    fv = phi(v) if slip == "phi_on_values" else v
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])             # S (..., d, d_v)
    norm = q.new_zeros(*q.shape[:-2], q.shape[-1])                             # z (..., d)
    out = []
    for i in range(q.shape[-2]):
        norm = fk[..., i, :] if slip == "norm_own_key" else norm + fk[..., i, :]
        read = (fq[..., i, None, :] @ state).squeeze(-2)                      # S before token i
        state = state + fk[..., i, :, None] * fv[..., i, None, :]
        if slip != "read_before_add":
            read = (fq[..., i, None, :] @ state).squeeze(-2)
        out.append(read / ((fq[..., i, :] * norm).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(out, dim=-2)


@correct("12.3")
def linear_recurrent_right(q, k, v):
    return _recurrent(q, k, v)


@bug("12.3", "feature_map", "without the + 1")
def linear_elu_without_plus_one(q, k, v):
    return _recurrent(q, k, v, phi=F.elu)


@bug("12.3", "feature_map", "softplus")
def linear_softplus(q, k, v):
    return _recurrent(q, k, v, phi=F.softplus)


@bug("12.3", "feature_map", "values too")
def linear_phi_on_values(q, k, v):
    return _recurrent(q, k, v, slip="phi_on_values")


@bug("12.3", "normalization", "current key")
def linear_normaliser_of_one_key(q, k, v):
    return _recurrent(q, k, v, slip="norm_own_key")


@bug("12.3", "state_order", "z already")
def linear_reads_state_before_adding(q, k, v):
    return _recurrent(q, k, v, slip="read_before_add")
