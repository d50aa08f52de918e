"""Interop with Hugging Face transformers: our GPT next to GPT-2, weight for weight.

- ``to_hf_gpt2`` / ``from_hf_gpt2`` convert whole models; the name pairs come
  from :func:`weight_pairs`, the one table both directions read.
- ``from_pretrained`` loads real GPT-2 weights (a local folder or the hub cache).
- ``save_pretrained`` writes a course model and its tokenizer as a folder that
  ``transformers.pipeline("text-generation", model=folder)`` can run.
- ``course_attention_forward`` is the course's attention in transformers'
  AttentionInterface form; ``register_course_attention`` plugs it into any model
  that uses the interface, and ``run_with_attention`` runs a model with any
  attention function (notebook 07, exercise 7.2).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from . import _validate as validate
from .attention import attention_weights
from .data import REPLACEMENT_CHAR, UNKNOWN_POLICIES
from .model import GPT, GPTConfig, sinusoidal_table

try:
    import transformers
    from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as error:   # pragma: no cover - the course environment always has it
    raise ImportError("course_lib.hf needs the transformers package (>= 5); install the course "
                      "environment (environment.yml) or `pip install transformers`") from error

__all__ = [
    "WeightPair",
    "weight_pairs",
    "split_c_attn",
    "gpt2_config_from_course",
    "course_config_from_gpt2",
    "course_to_hf_state_dict",
    "hf_to_course_state_dict",
    "to_hf_gpt2",
    "from_hf_gpt2",
    "PretrainedWeightsNotFound",
    "from_pretrained",
    "char_tokenizer_to_hf",
    "save_pretrained",
    "course_attention_forward",
    "register_course_attention",
    "run_with_attention",
]

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
        vocab_size=config.vocab_size,
        n_positions=config.max_tokens,
        n_embd=config.embed_dim,
        n_layer=config.num_layers,
        n_head=config.num_heads,
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
        vocab_size=c.vocab_size,
        max_tokens=c.n_positions,
        embed_dim=c.n_embd,
        num_heads=c.n_head,
        num_layers=c.n_layer,
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


# ---------------------------------------------------------------------------
# Loading real GPT-2 weights
# ---------------------------------------------------------------------------

class PretrainedWeightsNotFound(OSError):
    """GPT-2 weights are neither in a local folder nor in the Hugging Face cache (and cannot be fetched)."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else is meant as a folder.
    return (Path(name).expanduser().exists() or os.path.isabs(name) or name.startswith((".", "~"))
            or name.count("/") > 1 or "\\" in name)


