"""course_lib: the tested reference implementations behind the attention course notebooks."""
from . import _moved

# First, before the modules below load: the shim that keeps a student's notebook copy written before the
# classroom moved importing what it imported (`from course_lib import checks`); removed in the release
# after 2027-06-30. The course itself imports `from course_lib.classroom import checks`.
_moved.install()

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

# What `from course_lib import ...` offers: the pieces the notebooks build, by the names they teach.
__all__ = [
    "TOY_KEYS", "TOY_VALUES", "KVCache", "MaskedAttention", "MultiHeadMaskedAttention", "attention_weights",
    "causal_mask", "merge_heads", "scaled_dot_product_attention", "split_heads", "toy_attention",
    "GPT", "FeedForward", "GPTConfig", "LearnedPositionalEncoding", "SinusoidalPositionalEncoding",
    "TransformerBlock", "sinusoidal_table", "device", "set_seed", "setup_notebook", "__version__",
]

