"""Our ModernGPT next to Hugging Face Llama and Qwen 3, weight for weight: the name tables, the configs, whole models.

:func:`llama_weight_pairs` is the one table both directions read. :func:`from_hf_llama` loads a
``transformers.LlamaForCausalLM`` into a :class:`~course_lib.modern_gpt.ModernGPT` built from any
attention, norm and MLP classes with the reference's parameter names (a student's own, in notebook
09); :func:`to_hf_llama` goes back. Both give the same logits to float32 rounding.

Llama is one row of :data:`course_lib.hf.families.FAMILIES`: QK-norm goes to Qwen 3, a sliding window to
Mistral, the ReLU² MLP to Arcee (:func:`course_lib.hf.to_hf_modern` picks). Of Llama's options the course
model has no biases, only the plain (unscaled) RoPE and only SiLU: those are refused with a message.

``Qwen3ForCausalLM`` is Llama with an RMSNorm on each query and key head before RoPE (its weights
``self_attn.q_norm`` and ``k_norm`` are the course's ``attn.q_norm`` and ``attn.k_norm``, with the same
eps as the other norms), and, with ``use_sliding_window``, a sliding window: the course's
``ModernGPTConfig(qk_norm=True)`` with or without ``sliding_window``. The course model gives every layer
the same attention, so a Qwen 3 whose ``layer_types`` mix full and sliding layers is refused.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ..modern import GroupedQueryAttention, RMSNorm, SwiGLU
from ..modern_gpt import ModernGPT, ModernGPTConfig
from .families import (
    course_config_from_hf,
    family_named,
    from_hf_modern,
    hf_config_from_course,
    modern_weight_pairs,
    to_hf_modern,
)

# Public names: listed once, in course_lib.hf's __all__.

LLAMA = family_named("Llama")
QWEN3 = family_named("Qwen 3")


def llama_weight_pairs(num_layers: int) -> list[tuple[str, str]]:
    """(course name, Llama name) for every tensor of a model with ``num_layers`` blocks, in model order.

    Every tensor keeps its layout (both sides use nn.Linear, (out, in)): only the names differ.
    """
    return modern_weight_pairs(LLAMA, num_layers)


def course_config_from_llama(hf_config: LlamaConfig) -> ModernGPTConfig:
    """The ``ModernGPTConfig`` of a Llama architecture (refuses biases, scaled RoPE and activations
    other than SiLU, with a message naming the setting)."""
    return course_config_from_hf(LLAMA, hf_config, "hf_config")


def llama_config_from_course(config: ModernGPTConfig) -> LlamaConfig:
    """The ``LlamaConfig`` of a course ``ModernGPTConfig`` (refuses qk_norm, sliding_window, mlp='relu2',
    hashed_ngrams and ngram_prior)."""
    return hf_config_from_course(LLAMA, config, "config")


def from_hf_llama(model: LlamaForCausalLM, *,
                  attention_cls: Callable[..., nn.Module] = GroupedQueryAttention,
                  norm_cls: Callable[..., nn.Module] = RMSNorm,
                  mlp_cls: Callable[..., nn.Module] = SwiGLU,
                  max_tokens: int | None = None) -> ModernGPT:
    """A course ``ModernGPT`` computing the same logits as a ``transformers.LlamaForCausalLM``.

    Built from ``attention_cls``, ``norm_cls`` and ``mlp_cls`` (the references by default; a student's
    own classes with the same parameter names load the same weights). ``max_tokens`` (default: the
    model's ``max_position_embeddings``) sets the context, and with it the size of the RoPE tables and
    of the KV cache: a real Llama's 131072 positions are more than a course notebook needs.
    """
    return from_hf_modern(model, family=LLAMA, attention_cls=attention_cls, norm_cls=norm_cls, mlp_cls=mlp_cls,
                          max_tokens=max_tokens)


def to_hf_llama(ours: ModernGPT) -> LlamaForCausalLM:
    """A ``transformers.LlamaForCausalLM`` computing the same logits as the course ``ours``.

    Refuses a model Llama cannot express: ``qk_norm``, ``sliding_window``, ``mlp='relu2'``, ``hashed_ngrams`` or
    ``ngram_prior``.
    """
    return to_hf_modern(ours, family=LLAMA)


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
