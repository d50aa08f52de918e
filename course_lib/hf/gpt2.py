"""Our GPT next to GPT-2, weight for weight: the name table, the configs, state dicts and whole models.

:func:`weight_pairs` is the one table both directions read; ``to_hf_gpt2`` and
``from_hf_gpt2`` convert whole models with logits equal to float32 rounding.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from .. import _validate as validate
from .._rng import leaves_rng_alone
from ..model import GPT, GPTConfig, sinusoidal_table

# Public names: listed once, in course_lib.hf's __all__.

# Course activation name <-> GPT-2 ``activation_function``. On export "gelu_tanh"
# becomes "gelu_pytorch_tanh", the very op the course uses (nn.GELU(approximate="tanh"));
# OpenAI's checkpoints say "gelu_new", the same formula written out in Python.
_ACTIVATION_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
_ACTIVATION_FROM_HF = {
    "gelu": "gelu", "gelu_python": "gelu",
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
# Course GPTConfig field <-> GPT2Config field for the sizes that carry over unchanged, read both ways.
_SIZES = (("vocab_size", "vocab_size"), ("max_tokens", "n_positions"), ("embed_dim", "n_embd"),
          ("num_layers", "n_layer"), ("num_heads", "n_head"))


# ---------------------------------------------------------------------------
# The weight table: one list of name pairs, read in both directions
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightPair:
    """Course tensor name(s) and the GPT-2 tensor that holds the same numbers.

    ``conv1d``: GPT-2 stores the weight as Conv1D, (in, out) — the transpose of
    nn.Linear's (out, in). Several course names: GPT-2 concatenates them along
    its output dimension (query, key, value -> ``c_attn``).
    """

    course: tuple[str, ...]
    hf: str
    conv1d: bool = False


def weight_pairs(num_layers: int) -> list[WeightPair]:
    """Every tensor of a GPT-2 model with ``num_layers`` blocks, in model order."""
    validate.positive_int("num_layers", num_layers)
    pairs = [WeightPair(("token_embedding.weight",), "transformer.wte.weight"),
             WeightPair(("position_encoding.embedding.weight",), "transformer.wpe.weight")]
    for i in range(num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for module, hf_module, conv1d in (("ln1", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
                                          ("attn.proj", "attn.c_proj", True), ("ln2", "ln_2", False),
                                          ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True)):
            for kind in ("weight", "bias"):
                if module == "attn.qkv":
                    course = tuple(f"{ours}attn.{name}.{kind}" for name in ("query", "key", "value"))
                else:
                    course = (f"{ours}{module}.{kind}",)
                pairs.append(WeightPair(course, f"{theirs}{hf_module}.{kind}", conv1d))
    pairs += [WeightPair(("ln_f.weight",), "transformer.ln_f.weight"),
              WeightPair(("ln_f.bias",), "transformer.ln_f.bias"),
              WeightPair(("head.weight",), "lm_head.weight")]
    return pairs


def _fuse(tensors: list[torch.Tensor], conv1d: bool) -> torch.Tensor:
    """Course tensors -> one GPT-2 tensor (transpose Linear weights, concatenate outputs)."""
    if conv1d:
        tensors = [t.t() if t.dim() == 2 else t for t in tensors]   # (out, in) -> (in, out)
    return torch.cat(tensors, dim=-1) if len(tensors) > 1 else tensors[0]   # (in, parts * out)


def _unfuse(tensor: torch.Tensor, parts: int, conv1d: bool) -> list[torch.Tensor]:
    """One GPT-2 tensor -> course tensors: the exact inverse of :func:`_fuse`."""
    chunks = list(tensor.chunk(parts, dim=-1)) if parts > 1 else [tensor]   # parts x (in, out)
    if conv1d:
        chunks = [c.t() if c.dim() == 2 else c for c in chunks]         # (in, out) -> (out, in)
    return [c.contiguous() for c in chunks]


def split_c_attn(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-2's fused ``c_attn.weight`` (E, 3E), Conv1D layout -> (Wq, Wk, Wv), each (E, E) as in nn.Linear.

    Conv1D computes x @ W, nn.Linear computes x @ W.T: split along the output
    (last) dimension first, then transpose each third.
    """
    validate.tensor("weight", weight, dim=2, floating=True)
    in_dim, out_dim = weight.shape
    if out_dim != 3 * in_dim:
        raise ValueError(f"weight: expected Conv1D layout (embed_dim, 3 * embed_dim), e.g. ({in_dim}, "
                         f"{3 * in_dim}); got shape {tuple(weight.shape)}"
                         + ("; it looks transposed (nn.Linear layout), pass weight.T" if in_dim == 3 * out_dim else ""))
    wq, wk, wv = _unfuse(weight, 3, conv1d=True)
    return wq, wk, wv


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------

