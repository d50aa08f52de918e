"""Which transformers decoder holds which ModernGPT, weight for weight, both ways.

Five Hugging Face architectures are the course's :class:`~course_lib.modern_gpt.ModernGPT` with a
different set of its options; each has the same pre-norm blocks, RMSNorm, plain RoPE and no biases:

=================================================  ===========================================
ModernGPT                                          transformers
=================================================  ===========================================
mlp='swiglu', no QK-norm, no window                Llama (``LlamaForCausalLM``)
mlp='swiglu', no QK-norm, ``sliding_window``       Mistral (``MistralForCausalLM``)
mlp='swiglu', ``qk_norm=True``, window or not      Qwen 3 (``Qwen3ForCausalLM``)
mlp='relu2', no QK-norm, no window                 Arcee (``ArceeForCausalLM``, ``hidden_act='relu2'``)
mlp='relu2', ``qk_norm=True``, no window           Apertus (``ApertusForCausalLM``, ``hidden_act='relu2'``)
=================================================  ===========================================

:data:`FAMILIES` is that table; :func:`family_for` reads it for a config, :func:`to_hf_modern` and
:func:`from_hf_modern` convert whole models through it (``course_lib.hf.llama`` and ``.qwen3`` name two
rows). No architecture adds hashed n-gram tables or a counted n-gram model to a transformer, and none
has both the ungated ReLU² feed-forward and a sliding window: those are refused with one line.

Conventions checked against the installed transformers: Qwen 3 normalises each query and key head
(RMSNorm over head_dim, eps ``rms_norm_eps``) before RoPE, as ``GroupedQueryAttention(qk_norm=True)``
does; a sliding window of ``w`` lets query ``i`` see keys ``j`` with ``i - w < j <= i`` (the token itself
and the ``w - 1`` before it) in transformers' masks and in :func:`course_lib.modern.sliding_window_mask`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    ApertusConfig,
    ApertusForCausalLM,
    ArceeConfig,
    ArceeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from .. import _validate as validate
from .._rng import leaves_rng_alone
from ..modern_gpt import ModernGPT, ModernGPTConfig

__all__ = ["Family", "FAMILIES", "family_named", "family_for", "modern_weight_pairs", "hf_config_from_course",
           "course_config_from_hf", "to_hf_modern", "from_hf_modern"]


@dataclass(frozen=True)
class Family:
    """One transformers architecture and the ModernGPT options it expresses."""

    name: str                      # as a reader says it: "Qwen 3"
    model_class: type[PreTrainedModel]
    config_class: type
    mlp: str                       # "swiglu" (gate, up, down) or "relu2" (up, down)
    qk_norm: bool                  # q_norm and k_norm always there (True) or never (False)
    window: bool                   # whether it can hold a sliding window
    norm_names: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")

    @property
    def label(self) -> str:
        """'Qwen 3 (Qwen3ForCausalLM)': what the command line prints."""
        return f"{self.name} ({self.model_class.__name__})"


FAMILIES: tuple[Family, ...] = (
    Family("Llama", LlamaForCausalLM, LlamaConfig, "swiglu", qk_norm=False, window=False),
    Family("Mistral", MistralForCausalLM, MistralConfig, "swiglu", qk_norm=False, window=True),
    Family("Qwen 3", Qwen3ForCausalLM, Qwen3Config, "swiglu", qk_norm=True, window=True),
    Family("Arcee", ArceeForCausalLM, ArceeConfig, "relu2", qk_norm=False, window=False),
    Family("Apertus", ApertusForCausalLM, ApertusConfig, "relu2", qk_norm=True, window=False,
           norm_names=("attention_layernorm", "feedforward_layernorm")),
)

# What a course model can never take to transformers, whichever family: (field, what it is).
_NOWHERE = (
    ("hashed_ngrams", "hashed n-gram embedding tables added to the token's own"),
    ("ngram_prior", "a counted n-gram model added to the logits"),
)


def family_named(name: str) -> Family:
    """The row of :data:`FAMILIES` called ``name`` ("Llama", "Mistral", "Qwen 3", "Arcee", "Apertus")."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"name: expected one of {[f.name for f in FAMILIES]}, got {name!r}")


def _which_converts() -> str:
    return ("mlp='swiglu' converts as Llama, as Mistral with a sliding_window, as Qwen 3 with qk_norm=True; "
            "mlp='relu2' as Arcee, or as Apertus with qk_norm=True, without a window")


