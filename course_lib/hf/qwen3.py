"""Our ModernGPT with QK-norm next to Hugging Face Qwen 3, weight for weight, both ways.

``Qwen3ForCausalLM`` is Llama with an RMSNorm on each query and key head before RoPE (its weights
``self_attn.q_norm`` and ``k_norm`` are the course's ``attn.q_norm`` and ``attn.k_norm``, with the same
eps as the other norms), and, with ``use_sliding_window``, a sliding window: the course's
``ModernGPTConfig(qk_norm=True)`` with or without ``sliding_window``. The course model gives every layer
the same attention, so a Qwen 3 whose ``layer_types`` mix full and sliding layers is refused.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from ..modern_gpt import ModernGPT, ModernGPTConfig
from .families import (
    course_config_from_hf,
    family_named,
    from_hf_modern,
    hf_config_from_course,
    modern_weight_pairs,
    to_hf_modern,
)

__all__ = ["qwen3_weight_pairs", "course_config_from_qwen3", "qwen3_config_from_course",
           "from_hf_qwen3", "to_hf_qwen3"]

QWEN3 = family_named("Qwen 3")


def qwen3_weight_pairs(num_layers: int) -> list[tuple[str, str]]:
    """(course name, Qwen 3 name) for every tensor of a model with ``num_layers`` blocks, in model order."""
    return modern_weight_pairs(QWEN3, num_layers)


def course_config_from_qwen3(hf_config: Qwen3Config) -> ModernGPTConfig:
    """The ``ModernGPTConfig`` (qk_norm=True) of a Qwen 3 architecture; refuses biases, scaled RoPE,
    activations other than SiLU and a mix of full and sliding layers, naming the setting."""
    return course_config_from_hf(QWEN3, hf_config, "hf_config")


def qwen3_config_from_course(config: ModernGPTConfig) -> Qwen3Config:
    """The ``Qwen3Config`` of a course ``ModernGPTConfig`` with qk_norm=True (refuses qk_norm=False,
    mlp='relu2', hashed_ngrams and ngram_prior)."""
    return hf_config_from_course(QWEN3, config, "config")


def from_hf_qwen3(model: Qwen3ForCausalLM, *, attention_cls: Callable[..., nn.Module] | None = None,
                  norm_cls: Callable[..., nn.Module] | None = None, mlp_cls: Callable[..., nn.Module] | None = None,
                  max_tokens: int | None = None) -> ModernGPT:
    """A course ``ModernGPT`` computing the same logits as a ``transformers.Qwen3ForCausalLM``.

    The parts default to the references; ``attention_cls`` must take ``qk_norm`` (and ``sliding_window``
    when the model has one). ``max_tokens`` (default: ``max_position_embeddings``) sets the context.
    """
    return from_hf_modern(model, family=QWEN3, attention_cls=attention_cls, norm_cls=norm_cls, mlp_cls=mlp_cls,
                          max_tokens=max_tokens)


def to_hf_qwen3(ours: ModernGPT) -> Qwen3ForCausalLM:
    """A ``transformers.Qwen3ForCausalLM`` computing the same logits as the course ``ours`` (qk_norm=True)."""
    return to_hf_modern(ours, family=QWEN3)