def from_pretrained(name_or_path: str | os.PathLike, *, local_files_only: bool | None = None) -> GPT:
    """Load GPT-2 weights ("gpt2", "openai-community/gpt2-medium", or a save_pretrained folder) as a course GPT.

    Offline mode (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1, read at call time) or
    ``local_files_only=True`` use the local cache only.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise TypeError(f"name_or_path: expected a model name such as 'gpt2' or a folder path, "
                        f"got {validate.describe(name_or_path)}")
    name = os.fspath(name_or_path)
    if _looks_like_path(name):
        folder = Path(name).expanduser()
        if not folder.is_dir():
            raise PretrainedWeightsNotFound(
                f"name_or_path: no folder at {str(folder)!r}. Pass a folder written by save_pretrained "
                f"(it holds config.json and model.safetensors), or a hub name such as 'gpt2'.")
        if not (folder / "config.json").is_file():
            raise PretrainedWeightsNotFound(
                f"name_or_path: the folder {str(folder)!r} has no config.json; write it with "
                f"hf_model.save_pretrained(folder) or course_lib.hf.save_pretrained(model, tokenizer, folder)")
        name = str(folder)
    offline = (_env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE")
               if local_files_only is None else bool(local_files_only))
    try:
        hf_config = transformers.AutoConfig.from_pretrained(name, local_files_only=offline)
        if hf_config.model_type != "gpt2":
            raise ValueError(f"name_or_path: {name!r} holds a {hf_config.model_type!r} model; "
                             f"the course converts GPT-2 models (model_type 'gpt2') only")
        hf_model = GPT2LMHeadModel.from_pretrained(name, local_files_only=offline)
    except OSError as error:
        where = "in the Hugging Face cache" + (" (offline mode is on, so nothing was downloaded)" if offline else "")
        hub_name = name if not _looks_like_path(name) else "gpt2"
        raise PretrainedWeightsNotFound(
            f"from_pretrained: could not load GPT-2 weights {name!r}: not a local folder, and not {where}.\n"
            f"To get them, run this once on a machine with network access (it fills the cache; offline "
            f"mode works afterwards):\n"
            f"    python -c \"from transformers import GPT2LMHeadModel; "
            f"GPT2LMHeadModel.from_pretrained('{hub_name}')\"\n"
            f"or copy a folder written with model.save_pretrained(folder) to this machine and pass its path.\n"
            f"(transformers said: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__})"
        ) from error
    return from_hf_gpt2(hf_model.eval())


# ---------------------------------------------------------------------------
# Exporting a course model and its tokenizer for transformers.pipeline
# ---------------------------------------------------------------------------

def char_tokenizer_to_hf(tokenizer: Any, *, model_max_length: int | None = None) -> transformers.PreTrainedTokenizerFast:
    """The course's character tokenizer as a transformers tokenizer: one token per character, decode = concatenate.

    Needs ``tokenizer.stoi`` (character -> id, ids 0 .. n-1). Characters outside the
    vocabulary follow ``tokenizer.unknown``, as in ``CharTokenizer.encode``: "replace" gives
    them the id of the replacement character, "skip" drops them, "error" (the default) fails.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    stoi = getattr(tokenizer, "stoi", None)
    if not isinstance(stoi, dict) or not stoi:
        raise TypeError(f"tokenizer: expected a CharTokenizer with a non-empty .stoi dict (character -> id), "
                        f"got {validate.describe(tokenizer)}")
    bad = [c for c in stoi if not isinstance(c, str) or len(c) != 1]
    if bad:
        raise ValueError(f"tokenizer.stoi: expected single characters as keys, got {bad[0]!r}")
    if sorted(stoi.values()) != list(range(len(stoi))):
        raise ValueError(f"tokenizer.stoi: expected ids 0 .. {len(stoi) - 1}, each once; "
                         f"got {sorted(stoi.values())[:10]}...")
    unknown = getattr(tokenizer, "unknown", "error")
    validate.one_of("tokenizer.unknown", unknown, UNKNOWN_POLICIES)
    if unknown == "replace" and REPLACEMENT_CHAR not in stoi:
        raise ValueError(f"tokenizer.stoi: unknown='replace' maps unseen characters to {REPLACEMENT_CHAR!r}, "
                         f"which is not in the vocabulary; build the tokenizer with CharTokenizer(..., "
                         f"unknown='replace'), which adds it")
    # "replace": the word-level model's unknown token is the replacement character, so an
    # unseen character gets its id, as in CharTokenizer.encode.
    core = Tokenizer(models.WordLevel(vocab=dict(stoi),
                                      unk_token=REPLACEMENT_CHAR if unknown == "replace" else None))
    # Every character is its own token, spaces and newlines included; no lower-casing or
    # unicode folding: the ids are exactly tokenizer.encode's.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with nothing in between; the default would put spaces between characters.
    core.decoder = decoders.Fuse()
    if unknown == "skip":
        # Unseen characters are removed before splitting, so they get no id at all.
        known = "".join(f"\\x{{{ord(c):X}}}" for c in stoi)
        core.normalizer = normalizers.Replace(Regex(f"[^{known}]"), "")
    kwargs = {} if model_max_length is None else {"model_max_length": validate.positive_int("model_max_length",
                                                                                         model_max_length)}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False,
                                                **kwargs)


