"""Positional encodings, the feed-forward layer, the transformer block and the GPT model."""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import torch
from torch import nn

from . import _validate as validate
from ._config import SavedConfig
from .attention import KVCache, MultiHeadMaskedAttention, check_input_dtype, check_model_input

__all__ = [
    "sinusoidal_table",
    "LearnedPositionalEncoding",
    "SinusoidalPositionalEncoding",
    "FeedForward",
    "TransformerBlock",
    "GPTConfig",
    "GPT",
    "gpt2_init",
]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
POSITIONAL = ("learned", "sinusoidal")
GPT2_INIT_STD = 0.02   # GPT-2 draws every weight from normal(0, 0.02)


def sinusoidal_table(max_tokens: int, embed_dim: int) -> torch.Tensor:
    """The fixed encodings of "Attention is all you need": (max_tokens, embed_dim).

    PE[pos, 2i] = sin(pos / 10000^(2i/d)),  PE[pos, 2i+1] = cos(pos / 10000^(2i/d))
    """
    validate.positive_int("max_tokens", max_tokens)
    validate.positive_int("embed_dim", embed_dim)
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]             # (max_tokens, 1)
    frequency = torch.exp(torch.arange(0, embed_dim, 2, dtype=torch.float32)
                          * (-math.log(10000.0) / embed_dim))                      # (ceil(d/2),)
    angles = position * frequency                                                  # (max_tokens, ceil(d/2))
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : embed_dim // 2])
    return table


