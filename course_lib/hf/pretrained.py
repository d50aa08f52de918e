"""Hugging Face folders: loading GPT-2 weights into a course GPT, and writing a course model and
its tokenizer so that ``transformers.pipeline("text-generation", model=folder)`` runs it.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import transformers
from transformers import GPT2LMHeadModel

from .. import _validate as validate
from .._rng import leaves_rng_alone
from ..data import REPLACEMENT_CHAR, UNKNOWN_POLICIES
from ..model import GPT
from ..modern_gpt import ModernGPT
from .families import to_hf_modern
from .gpt2 import from_hf_gpt2, to_hf_gpt2

__all__ = ["PretrainedWeightsNotFound", "from_pretrained", "char_tokenizer_to_hf", "save_pretrained"]


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


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
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


@leaves_rng_alone   # builds a model (random initial weights) only to overwrite them
def save_pretrained(model: GPT | ModernGPT, tokenizer: Any, folder: str | os.PathLike) -> Path:
    """Write ``model`` and ``tokenizer`` to ``folder`` for ``transformers.pipeline("text-generation")``.

    A GPT goes as GPT-2; a ModernGPT as the transformers decoder that expresses its options
    (:func:`course_lib.hf.families.family_for`: Llama, Mistral, Qwen 3, Arcee or Apertus).

    ``tokenizer``: a transformers fast tokenizer (data.train_subword_tokenizer) or the
    course's CharTokenizer. Returns the folder.
    """
    if not isinstance(model, (GPT, ModernGPT)):
        raise TypeError(f"model: expected a course_lib GPT or ModernGPT, got {validate.describe(model)}")
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
    hf_model = (to_hf_gpt2(model) if isinstance(model, GPT) else to_hf_modern(model)).eval()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(hf_model.config, attr, getattr(hf_tokenizer, attr, None))
        setattr(hf_model.generation_config, attr, getattr(hf_tokenizer, attr, None))
    # Greedy unless the caller asks otherwise: the same text as course_lib.generate(temperature=0).
    hf_model.generation_config.do_sample = False
    # The pipeline's default of 256 new tokens would run past the position table of a
    # small model; half the context leaves room for the prompt. (A max_length cap
    # would make transformers warn whenever a caller passes max_new_tokens.)
    hf_model.generation_config.max_new_tokens = max(1, max_tokens // 2)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder
