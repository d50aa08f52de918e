r"""Multi-head latent attention (MLA), as in DeepSeek-V2 and V3.

Keys and values are not cached per head. Each token is projected *down* to one small latent
:math:`c = \mathrm{RMSNorm}(W^{DKV} x)` of ``kv_lora_rank`` numbers, and every head's key and value are
projected *up* from it (:math:`W^{UK} c`, :math:`W^{UV} c`). The cache keeps only :math:`c`.

RoPE cannot go through the latent: a rotation that depends on the key's position would sit between
:math:`W^{UK}` and the query and stop it from being folded away. So each head's query and key are split
into a part without position (``qk_nope_head_dim``, from the latent) and a small rotary part
(``qk_rope_head_dim``), whose key :math:`k^R = \mathrm{RoPE}(W^{KR} x)` is one vector *shared by all
heads* and cached beside the latent. The score of head ``h`` is
:math:`(q^{C}_h \cdot k^{C}_h + q^{R}_h \cdot k^R) \cdot \mathrm{scale}`, with
scale = ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.

The absorbed form (``absorb=True``) never builds the keys and values:
:math:`q^C_h \cdot (W^{UK}_h c) = (W^{UK\top}_h q^C_h) \cdot c`, so the query is moved into the latent
space once, the scores are taken against the cached latents directly, and :math:`W^{UV}_h` is applied to
the attention-weighted latent afterwards. Same outputs, less work per generated token.

Parameter names are Hugging Face DeepSeek-V3's, so its weights load unchanged both ways
(E = embed_dim, H = num_heads, dn, dr, dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim):

- ``q_a_proj`` (q_lora_rank, E), then ``q_a_layernorm``, then ``q_b_proj`` (H (dn + dr), q_lora_rank):
  the paper's :math:`W^{DQ}`, then :math:`W^{UQ}` and :math:`W^{QR}` side by side; or ``q_proj``
  (H (dn + dr), E) when ``q_lora_rank`` is None;
- ``kv_a_proj_with_mqa`` (kv_lora_rank + dr, E): :math:`W^{DKV}` and :math:`W^{KR}` stacked, then
  ``kv_a_layernorm`` on the latent part;
- ``kv_b_proj`` (H (dn + dv), kv_lora_rank): per head, :math:`W^{UK}_h` then :math:`W^{UV}_h`;
- ``o_proj`` (E, H dv): :math:`W^{O}`.

The two latent norms use ``norm_eps`` = 1e-6, as DeepSeek-V3's do (they do not read its ``rms_norm_eps``).

``rope_interleave=True`` (DeepSeek's checkpoints) pairs the rotary dimensions as (0, 1), (2, 3), ...; the
course's :func:`~course_lib.modern.apply_rotary` pairs ``i`` with ``i + d/2``, so the rotary part is first
reordered, evens then odds, and rotated in that layout (queries and keys alike: their dot product is the same).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate as validate
from ..attention import check_input, merge_heads
from ..modern import RMSNorm, apply_rotary, rope_tables

__all__ = ["LatentCache", "MultiHeadLatentAttention"]


class LatentCache:
    """What MLA keeps per token: the normalised latent (kv_lora_rank) and the shared rotary key (dr).

    ``append`` stores latent (N, L, kv_lora_rank) and k_rope (N, L, dr) and returns everything held so far.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = validate.positive_int("max_tokens", max_tokens)
        self.length = 0
        self._latent: torch.Tensor | None = None
        self._k_rope: torch.Tensor | None = None

    @property
    def latent(self) -> torch.Tensor | None:
        """The latents held, (N, length, kv_lora_rank), or None before the first append."""
        return None if self._latent is None else self._latent[:, :self.length]

    @property
    def k_rope(self) -> torch.Tensor | None:
        """The shared rotary keys held, (N, length, qk_rope_head_dim), already rotated, or None."""
        return None if self._k_rope is None else self._k_rope[:, :self.length]

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        validate.tensor("latent", latent, dim=3, floating=True)
        validate.tensor("k_rope", k_rope, dim=3, floating=True)
        if k_rope.shape[:2] != latent.shape[:2]:
            raise ValueError(f"k_rope: expected shape (N, L, dr) with (N, L) = {tuple(latent.shape[:2])} like "
                             f"latent, got {tuple(k_rope.shape)}")
        if self._latent is not None:
            held = (self._latent.shape[0], self._latent.shape[2], self._k_rope.shape[2], self._latent.dtype)
            given = (latent.shape[0], latent.shape[2], k_rope.shape[2], latent.dtype)
            if given != held:
                raise ValueError(f"latent, k_rope: this cache holds batch {held[0]}, latent size {held[1]}, rotary "
                                 f"size {held[2]}, {held[3]}; got {given}; start a new cache (layer.new_cache())")
        new_length = self.length + latent.shape[1]
        if new_length > self.max_tokens:
            raise ValueError(f"cache: holds {self.length} tokens, adding {latent.shape[1]} would exceed "
                             f"max_tokens={self.max_tokens}; start a new cache")
        if self._latent is None:
            # allocated once for the whole context, as KVCache does
            self._latent = latent.new_empty(latent.shape[0], self.max_tokens, latent.shape[2])
            self._k_rope = k_rope.new_empty(k_rope.shape[0], self.max_tokens, k_rope.shape[2])
        self._latent[:, self.length:new_length] = latent
        self._k_rope[:, self.length:new_length] = k_rope
        self.length = new_length
        return self._latent[:, :new_length], self._k_rope[:, :new_length]   # (N, T, r), (N, T, dr)


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA: x (N, L, embed_dim) -> (N, L, embed_dim), with an optional :class:`LatentCache`.

    ``q_lora_rank=None`` projects queries directly (``q_proj``, DeepSeek-V2-Lite); otherwise through a
    low-rank ``q_a_proj`` -> RMSNorm -> ``q_b_proj``. ``softmax_scale`` defaults to
    ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``. ``bias`` puts biases on ``q_a_proj``,
    ``kv_a_proj_with_mqa`` and ``o_proj``, as DeepSeek's ``attention_bias`` does.
    """

    def __init__(self, embed_dim: int, num_heads: int, max_tokens: int, *, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
                 rope_theta: float = 10000.0, rope_interleave: bool = True, norm_eps: float = 1e-6,
                 softmax_scale: float | None = None, bias: bool = False):
        super().__init__()
        self.embed_dim = validate.positive_int("embed_dim", embed_dim)
        self.num_heads = validate.positive_int("num_heads", num_heads)
        self.max_tokens = validate.positive_int("max_tokens", max_tokens)
        self.kv_lora_rank = validate.positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = validate.positive_int("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = validate.positive_int("qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = validate.positive_int("v_head_dim", v_head_dim)
        self.q_lora_rank = validate.positive_int_or_none("q_lora_rank", q_lora_rank)
        self.rope_theta = validate.finite_positive("rope_theta", rope_theta)
        norm_eps = validate.finite_positive("norm_eps", norm_eps)   # named here, not as RMSNorm's eps
        self.rope_interleave = validate.boolean("rope_interleave", rope_interleave)
        validate.boolean("bias", bias)
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number (RoPE turns pairs), got {qk_rope_head_dim}")
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale = self.qk_head_dim ** -0.5 if softmax_scale is None else \
            validate.positive_float("softmax_scale", softmax_scale, finite=True)
        h, dq = num_heads, self.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(embed_dim, h * dq, bias=False)
        else:
            self.q_a_proj = nn.Linear(embed_dim, self.q_lora_rank, bias=bias)          # W_DQ: down to the query latent
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * dq, bias=False)            # W_UQ and W_QR, per head
        self.kv_a_proj_with_mqa = nn.Linear(embed_dim, kv_lora_rank + qk_rope_head_dim, bias=bias)   # W_DKV; W_KR
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, h * (qk_nope_head_dim + v_head_dim), bias=False)   # W_UK; W_UV
        self.o_proj = nn.Linear(h * v_head_dim, embed_dim, bias=bias)
        cos, sin = rope_tables(qk_rope_head_dim, max_tokens, self.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)   # derived, so out of state dicts
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self) -> LatentCache:
        return LatentCache(self.max_tokens)

    def _rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """RoPE on the rotary part x (..., L, dr) at positions start.., in the course's half-split layout."""
        if self.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)   # pairs (0,1),(2,3).. -> (i, i + dr/2)
        return apply_rotary(x, self.rope_cos, self.rope_sin, offset=start)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, qk_nope_head_dim, kv_lora_rank) and W_UV (H, v_head_dim, kv_lora_rank), cut from kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, cache: LatentCache | None = None, *, absorb: bool = False) -> torch.Tensor:
        """x (N, L, embed_dim) -> (N, L, embed_dim); with ``cache``, x holds only the new tokens.

        ``absorb=True`` computes the same outputs with W_UK folded into the query and W_UV applied after.
        """
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(f"cache: expected a LatentCache or None, got {validate.describe(cache)}")
        validate.boolean("absorb", absorb)
        start = cache.length if cache is not None else 0
        check_input(x, self.embed_dim, self.max_tokens, start, module=self)
        n, length, _ = x.shape
        total = start + length
        dn, dr = self.qk_nope_head_dim, self.qk_rope_head_dim

        # 1. queries, per head: a part without position and a rotary part
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, length, self.num_heads, dn + dr).transpose(1, 2)   # (N, H, L, dn + dr)
        q_nope, q_rope = q.split([dn, dr], dim=-1)                        # (N, H, L, dn), (N, H, L, dr)
        q_rope = self._rotate(q_rope, start)

        # 2. what gets cached: the normalised latent, and one rotary key shared by every head
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, dr], dim=-1)   # (N, L, r), (N, L, dr)
        latent = self.kv_a_layernorm(latent)
        k_rope = self._rotate(k_rope, start)                              # (N, L, dr), at absolute positions
        if cache is not None:
            latent, k_rope = cache.append(latent, k_rope)                 # (N, T, r), (N, T, dr)

        # query at position start + i sees keys 0 .. start + i
        mask = torch.ones(total, total, dtype=torch.bool, device=x.device).tril()[start:total]   # (L, T)
        if not absorb:
            # 3a. up-project every cached latent to each head's key (nope part) and value
            kv = self.kv_b_proj(latent).view(n, total, self.num_heads, dn + self.v_head_dim).transpose(1, 2)
            k_nope, v = kv.split([dn, self.v_head_dim], dim=-1)           # (N, H, T, dn), (N, H, T, dv)
            k = torch.cat([k_nope, k_rope[:, None].expand(n, self.num_heads, total, dr)], dim=-1)   # (N, H, T, dn+dr)
            out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rope], dim=-1), k, v, attn_mask=mask,
                                                 scale=self.softmax_scale)   # (N, H, L, dv)
        else:
            # 3b. absorbed: q_nope . (W_UK c) = (W_UK^T q_nope) . c, so scores are taken against the latents
            w_uk, w_uv = self.up_projections()                           # (H, dn, r), (H, dv, r)
            q_latent = torch.einsum("nhld,hdr->nhlr", q_nope, w_uk)       # (N, H, L, r)
            scores = torch.einsum("nhlr,ntr->nhlt", q_latent, latent) \
                + torch.einsum("nhld,ntd->nhlt", q_rope, k_rope)          # (N, H, L, T)
            scores = (scores * self.softmax_scale).masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            out_latent = torch.einsum("nhlt,ntr->nhlr", weights, latent)  # (N, H, L, r)
            out = torch.einsum("nhlr,hvr->nhlv", out_latent, w_uv)        # (N, H, L, dv): W_UV after attention
        return self.o_proj(merge_heads(out))                              # (N, L, embed_dim)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"q_lora_rank={self.q_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
                f"rope_interleave={self.rope_interleave}")