def family_for(config: ModernGPTConfig, name: str = "config") -> Family:
    """The family that expresses ``config`` exactly, or ValueError naming the setting none has (one line).

    QK-norm picks Qwen 3 (or Apertus for ReLU²), a sliding window Mistral (or Qwen 3 with QK-norm),
    ReLU² Arcee (or Apertus); the rest is Llama.
    """
    if not isinstance(config, ModernGPTConfig):
        raise TypeError(f"{name}: expected a course_lib ModernGPTConfig, got {validate.describe(config)}")
    for field, what in _NOWHERE:
        if getattr(config, field):
            raise ValueError(f"{name}.{field}: no transformers architecture can express {field}="
                             f"{getattr(config, field)!r} ({what}); only a ModernGPT with hashed_ngrams=0 and "
                             f"ngram_prior=0 converts: {_which_converts()}")
    window = config.sliding_window is not None
    if config.mlp == "swiglu":
        return family_named("Qwen 3" if config.qk_norm else "Mistral" if window else "Llama")
    if window:
        raise ValueError(f"{name}.sliding_window: no transformers architecture has both mlp='relu2' (an ungated "
                         f"ReLU² feed-forward) and sliding_window={config.sliding_window!r}; {_which_converts()}")
    return family_named("Apertus" if config.qk_norm else "Arcee")


def modern_weight_pairs(family: Family, num_layers: int) -> list[tuple[str, str]]:
    """(course name, transformers name) for every tensor of a ``family`` model with ``num_layers`` blocks.

    Every tensor keeps its layout (both sides use nn.Linear, (out, in)): only the names differ.
    """
    if not isinstance(family, Family):
        raise TypeError(f"family: expected a row of course_lib.hf.FAMILIES, got {validate.describe(family)}")
    validate.positive_int("num_layers", num_layers)
    block = [("attn.query", "self_attn.q_proj"), ("attn.key", "self_attn.k_proj"),
             ("attn.value", "self_attn.v_proj"), ("attn.proj", "self_attn.o_proj")]
    if family.qk_norm:
        block += [("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")]
    if family.mlp == "swiglu":
        block += [("mlp.gate", "mlp.gate_proj")]
    block += [("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"),
              ("attn_norm", family.norm_names[0]), ("mlp_norm", family.norm_names[1])]
    pairs = [("token_embedding.weight", "model.embed_tokens.weight")]
    for i in range(num_layers):
        pairs += [(f"blocks.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight") for ours, theirs in block]
    pairs += [("norm_f.weight", "model.norm.weight"), ("head.weight", "lm_head.weight")]
    return pairs


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------

def _activation(family: Family) -> str:
    return "silu" if family.mlp == "swiglu" else "relu2"


def _what_converts(family: Family) -> str:
    window = "a sliding_window or none" if family.window else "sliding_window=None"
    return (f"only a ModernGPT with qk_norm={family.qk_norm}, {window}, mlp={family.mlp!r}, hashed_ngrams=0, "
            f"ngram_prior=0 converts to {family.name}")


def _elsewhere(config: ModernGPTConfig) -> str:
    """Which family expresses the model a family refused (or that none does), for the message."""
    try:
        return f"this model converts as {family_for(config).name}"
    except ValueError:
        return "no transformers architecture expresses this model"


def hf_config_from_course(family: Family, config: ModernGPTConfig, name: str = "config") -> Any:
    """The transformers config of ``family`` for a course ``ModernGPTConfig``; ValueError (one line) for a
    setting the family cannot express."""
    if not isinstance(family, Family):
        raise TypeError(f"family: expected a row of course_lib.hf.FAMILIES, got {validate.describe(family)}")
    if not isinstance(config, ModernGPTConfig):
        raise TypeError(f"{name}: expected a course_lib ModernGPTConfig, got {validate.describe(config)}")
    article = "an" if family.name[0] in "AEIOU" else "a"
    refused = [
        (config.qk_norm != family.qk_norm, "qk_norm", repr(config.qk_norm),
         f"{family.name} {'always normalises' if family.qk_norm else 'has no norm on'} each query and key head"),
        (config.sliding_window is not None and not family.window, "sliding_window", repr(config.sliding_window),
         f"{family.name} attends to the whole context"),
        (config.mlp != family.mlp, "mlp", repr(config.mlp),
         f"{family.name}'s MLP is " + ("SwiGLU (mlp='swiglu')" if family.mlp == "swiglu"
                                       else "the ungated ReLU² (mlp='relu2')")),
        (config.hashed_ngrams != 0, "hashed_ngrams", repr(config.hashed_ngrams),
         f"{family.name} embeds each token alone, with no n-gram tables"),
        (config.ngram_prior != 0, "ngram_prior", repr(config.ngram_prior),
         f"{family.name}'s logits come from the network alone, with no counted n-gram model"),
    ]
    for bad, field, value, why in refused:
        if bad:
            raise ValueError(f"{name}.{field}: {article} {family.name} cannot express {field}={value} ({why}; "
                             f"{_elsewhere(config)}); {_what_converts(family)}")
    values: dict[str, Any] = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.embed_dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,   # Apertus has no such field, but reads it when given
        hidden_act=_activation(family),
        max_position_embeddings=config.max_tokens,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_weights,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_dropout=config.dropout_rate,
        # The families' defaults are ids of their own tokenizers: meaningless for ours.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family.name != "Mistral":   # Mistral's attention has no bias option
        values["attention_bias"] = False
    if family.config_class in (LlamaConfig, ArceeConfig):
        values["mlp_bias"] = False
    if family.name == "Mistral":
        values["sliding_window"] = config.sliding_window   # None: the whole context (its default is 4096)
    if family.name == "Qwen 3":
        # Every layer the same kind: Qwen 3 slides only in the layers from max_window_layers on.
        window = config.sliding_window
        values.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0,
                      layer_types=["sliding_attention" if window is not None else "full_attention"]
                      * config.num_layers)
    return family.config_class(**values)