class LearnedPositionalEncoding(nn.Module):
    """One trained vector per position (GPT-1, GPT-2)."""

    def __init__(self, max_tokens: int, embed_dim: int):
        super().__init__()
        self.max_tokens = validate.positive_int("max_tokens", max_tokens)
        self.embedding = nn.Embedding(max_tokens, validate.positive_int("embed_dim", embed_dim))

    def forward(self, length: int, start: int = 0) -> torch.Tensor:
        """Vectors for positions start .. start + length - 1: (length, embed_dim)."""
        _check_positions(length, start, self.max_tokens)
        positions = torch.arange(start, start + length, device=self.embedding.weight.device)
        return self.embedding(positions)


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sine/cosine vectors per position (the original transformer); nothing to learn."""

    def __init__(self, max_tokens: int, embed_dim: int):
        super().__init__()
        self.max_tokens = max_tokens
        self.register_buffer("table", sinusoidal_table(max_tokens, embed_dim), persistent=False)

    def forward(self, length: int, start: int = 0) -> torch.Tensor:
        """Vectors for positions start .. start + length - 1: (length, embed_dim)."""
        _check_positions(length, start, self.max_tokens)
        return self.table[start:start + length]


def _check_position_count(name: str, value: object) -> None:
    """``value`` an int >= 0 (numpy's too); cheap, since a positional encoding runs on every forward."""
    if type(value) is int and value >= 0:
        return
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        hint = "; pass the number of positions, x.shape[1], not the tensor" if isinstance(value, torch.Tensor) else ""
        raise ValueError(f"{name}: expected an int >= 0, got {validate.describe(value)}{hint}")


def _check_positions(length: int, start: int, max_tokens: int) -> None:
    _check_position_count("length", length)
    _check_position_count("start", start)
    if start + length > max_tokens:
        raise ValueError(f"length: positions {start}..{start + length - 1} go past max_tokens={max_tokens}; "
                         f"crop the sequence to its last {max_tokens} tokens")


def _check_last_dim(x: torch.Tensor, embed_dim: int) -> None:
    if x.shape[-1] != embed_dim:   # the message is built only when it is needed: this runs on every forward
        raise ValueError(f"x: expected last dimension embed_dim={embed_dim}, got shape {tuple(x.shape)}")


class FeedForward(nn.Module):
    """Position-wise MLP: Linear(embed_dim -> hidden_dim), activation, Linear back, dropout."""

    def __init__(self, embed_dim: int, hidden_dim: int | None = None, dropout_rate: float = 0.0,
                 *, bias: bool = False, activation: str = "gelu"):
        super().__init__()
        validate.positive_int("embed_dim", embed_dim)
        hidden_dim = 4 * embed_dim if hidden_dim is None else validate.positive_int("hidden_dim", hidden_dim)
        validate.probability("dropout_rate", dropout_rate)
        validate.one_of("activation", activation, ACTIVATIONS)
        validate.boolean("bias", bias)
        self.embed_dim = embed_dim
        self.fc = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.act = nn.ReLU() if activation == "relu" else nn.GELU(
            approximate="tanh" if activation == "gelu_tanh" else "none")
        self.proj = nn.Linear(hidden_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        validate.tensor("x", x, min_dim=1, floating=True)
        check_input_dtype("x", x, self)
        _check_last_dim(x, self.embed_dim)
        return self.dropout(self.proj(self.act(self.fc(x))))   # (N, L, embed_dim)


class TransformerBlock(nn.Module):
    """Attention then feed-forward, each wrapped in a residual connection and a LayerNorm.

    norm_first=True (pre-norm, GPT-2):   x = x + attn(ln1(x));  x = x + mlp(ln2(x))
    norm_first=False (post-norm, 2017):  x = ln1(x + attn(x));  x = ln2(x + mlp(x))
    """

    def __init__(self, embed_dim: int, num_heads: int, max_tokens: int, dropout_rate: float = 0.0,
                 norm_first: bool = True, *, bias: bool = False, activation: str = "gelu",
                 layer_norm_eps: float = 1e-5, mlp_ratio: int = 4, fused: bool = True):
        super().__init__()
        self.embed_dim = validate.positive_int("embed_dim", embed_dim)   # here, not in nn.LayerNorm's own error
        validate.positive_int("mlp_ratio", mlp_ratio)
        validate.finite_positive("layer_norm_eps", layer_norm_eps)
        self.norm_first = validate.boolean("norm_first", norm_first)
        self.ln1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.attn = MultiHeadMaskedAttention(embed_dim, num_heads, max_tokens, dropout_rate,
                                             bias=bias, fused=fused)
        self.ln2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.mlp = FeedForward(embed_dim, mlp_ratio * embed_dim, dropout_rate,
                               bias=bias, activation=activation)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x (N, L, embed_dim) -> (N, L, embed_dim)."""
        validate.tensor("x", x, dim=3, floating=True)
        check_input_dtype("x", x, self)   # before ln1, whose own error would not name x
        _check_last_dim(x, self.embed_dim)
        if self.norm_first:
            x = x + self.attn(self.ln1(x), cache)
            x = x + self.mlp(self.ln2(x))
        else:
            x = self.ln1(x + self.attn(x, cache))
            x = self.ln2(x + self.mlp(x))
        return x


@dataclass
class GPTConfig(SavedConfig):
    """Everything needed to build a GPT; validates itself when created."""

    vocab_size: int
    max_tokens: int = 64
    embed_dim: int = 128
    num_heads: int = 4
    num_layers: int = 4
    dropout_rate: float = 0.0
    norm_first: bool = True
    positional: str = "learned"
    tie_weights: bool = False
    # What GPT-2 needs; the course defaults leave them off.
    bias: bool = False
    activation: str = "gelu"
    layer_norm_eps: float = 1e-5
    mlp_ratio: int = 4
    fused_attention: bool = True
    # The spread of the matrices that read the residual stream (query, key, value, the feed-forward's
    # first layer). GPT-2's 0.02 was chosen for widths of 768 and more; a narrow model learns faster
    # from a wider start (notebook 05).
    input_init_std: float = GPT2_INIT_STD

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_tokens", "embed_dim", "num_heads", "num_layers", "mlp_ratio"):
            # stored as a plain int (a numpy integer is taken too), so that the config saves as JSON
            setattr(self, name, validate.positive_int(f"GPTConfig.{name}", getattr(self, name)))
        if self.embed_dim % self.num_heads:
            divisors = [h for h in range(1, self.embed_dim + 1) if self.embed_dim % h == 0 and h <= 64]
            raise ValueError(f"GPTConfig.embed_dim={self.embed_dim} is not divisible by "
                             f"num_heads={self.num_heads}; choose num_heads from {divisors} "
                             f"or change embed_dim to a multiple of {self.num_heads}")
        validate.probability("GPTConfig.dropout_rate", self.dropout_rate,
                             hint="0.0 turns dropout off, 0.1-0.2 is typical")
        validate.one_of("GPTConfig.positional", self.positional, POSITIONAL)
        validate.one_of("GPTConfig.activation", self.activation, ACTIVATIONS)
        validate.finite_positive("GPTConfig.layer_norm_eps", self.layer_norm_eps, hint="1e-5 is typical")
        validate.positive_float("GPTConfig.input_init_std", self.input_init_std, finite=True,
                                hint=f"GPT-2 uses {GPT2_INIT_STD}")
        for name in ("norm_first", "tie_weights", "bias", "fused_attention"):
            validate.boolean(f"GPTConfig.{name}", getattr(self, name))

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


def gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialisation of one module (for ``model.apply``): weights normal(0, 0.02), biases zero."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=GPT2_INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, blocks, final LayerNorm, output head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        validate.instance("config", config, GPTConfig, "a GPTConfig", brief=True,
                          hint="build one with GPTConfig(vocab_size=..., ...)")
        self.config = config
        c = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        encoding = LearnedPositionalEncoding if c.positional == "learned" else SinusoidalPositionalEncoding
        self.position_encoding = encoding(c.max_tokens, c.embed_dim)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.blocks = nn.ModuleList(
            TransformerBlock(c.embed_dim, c.num_heads, c.max_tokens, c.dropout_rate, c.norm_first,
                             bias=c.bias, activation=c.activation, layer_norm_eps=c.layer_norm_eps,
                             mlp_ratio=c.mlp_ratio, fused=c.fused_attention)
            for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.embed_dim, eps=c.layer_norm_eps)
        self.head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        self.apply(gpt2_init)
        # GPT-2: the projections that write into the residual stream start smaller,
        # so the stream's variance does not grow with depth.
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=GPT2_INIT_STD / math.sqrt(2 * c.num_layers))
        if c.input_init_std != GPT2_INIT_STD:
            # drawn again after every other weight, as in the runs that chose 0.05 (PERFORMANCE.md), so the
            # preset reproduces them; only when the value differs, so GPT-2's models keep their draws
            for block in self.blocks:
                for layer in (block.attn.query, block.attn.key, block.attn.value, block.mlp.fc):
                    nn.init.normal_(layer.weight, mean=0.0, std=c.input_init_std)
        if c.tie_weights:
            self.head.weight = self.token_embedding.weight

    def new_cache(self) -> list[KVCache]:
        """One empty KV cache per block, for :func:`course_lib.generate`."""
        return [KVCache(self.config.max_tokens) for _ in self.blocks]

    def forward(self, idx: torch.Tensor, cache: list[KVCache] | None = None) -> torch.Tensor:
        """Token ids (N, L) -> logits (N, L, vocab_size).

        With ``cache`` (from :meth:`new_cache`), ``idx`` holds only the tokens not yet
        seen; their positions continue after the cached ones.
        """
        start = self._start_position(idx, cache)
        if idx.dtype != torch.long and idx.dtype != torch.int32:
            idx = idx.long()   # any integer ids: nn.Embedding takes only int32 and int64
        n, length = idx.shape
        x = self.token_embedding(idx) + self.position_encoding(length, start)   # (N, L, embed_dim)
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cache[i] if cache is not None else None)               # (N, L, embed_dim)
        return self.head(self.ln_f(x))                                          # (N, L, vocab_size)

    def _start_position(self, idx: torch.Tensor, cache: list[KVCache] | None) -> int:
        """The boundary check of forward's inputs (ids in the vocabulary, a cache of one layer per block, room left
        in the context); returns the position of idx's first token, the tokens already cached."""
        return check_model_input(idx, cache, vocab_size=self.config.vocab_size, max_tokens=self.config.max_tokens,
                                 num_blocks=len(self.blocks), training=self.training)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Number of trainable numbers; a tied head/embedding is counted once."""
        validate.boolean("include_embeddings", include_embeddings)
        unique = {id(p): p for p in self.parameters()}
        total = sum(p.numel() for p in unique.values())
        if not include_embeddings and self.config.positional == "learned":
            total -= self.position_encoding.embedding.weight.numel()
        return total

    @torch.no_grad()
    def attention_maps(self, idx: torch.Tensor) -> torch.Tensor:
        """Attention weights of every layer and head: (num_layers, N, num_heads, L, L)."""
        was_training = self.training
        self.eval()
        try:
            for block in self.blocks:
                block.attn.record_weights = True
            self(idx)
            return torch.stack([block.attn.attention_weights for block in self.blocks])
        finally:
            for block in self.blocks:
                block.attn.record_weights = False
                block.attn.attention_weights = None
            self.train(was_training)