def save_pretrained(model: GPT, tokenizer: Any, folder: str | os.PathLike) -> Path:
    """Write ``model`` (as GPT-2) and ``tokenizer`` to ``folder`` for ``transformers.pipeline("text-generation")``.

    ``tokenizer``: a transformers fast tokenizer (data.train_subword_tokenizer) or the
    course's CharTokenizer. Returns the folder.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected a course_lib GPT, got {validate.describe(model)}")
    if not isinstance(folder, (str, os.PathLike)) or not str(folder):
        raise TypeError(f"folder: expected a folder path, got {validate.describe(folder)}")
    max_tokens = model.config.max_tokens
    if isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        hf_tokenizer = copy.deepcopy(tokenizer)   # set the context length on a copy, not on the caller's
        hf_tokenizer.model_max_length = max_tokens
    else:
        hf_tokenizer = char_tokenizer_to_hf(tokenizer, model_max_length=max_tokens)
    if len(hf_tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer: has {len(hf_tokenizer)} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}; export the tokenizer the model was trained with")
    hf_model = to_hf_gpt2(model).eval()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(hf_model.config, attr, getattr(hf_tokenizer, attr, None))
        setattr(hf_model.generation_config, attr, getattr(hf_tokenizer, attr, None))
    # The pipeline's default of 256 new tokens would run past the position table of a
    # small model; half the context leaves room for the prompt. (A max_length cap
    # would make transformers warn whenever a caller passes max_new_tokens.)
    hf_model.generation_config.max_new_tokens = max(1, max_tokens // 2)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------
# The course's attention inside transformers models
# ---------------------------------------------------------------------------

def _as_bool_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' masks -> the course convention: bool, True = may attend."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if not attention_mask.is_floating_point():
        raise TypeError(f"attention_mask: expected a bool mask (True = may attend) or a float additive mask "
                        f"(0 = may attend, large negative = blocked), got dtype {attention_mask.dtype}")
    allowed = attention_mask == 0
    # Anything at or below -1e4 makes exp() underflow to exactly zero weight.
    if not bool((allowed | (attention_mask <= -1e4)).all()):
        odd = attention_mask[~allowed & (attention_mask > -1e4)].flatten()[0].item()
        raise ValueError(f"attention_mask: the course attention takes on/off masks (0 = may attend, a large "
                         f"negative number = blocked); got the additive bias {odd:g}. Position biases "
                         f"(ALiBi, relative positions) need attn_implementation='eager'")
    return allowed


def course_attention_forward(module: torch.nn.Module | None, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention-interface function computed with the course's ``attention_weights``.

    query (N, heads, Lq, d), key/value (N, kv_heads, Lk, d); attention_mask bool or additive
    float, broadcastable to (N, heads, Lq, Lk), or None. Returns (output (N, Lq, heads, d),
    weights (N, heads, Lq, Lk)) — the shapes GPT2Attention and friends expect.
    """
    validate.tensor("query", query, dim=4, floating=True)
    validate.tensor("key", key, dim=4, floating=True)
    validate.tensor("value", value, dim=4, floating=True)
    n, heads, q_len, head_dim = query.shape
    if key.shape[0] != n or key.shape[-1] != head_dim or key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key: expected (N={n}, kv_heads, Lk, {head_dim}) and value with the same "
                         f"(N, kv_heads, Lk), got key {tuple(key.shape)}, value {tuple(value.shape)}")
    if heads % key.shape[1]:
        raise ValueError(f"key: {key.shape[1]} key/value heads must divide the {heads} query heads, "
                         f"got key {tuple(key.shape)}")
    if scaling is not None:
        validate.positive_float("scaling", scaling)
    dropout = validate.probability("dropout", dropout)
    if key.shape[1] != heads:   # grouped-query attention: each key/value head serves several query heads
        key = key.repeat_interleave(heads // key.shape[1], dim=1)       # (N, heads, Lk, d)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)  # (N, heads, Lk, dv)
    k_len = key.shape[2]

    if attention_mask is None:
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # transformers passes no mask when a plain causal mask would do (sdpa's is_causal
        # shortcut): the causality is then ours to apply, never to drop. Upper-left aligned,
        # as torch's is_causal: query i sees keys 0..i.
        mask = (torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
                if is_causal and q_len > 1 else None)                  # (Lq, Lk)
    else:
        validate.tensor("attention_mask", attention_mask, min_dim=2)
        if attention_mask.shape[-1] != k_len or attention_mask.shape[-2] not in (1, q_len):
            raise ValueError(f"attention_mask: expected shape (..., {q_len}, {k_len}) (queries x keys), "
                             f"got {tuple(attention_mask.shape)}")
        mask = _as_bool_mask(attention_mask)                          # (N, 1, Lq, Lk)

    if scaling is not None and scaling != head_dim ** -0.5:
        # attention_weights scales by head_dim**-0.5; fold the rest of the requested scale into q
        query = query * (scaling * head_dim ** 0.5)
    if mask is None:
        weights = attention_weights(query, key)                       # (N, heads, Lq, Lk)
    else:
        # A query that may see no key at all (left padding) would get 0/0 = NaN from the
        # softmax, and the NaN would leak into every position through the values of the
        # next layer. Give such rows zero weight, hence a zero output, instead.
        sees_something = mask.any(dim=-1, keepdim=True)               # (..., Lq, 1)
        weights = attention_weights(query, key, mask | ~sees_something) * sees_something
    if dropout > 0:   # as eager attention: GPT-2 already passes 0.0 in eval mode
        weights = F.dropout(weights, p=dropout, training=getattr(module, "training", True))
    output = weights @ value                                          # (N, heads, Lq, dv)
    return output.transpose(1, 2).contiguous(), weights              # (N, Lq, heads, dv)


_BUILT_IN = {"eager", "sdpa", "flex_attention", "paged|eager", "flash_attention_2", "flash_attention_3",
             "flash_attention_4"}


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in _BUILT_IN:
        raise ValueError(f"name: expected a new attention implementation name (no '/', not one of "
                         f"{sorted(_BUILT_IN)}), got {validate.describe(name)}")
    return name


def register_course_attention(name: str = "course", fn: Callable[..., Any] = course_attention_forward) -> str:
    """Register ``fn`` with transformers under ``name``; select it with attn_implementation=name.

    The mask function is registered too: for a name the mask registry does not
    know, transformers builds no mask at all — padding would be silently ignored.
    The registered masks are sdpa's: bool, True = may attend, or None when a plain
    causal mask would do (``course_attention_forward`` then applies causality itself).
    """
    _check_name(name)
    if not callable(fn):
        raise TypeError(f"fn: expected an attention function (module, query, key, value, attention_mask, "
                        f"scaling=None, dropout=0.0, **kwargs), got {validate.describe(fn)}")
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _unregister(name: str) -> None:
    # The registries have register() but no unregister(): drop the global entries directly.
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


def _checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a student's attention function so a wrong return names what was wrong."""
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        result = fn(module, query, key, value, attention_mask, *args, **kwargs)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(f"fn: expected a tuple (attn_output, attn_weights or None), got {validate.describe(result)}")
        output = result[0]
        n, heads, q_len, _ = query.shape
        expected = (n, q_len, heads, value.shape[-1])
        if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
            hint = ("; transpose(1, 2) the (N, heads, L, head_dim) result"
                    if isinstance(output, torch.Tensor) and tuple(output.shape) == (n, heads, q_len, value.shape[-1])
                    else "")
            raise ValueError(f"fn: expected attn_output of shape (N, L, heads, head_dim) = {expected}, "
                             f"got {validate.describe(output)}{hint}")
        return result
    return attention


@contextlib.contextmanager
def _attention_implementation(hf_model: Any, fn: Callable[..., Any]) -> Iterator[str]:
    name = register_course_attention(f"course_tmp_{uuid.uuid4().hex[:8]}", _checked(fn))
    previous = hf_model.config._attn_implementation
    try:
        hf_model.set_attn_implementation(name)
        yield name
    finally:
        hf_model.set_attn_implementation(previous)
        _unregister(name)


def run_with_attention(hf_model: transformers.PreTrainedModel, fn: Callable[..., Any], input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (N, L, vocab) of ``hf_model`` with every attention layer computed by ``fn``.

    ``fn`` has the signature of :func:`course_attention_forward`. It is registered
    under a temporary name for this call only; the model's own implementation is
    restored afterwards, even when ``fn`` fails.
    """
    if not isinstance(hf_model, transformers.PreTrainedModel):
        raise TypeError(f"hf_model: expected a transformers model (e.g. GPT2LMHeadModel), "
                        f"got {validate.describe(hf_model)}")
    if not callable(fn):
        raise TypeError(f"fn: expected an attention function (module, query, key, value, attention_mask, "
                        f"scaling=None, dropout=0.0, **kwargs), got {validate.describe(fn)}")
    validate.token_ids("input_ids", input_ids, dim=2)
    if attention_mask is not None:
        validate.tensor("attention_mask", attention_mask, dim=2)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: expected the shape of input_ids {tuple(input_ids.shape)} "
                             f"(1 = token, 0 = padding), got {tuple(attention_mask.shape)}")
    with _attention_implementation(hf_model, fn), torch.no_grad():
        return hf_model(input_ids=input_ids, attention_mask=attention_mask).logits