def gpt2_config_from_course(config: GPTConfig) -> GPT2Config:
    """The GPT2Config of the same architecture as a course ``GPTConfig``.

    bias=False exports exactly (GPT-2 gets zero biases) and so does
    positional="sinusoidal" (the fixed table becomes ``wpe``'s weights); post-norm
    blocks cannot be expressed in GPT-2 and are refused.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config: expected a course_lib GPTConfig, got {validate.describe(config)}")
    if not config.norm_first:
        raise ValueError("config.norm_first: GPT-2 normalises before attention and MLP (pre-norm, "
                         "norm_first=True); got norm_first=False (post-norm), which GPT-2 cannot "
                         "represent. Train with GPTConfig(norm_first=True, ...) to export to GPT-2.")
    return GPT2Config(
        **{hf: getattr(config, course) for course, hf in _SIZES},
        n_inner=config.mlp_ratio * config.embed_dim,
        activation_function=_ACTIVATION_TO_HF[config.activation],
        resid_pdrop=config.dropout_rate,
        embd_pdrop=config.dropout_rate,
        attn_pdrop=config.dropout_rate,
        layer_norm_epsilon=float(config.layer_norm_eps),
        tie_word_embeddings=config.tie_weights,
        # GPT-2's defaults (50256) are ids of OpenAI's tokenizer: wrong for ours.
        # save_pretrained fills them in from the tokenizer it is given.
        bos_token_id=None,
        eos_token_id=None,
    )


def course_config_from_gpt2(hf_config: GPT2Config) -> GPTConfig:
    """The course ``GPTConfig`` of a GPT-2 architecture (always bias=True, learned positions, pre-norm)."""
    if not isinstance(hf_config, GPT2Config):
        raise TypeError(f"hf_config: expected a transformers.GPT2Config, got {validate.describe(hf_config)}")
    c = hf_config
    unsupported = [
        (not c.scale_attn_weights, "scale_attn_weights=False",
         "the course always scales attention scores by head_dim**-0.5"),
        (c.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True",
         "the course scales every layer by head_dim**-0.5 only"),
        (c.add_cross_attention, "add_cross_attention=True",
         "the course GPT is decoder-only, without cross-attention"),
    ]
    for bad, setting, why in unsupported:
        if bad:
            raise ValueError(f"hf_config.{setting.split('=')[0]}: the course GPT cannot express {setting} "
                             f"({why}); only standard GPT-2 settings convert")
    if c.activation_function not in _ACTIVATION_FROM_HF:
        raise ValueError(f"hf_config.activation_function: expected one of {sorted(_ACTIVATION_FROM_HF)}, "
                         f"got {c.activation_function!r}; the course has gelu, gelu_tanh and relu")
    inner = c.n_inner if c.n_inner is not None else 4 * c.n_embd
    if inner % c.n_embd:
        raise ValueError(f"hf_config.n_inner: the course sizes the MLP as mlp_ratio * n_embd, so n_inner "
                         f"must be a multiple of n_embd={c.n_embd}; got n_inner={c.n_inner}")
    rates = {float(c.resid_pdrop), float(c.embd_pdrop), float(c.attn_pdrop)}
    if len(rates) > 1:
        warnings.warn(f"hf_config: GPT-2 has three dropout rates (resid {c.resid_pdrop}, embd {c.embd_pdrop}, "
                      f"attn {c.attn_pdrop}); the course has one, dropout_rate={c.resid_pdrop} (resid_pdrop). "
                      f"Outputs in eval mode are unaffected.", stacklevel=2)
    return GPTConfig(
        **{course: getattr(c, hf) for course, hf in _SIZES},
        dropout_rate=float(c.resid_pdrop),
        norm_first=True,
        positional="learned",
        tie_weights=bool(c.tie_word_embeddings),
        bias=True,
        activation=_ACTIVATION_FROM_HF[c.activation_function],
        layer_norm_eps=float(c.layer_norm_epsilon),
        mlp_ratio=inner // c.n_embd,
    )


# ---------------------------------------------------------------------------
# State dicts and whole models
# ---------------------------------------------------------------------------

def _gpt2_like(config: GPTConfig) -> GPTConfig:
    # The course model that has every tensor GPT-2 has: biases and a position table.
    return dataclasses.replace(config, bias=True, positional="learned", norm_first=True)


def _shapes(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in state_dict.items()}


def _expected_course_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    # A model on the meta device has shapes and no numbers: free to build.
    with torch.device("meta"):
        return _shapes(GPT(config).state_dict())


def _check_state_dict(name: str, state_dict: Any, expected: dict[str, tuple[int, ...]],
                      what: str, ignore: Callable[[str], bool] = lambda key: False) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"{name}: expected a dict of tensors (a state_dict), got {validate.describe(state_dict)}")
    missing = [key for key in expected if key not in state_dict]
    if missing:
        raise KeyError(f"{name}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
                       f"expected every tensor of {what}")
    unexpected = [key for key in state_dict if key not in expected and not ignore(key)]
    if unexpected:
        raise KeyError(f"{name}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all); "
                       f"it has no counterpart in {what}")
    for key, shape in expected.items():
        given = state_dict[key]
        if not isinstance(given, torch.Tensor):
            raise TypeError(f"{name}[{key!r}]: expected a tensor, got {validate.describe(given)}")
        if tuple(given.shape) != shape:
            raise ValueError(f"{name}[{key!r}]: expected shape {shape} for {what}, got {tuple(given.shape)}")


def course_to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A course state_dict -> GPT-2 tensor names and layouts (zero biases / the sinusoidal table filled in)."""
    gpt2_config_from_course(config)   # refuses what GPT-2 cannot represent
    _check_state_dict("state_dict", state_dict, _expected_course_shapes(config), f"a course GPT with {config}")
    tensors = dict(state_dict)
    full = _expected_course_shapes(_gpt2_like(config))
    reference = state_dict["token_embedding.weight"]
    for key, shape in full.items():
        if key in tensors:
            continue
        if key == "position_encoding.embedding.weight":   # sinusoidal: the fixed table is exact as wpe
            tensors[key] = sinusoidal_table(config.max_tokens, config.embed_dim).to(reference)
        else:                                             # bias=False: a zero bias changes nothing
            tensors[key] = reference.new_zeros(shape)
    return {pair.hf: _fuse([tensors[name] for name in pair.course], pair.conv1d)
            for pair in weight_pairs(config.num_layers)}


