"""Round 38 (notebooks 02, 04, 05, 11, 12): attempts at 2.1, 4.1, 4.2, 4.3, 5.1, 5.2, 5.3, 5.4, 11.1, 11.2, 11.3 and 12.1.

Named by this round's fixes: 11.3 a keep-mask made without dtype= (a bfloat16 model: ``dtype``; the bank's
heads_bugs.ablate_by_masking did the same and now makes its mask in the weights' dtype); 5.2 a log-softmax over
dim 0 of the flattened logits (``softmax_dim``); 4.3 ln_f after every block (``norm_placement``) and positions of
the first call kept on self (a new GPT with the same weights is right: ``kept_state``); 5.1 a last window cut short
(``exception``, now with the count of windows that fit). The engine's probes hold here too: state kept in globals
and on the module (2.1, 4.1, 5.3, 11.3, 4.3: ``kept_state``), float32 tensors meeting float64 (11.1, 11.2:
``dtype``), an nn.Dropout made in forward (4.2: ``dropout``).
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import new_bank
from course_lib.attention import MultiHeadMaskedAttention
from course_lib.model import FeedForward, LearnedPositionalEncoding, SinusoidalPositionalEncoding
from course_lib.model import TransformerBlock as _CourseBlock
from course_lib.train import lm_loss

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 2.1 causal_mask

_R38_BIG_MASK = {"mask": torch.ones(0, 0, dtype=torch.bool)}


@correct("2.1")
def causal_mask_sliced_from_a_growing_cache(n):
    """Right: one mask kept, rebuilt larger when a bigger n comes, and its top-left n x n corner returned."""
    if _R38_BIG_MASK["mask"].shape[0] < n:
        _R38_BIG_MASK["mask"] = torch.ones(n, n, dtype=torch.bool).tril()
    return _R38_BIG_MASK["mask"][:n, :n]


@correct("2.1")
def causal_mask_as_transposed_triu(n):
    """Right: the upper triangle transposed is the lower one (a non-contiguous view)."""
    return torch.ones(n, n, dtype=torch.bool).triu().t()


_R38_FIRST_MASK = None


@bug("2.1", "kept_state")
def causal_mask_built_on_the_first_call(n):
    """Wrong: the mask built once, on the first call, and handed back for every later n."""
    global _R38_FIRST_MASK
    if _R38_FIRST_MASK is None:
        _R38_FIRST_MASK = torch.ones(n, n, dtype=torch.bool).tril()
    return _R38_FIRST_MASK


@bug("2.1", "causal_mask")
def causal_mask_tril_equals_zero(n):
    """Wrong: '== 0' picks the zeros of the lower triangle: True strictly above the diagonal (the future)."""
    return torch.tril(torch.ones(n, n)) == 0


# ============================================================================ 4.1 sinusoidal_table

@correct("4.1")
def table_from_complex_exponentials(max_tokens, embed_dim):
    """Right: exp(i * angle) = cos + i sin; the imaginary part in the even columns, the real part in the odd."""
    position = torch.arange(max_tokens, dtype=torch.float64)
    frequency = 10000.0 ** (-torch.arange(0, embed_dim, 2, dtype=torch.float64) / embed_dim)
    z = torch.exp(1j * torch.outer(position, frequency))                   # (T, E/2) complex
    return torch.stack([z.imag, z.real], dim=-1).reshape(max_tokens, embed_dim).float()


@correct("4.1")
def table_by_einsum_outer_product(max_tokens, embed_dim):
    """Right: the angles by einsum, sin and cos written into a zeros table by index tensors."""
    pos = torch.arange(max_tokens).float()
    inv = torch.exp(torch.arange(0, embed_dim, 2).float() * (-math.log(10000.0) / embed_dim))
    angles = torch.einsum("p,f->pf", pos, inv)
    table = torch.zeros(max_tokens, embed_dim)
    even = torch.arange(0, embed_dim, 2)
    table[:, even] = angles.sin()
    table[:, even + 1] = angles.cos()
    return table


@bug("4.1", "scale", "positions")
def table_positions_by_linspace(max_tokens, embed_dim):
    """Wrong: linspace(0, max_tokens, max_tokens) is not 0, 1, 2, ...: the positions are max/(max-1) apart."""
    position = torch.linspace(0, max_tokens, max_tokens)[:, None]
    frequency = 1.0 / 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


_R38_FREQUENCIES = []


@bug("4.1", "kept_state")
def table_frequencies_kept_from_the_first_call(max_tokens, embed_dim):
    """Wrong: the frequencies computed on the first call (its embed_dim) and reused on every later one."""
    if not _R38_FREQUENCIES:
        _R38_FREQUENCIES.append(1.0 / 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim))
    angles = torch.arange(max_tokens).float()[:, None] * _R38_FREQUENCIES[0]
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table


@bug("4.1", "mismatch")
def table_sine_as_shifted_cosine_wrong_sign(max_tokens, embed_dim):
    """Wrong: sin(a) written as cos(a + pi/2), which is -sin(a): every sine has the wrong sign."""
    angles = torch.arange(max_tokens).float()[:, None] / 10000 ** (torch.arange(0, embed_dim, 2).float() / embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.cos(angles + math.pi / 2)
    table[:, 1::2] = torch.cos(angles)
    return table


# ============================================================================ 4.2 TransformerBlock

class _Block(nn.Module):
    """The constructor notebook 04 gives; students write forward."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__()
        self.norm_first = norm_first
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = MultiHeadMaskedAttention(embed_dim, num_heads, max_tokens, dropout_rate)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)


