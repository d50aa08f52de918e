"""Checkers for notebooks 04-07 (blocks, GPT, training, sampling, KV cache, Hugging Face).

Each group of checkers lives in a private module next to this one (``_model_*.py``);
this module gathers them for ``course_lib.checks``. References are imported inside
each checker, so the package imports even where an optional piece is missing.
"""
from ._model_arch import check_gpt, check_transformer_block
from ._model_flops import check_flops_per_token
from ._model_generation import check_kv_cache
from ._model_hf import check_hf_attention, check_split_c_attn
from ._model_positions import check_sinusoidal_table
from ._model_sampling import check_sampling
from ._model_training import check_lm_loss, check_lm_windows, check_train_step

__all__ = [
    "check_sinusoidal_table", "check_transformer_block", "check_gpt",
    "check_lm_windows", "check_lm_loss", "check_train_step", "check_sampling",
    "check_kv_cache", "check_flops_per_token", "check_split_c_attn", "check_hf_attention",
]