def _rope_theta(hf_config: Any, name: str) -> float:
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


def _window(family: Family, c: Any, name: str) -> int | None:
    """The one sliding window every layer of ``c`` uses, or None for the whole context."""
    if not family.window:
        return None
    if family.name == "Mistral":
        return c.sliding_window
    kinds = sorted(set(c.layer_types))
    if kinds == ["full_attention"] or c.sliding_window is None:
        return None
    if kinds == ["sliding_attention"]:
        return c.sliding_window
    raise ValueError(f"{name}.layer_types: the course model gives every layer the same attention; got "
                     f"{c.layer_types.count('sliding_attention')} sliding and {c.layer_types.count('full_attention')} "
                     f"full layers (set max_window_layers=0 or use_sliding_window=False)")


def course_config_from_hf(family: Family, hf_config: Any, name: str = "hf_config",
                          max_tokens: int | None = None) -> ModernGPTConfig:
    """The ``ModernGPTConfig`` of a ``family`` config (refuses biases, scaled RoPE, another activation,
    and Qwen 3's mix of full and sliding layers, with a message naming the setting)."""
    if not isinstance(family, Family):
        raise TypeError(f"family: expected a row of course_lib.hf.FAMILIES, got {validate.describe(family)}")
    if not isinstance(hf_config, family.config_class):
        raise TypeError(f"{name}: expected a transformers.{family.config_class.__name__}, "
                        f"got {validate.describe(hf_config)}")
    c = hf_config
    mlp_parts = "gate, up, down" if family.mlp == "swiglu" else "up, down"
    mlp_name = "SwiGLU" if family.mlp == "swiglu" else "ReLU² feed-forward"
    act = _activation(family)
    refused = [
        (getattr(c, "attention_bias", False), "attention_bias=True",
         "the course's attention projections have no bias (query, key, value, proj)"),
        (getattr(c, "mlp_bias", False), "mlp_bias=True", f"the course's {mlp_name} has no bias ({mlp_parts})"),
        (c.hidden_act != act, f"hidden_act={c.hidden_act!r}",
         "the course's SwiGLU gates with SiLU (hidden_act='silu')" if act == "silu"
         else "the course's ReLU² feed-forward squares a ReLU (hidden_act='relu2')"),
    ]
    for bad, setting, why in refused:
        if bad:
            raise ValueError(f"{name}.{setting.split('=')[0]}: the course model cannot express {setting} "
                             f"({why}); only {family.name}'s standard settings convert")
    theta = _rope_theta(c, name)
    window = _window(family, c, name)
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
        mlp=family.mlp,
        rope_theta=theta,
        norm_eps=float(c.rms_norm_eps),
        qk_norm=family.qk_norm,
        sliding_window=window,
        tie_weights=bool(c.tie_word_embeddings),
        dropout_rate=dropout,
        head_dim=head_dim,
    )


# ---------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------

def _part_argument(course_name: str) -> str:
    """Which class argument of from_hf_* built the module holding ``course_name``."""
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
                             f"{what}; the parts must use the reference's names (query, key, value, proj, "
                             f"q_norm, k_norm; gate, up, down; weight) and no biases")
        given = source[names[name]]
        if tuple(given.shape) != tuple(param.shape):
            raise ValueError(f"{blame(name)}: parameter {name!r} has shape {tuple(param.shape)}, but {what}'s "
                             f"{names[name]!r} has shape {tuple(given.shape)}")
    unused = [ours for ours in names if ours not in params]
    if unused:
        raise ValueError(f"{blame(unused[0])}: the model built has no parameter {unused[0]!r} to hold {what}'s "
                         f"{names[unused[0]]!r} ({len(unused)} missing in all); the parts must use the "
                         f"reference's names (query, key, value, proj, q_norm, k_norm; gate, up, down; weight)")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(source[names[name]])


