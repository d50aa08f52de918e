"""course_lib: the tested reference implementations behind the attention course notebooks."""
from . import _moved
from .attention import (
    TOY_KEYS,
    TOY_VALUES,
    KVCache,
    MaskedAttention,
    MultiHeadMaskedAttention,
    attention_weights,
    causal_mask,
    merge_heads,
    scaled_dot_product_attention,
    split_heads,
    toy_attention,
)
from .model import (
    GPT,
    FeedForward,
    GPTConfig,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
    TransformerBlock,
    sinusoidal_table,
)
from .runtime import __version__, device, set_seed, setup_notebook

# `from course_lib import checks` (every notebook's first cell) and `capstone` (notebook 08) find the
# classroom through the same finder that keeps a student's older notebook copy importing what it imported;
# importing the reference alone never loads the classroom.
_moved.install()

# What `from course_lib import ...` offers: the pieces the notebooks build, by the names they teach.
__all__ = [
    "TOY_KEYS", "TOY_VALUES", "KVCache", "MaskedAttention", "MultiHeadMaskedAttention", "attention_weights",
    "causal_mask", "merge_heads", "scaled_dot_product_attention", "split_heads", "toy_attention",
    "GPT", "FeedForward", "GPTConfig", "LearnedPositionalEncoding", "SinusoidalPositionalEncoding",
    "TransformerBlock", "sinusoidal_table", "device", "set_seed", "setup_notebook", "__version__",
]

