"""A trained ModernGPT on a stream longer than it was trained on, through a sliding window with or without sinks.

StreamingLLM (Xiao et al. 2023) generates with a cache that keeps the last ``window`` tokens and the first
``sinks``. What the model then computes is one forward in which every layer's attention is masked to exactly
those keys (:func:`course_lib.variants.sliding_window_mask`): each token's state in each layer is made from
states that were themselves made under the same mask, as they were when a :class:`RingKVCache` held them.
:func:`streaming_logits` runs that forward with :class:`SlidingWindowAttention` carrying each block's weights,
so a stream of any length fits (RoPE at absolute positions needs no table), and
:func:`first_position_share` measures how much attention the first position collects.
"""
from __future__ import annotations

import torch

from .. import _validate as validate
from ..modern import GroupedQueryAttention
from ..modern_gpt import ModernGPT
from .sliding import SlidingWindowAttention

__all__ = ["streaming_logits", "first_position_share"]


def _check_model(model: object) -> ModernGPT:
    if not isinstance(model, ModernGPT):
        raise TypeError(f"model: expected a course_lib.ModernGPT, got {validate.describe(model)}")
    c = model.config
    plain = (not c.hashed_ngrams and not c.ngram_prior and not c.qk_norm
             and all(type(block.attn) is GroupedQueryAttention for block in model.blocks)
             and c.head_dim == c.embed_dim // c.num_heads)
    if not plain:
        raise ValueError("model: expected a plain ModernGPT (grouped-query attention, head_dim = embed_dim // "
                         "num_heads, no qk_norm, no n-gram features), the layers a sliding window replaces; got "
                         f"{c}")
    return model


@torch.no_grad()
def streaming_logits(model: ModernGPT, idx: torch.Tensor, window: int, sinks: int = 0) -> torch.Tensor:
    """Logits (N, L, vocab_size) of ``model`` on ``idx`` (N, L) when every layer sees only the last ``window``
    tokens and the first ``sinks``: what generation with a ring-buffer cache of ``sinks + window`` slots gives.

    ``L`` may exceed ``model.config.max_tokens``. With ``window >= L`` it is the model's own causal forward.
    """
    model = _check_model(model)
    validate.token_ids("idx", idx, dim=2)
    validate.in_vocabulary("idx", idx, model.config.vocab_size)
    validate.positive_int("window", window)
    validate.non_negative_int("sinks", sinks)
    c = model.config
    was_training = model.training
    model.eval()
    try:
        x = model.token_embedding(idx)                                      # (N, L, embed_dim)
        for block in model.blocks:
            attn = SlidingWindowAttention(c.embed_dim, c.num_heads, window, sinks, num_kv_heads=c.num_kv_heads,
                                          rope_theta=c.rope_theta).to(x.device, x.dtype)
            attn.load_state_dict(block.attn.state_dict())                   # query, key, value, proj
            x = x + attn(block.attn_norm(x))                                # (N, L, embed_dim)
            x = x + block.mlp(block.mlp_norm(x))
        return model.head(model.norm_f(x))                                  # (N, L, vocab_size)
    finally:
        model.train(was_training)


@torch.no_grad()
def first_position_share(weights: torch.Tensor, skip: int = 1) -> torch.Tensor:
    """Per layer, the mean attention weight on key 0 of the queries from ``skip`` on.

    ``weights`` (num_layers, N, heads, L, L), as ``course_lib.heads.attention_patterns`` gives them. Query 0
    sees only key 0, so it is left out (``skip=1``); returns (num_layers,).
    """
    validate.tensor("weights", weights, dim=5, floating=True)
    length = weights.shape[-1]
    if weights.shape[-2] != length:
        raise ValueError(f"weights: expected square (..., L, L) attention maps, got shape {tuple(weights.shape)}")
    validate.non_negative_int("skip", skip)
    if skip >= length:
        raise ValueError(f"skip: expected fewer than L={length} queries left out, got {skip}")
    return weights[..., skip:, 0].mean(dim=(1, 2, 3))                       # (num_layers,)

