"""Attention, from the toy dot-product example to multi-head causal self-attention.

The names here are the ones the notebooks teach: a student who writes
``MultiHeadMaskedAttention`` in notebook 03 finds the same class, with the same
constructor and parameter names, in this file.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate as validate

__all__ = [
    "TOY_KEYS",
    "TOY_VALUES",
    "toy_attention",
    "attention_weights",
    "scaled_dot_product_attention",
    "causal_mask",
    "split_heads",
    "merge_heads",
    "KVCache",
    "MaskedAttention",
    "MultiHeadMaskedAttention",
]


# The worked example of notebook 01: three keys pointing right, up and left, and
# one scalar value each. Query [1, 0] matches the first key best; query [0, 1]
# matches the second, and the first and third then weigh the same.
TOY_KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
TOY_VALUES = torch.tensor([1.0, 2.0, 3.0])


def toy_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Weight ``values`` by how well each key matches ``query`` (no scaling, no batch).

    query (d,), keys (n, d), values (n,) or (n, dv)  ->  () or (dv,)
    """
    validate.tensor("query", query, dim=1, floating=True)
    validate.tensor("keys", keys, dim=2, floating=True)
    validate.tensor("values", values, floating=True)
    d, n = query.shape[0], keys.shape[0]
    validate.expect(keys.shape[1] == d, "keys", f"shape (n, {d}) to match query of shape ({d},)", tuple(keys.shape))
    validate.expect(values.dim() in (1, 2) and values.shape[0] == n, "values",
                    f"shape ({n},) or ({n}, dv), one value per key", tuple(values.shape))
    _same_dtype("keys", keys, "query", query)
    _same_dtype("values", values, "query", query)
    scores = keys @ query                    # (n,)  one compatibility score per key
    weights = torch.softmax(scores, dim=0)   # (n,)  positive, sums to one
    return weights @ values                  # () or (dv,)


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) with disallowed positions set to zero weight.

    q (..., Lq, d), k (..., Lk, d), mask bool broadcastable to (..., Lq, Lk)  ->  (..., Lq, Lk)
    Each row (one query) sums to one over the keys it may attend to.
    """
    _check_qk_mask(q, k, mask)
    return _attention_weights(q, k, mask)


def _attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # attention_weights without its checks (_check_qk_mask made them)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5   # (..., Lq, Lk)
    if mask is not None:
        # -inf becomes exactly zero weight after the softmax, and the remaining
        # weights of the row still sum to one.
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)   # normalise over the keys, one distribution per query


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape that shapes ``a`` and ``b`` broadcast to, or None when they do not (sizes only: no tensor work)."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _fits(batch: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """Whether batch shape ``other`` broadcasts into ``batch`` without enlarging it (a leading 1 aside): a mask
    or values may repeat over the batch, never add sequences to it."""
    joined = _broadcast(batch, other)
    if joined is None:
        return False
    extra = len(joined) - len(batch)
    return all(size == 1 for size in joined[:extra]) and tuple(joined[extra:]) == tuple(batch)


def _same_dtype(name: str, x: torch.Tensor, of: str, ref: torch.Tensor) -> None:
    """``x`` in the dtype of ``ref`` (autocast mixes dtypes on purpose: then any dtype goes).

    Devices are left to torch: its "Expected all tensors to be on the same device" is what the checks' device
    probe recognises in a student's layer that builds its mask on the CPU."""
    if x.dtype != ref.dtype and not torch.is_autocast_enabled(ref.device.type):
        raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {of}), got {x.dtype}; "
                        f"convert it with {name}.to({of}.dtype)")


