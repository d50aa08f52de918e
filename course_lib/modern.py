"""The four changes between GPT-2's attention block and today's models (notebook 09).

Llama, Qwen, Mistral, Gemma and OLMo keep the attention of notebooks 01-04 and change four parts:

- **RoPE** (:func:`rope_tables`, :func:`apply_rotary`): no position vectors added to the tokens;
  each query and key is rotated by an angle proportional to its position, so their dot product
  depends only on the offset between them.
- **RMSNorm** (:class:`RMSNorm`): LayerNorm without the mean and the bias.
- **SwiGLU** (:class:`SwiGLU`): a gated feed-forward, ``down(silu(gate(x)) * up(x))``.
- **Grouped-query attention** (:class:`GroupedQueryAttention`): fewer key/value heads than query
  heads, each shared by a group of query heads, which shrinks the KV cache.

Conventions are Hugging Face Llama's, so its weights load unchanged (``course_lib.hf.llama``):
the rotation pairs dimension ``i`` with ``i + head_dim/2`` (the "half-split" layout), and query
head ``h`` reads key/value head ``h // groups``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _validate as validate
from .attention import KVCache, check_input, check_input_dtype, merge_heads, split_heads

__all__ = ["rope_tables", "rotate_half", "apply_rotary", "RMSNorm", "SwiGLU", "ReLUSquared",
           "repeat_kv", "sliding_window_mask", "GroupedQueryAttention"]


# ---------------------------------------------------------------- RoPE

def rope_tables(head_dim: int, max_tokens: int, theta: float = 10000.0, *,
                device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The cosines and sines RoPE rotates by: two ``(max_tokens, head_dim)`` tables.

    Pair ``i`` (dimensions ``i`` and ``i + head_dim/2``) turns at frequency
    :math:`\omega_i = \theta^{-2i/d}`, so position ``m`` is turned by the angle :math:`m\,\omega_i`.
    Each row holds the ``head_dim/2`` angles twice, once per half, as :func:`apply_rotary` reads them.
    """
    validate.positive_int("head_dim", head_dim)
    validate.positive_int("max_tokens", max_tokens)
    validate.expect(head_dim % 2 == 0, "head_dim", "an even number (RoPE turns pairs of dimensions)", head_dim)
    theta = validate.finite_positive("theta", theta, hint="Llama uses 10000.0 or 500000.0")
    if device is not None:
        validate.device("device", device)
    validate.floating_dtype("dtype", dtype, " (cosines and sines of angles)")
    pair = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim   # 2i/d, (head_dim/2,)
    frequencies = theta ** -pair                                                         # (head_dim/2,)
    positions = torch.arange(max_tokens, dtype=torch.float64, device=device)             # (max_tokens,)
    angles = torch.outer(positions, frequencies)                                         # (max_tokens, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)                                         # (max_tokens, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension: a quarter turn of every pair ``(i, i + d/2)``."""
    validate.tensor("x", x, min_dim=1)
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even last dimension (pairs i, i + d/2 turn together), got shape "
                         f"{tuple(x.shape)}")
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0) -> torch.Tensor:
    r"""Rotate queries or keys ``x`` (N, heads, L, head_dim) to their positions ``offset .. offset+L-1``.

    Each pair :math:`(x_i, x_{i+d/2})` at position ``m`` turns by :math:`m\,\omega_i`:
    :math:`x \cos(m\omega) + \mathrm{rotate\_half}(x) \sin(m\omega)`. With a KV cache, ``offset`` is the
    number of tokens already cached, so a new token gets its true position, not 0.
    """
    validate.tensor("x", x, min_dim=2, floating=True)
    validate.tensor("cos", cos, dim=2, floating=True)
    validate.tensor("sin", sin, dim=2, floating=True)
    offset = validate.non_negative_int("offset", offset)
    length, head_dim = x.shape[-2], x.shape[-1]
    validate.expect(cos.shape == sin.shape and cos.shape[1] == head_dim, "cos, sin", f"two (max_tokens, {head_dim}) "
                    f"tables for x of head_dim {head_dim}", f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if offset + length > cos.shape[0]:
        raise ValueError(f"offset: positions {offset}..{offset + length - 1} go past the tables' "
                         f"{cos.shape[0]} rows; build them with a larger max_tokens")
    cos = cos[offset:offset + length].to(x.dtype)   # (L, head_dim), broadcast over N and heads
    sin = sin[offset:offset + length].to(x.dtype)   # (L, head_dim)
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------- RMSNorm

class RMSNorm(nn.Module):
    r""":math:`y = x / \sqrt{\mathrm{mean}(x^2) + \epsilon} \cdot w`: LayerNorm without centring or bias.

    Computed in float32 for half-precision inputs (the mean of squares overflows in float16),
    then cast back, as Llama does; float64 stays float64.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = validate.positive_int("dim", dim)
        self.eps = validate.finite_positive("eps", eps, hint="Llama uses 1e-5 or 1e-6")
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        validate.tensor("x", x, min_dim=1, floating=True)
        validate.expect(x.shape[-1] == self.dim, "x", f"a last dimension of {self.dim}", f"shape {tuple(x.shape)}")
        # at least float32: the mean of squares overflows float16's range (float64 stays float64)
        wide = torch.promote_types(x.dtype, torch.float32)
        xw = x.to(wide)
        normed = xw * torch.rsqrt(xw.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(wide)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


# ---------------------------------------------------------------- feed-forward

class SwiGLU(nn.Module):
    r"""The gated feed-forward: :math:`W_{down}\,(\mathrm{SiLU}(W_{gate}\,x) \odot W_{up}\,x)`.

    The gate branch goes through SiLU and multiplies the plain ``up`` branch, element by element.
    """

    def __init__(self, embed_dim: int, hidden_dim: int):
        super().__init__()
        self.embed_dim = validate.positive_int("embed_dim", embed_dim)
        validate.positive_int("hidden_dim", hidden_dim)
        self.gate = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        validate.tensor("x", x, min_dim=1, floating=True)
        check_input_dtype("x", x, self)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected last dimension embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        return self.down(F.silu(self.gate(x)) * self.up(x))   # (N, L, embed_dim)


class ReLUSquared(nn.Module):
    r""":math:`W_{down}\,\mathrm{ReLU}(W_{up}\,x)^2`: the ungated feed-forward of the recent speed runs.

    Two matrices instead of SwiGLU's three, so at the same parameter count it is wider.
    """

    def __init__(self, embed_dim: int, hidden_dim: int):
        super().__init__()
        self.embed_dim = validate.positive_int("embed_dim", embed_dim)
        validate.positive_int("hidden_dim", hidden_dim)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, embed_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        validate.tensor("x", x, min_dim=1, floating=True)
        check_input_dtype("x", x, self)
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected last dimension embed_dim={self.embed_dim}, got shape {tuple(x.shape)}")
        return self.down(F.relu(self.up(x)).square())   # (N, L, embed_dim)


# ---------------------------------------------------------------- grouped-query attention

def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, kv_heads, L, head_dim) -> (N, kv_heads * groups, L, head_dim): each key/value head repeated
    ``groups`` times in a row, so query head ``h`` meets key/value head ``h // groups``.

    This is ``repeat_interleave`` on the head dimension; ``repeat`` (tiling the whole stack) would
    send query head ``h`` to key/value head ``h % kv_heads``, the wrong group.
    """
    validate.tensor("x", x, dim=4)
    groups = validate.positive_int("groups", groups)
    if groups == 1:
        return x
    n, kv_heads, length, head_dim = x.shape
    x = x[:, :, None].expand(n, kv_heads, groups, length, head_dim)   # (N, kv_heads, groups, L, head_dim)
    return x.reshape(n, kv_heads * groups, length, head_dim)           # (N, heads, L, head_dim)


def sliding_window_mask(length: int, window: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool (length, length): query ``i`` may see key ``j`` when ``0 <= i - j < window``.

    The causal mask of notebook 02 with a horizon: each token sees itself and the ``window - 1``
    tokens before it (Mistral, Gemma's local layers).
    """
    validate.positive_int("length", length)
    validate.positive_int("window", window)
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return (i - j >= 0) & (i - j < window)


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with RoPE and ``num_kv_heads`` key/value heads shared by ``num_heads`` queries.

    ``num_kv_heads == num_heads`` is multi-head attention (notebook 03); ``num_kv_heads == 1`` is
    multi-query attention. The KV cache keeps only the ``num_kv_heads`` heads, so it is
    ``num_heads / num_kv_heads`` times smaller than multi-head attention's.

    ``qk_norm`` normalises each query and key head (RMSNorm over ``head_dim``) before the rotation
    (Qwen 3, Gemma 3; OLMo 2 normalises the whole query and key vectors instead); ``sliding_window`` lets
    each token see only the last ``sliding_window`` tokens.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, max_tokens: int,
                 rope_theta: float = 10000.0, *, qk_norm: bool = False, sliding_window: int | None = None,
                 dropout_rate: float = 0.0, norm_eps: float = 1e-6, head_dim: int | None = None):
        super().__init__()
        validate.positive_int("embed_dim", embed_dim)
        validate.positive_int("num_heads", num_heads)
        validate.positive_int("num_kv_heads", num_kv_heads)
        validate.positive_int("max_tokens", max_tokens)
        validate.boolean("qk_norm", qk_norm)
        validate.positive_int_or_none("sliding_window", sliding_window)
        validate.probability("dropout_rate", dropout_rate)
        rope_theta = validate.finite_positive("rope_theta", rope_theta, hint="Llama uses 10000.0 or 500000.0")
        norm_eps = validate.finite_positive("norm_eps", norm_eps, hint="Llama uses 1e-5 or 1e-6")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads={num_heads} (each key/value head serves "
                             f"a whole group of query heads), got {num_kv_heads}")
        if head_dim is None:
            validate.divisor("num_heads", num_heads, embed_dim, f"embed_dim={embed_dim}", f"pick a divisor of {embed_dim}")
            head_dim = embed_dim // num_heads
        validate.positive_int("head_dim", head_dim)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.max_tokens = max_tokens
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window
        self.dropout_rate = dropout_rate
        self.query = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.key = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.value = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        cos, sin = rope_tables(head_dim, max_tokens, self.rope_theta)
        # Not persistent: derived from max_tokens and rope_theta, so out of checkpoints and conversions.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self) -> KVCache:
        return KVCache(self.max_tokens)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x (N, L, embed_dim) -> (N, L, embed_dim); with ``cache``, x holds only the new tokens."""
        validate.instance("cache", cache, KVCache, "a KVCache or None", or_none=True)
        start = cache.length if cache is not None else 0
        check_input(x, self.embed_dim, self.max_tokens, start, module=self)
        length = x.shape[1]
        total = start + length

        q = split_heads(self.query(x), self.num_heads)      # (N, heads, L, head_dim)
        k = split_heads(self.key(x), self.num_kv_heads)     # (N, kv_heads, L, head_dim)
        v = split_heads(self.value(x), self.num_kv_heads)   # (N, kv_heads, L, head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotate queries and keys (never the values) to their true positions start .. total-1.
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)                       # (N, kv_heads, total, head_dim)
        k = repeat_kv(k, self.groups)                       # (N, heads, total, head_dim)
        v = repeat_kv(v, self.groups)                       # (N, heads, total, head_dim)

        dropout = self.dropout_rate if self.training else 0.0
        if self.sliding_window is None and start == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=length > 1, dropout_p=dropout)
        else:
            # Query i sits at position start + i: it sees keys up to there (and not past the window).
            window = self.sliding_window or total
            mask = sliding_window_mask(total, window, device=x.device)[start:total]   # (L, total)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.proj(merge_heads(out))                  # (N, L, embed_dim)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, rope_theta={self.rope_theta:g}, "
                f"qk_norm={self.q_norm is not None}, sliding_window={self.sliding_window}")
