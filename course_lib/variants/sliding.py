"""Sliding-window attention, attention sinks, and the ring-buffer KV cache that keeps memory flat.

A window of ``w`` keys per query: query ``i`` sees key ``j`` when ``0 <= i - j < w``, that is itself
and the ``w - 1`` tokens before it (Mistral's and Gemma's local layers). With ``sinks = s`` it also
sees the first ``s`` positions of the stream, however far back (StreamingLLM, Xiao et al. 2023: the
first tokens collect attention that has nowhere else to go, and dropping them breaks the model).

Generation with such a mask never needs a key older than ``w`` tokens, except the sinks, so
:class:`RingKVCache` keeps ``sinks + window`` slots and overwrites the oldest: its memory is the same
after ten tokens and after a million. Rotary embeddings are applied with each token's absolute
position *before* its key enters the cache, so a key rotated once stays right wherever it is stored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate as validate
from ..attention import check_input_dtype, merge_heads, split_heads
from ..modern import apply_rotary, repeat_kv
from ..modern import sliding_window_mask as _window_only

__all__ = ["sliding_window_mask", "window_mask_at", "rope_rows", "RingKVCache", "SlidingWindowAttention"]


def window_mask_at(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int,
                   sinks: int = 0) -> torch.Tensor:
    """Bool (Lq, Lk) from absolute positions: a query at ``p`` sees a key at ``j`` when ``j <= p`` and
    ``p - j < window`` or ``j < sinks``. Positions need not be sorted (a ring buffer's are not)."""
    for name, positions in (("query_positions", query_positions), ("key_positions", key_positions)):
        validate.tensor(name, positions, dim=1)
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise TypeError(f"{name}: expected integer positions (torch.long), got dtype {positions.dtype}")
    validate.positive_int("window", window)
    validate.non_negative_int("sinks", sinks)
    p = query_positions[:, None]   # (Lq, 1)
    j = key_positions[None, :]     # (1, Lk)
    return (j <= p) & ((p - j < window) | (j < sinks))   # (Lq, Lk)


def sliding_window_mask(length: int, window: int, sinks: int = 0, *,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Bool (length, length), True = may attend: query ``i`` sees key ``j`` when ``0 <= i - j < window``
    (itself and the ``window - 1`` tokens before it), and also when ``j < sinks`` and ``j <= i``.

    ``window >= length`` gives the causal mask of notebook 02; ``sinks=0`` is ``course_lib.modern``'s mask.
    """
    validate.positive_int("length", length)
    validate.positive_int("window", window)
    validate.non_negative_int("sinks", sinks)
    mask = _window_only(length, window, device=device)   # (length, length)
    if sinks:
        mask[:, :sinks] |= torch.ones(length, min(sinks, length), dtype=torch.bool, device=device).tril()
    return mask


def rope_rows(head_dim: int, start: int, length: int, theta: float = 10000.0, *,
              device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start .. start+length-1`` of ``rope_tables(head_dim, ...)``, computed without the rows before.

    The same float64 angles as :func:`course_lib.modern.rope_tables`, so a stream of any length needs no
    table as long as the stream.
    """
    validate.positive_int("head_dim", head_dim)
    validate.non_negative_int("start", start)
    validate.positive_int("length", length)
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even number (RoPE turns pairs of dimensions), got {head_dim}")
    theta = validate.finite_positive("theta", theta)
    if device is not None:
        validate.device("device", device)
    validate.floating_dtype("dtype", dtype, " (cosines and sines of angles)")
    pair = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim        # (head_dim/2,)
    positions = torch.arange(start, start + length, dtype=torch.float64, device=device)      # (length,)
    angles = torch.outer(positions, theta ** -pair)                                          # (length, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)                                             # (length, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RingKVCache:
    """A KV cache of ``sinks + window`` slots: the first ``sinks`` positions stay, the rest is a ring.

    Position ``p >= sinks`` lives in slot ``sinks + (p - sinks) % window``, overwriting the position
    ``window`` before it, which no later query can see. ``positions`` says which absolute position each
    slot holds (-1 for an empty slot), so the mask is built from positions, not from slot order.
    """

    def __init__(self, window: int, sinks: int = 0):
        self.window = validate.positive_int("window", window)
        self.sinks = validate.non_negative_int("sinks", sinks)
        self.capacity = window + sinks
        self.length = 0   # tokens seen so far: the absolute position of the next one
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.positions = torch.full((self.capacity,), -1, dtype=torch.long)

    def slot(self, position: int) -> int:
        """The slot that holds absolute ``position``."""
        position = validate.non_negative_int("position", position)
        return position if position < self.sinks else self.sinks + (position - self.sinks) % self.window

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v (N, heads, L, head_dim) of the next L positions.

        Returns the keys and values the new queries may need, with their absolute positions:
        what the ring held before this call, then the L new ones, (N, heads, held + L, head_dim) and
        (held + L,). The new ones are returned whole even when L > window, because the first new
        queries still see keys that the last new ones push out of the ring.
        """
        validate.tensor("k", k, dim=4, floating=True)
        validate.tensor("v", v, dim=4, floating=True)
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"v: expected shape (N, heads, L, ...) = {tuple(k.shape[:3])} like k, got {tuple(v.shape)}")
        if v.dtype != k.dtype:
            raise TypeError(f"v: expected dtype {k.dtype} (the dtype of k), got {v.dtype}")
        if v.device != k.device:
            raise ValueError(f"v: expected a tensor on {k.device} (the device of k), got {v.device}")
        if self._k is None:
            # allocated once: the cache never grows, however long the stream
            self._k = k.new_zeros(k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self._v = v.new_zeros(v.shape[0], v.shape[1], self.capacity, v.shape[3])
            self.positions = self.positions.to(k.device)
        else:
            held = (self._k.shape[:2], self._k.shape[3], self._v.shape[3], self._k.dtype, self._k.device)
            given = (k.shape[:2], k.shape[3], v.shape[3], k.dtype, k.device)
            if given != held:
                raise ValueError(f"k, v: this cache holds (N, heads) {tuple(held[0])}, key size {held[1]}, value "
                                 f"size {held[2]}, {held[3]} on {held[4]}; got {tuple(given[0])}, {given[1]}, "
                                 f"{given[2]}, {given[3]} on {given[4]}; use a fresh cache for another layer or batch")
        length = k.shape[2]
        full = self.positions >= 0                                              # (capacity,) slots in use
        new_positions = torch.arange(self.length, self.length + length, device=self.positions.device)
        keys = torch.cat([self._k[:, :, full], k], dim=2)                       # (N, heads, held + L, head_dim)
        values = torch.cat([self._v[:, :, full], v], dim=2)                     # (N, heads, held + L, v_dim)
        positions = torch.cat([self.positions[full], new_positions])            # (held + L,)
        # Write the new positions into their slots; only the last `window` non-sink ones survive,
        # so write only those (a later write to the same slot would overwrite an earlier one anyway).
        for i, position in enumerate(new_positions.tolist()):
            if position < self.sinks or position >= self.length + length - self.window:
                slot = self.slot(position)
                self._k[:, :, slot] = k[:, :, i]
                self._v[:, :, slot] = v[:, :, i]
                self.positions[slot] = position
        self.length += length
        return keys, values, positions

    def nbytes(self) -> int:
        """Bytes the cache holds for keys and values (0 before the first append)."""
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


class SlidingWindowAttention(nn.Module):
    """Causal self-attention with RoPE where each token sees the last ``window`` tokens and the first ``sinks``.

    Parameters ``query``, ``key``, ``value`` and ``proj`` as in ``GroupedQueryAttention`` (so its weights
    load unchanged). With a :class:`RingKVCache`, ``x`` holds only the new tokens and the output equals the
    full forward's on the same positions.
    """

    def __init__(self, embed_dim: int, num_heads: int, window: int, sinks: int = 0, *,
                 num_kv_heads: int | None = None, rope_theta: float = 10000.0):
        super().__init__()
        validate.positive_int("embed_dim", embed_dim)
        validate.positive_int("num_heads", num_heads)
        self.window = validate.positive_int("window", window)
        self.sinks = validate.non_negative_int("sinks", sinks)
        num_kv_heads = num_heads if num_kv_heads is None else validate.positive_int("num_kv_heads", num_kv_heads)
        if embed_dim % num_heads:
            raise ValueError(f"num_heads: embed_dim={embed_dim} must be divisible by num_heads, got {num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads={num_heads}, got {num_kv_heads}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        if self.head_dim % 2:
            raise ValueError(f"num_heads: head_dim = embed_dim // num_heads must be even for RoPE, got {self.head_dim}")
        self.rope_theta = validate.finite_positive("rope_theta", rope_theta)
        self.query = nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.key = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.value = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=False)

    def new_cache(self) -> RingKVCache:
        return RingKVCache(self.window, self.sinks)

    def forward(self, x: torch.Tensor, cache: RingKVCache | None = None) -> torch.Tensor:
        """x (N, L, embed_dim) -> (N, L, embed_dim); with ``cache``, x holds only the new tokens."""
        if cache is not None and not isinstance(cache, RingKVCache):
            raise TypeError(f"cache: expected a RingKVCache or None, got {validate.describe(cache)}")
        if cache is not None and (cache.window, cache.sinks) != (self.window, self.sinks):
            raise ValueError(f"cache: expected window={self.window}, sinks={self.sinks} like this layer, got "
                             f"window={cache.window}, sinks={cache.sinks}; use layer.new_cache()")
        validate.tensor("x", x, dim=3, floating=True)
        check_input_dtype("x", x, self)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected last dimension embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        start = cache.length if cache is not None else 0
        length = x.shape[1]

        q = split_heads(self.query(x), self.num_heads)      # (N, heads, L, head_dim)
        k = split_heads(self.key(x), self.num_kv_heads)     # (N, kv_heads, L, head_dim)
        v = split_heads(self.value(x), self.num_kv_heads)   # (N, kv_heads, L, head_dim)
        # 1. rotate to the absolute positions start .. start+L-1, before anything is cached
        cos, sin = rope_rows(self.head_dim, start, length, self.rope_theta, device=x.device, dtype=x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # 2. the keys this chunk may need, and where each one stands in the stream
        if cache is not None:
            k, v, key_positions = cache.append(k, v)        # (N, kv_heads, held + L, head_dim), (held + L,)
        else:
            key_positions = torch.arange(length, device=x.device)
        query_positions = torch.arange(start, start + length, device=x.device)
        # 3. the window (and sinks) from positions, since a ring buffer's slots are not in order
        mask = window_mask_at(query_positions, key_positions.to(x.device), self.window, self.sinks)   # (L, keys)
        groups = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)
        return self.proj(merge_heads(out))                  # (N, L, embed_dim)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"window={self.window}, sinks={self.sinks}, rope_theta={self.rope_theta:g}")
