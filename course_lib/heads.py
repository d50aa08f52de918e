"""What attention learns (notebook 11): induction heads in a 2-layer, attention-only transformer.

The data are random tokens repeated twice; the model is built from the course's parts
(:class:`~course_lib.attention.MultiHeadMaskedAttention`, learned positions, LayerNorm) without any
feed-forward layer, so all it can do is move information between positions. After a plateau, the loss
on the repeated half drops at once (the phase change) when a previous-token head in layer 0 and an
induction head in layer 1 form (Olsson et al. 2022, "In-context Learning and Induction Heads").

The scores read attention weights laid out (N, heads, L, L), as the course records them
(``record_weights``; :func:`attention_patterns`).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from numbers import Integral

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate as validate
from ._rng import leaves_rng_alone
from .attention import MultiHeadMaskedAttention
from .model import GPT, LearnedPositionalEncoding
from .modern import apply_rotary, repeat_kv, sliding_window_mask, split_heads

__all__ = [
    "previous_token_score", "induction_score", "ablate_head", "repeated_tokens", "InductionConfig",
    "AttentionOnlyBlock", "AttentionOnly", "InductionRun", "train_induction", "attention_patterns",
    "half_losses", "phase_change_step",
]


# ---------------------------------------------------------------- the scores (exercises 11.1, 11.2)

def _check_weights(weights: object) -> torch.Tensor:
    weights = validate.tensor("weights", weights, dim=4, floating=True)
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights: expected attention weights (N, heads, L, L), square in the last two axes, "
                         f"got shape {tuple(weights.shape)}")
    return weights


def previous_token_score(weights: torch.Tensor) -> torch.Tensor:
    """Each head's mean attention from position i to i - 1: weights (N, heads, L, L) -> (heads,).

    Position 0 has no previous token, so the mean runs over i = 1 .. L-1 and over the batch.
    """
    weights = _check_weights(weights)
    if weights.shape[-1] < 2:
        raise ValueError(f"weights: a previous token needs at least 2 positions, got L={weights.shape[-1]}")
    below = weights.diagonal(offset=-1, dim1=-2, dim2=-1)   # (N, heads, L-1): entries (i, i-1)
    return below.mean(dim=(0, 2))                           # (heads,)


def induction_score(weights: torch.Tensor, half: int) -> torch.Tensor:
    """Each head's mean attention from i to i - half + 1, over the second half: (N, heads, L, L) -> (heads,).

    A sequence of ``half`` random tokens followed by the same tokens again: position i >= half holds
    the token that sat at i - half, and an induction head looks at the token *after* that earlier copy.
    """
    weights = _check_weights(weights)
    half = validate.positive_int("half", half)
    length = weights.shape[-1]
    if not half < length <= 2 * half:
        raise ValueError(f"half: expected the second half to start inside the sequence (half < L <= 2*half), "
                         f"got half={half} for L={length}")
    # Diagonal -(half-1) holds (i, i - half + 1) for i = half-1 .. L-1; i = half-1 is still in the first half.
    after_copy = weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:]   # (N, heads, L-half)
    return after_copy.mean(dim=(0, 2))                                              # (heads,)


# ---------------------------------------------------------------- ablation (exercise 11.3)

def _attention_of(model: nn.Module, layer: int) -> nn.Module:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"model: expected a course model with its layers in model.blocks, got "
                        f"{type(model).__name__}")
    if not 0 <= layer < len(blocks):
        raise ValueError(f"layer: expected 0 .. {len(blocks) - 1}, got {layer}")
    return blocks[layer].attn


@contextlib.contextmanager
def ablate_head(model: nn.Module, layer: int, head: int) -> Iterator[nn.Module]:
    """Inside the ``with``, head ``head`` of layer ``layer`` outputs zeros; the model is as before afterwards.

    The heads' outputs are merged (N, L, heads * head_dim) before the output projection ``attn.proj``;
    head h owns columns h * head_dim .. (h+1) * head_dim - 1. A hook on ``proj``'s input zeroes them,
    and is removed on leaving, even when the block raises.
    """
    validate.non_negative_int("layer", layer)
    validate.non_negative_int("head", head)
    attn = _attention_of(model, layer)
    if not head < attn.num_heads:
        raise ValueError(f"head: layer {layer} has heads 0 .. {attn.num_heads - 1}, got {head}")
    size = attn.head_dim
    columns = slice(head * size, (head + 1) * size)

    def zero_head(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        merged = inputs[0].clone()   # (N, L, heads * head_dim); a copy, so the hook changes nothing upstream
        merged[..., columns] = 0.0
        return (merged, *inputs[1:])

    handle = attn.proj.register_forward_pre_hook(zero_head)
    try:
        yield model
    finally:
        handle.remove()


# ---------------------------------------------------------------- the data

def repeated_tokens(batch_size: int, half: int, vocab_size: int, *, length: int | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``batch_size`` sequences of ``half`` random tokens, then the same tokens again: (N, 2 * half).

    With ``length``, the ``half`` tokens repeat until the sequence is ``length`` long: (N, length).
    """
    validate.positive_int("batch_size", batch_size)
    validate.positive_int("half", half)
    validate.positive_int("vocab_size", vocab_size)
    length = 2 * half if length is None else validate.positive_int("length", length)
    validate.instance("generator", generator, torch.Generator, "a torch.Generator or None", or_none=True,
                      hint="torch.Generator().manual_seed(0), say")
    first = torch.randint(vocab_size, (batch_size, half), generator=generator)   # (N, half)
    repeats = -(-length // half)                                                 # ceil(length / half)
    return first.repeat(1, repeats)[:, :length]                                  # (N, length)


# ---------------------------------------------------------------- the model

_DEFAULT_MIN_PERIOD = 8


@dataclass(frozen=True)
class InductionConfig:
    """The toy task and model of notebook 11; the defaults show the phase change in under 10 s on a quiet 2-core CPU.

    One head per layer: with more, every head of layer 1 becomes an induction head (the task has no other
    job for them), and no single one stands out.
    """

    vocab_size: int = 64
    half: int = 16
    embed_dim: int = 64
    num_heads: int = 1
    num_layers: int = 2
    learning_rate: float = 1e-3
    batch_size: int = 32
    steps: int = 800
    seed: int = 0
    log_every: int = 10
    # Each training batch repeats with its own period, drawn from min_period .. half, so no head can
    # find the copy by its position alone (a fixed period would let layer 0 look back `half` places).
    min_period: int = _DEFAULT_MIN_PERIOD

    def __post_init__(self) -> None:
        for name in ("vocab_size", "half", "embed_dim", "num_heads", "num_layers", "batch_size", "steps",
                     "log_every"):
            validate.positive_int(f"InductionConfig.{name}", getattr(self, name))
        validate.positive_float("InductionConfig.learning_rate", self.learning_rate)
        validate.positive_float("InductionConfig.learning_rate", self.learning_rate, finite=True)
        if isinstance(self.min_period, bool) or not isinstance(self.min_period, int):
            raise ValueError(f"InductionConfig.min_period: expected an int in 2 .. half={self.half}, got "
                             f"{validate.describe(self.min_period)}")
        if self.half < 2:
            raise ValueError(f"InductionConfig.half: expected an int >= 2 (a batch repeats with a period of 2 .. half "
                             f"tokens), got {self.half}")
        if self.min_period > self.half and self.min_period == _DEFAULT_MIN_PERIOD:
            raise ValueError(f"InductionConfig.half: half={self.half} is below the default min_period="
                             f"{_DEFAULT_MIN_PERIOD} (each batch repeats with a period of min_period .. half tokens); "
                             f"set min_period too, to 2 .. {self.half}")
        if not 2 <= self.min_period <= self.half:
            raise ValueError(f"InductionConfig.min_period: expected 2 .. half={self.half}, got {self.min_period}")
        validate.non_negative_int("InductionConfig.seed", self.seed)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"InductionConfig.num_heads: embed_dim={self.embed_dim} must be divisible by "
                             f"num_heads, got {self.num_heads}")


