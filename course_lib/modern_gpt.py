"""A Llama-style GPT built from notebook 09's parts: RoPE attention with grouped-query heads, RMSNorm, SwiGLU.

:class:`ModernGPT` has the interface of :class:`course_lib.model.GPT` (``forward(idx, cache=None)``,
``new_cache()``, ``num_parameters()``, ``config.max_tokens``, ``config.vocab_size``), so
:func:`course_lib.generate.generate` and :func:`course_lib.train.train` take it unchanged. Its parts are
passed in as classes, so a student's own ``GroupedQueryAttention``, ``RMSNorm`` and ``SwiGLU`` build the
same model, and :func:`course_lib.hf.from_hf_llama` loads a Hugging Face Llama into them
(``hf.from_hf_modern``: a Qwen 3, Mistral, Arcee or Apertus too).
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _validate as validate
from ._config import SavedConfig
from .attention import KVCache, check_model_input
from .data import IGNORE_INDEX
from .model import GPT, GPTConfig, gpt2_init
from .modern import GroupedQueryAttention, ReLUSquared, RMSNorm, SwiGLU
from .ngram_embedding import HashedNgramEmbedding
from .ngram_prior import NgramPrior

__all__ = ["MLP_KINDS", "default_hidden_dim", "ModernGPTConfig", "ModernBlock", "ModernGPT", "ARCHITECTURES"]

MLP_KINDS = ("swiglu", "relu2")


def default_hidden_dim(embed_dim: int, mlp: str) -> int:
    """SwiGLU: 8/3 of embed_dim rounded up to a multiple of 8 (three matrices, about the parameters of
    GPT-2's two at 4x); ReLU²: 4 * embed_dim."""
    validate.positive_int("embed_dim", embed_dim)
    validate.one_of("mlp", mlp, MLP_KINDS)
    if mlp == "relu2":
        return 4 * embed_dim
    return 8 * math.ceil(8 * embed_dim / 3 / 8)


@dataclass
class ModernGPTConfig(SavedConfig):
    """Everything needed to build a :class:`ModernGPT`; validates itself when created.

    ``num_kv_heads``, ``hidden_dim`` and ``head_dim`` left at None are filled in when the config is
    created (``num_heads``; :func:`default_hidden_dim`; ``embed_dim // num_heads``), so a config always
    reads as the concrete architecture. ``dataclasses.replace`` keeps those filled-in values: pass
    ``None`` again to have them recomputed from a new ``embed_dim`` or ``num_heads``.
    """

    vocab_size: int
    max_tokens: int = 64
    embed_dim: int = 128
    num_heads: int = 4
    num_kv_heads: int | None = None
    num_layers: int = 4
    hidden_dim: int | None = None
    mlp: str = "swiglu"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = False
    sliding_window: int | None = None
    tie_weights: bool = False
    dropout_rate: float = 0.0
    head_dim: int | None = None
    hashed_ngrams: int = 0       # the longest n-gram with an embedding of its own (0: none; 4: 2-, 3- and 4-grams)
    ngram_buckets: int = 8192    # rows of each n-gram table (course_lib.ngram_embedding)
    ngram_prior: int = 0         # the order of a counted n-gram model the logits are added to (0: none; course_lib.ngram_prior)
    prior_features: bool = False # the network also reads the counted model's probabilities at its input

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_tokens", "embed_dim", "num_heads", "num_layers"):
            # stored as a plain int (a numpy integer is taken too), so that the config saves as JSON
            setattr(self, name, validate.positive_int(f"ModernGPTConfig.{name}", getattr(self, name)))
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        validate.positive_int("ModernGPTConfig.num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            divisors = [k for k in range(1, self.num_heads + 1) if self.num_heads % k == 0]
            raise ValueError(f"ModernGPTConfig.num_kv_heads: must divide num_heads={self.num_heads} (each "
                             f"key/value head serves a whole group of query heads); got {self.num_kv_heads}, "
                             f"choose from {divisors}")
        validate.one_of("ModernGPTConfig.mlp", self.mlp, MLP_KINDS)
        if self.hidden_dim is None:
            self.hidden_dim = default_hidden_dim(self.embed_dim, self.mlp)
        validate.positive_int("ModernGPTConfig.hidden_dim", self.hidden_dim)
        if self.head_dim is None:
            if self.embed_dim % self.num_heads:
                divisors = [h for h in range(1, self.embed_dim + 1) if self.embed_dim % h == 0 and h <= 64]
                raise ValueError(f"ModernGPTConfig.embed_dim={self.embed_dim} is not divisible by "
                                 f"num_heads={self.num_heads}; choose num_heads from {divisors}, or set "
                                 f"head_dim explicitly")
            self.head_dim = self.embed_dim // self.num_heads
        validate.positive_int("ModernGPTConfig.head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"ModernGPTConfig.head_dim: expected an even number (RoPE turns pairs of "
                             f"dimensions), got {self.head_dim} (embed_dim={self.embed_dim}, "
                             f"num_heads={self.num_heads})")
        self.rope_theta = validate.finite_positive("ModernGPTConfig.rope_theta", self.rope_theta,
                                           hint="Llama uses 10000.0 or 500000.0")
        self.norm_eps = validate.finite_positive("ModernGPTConfig.norm_eps", self.norm_eps, hint="Llama uses 1e-5 or 1e-6")
        validate.boolean("ModernGPTConfig.qk_norm", self.qk_norm)
        validate.boolean("ModernGPTConfig.tie_weights", self.tie_weights)
        self.sliding_window = validate.positive_int_or_none("ModernGPTConfig.sliding_window",
                                                            self.sliding_window)
        validate.probability("ModernGPTConfig.dropout_rate", self.dropout_rate,
                             hint="0.0 turns dropout off, 0.1-0.2 is typical")
        if isinstance(self.hashed_ngrams, bool) or not isinstance(self.hashed_ngrams, int) \
                or self.hashed_ngrams < 0 or self.hashed_ngrams == 1:
            raise ValueError(f"ModernGPTConfig.hashed_ngrams: expected 0 (none) or an int >= 2 (the longest n-gram "
                             f"embedded; 4 embeds 2-, 3- and 4-grams), got {validate.describe(self.hashed_ngrams)}")
        validate.positive_int("ModernGPTConfig.ngram_buckets", self.ngram_buckets)
        if isinstance(self.ngram_prior, bool) or not isinstance(self.ngram_prior, int) or self.ngram_prior < 0:
            raise ValueError(f"ModernGPTConfig.ngram_prior: expected 0 (none) or an int >= 1 (the order of the counted "
                             f"model; 7 counts 6 tokens of context), got {validate.describe(self.ngram_prior)}")
        validate.boolean("ModernGPTConfig.prior_features", self.prior_features)
        if self.prior_features and not self.ngram_prior:
            raise ValueError("ModernGPTConfig.prior_features: the network reads the counted model's probabilities, "
                             "so it needs one; set ngram_prior (7, say) too, or prior_features=False")

    @property
    def groups(self) -> int:
        """Query heads per key/value head: 1 is multi-head attention, num_heads is multi-query."""
        return self.num_heads // self.num_kv_heads


# ---------------------------------------------------------------- building the parts

def _check_part_class(name: str, cls: Any) -> None:
    if isinstance(cls, nn.Module):   # callable too, but it is called with sizes to build a part, not with x
        raise TypeError(f"{name}: expected a class (an nn.Module subclass), got an instance of {type(cls).__name__}; "
                        f"pass the class itself, {name}={type(cls).__name__}, and the model builds its parts")
    if not callable(cls):
        raise TypeError(f"{name}: expected a class (an nn.Module subclass), got {validate.describe(cls)}")


# How ModernBlock calls each part's class, and the course's class that takes it, for the message.
_PART_CALLS = {"attention_cls": ("(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta, **options)",
                                 "GroupedQueryAttention"),
               "norm_cls": ("(embed_dim, norm_eps)", "RMSNorm"), "mlp_cls": ("(embed_dim, hidden_dim)", "SwiGLU")}


def _check_callable_as(name: str, cls: Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any]) -> None:
    """Refuse a part class that cannot take the arguments ModernBlock passes (read from its signature)."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):   # no signature to read (a builtin): let the call decide
        return
    try:
        signature.bind(*args, **options)
    except TypeError as error:
        call, course = _PART_CALLS[name]
        raise TypeError(f"{name}: expected a class the model can call as {name}{call}, got "
                        f"{getattr(cls, '__name__', type(cls).__name__)}{signature} ({error}); use "
                        f"course_lib.modern.{course} or a class with that signature") from None


def _accepts(cls: Callable[..., Any], keyword: str) -> bool:
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):   # no signature to read (a builtin): let the call decide
        return True
    return any(p.name == keyword and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
               for p in parameters)


def _built(name: str, cls: Any, module: Any) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name}: {getattr(cls, '__name__', cls)!s}(...) should build an nn.Module, "
                        f"got {validate.describe(module)}")
    return module


def _attention_options(config: ModernGPTConfig) -> dict[str, Any]:
    """The optional keyword arguments of GroupedQueryAttention that this config needs.

    Only those that differ from the defaults, so a class with the plain signature
    ``(embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0)`` builds a Llama.
    ``norm_eps`` only matters to the QK-norm, so it goes along only with ``qk_norm=True``.
    """
    options: dict[str, Any] = {}
    if config.qk_norm:
        options["qk_norm"] = True
        if config.norm_eps != 1e-6:
            options["norm_eps"] = config.norm_eps
    if config.sliding_window is not None:
        options["sliding_window"] = config.sliding_window
    if config.dropout_rate:
        options["dropout_rate"] = config.dropout_rate
    if config.head_dim * config.num_heads != config.embed_dim:
        options["head_dim"] = config.head_dim
    return options


class ModernBlock(nn.Module):
    """Pre-norm residual block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``.

    The parts are built from the classes given: ``attention_cls(embed_dim, num_heads, num_kv_heads,
    max_tokens, rope_theta, **options)``, ``norm_cls(embed_dim, norm_eps)`` and
    ``mlp_cls(embed_dim, hidden_dim)`` (``mlp_cls=None``: SwiGLU or ReLUSquared as ``config.mlp`` says).
    """

    def __init__(self, config: ModernGPTConfig, *, attention_cls: Callable[..., nn.Module] = GroupedQueryAttention,
                 norm_cls: Callable[..., nn.Module] = RMSNorm, mlp_cls: Callable[..., nn.Module] | None = None):
        super().__init__()
        if not isinstance(config, ModernGPTConfig):
            raise TypeError(f"config: expected a ModernGPTConfig, got {validate.describe(config)}")
        mlp_cls = mlp_cls if mlp_cls is not None else (SwiGLU if config.mlp == "swiglu" else ReLUSquared)
        for name, cls in (("attention_cls", attention_cls), ("norm_cls", norm_cls), ("mlp_cls", mlp_cls)):
            _check_part_class(name, cls)
        c = config
        options = _attention_options(c)
        refused = [key for key in options if not _accepts(attention_cls, key)]
        if refused:
            settings = ", ".join(f"{key}={options[key]!r}" for key in refused)
            raise TypeError(f"attention_cls: {getattr(attention_cls, '__name__', attention_cls)} does not take "
                            f"{', '.join(refused)}, and the config asks for {settings}; use "
                            f"course_lib.modern.GroupedQueryAttention or a config without them")
        _check_callable_as("attention_cls", attention_cls,
                           (c.embed_dim, c.num_heads, c.num_kv_heads, c.max_tokens, c.rope_theta), options)
        _check_callable_as("norm_cls", norm_cls, (c.embed_dim, c.norm_eps), {})
        _check_callable_as("mlp_cls", mlp_cls, (c.embed_dim, c.hidden_dim), {})
        self.attn_norm = _built("norm_cls", norm_cls, norm_cls(c.embed_dim, c.norm_eps))
        self.attn = _built("attention_cls", attention_cls,
                           attention_cls(c.embed_dim, c.num_heads, c.num_kv_heads, c.max_tokens, c.rope_theta,
                                         **options))
        self.mlp_norm = _built("norm_cls", norm_cls, norm_cls(c.embed_dim, c.norm_eps))
        self.mlp = _built("mlp_cls", mlp_cls, mlp_cls(c.embed_dim, c.hidden_dim))
        # On each branch's output, as GPT's attention and FeedForward drop theirs.
        self.dropout = nn.Dropout(c.dropout_rate)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x (N, L, embed_dim) -> (N, L, embed_dim)."""
        x = x + self.dropout(self.attn(self.attn_norm(x), cache))
        x = x + self.dropout(self.mlp(self.mlp_norm(x)))
        return x


class ModernGPT(nn.Module):
    """A Llama-style decoder: token embeddings (no position vectors: RoPE turns q and k inside attention),
    pre-norm blocks of grouped-query attention and a gated MLP, a final RMSNorm, the output head.

    With ``config.hashed_ngrams``, the embeddings of the n-grams ending at each token are added to its own
    (:class:`course_lib.ngram_embedding.HashedNgramEmbedding`). With ``config.ngram_prior``, a counted n-gram
    model's log-probabilities are added to the logits, and with ``config.prior_features`` the network also
    reads its probabilities at its input (:class:`course_lib.ngram_prior.NgramPrior`)."""

    def __init__(self, config: ModernGPTConfig, *, attention_cls: Callable[..., nn.Module] = GroupedQueryAttention,
                 norm_cls: Callable[..., nn.Module] = RMSNorm, mlp_cls: Callable[..., nn.Module] | None = None):
        super().__init__()
        if not isinstance(config, ModernGPTConfig):
            raise TypeError(f"config: expected a ModernGPTConfig, got {validate.describe(config)}; "
                            f"build one with ModernGPTConfig(vocab_size=..., ...)")
        _check_part_class("norm_cls", norm_cls)
        self.config = config
        c = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.blocks = nn.ModuleList(
            ModernBlock(c, attention_cls=attention_cls, norm_cls=norm_cls, mlp_cls=mlp_cls)
            for _ in range(c.num_layers))
        self.norm_f = _built("norm_cls", norm_cls, norm_cls(c.embed_dim, c.norm_eps))
        self.head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        self.apply(gpt2_init)   # GPT-2's: normal(0, 0.02) weights, zero biases
        # As in GPT: the projections that write into the residual stream start smaller,
        # so the stream's variance does not grow with depth.
        for block in self.blocks:
            for proj in (getattr(block.attn, "proj", None), getattr(block.mlp, "down", None)):
                if isinstance(proj, nn.Linear):
                    nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * c.num_layers))
        if c.tie_weights:
            self.head.weight = self.token_embedding.weight
        # after gpt2_init, which would draw its tables: they start at zero, so the model starts without them
        self.ngram_embedding = HashedNgramEmbedding(c.embed_dim, c.hashed_ngrams, c.ngram_buckets) \
            if c.hashed_ngrams else None
        # Counted from the training text when training starts (course_lib.train); it has no weights to learn,
        # only how much to trust it, which starts at 1. With prior_features the network also reads its
        # probabilities, through a matrix that starts at zero: a fresh model is the model without it.
        self.ngram_prior = NgramPrior(c.vocab_size, c.ngram_prior) if c.ngram_prior else None
        self.prior_weight = nn.Parameter(torch.ones(())) if c.ngram_prior else None
        self.prior_in = nn.Linear(c.vocab_size, c.embed_dim, bias=False) if c.prior_features else None
        if self.prior_in is not None:
            nn.init.zeros_(self.prior_in.weight)
        # how many tokens a cache keeps, for the n-grams that reach back over what it already saw
        self._recent_tokens = max(c.hashed_ngrams, c.ngram_prior, 1) - 1

    def new_cache(self) -> list[KVCache]:
        """One empty KV cache per block, for :func:`course_lib.generate`."""
        caches = [KVCache(self.config.max_tokens) for _ in self.blocks]
        return _CacheWithRecentTokens(caches) if self._recent_tokens > 0 else caches

    def forward(self, idx: torch.Tensor, cache: list[KVCache] | None = None, *,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (N, L) -> logits (N, L, vocab_size).

        With ``cache`` (from :meth:`new_cache`), ``idx`` holds only the tokens not yet seen; the
        attention layers rotate them to positions that continue after the cached ones. ``targets``
        (N, L), given by the training loop, matter only to the counted n-gram model: in training it
        leaves each position's own occurrence out of its counts (:mod:`course_lib.ngram_prior`).
        """
        start = check_model_input(idx, cache, vocab_size=self.config.vocab_size, max_tokens=self.config.max_tokens,
                                  num_blocks=len(self.blocks), training=self.training)
        if idx.dtype != torch.long and idx.dtype != torch.int32:
            idx = idx.long()   # any integer ids: nn.Embedding takes only int32 and int64
        if targets is not None and self.ngram_prior is not None:
            validate.token_ids("targets", targets, dim=2, padding=IGNORE_INDEX)
            if targets.shape != idx.shape:
                raise ValueError(f"targets: expected the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
        recent = self._recent(idx, cache, start)
        x = self.token_embedding(idx)                                 # (N, L, embed_dim)
        prior = None
        if self.ngram_prior is not None:
            # only in training: evaluation scores text the counts never saw, as it should
            prior = self.ngram_prior(idx, targets if self.training else None, recent)   # (N, L, vocab_size)
            if self.prior_in is not None:
                x = x + self.prior_in(prior.exp())                    # (N, L, embed_dim)
        if self.ngram_embedding is not None:
            before = None if recent is None else recent[:, -(self.config.hashed_ngrams - 1):]
            x = x + self.ngram_embedding(idx, before)                 # (N, L, embed_dim)
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cache[i] if cache is not None else None)     # (N, L, embed_dim)
        logits = self.head(self.norm_f(x))                            # (N, L, vocab_size)
        if prior is not None:
            logits = logits + self.prior_weight * prior
        return logits

    def _recent(self, idx: torch.Tensor, cache: list[KVCache] | None, start: int) -> torch.Tensor | None:
        """The tokens a cache saw just before ``idx``, for the n-grams that reach back over them; keeps the new ones."""
        if cache is None or self._recent_tokens == 0:
            return None
        if not isinstance(cache, _CacheWithRecentTokens):
            raise TypeError("cache: this model looks at n-grams, so its cache also keeps the last tokens seen; "
                            "use model.new_cache(), got a plain list of KVCache")
        recent = cache.recent if start else None
        if recent is not None and recent.shape[0] != idx.shape[0]:
            raise ValueError(f"cache: holds the last tokens of a batch of {recent.shape[0]} sequences, got a batch "
                             f"of {idx.shape[0]}; start a new cache (model.new_cache()) for a new batch")
        seen = idx if recent is None else torch.cat([recent, idx], dim=1)
        cache.recent = seen[:, -self._recent_tokens:]                 # (N, up to the longest n-gram - 1)
        return recent

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Number of trainable numbers; a tied head/embedding is counted once.

        RoPE has no position table: as in :meth:`GPT.num_parameters`, the token embedding stays in the
        count (tied, it is the head too), and ``include_embeddings=False`` subtracts only the n-gram
        tables, lookups that cost no multiply-adds (the FLOP counts use this number).
        """
        validate.boolean("include_embeddings", include_embeddings)
        unique = {id(p): p for p in self.parameters()}
        if not include_embeddings and self.ngram_embedding is not None:
            for p in self.ngram_embedding.parameters():
                unique.pop(id(p))
        return sum(p.numel() for p in unique.values())


class _CacheWithRecentTokens(list):
    """A ModernGPT's KV caches, one per block, and the last tokens seen: its n-grams reach back over them."""

    recent: torch.Tensor | None = None


# The model classes a preset or a checkpoint may name, with their configs: GPT-2's (notebook 04) and this one.
ARCHITECTURES: dict[str, tuple[type[nn.Module], type]] = {"gpt": (GPT, GPTConfig), "modern": (ModernGPT, ModernGPTConfig)}