@correct("4.2")
class BlockLoopOverNormSublayerPairs(_Block):
    """Right: one loop over (norm, sublayer) pairs, for both placements."""

    def forward(self, x):
        for norm, sublayer in ((self.ln1, self.attn), (self.ln2, self.mlp)):
            x = x + sublayer(norm(x)) if self.norm_first else norm(x + sublayer(x))
        return x


@correct("4.2", norm_first=False)
class BlockLoopOverNormSublayerPairsPost(BlockLoopOverNormSublayerPairs):
    """Right: the same loop, checked as post-norm."""


@bug("4.2", "dropout")
class BlockDropoutModuleMadeInForward(_Block):
    """Wrong: an nn.Dropout made inside forward is in training mode, whatever model.eval() said."""

    def forward(self, x):
        drop = nn.Dropout(0.1)
        x = x + drop(self.attn(self.ln1(x)))
        return x + drop(self.mlp(self.ln2(x)))


@bug("4.2", "mismatch", "order")
class BlockFeedForwardBeforeAttention(_Block):
    """Wrong: the two sublayers in the other order (feed-forward first), each with its own norm."""

    def forward(self, x):
        x = x + self.mlp(self.ln2(x))
        return x + self.attn(self.ln1(x))


# ============================================================================ 4.3 GPT

class _GPT(nn.Module):
    """The constructor the notebook gives (the blocks are the course's)."""

    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        positions = LearnedPositionalEncoding if c.positional == "learned" else SinusoidalPositionalEncoding
        self.position_encoding = positions(c.max_tokens, c.embed_dim)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.blocks = nn.ModuleList(
            _CourseBlock(c.embed_dim, c.num_heads, c.max_tokens, c.dropout_rate, c.norm_first)
            for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.embed_dim)
        self.head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)


@correct("4.3")
class GPTReducedOverBlocks(_GPT):
    """Right: F.embedding and F.linear with the modules' weights, the blocks chained by functools.reduce."""

    def forward(self, idx):
        if idx.size(-1) > self.config.max_tokens:
            raise ValueError(f"idx has {idx.size(-1)} tokens, more than max_tokens={self.config.max_tokens}: "
                             f"crop it to idx[:, -{self.config.max_tokens}:]")
        x = F.embedding(idx, self.token_embedding.weight) + self.position_encoding(idx.size(-1))
        x = functools.reduce(lambda h, block: block(h), self.blocks, self.dropout(x))
        return F.linear(self.ln_f(x), self.head.weight)