def _family_of_model(model: Any) -> Family:
    for family in FAMILIES:
        if isinstance(model, family.model_class):
            return family
    raise TypeError(f"model: expected one of transformers' {', '.join(f.model_class.__name__ for f in FAMILIES)}, "
                    f"got {validate.describe(model)}")


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
def from_hf_modern(model: PreTrainedModel, *, family: Family | None = None,
                   attention_cls: Callable[..., nn.Module] | None = None,
                   norm_cls: Callable[..., nn.Module] | None = None,
                   mlp_cls: Callable[..., nn.Module] | None = None,
                   max_tokens: int | None = None) -> ModernGPT:
    """A course ``ModernGPT`` computing the same logits as a Llama, Mistral, Qwen 3, Arcee or Apertus model.

    ``family`` (default: the one of ``model``'s class) insists on one row of :data:`FAMILIES`. The parts
    are built from ``attention_cls``, ``norm_cls`` and ``mlp_cls`` (None: the references), so a student's
    own classes with the reference's parameter names load the same weights. ``max_tokens`` (default: the
    model's ``max_position_embeddings``) sets the context, and with it the RoPE tables and the KV cache.
    """
    if family is None:
        family = _family_of_model(model)
    elif not isinstance(model, family.model_class):
        raise TypeError(f"model: expected a transformers.{family.model_class.__name__}, got "
                        f"{validate.describe(model)}")
    if max_tokens is not None:
        validate.positive_int("max_tokens", max_tokens)
    config = course_config_from_hf(family, model.config, "model.config", max_tokens)
    parts = {key: cls for key, cls in (("attention_cls", attention_cls), ("norm_cls", norm_cls),
                                       ("mlp_cls", mlp_cls)) if cls is not None}
    reference = next(model.parameters())
    ours = ModernGPT(config, **parts).to(device=reference.device, dtype=reference.dtype)
    source = model.state_dict()
    if config.tie_weights and "lm_head.weight" not in source:
        source["lm_head.weight"] = source["model.embed_tokens.weight"]
    _copy_weights(ours, source, dict(modern_weight_pairs(family, config.num_layers)), _part_argument,
                  f"the {family.name}")
    return ours.train(model.training)


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
def to_hf_modern(ours: ModernGPT, *, family: Family | None = None) -> PreTrainedModel:
    """The transformers model computing the same logits as the course ``ours``.

    ``family`` (default: :func:`family_for` of its config) names the architecture; a setting it cannot
    express (or, by default, that none can: hashed n-grams, a counted n-gram prior, ReLU² with a sliding
    window) is refused with one line naming it and what converts.
    """
    if not isinstance(ours, ModernGPT):
        raise TypeError(f"ours: expected a course_lib ModernGPT, got {validate.describe(ours)}")
    if family is None:
        family = family_for(ours.config, "ours.config")
    hf_config = hf_config_from_course(family, ours.config, "ours.config")
    reference = next(ours.parameters())
    hf_model = family.model_class(hf_config).to(device=reference.device, dtype=reference.dtype)
    source = {name: p.detach() for name, p in _parameters(ours).items()}
    names = {theirs: mine for mine, theirs in modern_weight_pairs(family, ours.config.num_layers)}
    if hf_config.tie_word_embeddings and "head.weight" not in source:
        source["head.weight"] = source["token_embedding.weight"]
    missing = [mine for mine in names.values() if mine not in source]
    if missing:
        raise ValueError(f"ours: has no parameter {missing[0]!r} ({len(missing)} missing in all); {family.name} "
                         f"needs the reference's names (query, key, value, proj, q_norm, k_norm; gate, up, down; "
                         f"weight)")
    extra = [mine for mine in source if mine not in names.values()]
    if extra:
        raise ValueError(f"ours: parameter {extra[0]!r} has no counterpart in {family.name}; only the reference's "
                         f"parts without biases convert")
    _copy_weights(hf_model, source, names, lambda name: "ours", "the course model")
    if hf_config.tie_word_embeddings and hf_model.lm_head.weight is not hf_model.model.embed_tokens.weight:
        raise RuntimeError(f"to_hf_modern: transformers did not tie lm_head.weight to model.embed_tokens.weight "
                           f"in {family.model_class.__name__}")
    return hf_model.train(ours.training)