def _check_qk_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> tuple[int, ...]:
    """attention_weights' arguments (shapes, dtypes and devices only); the batch shape of the weights."""
    validate.tensor("q", q, min_dim=2, floating=True)
    validate.tensor("k", k, min_dim=2, floating=True)
    validate.expect(q.shape[-1] == k.shape[-1], "k", f"last dimension {q.shape[-1]} to match q {tuple(q.shape)}",
                    tuple(k.shape))
    if q.shape[-1] == 0:
        raise ValueError(f"q: expected a feature dimension d >= 1 (the scores divide by sqrt(d)), got shape "
                         f"{tuple(q.shape)}")
    _same_dtype("k", k, "q", q)
    batch = _broadcast(q.shape[:-2], k.shape[:-2])
    if batch is None:
        raise ValueError(f"k: expected batch dimensions that match q's {tuple(q.shape[:-2])} (or are 1), got "
                         f"shape {tuple(k.shape)} against q {tuple(q.shape)}")
    if mask is not None:
        lq, lk = q.shape[-2], k.shape[-2]
        validate.tensor("mask", mask, min_dim=2, dtype=torch.bool)
        validate.expect(mask.shape[-2] in (1, lq) and mask.shape[-1] in (1, lk), "mask", f"a bool tensor broadcastable "
                        f"to (..., {lq}, {lk}) (queries x keys, True = may attend)", f"shape {tuple(mask.shape)}")
        if not _fits(batch, mask.shape[:-2]):
            raise ValueError(f"mask: expected a bool tensor broadcastable to the scores {batch + (lq, lk)} "
                             f"(its batch dimensions matching q and k, or 1), got shape {tuple(mask.shape)}")
    return batch


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for any leading batch dimensions.

    q (..., Lq, d), k (..., Lk, d), v (..., Lk, dv), mask bool (..., Lq, Lk), True = may attend
    ->  (..., Lq, dv)
    """
    validate.tensor("v", v, min_dim=2, floating=True)
    validate.tensor("k", k, min_dim=2, floating=True)   # before its shape is read
    validate.expect(k.shape[-2] == v.shape[-2], "v", f"{k.shape[-2]} rows, one per key (k has shape {tuple(k.shape)})",
                    tuple(v.shape))
    batch = _check_qk_mask(q, k, mask)
    _same_dtype("v", v, "q", q)
    if not _fits(batch, v.shape[:-2]):
        raise ValueError(f"v: expected one value per key, with the batch dimensions of q and k "
                         f"({tuple(batch) if batch else 'none'}) or 1s, got shape {tuple(v.shape)} with k "
                         f"{tuple(k.shape)}")
    return _attention_weights(q, k, mask) @ v   # (..., Lq, dv)


def causal_mask(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool (n, n): True on and below the diagonal, so position i sees positions 0..i."""
    n = validate.positive_int("n", n)
    # a meta tensor's device (x.device) is taken as is: shape-only runs, such as the checks' device probe
    if device is not None and not (isinstance(device, torch.device) and device.type == "meta"):
        device = validate.device("device", device)
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(N, L, E) -> (N, num_heads, L, E // num_heads): each head gets its own slice of the features."""
    validate.tensor("x", x, dim=3)
    n, length, embed_dim = x.shape
    validate.divisor("num_heads", validate.positive_int("num_heads", num_heads), embed_dim,
                     f"the last dimension of x ({embed_dim})")
    # view first, then transpose: a bare .view(n, num_heads, length, head_dim)
    # would cut the sequence, not the features, into heads.
    return x.view(n, length, num_heads, embed_dim // num_heads).transpose(1, 2)   # (N, heads, L, head_dim)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(N, heads, L, head_dim) -> (N, L, heads * head_dim): the heads' outputs side by side."""
    validate.tensor("x", x, dim=4)
    n, heads, length, head_dim = x.shape
    # transpose back before reshaping, or features of different positions get mixed
    return x.transpose(1, 2).reshape(n, length, heads * head_dim)   # (N, L, E)


def check_input_dtype(name: str, x: torch.Tensor, module: nn.Module) -> None:
    """``x`` in the dtype of ``module``'s weights (float16 into a float32 layer is refused here,
    not deep inside a matmul); under autocast, which mixes dtypes on purpose, anything goes."""
    weight = next(module.parameters(), None)
    if weight is None or x.dtype == weight.dtype or torch.is_autocast_enabled(x.device.type):
        return
    raise TypeError(f"{name}: expected dtype {weight.dtype} (the dtype of this {type(module).__name__}'s "
                    f"weights), got {x.dtype}; convert the input with {name}.to({weight.dtype}), or the "
                    f"module with .to({x.dtype})")


def check_input(x: torch.Tensor, embed_dim: int, max_tokens: int, start: int = 0,
                 module: nn.Module | None = None) -> None:
    """x (N, L, embed_dim) with start + L <= max_tokens, in the module's dtype, or a message naming x."""
    validate.tensor("x", x, dim=3, floating=True)
    if module is not None:
        check_input_dtype("x", x, module)
    validate.expect(x.shape[-1] == embed_dim, "x", f"last dimension embed_dim={embed_dim}", f"shape {tuple(x.shape)}")
    total = start + x.shape[1]
    if total > max_tokens:
        raise ValueError(f"x: sequence of {total} tokens is longer than max_tokens={max_tokens}; "
                         f"crop the input to its last {max_tokens} tokens")


class MaskedAttention(nn.Module):
    """Causal self-attention with a single head: the layer written in notebook 02 (exercise 2.2).

    Parameters ``query``, ``key``, ``value`` (embed_dim -> embed_dim) and ``proj``
    (the output projection); dropout on the attention weights and after ``proj``.
    ``fused=True`` runs steps 2-4 as one ``F.scaled_dot_product_attention`` call (notebook 06):
    the same numbers, computed without keeping the (L, L) weights.
    """

    def __init__(self, embed_dim: int, max_tokens: int, dropout_rate: float = 0.0,
                 *, bias: bool = False, fused: bool = True):
        super().__init__()
        self.embed_dim = validate.positive_int("embed_dim", embed_dim)
        self.max_tokens = validate.positive_int("max_tokens", max_tokens)
        validate.probability("dropout_rate", dropout_rate)
        validate.boolean("bias", bias)
        self.dropout_rate = dropout_rate
        self.fused = validate.boolean("fused", fused)
        # one head as wide as the embedding, named as in MultiHeadMaskedAttention so code reads both
        self.num_heads, self.head_dim = 1, embed_dim
        self.query = nn.Linear(embed_dim, embed_dim, bias=bias)   # W_Q
        self.key = nn.Linear(embed_dim, embed_dim, bias=bias)     # W_K
        self.value = nn.Linear(embed_dim, embed_dim, bias=bias)   # W_V
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)    # output projection
        self.attn_dropout = nn.Dropout(dropout_rate)              # on the attention weights
        self.proj_dropout = nn.Dropout(dropout_rate)              # on the output
        # Not persistent: the mask is derived from max_tokens, not learned, so it
        # stays out of checkpoints and out of weight-for-weight conversions.
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)
        # Set record_weights = True to keep the last attention weights (for plots), laid out
        # (N, 1, L, L) like MultiHeadMaskedAttention's, so the same plotting code reads both.
        self.record_weights = False
        self.attention_weights: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, L, embed_dim) -> (N, L, embed_dim): the steps of notebook 02, exercise 2.2."""
        check_input(x, self.embed_dim, self.max_tokens, module=self)
        length = x.shape[1]
        # 1. project every position to its query, key and value
        q, k, v = self.query(x), self.key(x), self.value(x)                        # each (N, L, E)
        if self.fused and not self.record_weights:
            # steps 2-4 in one fused kernel (notebook 06): the same numbers, without storing the (L, L) weights
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 dropout_p=self.dropout_rate if self.training else 0.0)
            return self.proj_dropout(self.proj(out))                                  # (N, L, E)
        # 2. scores q @ k^T, scaled by 1/sqrt(E) so they keep unit variance whatever the size
        scores = q @ k.transpose(-2, -1) / self.embed_dim ** 0.5                  # (N, L, L)
        # 3. the future gets -inf, so exactly zero weight after the softmax
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        # 4. one distribution over the keys per query
        weights = torch.softmax(scores, dim=-1)                                   # (N, L, L)
        if self.record_weights:   # before dropout: the weights the model computed
            self.attention_weights = weights.detach().unsqueeze(1)                # (N, 1, L, L)
        # 5. the weighted average of the values, then the output projection
        return self.proj_dropout(self.proj(self.attn_dropout(weights) @ v))       # (N, L, E)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, max_tokens={self.max_tokens}, "
                f"dropout_rate={self.dropout_rate}, fused={self.fused}")


class KVCache:
    """Keys and values of the tokens already seen by one attention layer.

    During generation each new token only needs its own query, key and value:
    the keys and values of earlier tokens do not change, so we keep them here
    instead of recomputing them at every step.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = validate.positive_int("max_tokens", max_tokens)
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (N, heads, L, head_dim); return all keys and values so far."""
        validate.tensor("k", k, dim=4, floating=True)
        validate.tensor("v", v, dim=4, floating=True)
        validate.expect(v.shape == k.shape, "v", f"the shape of k {tuple(k.shape)} (N, heads, L, head_dim)",
                        tuple(v.shape))
        # each is written into a buffer of its own kind: a mix would fail later, or attend across devices
        _same_dtype("v", v, "k", k)
        if v.device != k.device:
            raise ValueError(f"v: expected a tensor on {k.device} (the device of k), got {v.device}")
        if self._k is not None:
            held = (self._k.shape[1], self._k.shape[3], self._k.dtype, self._k.device)
            if (k.shape[1], k.shape[3], k.dtype, k.device) != held:
                # A cache filled by another layer or model: writing into it would fail or mix them.
                raise ValueError(f"cache: holds {held[0]} heads of size {held[1]} ({held[2]}, "
                                 f"{held[3]}), got {k.shape[1]} heads of size {k.shape[3]} ({k.dtype}, "
                                 f"{k.device}); use a cache made for this layer (model.new_cache())")
        new_length = self.length + k.shape[2]
        if new_length > self.max_tokens:
            raise ValueError(f"cache: holds {self.length} tokens, adding {k.shape[2]} would exceed "
                             f"max_tokens={self.max_tokens}; start a new cache (see generate.py)")
        if self._k is not None and self._k.shape[0] != k.shape[0]:
            # The rows already cached belong to other sequences: mixing them would attend to garbage.
            raise ValueError(f"k: this cache holds a batch of {self._k.shape[0]} sequences, got a batch "
                             f"of {k.shape[0]}; start a new cache (model.new_cache()) for a new batch")
        if self._k is None:
            # Allocate once for the whole context: appending by torch.cat would copy
            # everything seen so far at every step.
            shape = (k.shape[0], k.shape[1], self.max_tokens, k.shape[3])
            self._k = k.new_empty(shape)
            self._v = v.new_empty(shape)
        self._k[:, :, self.length:new_length] = k
        self._v[:, :, self.length:new_length] = v
        self.length = new_length
        return self._k[:, :, :new_length], self._v[:, :, :new_length]   # (N, heads, length, head_dim)


def check_caches(cache: object, num_blocks: int) -> None:
    """A model's ``cache`` argument: None, or one KVCache per block, all at the same length."""
    if cache is None:
        return
    validate.expect(isinstance(cache, (list, tuple)) and all(isinstance(c, KVCache) for c in cache), "cache",
                    "a list of KVCache (from model.new_cache())", validate.describe(cache), TypeError)
    validate.expect(len(cache) == num_blocks, "cache", f"{num_blocks} KVCache objects (one per block)",
                    f"{len(cache)}; use model.new_cache()")
    lengths = [c.length for c in cache]
    validate.expect(len(set(lengths)) <= 1, "cache", "every block's cache to hold the same number of tokens",
                    f"lengths {lengths}; use a fresh model.new_cache()")