def _expected_hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    # Converting a meta course model gives GPT-2's shapes with no second table to keep in sync.
    with torch.device("meta"):
        state = GPT(_gpt2_like(config)).state_dict()
    return {pair.hf: tuple(_fuse([state[n] for n in pair.course], pair.conv1d).shape)
            for pair in weight_pairs(config.num_layers)}


def _old_gpt2_buffer(key: str) -> bool:
    # Checkpoints from transformers 4 carry the causal mask as buffers "attn.bias"/"attn.masked_bias".
    return key.endswith((".attn.bias", ".attn.masked_bias"))


def hf_to_course_state_dict(state_dict: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A GPT-2 state_dict -> course tensor names and layouts, for a course model built with ``config``."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config: expected a course_lib GPTConfig, got {validate.describe(config)}")
    if config != _gpt2_like(config):
        raise ValueError(f"config: a GPT-2 state_dict fills a course GPT with bias=True, positional='learned', "
                         f"norm_first=True; got bias={config.bias}, positional={config.positional!r}, "
                         f"norm_first={config.norm_first}")
    if isinstance(state_dict, dict) and "lm_head.weight" not in state_dict and config.tie_weights:
        state_dict = {**state_dict, "lm_head.weight": state_dict.get("transformer.wte.weight")}
    _check_state_dict("state_dict", state_dict, _expected_hf_shapes(config),
                      f"a GPT-2 model with n_layer={config.num_layers}, n_embd={config.embed_dim}, "
                      f"vocab_size={config.vocab_size}, n_positions={config.max_tokens}, "
                      f"n_inner={config.mlp_ratio * config.embed_dim}", ignore=_old_gpt2_buffer)
    course: dict[str, torch.Tensor] = {}
    for pair in weight_pairs(config.num_layers):
        course.update(zip(pair.course, _unfuse(state_dict[pair.hf], len(pair.course), pair.conv1d)))
    return course


def _first_parameter(module: torch.nn.Module) -> torch.Tensor:
    return next(module.parameters())


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
def to_hf_gpt2(model: GPT) -> GPT2LMHeadModel:
    """A ``transformers.GPT2LMHeadModel`` computing the same logits as the course ``model``."""
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected a course_lib GPT, got {validate.describe(model)}")
    hf_config = gpt2_config_from_course(model.config)
    state = course_to_hf_state_dict(model.state_dict(), model.config)
    reference = _first_parameter(model)
    hf_model = GPT2LMHeadModel(hf_config).to(device=reference.device, dtype=reference.dtype)
    hf_model.load_state_dict(state, strict=True)
    if model.config.tie_weights and hf_model.lm_head.weight is not hf_model.transformer.wte.weight:
        raise RuntimeError("to_hf_gpt2: transformers did not tie lm_head.weight to transformer.wte.weight")
    return hf_model.train(model.training)


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
def from_hf_gpt2(hf_model: GPT2LMHeadModel) -> GPT:
    """A course ``GPT`` computing the same logits as a ``transformers.GPT2LMHeadModel``."""
    if not isinstance(hf_model, GPT2LMHeadModel):
        raise TypeError(f"hf_model: expected a transformers.GPT2LMHeadModel, got {validate.describe(hf_model)}")
    config = course_config_from_gpt2(hf_model.config)
    state = hf_to_course_state_dict(hf_model.state_dict(), config)
    reference = _first_parameter(hf_model)
    model = GPT(config).to(device=reference.device, dtype=reference.dtype)
    model.load_state_dict(state, strict=True)
    return model.train(hf_model.training)