@correct("4.3")
class GPTPositionsExpandedOverBatch(_GPT):
    """Right: positions expanded to (N, L, E) explicitly before the sum; relies on position_encoding's error."""

    def forward(self, idx):
        n, length = idx.shape
        pos = self.position_encoding(length).unsqueeze(0).expand(n, -1, -1)
        x = self.dropout(self.token_embedding(idx) + pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "kept_state")
class GPTPositionsCachedOnFirstCall(_GPT):
    """Wrong: the position encodings computed on the first call and kept on the module for every later length."""

    def forward(self, idx):
        if not hasattr(self, "_pos"):
            self._pos = self.position_encoding(idx.shape[1])
        x = self.dropout(self.token_embedding(idx) + self._pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "kept_state")
class GPTPositionTableCachedOnce(_GPT):
    """Wrong: the whole position table computed on the first call (to save work) and sliced afterwards: it is cut
    from the graph of that call (the first one ran under no_grad) and goes stale once the weights are trained."""

    def forward(self, idx):
        if getattr(self, "_table", None) is None:
            self._table = self.position_encoding(self.config.max_tokens)
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx has {length} tokens, max_tokens={self.config.max_tokens}: crop it")
        x = self.dropout(self.token_embedding(idx) + self._table[:length])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "norm_placement", "ln_f")
class GPTFinalNormAfterEveryBlock(_GPT):
    """Wrong: ln_f applied after every block (inside the loop), not once after the last."""

    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = self.ln_f(block(x))
        return self.head(x)


# ============================================================================ 5.1 lm_windows

@correct("5.1")
def windows_by_two_reshapes(ids, max_tokens):
    """Right: n = (T - 1) // max_tokens windows; inputs and targets are two shifted slices, each reshaped."""
    n = (len(ids) - 1) // max_tokens
    inputs = ids[:n * max_tokens].reshape(n, max_tokens)
    targets = ids[1:n * max_tokens + 1].reshape(n, max_tokens)
    return inputs.long(), targets.long()


@bug("5.1", "exception", "max_tokens + 1")
def windows_count_without_the_extra_token(ids, max_tokens):
    """Wrong: len(ids) // max_tokens windows, forgetting the extra target token: the last one does not fit."""
    n = len(ids) // max_tokens
    inputs = torch.stack([ids[w * max_tokens:(w + 1) * max_tokens] for w in range(n)])
    targets = torch.stack([ids[w * max_tokens + 1:(w + 1) * max_tokens + 1] for w in range(n)])
    return inputs.long(), targets.long()


@bug("5.1", "shape")
def windows_disjoint_by_max_tokens_plus_one(ids, max_tokens):
    """Wrong: windows every max_tokens + 1 tokens (no token shared between windows), so fewer windows."""
    starts = range(0, len(ids) - max_tokens, max_tokens + 1)
    chunks = torch.stack([ids[s:s + max_tokens + 1] for s in starts])
    return chunks[:, :-1].long(), chunks[:, 1:].long()


@bug("5.1", "dtype", "long")
def windows_cast_to_int(ids, max_tokens):
    """Wrong: .int() (int32) where torch.long is asked."""
    starts = range(0, len(ids) - max_tokens, max_tokens)
    chunks = torch.stack([ids[s:s + max_tokens + 1] for s in starts])
    return chunks[:, :-1].int(), chunks[:, 1:].int()


# ============================================================================ 5.2 lm_loss

@correct("5.2")
def loss_summed_over_real_count(logits, targets):
    """Right: the summed cross-entropy divided by the number of real (non -100) targets."""
    flat, t = logits.flatten(0, 1), targets.flatten()
    total = F.cross_entropy(flat, t, ignore_index=-100, reduction="sum")
    return total / (t != -100).sum()