def check_model_input(idx: object, cache: object, *, vocab_size: int, max_tokens: int, num_blocks: int,
                      training: bool) -> int:
    """A language model's ``idx`` (N, L) of token ids and its ``cache``; the position of idx's first token."""
    validate.token_ids("idx", idx, dim=2)
    if not torch.compiler.is_compiling() and not (idx.is_cuda and training):
        # Reading the ids back waits for a GPU, so training on one checks its data once up front.
        validate.in_vocabulary("idx", idx, vocab_size)
    check_caches(cache, num_blocks)
    start = cache[0].length if cache else 0
    if start + idx.shape[1] > max_tokens:
        raise ValueError(f"idx: sequence of {start + idx.shape[1]} tokens is longer than max_tokens={max_tokens}; "
                         f"crop it to the last {max_tokens} tokens (idx[:, -{max_tokens}:])")
    return start


class MultiHeadMaskedAttention(nn.Module):
    """Causal self-attention with ``num_heads`` heads of size embed_dim // num_heads.

    Parameters ``query``, ``key``, ``value`` (embed_dim -> embed_dim) and ``proj``
    (the output projection); dropout on the attention weights and after ``proj``.
    ``fused=True`` runs ``F.scaled_dot_product_attention``; ``fused=False`` runs
    the same computation written out step by step with einsum.
    """

    def __init__(self, embed_dim: int, num_heads: int, max_tokens: int, dropout_rate: float = 0.0,
                 *, bias: bool = False, fused: bool = True):
        super().__init__()
        self.embed_dim = validate.positive_int("embed_dim", embed_dim)
        self.num_heads = validate.positive_int("num_heads", num_heads)
        self.max_tokens = validate.positive_int("max_tokens", max_tokens)
        validate.probability("dropout_rate", dropout_rate)
        validate.boolean("bias", bias)
        self.fused = validate.boolean("fused", fused)
        validate.divisor("num_heads", num_heads, embed_dim, f"embed_dim={embed_dim}", f"pick a divisor of {embed_dim}")
        self.head_dim = embed_dim // num_heads
        self.dropout_rate = dropout_rate
        self.query = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.key = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.value = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        # Not persistent: the mask is derived from max_tokens, not learned, so it
        # stays out of checkpoints and out of weight-for-weight conversions.
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)
        # Set record_weights = True to keep the last attention weights (for plots).
        self.record_weights = False
        self.attention_weights: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x (N, L, embed_dim) -> (N, L, embed_dim); with ``cache``, x holds only the new tokens."""
        validate.instance("cache", cache, KVCache, "a KVCache or None", or_none=True)
        start = cache.length if cache is not None else 0
        check_input(x, self.embed_dim, self.max_tokens, start, module=self)
        length = x.shape[1]
        total = start + length

        q = split_heads(self.query(x), self.num_heads)   # (N, heads, L, head_dim)
        k = split_heads(self.key(x), self.num_heads)     # (N, heads, L, head_dim)
        v = split_heads(self.value(x), self.num_heads)   # (N, heads, L, head_dim)
        if cache is not None:
            k, v = cache.append(k, v)          # (N, heads, total, head_dim)
        # Query i sits at position start + i and may see keys 0 .. start + i.
        mask = self.mask[start:total, :total]  # (L, total)

        if self.fused and not self.record_weights:
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=None if start == 0 or length == 1 else mask,
                is_causal=start == 0 and length > 1,
                dropout_p=self.dropout_rate if self.training else 0.0,
            )                                                                 # (N, heads, L, head_dim)
        else:
            # 1. compatibility of every query with every key, scaled so the logits
            #    keep unit variance whatever the head size
            scores = torch.einsum("nhqd,nhkd->nhqk", q, k) * self.head_dim ** -0.5   # (N, heads, L, total)
            # 2. the future gets -inf, so exactly zero weight after the softmax
            scores = scores.masked_fill(~mask, float("-inf"))
            # 3. one distribution over the keys per query
            weights = scores.softmax(dim=-1)
            if self.record_weights:
                self.attention_weights = weights.detach()
            weights = self.attn_dropout(weights)
            # 4. the weighted average of the values
            out = torch.einsum("nhqk,nhkd->nhqd", weights, v)                        # (N, heads, L, head_dim)

        return self.proj_dropout(self.proj(merge_heads(out)))   # (N, L, embed_dim)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, max_tokens={self.max_tokens}, "
                f"dropout_rate={self.dropout_rate}, fused={self.fused}")