class AttentionOnlyBlock(nn.Module):
    """One attention layer with its residual connection and no feed-forward: x + attn(ln1(x))."""

    def __init__(self, embed_dim: int, num_heads: int, max_tokens: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = MultiHeadMaskedAttention(embed_dim, num_heads, max_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln1(x))   # (N, L, embed_dim)


class AttentionOnly(nn.Module):
    """Token and position embeddings, ``num_layers`` attention-only blocks, a final LayerNorm, the head."""

    def __init__(self, config: InductionConfig):
        super().__init__()
        if not isinstance(config, InductionConfig):
            raise TypeError(f"config: expected an InductionConfig, got {type(config).__name__}")
        self.config = config
        c, max_tokens = config, 2 * config.half
        self.token_embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        self.position_encoding = LearnedPositionalEncoding(max_tokens, c.embed_dim)
        self.blocks = nn.ModuleList(AttentionOnlyBlock(c.embed_dim, c.num_heads, max_tokens)
                                    for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.embed_dim)
        self.head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (N, L) -> logits (N, L, vocab_size)."""
        validate.token_ids("idx", idx, dim=2, vocab_size=self.config.vocab_size)   # not the embedding's IndexError
        max_tokens = 2 * self.config.half
        if idx.shape[1] > max_tokens:   # here, where the message can name idx, not the position table
            raise ValueError(f"idx: sequence of {idx.shape[1]} tokens is longer than max_tokens={max_tokens} "
                             f"(2 * half); crop it to the last {max_tokens} tokens (idx[:, -{max_tokens}:])")
        if idx.dtype != torch.long and idx.dtype != torch.int32:
            idx = idx.long()   # any integer ids: nn.Embedding takes only int32 and int64
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])   # (N, L, embed_dim)
        for block in self.blocks:
            x = block(x)                                                       # (N, L, embed_dim)
        return self.head(self.ln_f(x))                                         # (N, L, vocab_size)


# ---------------------------------------------------------------- training

@dataclass
class InductionRun:
    """A trained model with its loss curves: the mean loss on each half, every ``log_every`` steps."""

    model: AttentionOnly
    config: InductionConfig
    steps: list[int] = field(default_factory=list)
    first_half: list[float] = field(default_factory=list)
    second_half: list[float] = field(default_factory=list)
    seconds: float = 0.0


def half_losses(model: nn.Module, tokens: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss of predicting the tokens of each half: (first, second), two scalars.

    The first half's targets are positions 1 .. half-1 (random, unpredictable); the second half's are
    half .. 2*half-1, each a copy of a token seen ``half`` positions before.
    """
    if not callable(model):
        raise TypeError(f"model: expected a model that maps token ids (N, L) to logits (N, L, vocab), got "
                        f"{validate.describe(model)}")
    tokens = validate.token_ids("tokens", tokens, dim=2)
    length = tokens.shape[1]
    if length < 3:
        raise ValueError(f"tokens: expected at least 3 tokens per sequence (a target in each half), got shape "
                         f"{tuple(tokens.shape)}")
    if isinstance(half, bool) or not isinstance(half, Integral) or not 2 <= half <= length - 1:
        raise ValueError(f"half: expected an int in 2 .. {length - 1} (the first half's length, so that each half has "
                         f"a target in tokens of length {length}), got {validate.describe(half)}")
    logits = model(tokens[:, :-1])                                       # (N, L-1, vocab)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != (tokens.shape[0], length - 1):
        raise ValueError(f"model: expected logits (N, L-1, vocab) with (N, L-1) = {(tokens.shape[0], length - 1)} "
                         f"for tokens[:, :-1], got {validate.describe(logits)}")
    losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")   # (N, L-1)
    # Target j + 1 is predicted at position j: the first half's targets are columns 0 .. half-2.
    return losses[:, :half - 1].mean(), losses[:, half - 1:].mean()


@leaves_rng_alone   # seeds its own model and data: the notebook's random stream is untouched
def train_induction(config: InductionConfig | None = None) -> InductionRun:
    """Train an :class:`AttentionOnly` model on repeated random tokens for ``config.steps`` steps (AdamW).

    Each batch repeats its random tokens with a period drawn from ``min_period .. half``; the curves are
    measured on one fixed batch of the notebook's data, ``half`` tokens then the same again.
    """
    config = InductionConfig() if config is None else config
    if not isinstance(config, InductionConfig):
        raise TypeError(f"config: expected an InductionConfig or None, got {type(config).__name__}")
    torch.manual_seed(config.seed)
    model = AttentionOnly(config)
    data = torch.Generator().manual_seed(config.seed + 1)
    probe = repeated_tokens(128, config.half, config.vocab_size,
                            generator=torch.Generator().manual_seed(config.seed + 2))   # (128, 2 * half)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    run = InductionRun(model, config)
    threads = torch.get_num_threads()
    # Matrices 64 wide are too small to share between cores: one thread runs them fastest (4x on 2 busy cores).
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        for step in range(config.steps):
            if step % config.log_every == 0:
                _log(run, step, probe)
            model.train()
            period = int(torch.randint(config.min_period, config.half + 1, (1,), generator=data))
            tokens = repeated_tokens(config.batch_size, period, config.vocab_size, length=2 * config.half,
                                     generator=data)
            logits = model(tokens[:, :-1])                                          # (N, L-1, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())  # every target counts
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        _log(run, config.steps, probe)
    finally:
        run.seconds = time.perf_counter() - start
        torch.set_num_threads(threads)
        model.eval()
    return run


@torch.no_grad()
def _log(run: InductionRun, step: int, probe: torch.Tensor) -> None:
    run.model.eval()
    first, second = half_losses(run.model, probe, run.config.half)
    run.steps.append(step)
    run.first_half.append(float(first))
    run.second_half.append(float(second))


def _numbers(name: str, values: object, *, whole: bool) -> list:
    """A list (tuple, array, 1-D tensor) of ints (``whole``) or finite numbers, as InductionRun logs them."""
    what = "ints" if whole else "finite numbers"
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a list of {what} (as InductionRun logs them), got {validate.describe(values)}")
    items = []
    for i, item in enumerate(values):
        if isinstance(item, torch.Tensor) and item.numel() == 1:
            item = item.item()
        ok = isinstance(item, Integral) and not isinstance(item, bool) if whole \
            else validate.is_number(item) and math.isfinite(item)
        if not ok:
            number = validate.is_number(item)
            hint = "; a diverged run (nan or inf loss) has no phase change to find" if number and not whole else ""
            raise (ValueError if number else TypeError)(
                f"{name}: expected a list of {what}, got {validate.describe(item)} at index {i}{hint}")
        items.append(item)
    return items


def phase_change_step(steps: list[int], losses: list[float]) -> int:
    """The logged step where the loss falls fastest (the largest drop between two logged points)."""
    steps = _numbers("steps", steps, whole=True)
    losses = _numbers("losses", losses, whole=False)
    if len(steps) != len(losses) or len(steps) < 2:
        raise ValueError(f"steps, losses: expected two equal-length lists of at least 2 points, got "
                         f"{len(steps)} and {len(losses)}")
    drops = [losses[i] - losses[i + 1] for i in range(len(losses) - 1)]
    return steps[max(range(len(drops)), key=drops.__getitem__) + 1]


# ---------------------------------------------------------------- attention patterns of any course model

def _modern_weights(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # GroupedQueryAttention has no record_weights: recompute its weights from its input, as it does.
    q = split_heads(attn.query(x), attn.num_heads)      # (N, heads, L, head_dim)
    k = split_heads(attn.key(x), attn.num_kv_heads)     # (N, kv_heads, L, head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rotary(q, attn.rope_cos, attn.rope_sin)
    k = repeat_kv(apply_rotary(k, attn.rope_cos, attn.rope_sin), attn.groups)   # (N, heads, L, head_dim)
    length = x.shape[1]
    mask = sliding_window_mask(length, attn.sliding_window or length, device=x.device)   # (L, L)
    scores = (q @ k.transpose(-2, -1)) * attn.head_dim ** -0.5                        # (N, heads, L, L)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


@torch.no_grad()
def attention_patterns(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Attention weights of every layer and head on ``idx``: (num_layers, N, heads, L, L).

    Course attention records its weights (``record_weights``); notebook 09's grouped-query attention is
    recomputed from the input it received.
    """
    if isinstance(model, GPT):
        return model.attention_maps(idx)
    _attention_of(model, 0)   # refuses a model without course blocks
    blocks = model.blocks
    was_training = model.training
    model.eval()
    seen: list[torch.Tensor] = []
    handles = []
    try:
        for block in blocks:
            if isinstance(block.attn, MultiHeadMaskedAttention):
                block.attn.record_weights = True
            else:
                handles.append(block.attn.register_forward_pre_hook(
                    lambda module, inputs: seen.append(_modern_weights(module, inputs[0]))))
        model(idx)
        if handles:
            return torch.stack(seen)
        return torch.stack([block.attn.attention_weights for block in blocks])
    finally:
        for handle in handles:
            handle.remove()
        for block in blocks:
            if isinstance(block.attn, MultiHeadMaskedAttention):
                block.attn.record_weights = False
                block.attn.attention_weights = None
        model.train(was_training)