@correct("5.2")
def loss_with_a_module_instance(logits, targets):
    """Right: nn.CrossEntropyLoss made inside the function (ignore_index defaults to -100)."""
    criterion = nn.CrossEntropyLoss()
    return criterion(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@bug("5.2", "loss_reduction", "-100")
def loss_ignore_index_minus_one(logits, targets):
    """Wrong: ignore_index=-1 (the padding id of another tutorial): the -100 targets are not ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


@bug("5.2", "softmax_dim")
def loss_log_softmax_over_the_flattened_rows(logits, targets):
    """Wrong: log_softmax over dim 0 of the flattened (N*L, V) logits: over the positions, not the vocabulary."""
    flat = logits.reshape(-1, logits.size(-1))
    return F.nll_loss(F.log_softmax(flat, dim=0), targets.reshape(-1))


# ============================================================================ 5.3 train_step

@correct("5.3")
def step_grads_set_to_none_by_hand(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Right: the gradients cleared by hand (p.grad = None for every parameter), the loss read before backward."""
    model.train()
    for p in model.parameters():
        p.grad = None
    loss = lm_loss(model(inputs), targets)
    value = loss.item()
    loss.backward()
    if max_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_grad_norm)
    optimizer.step()
    return value


@correct("5.3")
def step_model_zero_grad(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Right: model.zero_grad() clears the same gradients as the optimizer's."""
    model.train()
    model.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss)


_R38_STEPS = {"done": 0}


@bug("5.3", "kept_state")
def step_with_a_warmup_counter(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Wrong: a learning-rate warm-up of its own, counted in a global: the first steps use a fraction of lr."""
    _R38_STEPS["done"] += 1
    scale = min(1.0, _R38_STEPS["done"] / 100)
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
        group["lr"] = group["base_lr"] * scale
    optimizer.step()
    return loss.item()


@bug("5.3", "clipping")
def step_clips_at_one_when_none(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Wrong: 'max_grad_norm or 1.0' clips at 1.0 also when max_grad_norm=None asks for no clipping."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or 1.0)
    optimizer.step()
    return loss.item()


# ============================================================================ 5.4 sample_next_token

@correct("5.4")
def sample_top_k_on_the_probabilities(logits, temperature=1.0, top_k=None, generator=None):
    """Right: top-k applied to the probabilities (zeros below the k-th); multinomial renormalises the rest."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k is not None:
        kth = probs.topk(min(top_k, probs.size(-1)), dim=-1).values[..., -1:]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@correct("5.4")
def sample_top_k_before_the_temperature(logits, temperature=1.0, top_k=None, generator=None):
    """Right: top-k first, then the temperature: dividing by T > 0 keeps the order and -inf stays -inf."""
    if not temperature:
        return torch.argmax(logits, dim=-1)
    if top_k is not None:
        values, _ = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
        logits = logits.masked_fill(logits < values[:, [-1]], float("-inf"))
    probs = F.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)


