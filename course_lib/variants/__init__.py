"""Where attention is going (notebook 12): three ways to make generation's memory smaller.

- :mod:`.cache_size`: bytes per generated token in the KV cache, for MHA, GQA, MQA and MLA;
- :mod:`.sliding`: a window of ``w`` keys per query, attention sinks, and the ring-buffer KV cache
  whose memory stays flat however long the generation;
- :mod:`.streaming`: a trained ModernGPT on a long stream through a window with or without sinks;
- :mod:`.latent`: multi-head latent attention (DeepSeek-V2/V3): a cache of one small latent per token;
- :mod:`.linear`: linear attention (Katharopoulos et al. 2020): a state of fixed size instead of a cache.
"""
from .cache_size import ATTENTION_KINDS, kv_cache_bytes_per_token
from .latent import LatentCache, MultiHeadLatentAttention
from .linear import elu_feature_map, linear_attention, linear_attention_recurrent
from .sliding import RingKVCache, SlidingWindowAttention, rope_rows, sliding_window_mask, window_mask_at
from .streaming import first_position_share, streaming_logits

__all__ = [
    "ATTENTION_KINDS", "kv_cache_bytes_per_token",
    "LatentCache", "MultiHeadLatentAttention",
    "elu_feature_map", "linear_attention", "linear_attention_recurrent",
    "RingKVCache", "SlidingWindowAttention", "rope_rows", "sliding_window_mask", "window_mask_at",
    "first_position_share", "streaming_logits",
]
