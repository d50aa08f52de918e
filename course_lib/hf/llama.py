"""Our ModernGPT next to Hugging Face Llama, weight for weight: the name table, the configs, whole models.

:func:`llama_weight_pairs` is the one table both directions read. :func:`from_hf_llama` loads a
``transformers.LlamaForCausalLM`` into a :class:`~course_lib.modern_gpt.ModernGPT` built from any
attention, norm and MLP classes with the reference's parameter names (a student's own, in notebook
09); :func:`to_hf_llama` goes back. Both give the same logits to float32 rounding.

Llama has no counterpart for QK-norm, a sliding window or the ReLU² MLP; of Llama's options the course
model has no biases, only the plain (unscaled) RoPE and only SiLU: those are refused with a message.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from .. import _validate as validate
from .._rng import leaves_rng_alone
from ..modern import GroupedQueryAttention, RMSNorm, SwiGLU
from ..modern_gpt import ModernGPT, ModernGPTConfig

__all__ = ["llama_weight_pairs", "course_config_from_llama", "llama_config_from_course",
           "from_hf_llama", "to_hf_llama"]

# Course module name -> Llama module name, inside one block.
_BLOCK_NAMES = (
    ("attn.query", "self_attn.q_proj"),
    ("attn.key", "self_attn.k_proj"),
    ("attn.value", "self_attn.v_proj"),
    ("attn.proj", "self_attn.o_proj"),
    ("mlp.gate", "mlp.gate_proj"),
    ("mlp.up", "mlp.up_proj"),
    ("mlp.down", "mlp.down_proj"),
    ("attn_norm", "input_layernorm"),
    ("mlp_norm", "post_attention_layernorm"),
)


def llama_weight_pairs(num_layers: int) -> list[tuple[str, str]]:
    """(course name, Llama name) for every tensor of a model with ``num_layers`` blocks, in model order.

    Every tensor keeps its layout (both sides use nn.Linear, (out, in)): only the names differ.
    """
    validate.positive_int("num_layers", num_layers)
    pairs = [("token_embedding.weight", "model.embed_tokens.weight")]
    for i in range(num_layers):
        pairs += [(f"blocks.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight") for ours, theirs in _BLOCK_NAMES]
    pairs += [("norm_f.weight", "model.norm.weight"), ("head.weight", "lm_head.weight")]
    return pairs


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------

def _rope_theta(hf_config: LlamaConfig, name: str) -> float:
    # transformers 5 keeps RoPE's settings in config.rope_parameters; 4 had config.rope_theta/rope_scaling.
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{name}.rope_parameters: rope_type={rope_type!r} rescales RoPE's frequencies (Llama 3.1's "
                         f"'llama3', YaRN, linear or dynamic scaling stretch the context); the course's RoPE is the "
                         f"plain one, rope_type='default', so this model cannot be converted")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial is not None and partial != 1.0:
        raise ValueError(f"{name}.rope_parameters: partial_rotary_factor={partial} rotates only part of each "
                         f"head; the course's RoPE rotates all of head_dim (partial_rotary_factor=1.0)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return validate.positive_float(f"{name}.rope_parameters['rope_theta']", theta)


def _course_config(hf_config: Any, name: str, max_tokens: int | None = None) -> ModernGPTConfig:
    if not isinstance(hf_config, LlamaConfig):
        raise TypeError(f"{name}: expected a transformers.LlamaConfig, got {validate.describe(hf_config)}")
    c = hf_config
    refused = [
        (c.attention_bias, "attention_bias=True",
         "the course's attention projections have no bias (query, key, value, proj)"),
        (c.mlp_bias, "mlp_bias=True", "the course's SwiGLU has no bias (gate, up, down)"),
        (c.hidden_act != "silu", f"hidden_act={c.hidden_act!r}",
         "the course's SwiGLU gates with SiLU (hidden_act='silu')"),
    ]
    for bad, setting, why in refused:
        if bad:
            raise ValueError(f"{name}.{setting.split('=')[0]}: the course model cannot express {setting} "
                             f"({why}); only Llama's standard settings convert")
    theta = _rope_theta(c, name)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dropout = float(getattr(c, "attention_dropout", 0.0) or 0.0)
    if dropout:
        warnings.warn(f"{name}.attention_dropout={dropout}: the course model uses it as dropout_rate, which also "
                      f"drops each residual branch while training; outputs in eval mode are unaffected",
                      stacklevel=3)
    if max_tokens is None:
        max_tokens = c.max_position_embeddings
    return ModernGPTConfig(
        vocab_size=c.vocab_size,
        max_tokens=max_tokens,
        embed_dim=c.hidden_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        num_layers=c.num_hidden_layers,
        hidden_dim=c.intermediate_size,
        mlp="swiglu",
        rope_theta=theta,
        norm_eps=float(c.rms_norm_eps),
        tie_weights=bool(c.tie_word_embeddings),
        dropout_rate=dropout,
        head_dim=head_dim,
    )


def course_config_from_llama(hf_config: LlamaConfig) -> ModernGPTConfig:
    """The ``ModernGPTConfig`` of a Llama architecture (refuses biases, scaled RoPE and activations
    other than SiLU, with a message naming the setting)."""
    return _course_config(hf_config, "hf_config")


def _llama_config(config: Any, name: str) -> LlamaConfig:
    if not isinstance(config, ModernGPTConfig):
        raise TypeError(f"{name}: expected a course_lib ModernGPTConfig, got {validate.describe(config)}")
    refused = [
        (config.qk_norm, "qk_norm", "True", "Llama has no QK-norm (Qwen 3 and OLMo 2 have it)"),
        (config.sliding_window is not None, "sliding_window", repr(config.sliding_window),
         "Llama attends to the whole context (Mistral has a sliding window)"),
        (config.mlp != "swiglu", "mlp", repr(config.mlp), "Llama's MLP is SwiGLU (mlp='swiglu')"),
        (config.hashed_ngrams != 0, "hashed_ngrams", repr(config.hashed_ngrams),
         "Llama embeds each token alone, with no n-gram tables"),
        (config.ngram_prior != 0, "ngram_prior", repr(config.ngram_prior),
         "Llama's logits come from the network alone, with no counted n-gram model"),
    ]
    for bad, field, value, why in refused:
        if bad:
            raise ValueError(f"{name}.{field}: a Llama cannot express {field}={value} ({why}); only a ModernGPT "
                             f"with qk_norm=False, sliding_window=None, mlp='swiglu', hashed_ngrams=0, ngram_prior=0 converts")
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.embed_dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_tokens,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_weights,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=config.dropout_rate,
        # Llama's defaults (1, 2) are ids of Meta's tokenizer: meaningless for ours.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def llama_config_from_course(config: ModernGPTConfig) -> LlamaConfig:
    """The ``LlamaConfig`` of a course ``ModernGPTConfig`` (refuses qk_norm, sliding_window, mlp='relu2',
    hashed_ngrams and ngram_prior)."""
    return _llama_config(config, "config")


# ---------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------

def _part_argument(course_name: str) -> str:
    """Which class argument of from_hf_llama built the module holding ``course_name``."""
    if ".attn." in course_name:
        return "attention_cls"
    if ".mlp." in course_name:
        return "mlp_cls"
    if "norm" in course_name:
        return "norm_cls"
    return "model"


def _parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    # Every name, a tied head's included: state_dict's view, without persistent buffers.
    return dict(module.named_parameters(remove_duplicate=False))


def _copy_weights(target: nn.Module, source: dict[str, torch.Tensor], names: dict[str, str],
                  blame: Callable[[str], str], what: str) -> None:
    """Copy ``source[names[t]]`` into each parameter ``t`` of ``target``, refusing any mismatch by name."""
    params = _parameters(target)
    for name, param in params.items():
        if name not in names:
            raise ValueError(f"{blame(name)}: the model built has a parameter {name!r} with no counterpart in "
                             f"{what}; the parts must use the reference's names (query, key, value, proj; "
                             f"gate, up, down; weight) and no biases")
        given = source[names[name]]
        if tuple(given.shape) != tuple(param.shape):
            raise ValueError(f"{blame(name)}: parameter {name!r} has shape {tuple(param.shape)}, but {what}'s "
                             f"{names[name]!r} has shape {tuple(given.shape)}")
    unused = [ours for ours in names if ours not in params]
    if unused:
        raise ValueError(f"{blame(unused[0])}: the model built has no parameter {unused[0]!r} to hold {what}'s "
                         f"{names[unused[0]]!r} ({len(unused)} missing in all); the parts must use the "
                         f"reference's names (query, key, value, proj; gate, up, down; weight)")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(source[names[name]])


def _first_parameter(module: nn.Module) -> torch.Tensor:
    return next(module.parameters())


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
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
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"model: expected a transformers.LlamaForCausalLM, got {validate.describe(model)}")
    if max_tokens is not None:
        validate.positive_int("max_tokens", max_tokens)
    config = _course_config(model.config, "model.config", max_tokens)
    reference = _first_parameter(model)
    ours = ModernGPT(config, attention_cls=attention_cls, norm_cls=norm_cls, mlp_cls=mlp_cls)
    ours = ours.to(device=reference.device, dtype=reference.dtype)
    source = model.state_dict()
    names = dict(llama_weight_pairs(config.num_layers))
    if config.tie_weights and "lm_head.weight" not in source:
        source["lm_head.weight"] = source["model.embed_tokens.weight"]
    _copy_weights(ours, source, names, _part_argument, "the Llama")
    return ours.train(model.training)


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
def to_hf_llama(ours: ModernGPT) -> LlamaForCausalLM:
    """A ``transformers.LlamaForCausalLM`` computing the same logits as the course ``ours``.

    Refuses a model Llama cannot express: ``qk_norm``, ``sliding_window``, ``mlp='relu2'``, ``hashed_ngrams`` or
    ``ngram_prior``.
    """
    if not isinstance(ours, ModernGPT):
        raise TypeError(f"ours: expected a course_lib ModernGPT, got {validate.describe(ours)}")
    hf_config = _llama_config(ours.config, "ours.config")
    reference = _first_parameter(ours)
    hf_model = LlamaForCausalLM(hf_config).to(device=reference.device, dtype=reference.dtype)
    source = {name: p.detach() for name, p in _parameters(ours).items()}
    names = {theirs: mine for mine, theirs in llama_weight_pairs(ours.config.num_layers)}
    if hf_config.tie_word_embeddings and "head.weight" not in source:
        source["head.weight"] = source["token_embedding.weight"]
    missing = [mine for mine in names.values() if mine not in source]
    if missing:
        raise ValueError(f"ours: has no parameter {missing[0]!r} ({len(missing)} missing in all); a Llama needs "
                         f"the reference's names (query, key, value, proj; gate, up, down; weight)")
    extra = [mine for mine in source if mine not in names.values()]
    if extra:
        raise ValueError(f"ours: parameter {extra[0]!r} has no counterpart in a Llama; only the reference's "
                         f"parts without biases convert")
    _copy_weights(hf_model, source, names, lambda name: "ours", "the course model")
    if hf_config.tie_word_embeddings and hf_model.lm_head.weight is not hf_model.model.embed_tokens.weight:
        raise RuntimeError("to_hf_llama: transformers did not tie lm_head.weight to model.embed_tokens.weight")
    return hf_model.train(ours.training)