@bug("5.4", "shape")
def sample_greedy_flat_argmax(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: argmax() without dim, at temperature 0: one index into the flattened batch."""
    if temperature == 0:
        return logits.argmax()
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "generator")
def sample_global_rng_without_generator_only_for_top_k(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: the generator used on the plain path, but the top-k path draws with torch.multinomial's global RNG."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is None:
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
    return torch.multinomial(probs, 1).squeeze(-1)


@bug("5.4", "generator")
def sample_with_categorical_distribution(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: torch.distributions.Categorical(...).sample() takes no generator: a seeded generator is ignored."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.distributions.Categorical(logits=logits).sample()


# ============================================================================ 11.1 previous_token_score

@correct("11.1")
def prev_einsum_diagonal_of_slices(weights):
    """Right: the diagonal of weights[..., 1:, :-1] by einsum's repeated index."""
    return torch.einsum("nhii->nhi", weights[..., 1:, :-1]).mean(dim=(0, 2))


@bug("11.1", "dtype")
def prev_selector_in_float32_einsum(weights):
    """Wrong: the selector made on the right device but in float32: einsum with float64 (or half) weights fails."""
    length = weights.shape[-1]
    selector = torch.ones(length, length, device=weights.device).tril(-1).triu(-1)
    return torch.einsum("nhij,ij->h", weights, selector) / (weights.shape[0] * (length - 1))


@bug("11.1", "score_axes")
def prev_diagonal_default_dims(weights):
    """Wrong: weights.diagonal(-1) without dim1/dim2 takes the diagonal over the batch and head axes."""
    below = weights.diagonal(-1)
    return below.mean(dim=(0, 1))


# ============================================================================ 11.2 induction_score

@correct("11.2")
def induction_by_gather(weights, half):
    """Right: torch.gather of key i - half + 1 for every query i of the second half."""
    n, h, length, _ = weights.shape
    queries = torch.arange(half, length, device=weights.device)
    keys = (queries - half + 1).view(1, 1, -1, 1).expand(n, h, -1, 1)
    picked = weights[:, :, half:, :].gather(-1, keys)            # (N, H, L - half, 1)
    return picked.squeeze(-1).mean(dim=(0, 2))


@bug("11.2", "dtype")
def induction_loop_total_in_float32(weights, half):
    """Wrong: a running total made with torch.zeros(heads, device=...) but no dtype: float32 whatever the weights."""
    n, heads, length, _ = weights.shape
    total = torch.zeros(heads, device=weights.device)
    for i in range(half, length):
        total += weights[:, :, i, i - half + 1].sum(0)
    return total / (n * (length - half))


@bug("11.2", "score_offset")
def induction_offset_sign_slip(weights, half):
    """Wrong: offset=-half + 1 written as -(half + 1): two keys before the right one."""
    d = weights.diagonal(offset=-(half + 1), dim1=-2, dim2=-1)
    return d[..., -(weights.shape[-1] - half):].mean(dim=(0, 2)) if d.shape[-1] >= weights.shape[-1] - half \
        else d.mean(dim=(0, 2))


# ============================================================================ 11.3 ablate_head

@correct("11.3")
@contextlib.contextmanager
def ablate_by_subtracting_the_heads_share(model, layer, head):
    """Right: a forward hook on proj that subtracts the head's contribution, its columns of W times its slice."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs, output):
        return output - F.linear(inputs[0][..., cols], module.weight[:, cols])

    handle = attn.proj.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


_R38_HANDLE = None


@bug("11.3", "kept_state")
@contextlib.contextmanager
def ablate_handle_kept_in_a_global(model, layer, head):
    """Wrong: the hook's handle kept in a global that is never reset: a second ablation registers nothing."""
    global _R38_HANDLE
    attn = model.blocks[layer].attn
    d = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * d:(head + 1) * d] = 0
        return (x,)

    if _R38_HANDLE is None:
        _R38_HANDLE = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        _R38_HANDLE.remove()


@bug("11.3", "dtype")
@contextlib.contextmanager
def ablate_keep_mask_in_float32(model, layer, head):
    """Wrong: the keep-mask made on the activations' device but in float32: a half-precision model breaks."""
    attn = model.blocks[layer].attn
    d = attn.head_dim

    def hook(module, inputs):
        x = inputs[0]
        keep = torch.ones(x.shape[-1], device=x.device)
        keep[head * d:(head + 1) * d] = 0
        return (x * keep,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


# ============================================================================ 12.1 sliding_window_mask

@correct("12.1")
def window_factored_condition(length, window, sinks=0):
    """Right: never the future, and then either inside the window or a sink: (d >= 0) & ((d < w) | (j < s))."""
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    d = i - j
    return (d >= 0) & ((d < window) | (j < sinks))


@bug("12.1", "causal_mask")
def window_clamped_to_length_minus_one(length, window, sinks=0):
    """Wrong: the window clamped to length - 1 'so it fits', which cuts one key off when window >= length."""
    window = min(window, length - 1)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return ((i - j >= 0) & (i - j < window)) | ((j < sinks) & (j <= i))


@bug("12.1", "causal_mask", "should be False")
def window_by_rolled_eyes(length, window, sinks=0):
    """Wrong: the band built from identity matrices rolled down k rows: roll wraps, so the corner sees the future."""
    eye = torch.eye(length, dtype=torch.bool)
    mask = torch.zeros(length, length, dtype=torch.bool)
    for k in range(min(window, length)):
        mask |= eye.roll(k, dims=0)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    return mask | ((j < sinks) & (j <= i))


@correct("12.1")
def window_causal_minus_far_then_sink_columns(length, window, sinks=0):
    """Right: the causal mask minus the keys window or more back, then the first sinks columns put back."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = causal & ~causal.tril(-window)
    mask[:, :sinks] = causal[:, :sinks]
    return mask
