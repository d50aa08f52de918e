"""course_lib: the tested reference implementations behind the attention course notebooks."""
from .attention import (TOY_KEYS, TOY_VALUES, KVCache, MaskedAttention, MultiHeadMaskedAttention, attention_weights, merge_heads, split_heads,
                        causal_mask, scaled_dot_product_attention, toy_attention)
from .model import (GPT, FeedForward, GPTConfig, LearnedPositionalEncoding,
                    SinusoidalPositionalEncoding, TransformerBlock, sinusoidal_table)
from .runtime import device, set_seed, setup_notebook

__version__ = "0.1.0"
