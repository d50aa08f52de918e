"""Checkpoints: weights, the config that built them, and the tokenizer, saved atomically."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .model import GPT, GPTConfig

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "unwrap_model"]

FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    model: GPT
    tokenizer: Any
    extra: dict[str, Any]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DistributedDataParallel and torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _tokenizer_to_dict(tokenizer: Any) -> dict[str, Any] | None:
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "to_dict") and hasattr(tokenizer, "stoi"):
        return {"kind": "char", "data": tokenizer.to_dict()}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return {"kind": "subword", "data": backend.to_str(),
                "eos_token": getattr(tokenizer, "eos_token", None)}
    raise TypeError(f"tokenizer: expected a CharTokenizer or a transformers fast tokenizer, "
                    f"got {type(tokenizer).__name__}")


def _tokenizer_from_dict(saved: dict[str, Any] | None) -> Any:
    if saved is None:
        return None
    if saved["kind"] == "char":
        from .data import CharTokenizer
        return CharTokenizer.from_dict(saved["data"])
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    eos = saved.get("eos_token")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(saved["data"]),
                                   eos_token=eos, bos_token=eos, unk_token=eos)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, tokenizer: Any = None,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write model weights, its GPTConfig, the tokenizer and ``extra`` (plain data) to ``path``.

    The file is written next to its destination and then renamed, so an interrupted
    save never leaves a half-written checkpoint behind.
    """
    model = unwrap_model(model)
    if not isinstance(model, GPT):
        raise TypeError(f"model: expected a course_lib GPT, got {type(model).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": FORMAT_VERSION,
        "config": model.config.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "tokenizer": _tokenizer_to_dict(tokenizer),
        "extra": dict(extra or {}),
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _config_differences(saved: GPTConfig, wanted: GPTConfig) -> list[str]:
    a, b = saved.to_dict(), wanted.to_dict()
    return [f"{k}: checkpoint has {a[k]!r}, your model has {b[k]!r}" for k in a if a[k] != b.get(k)]


def load_checkpoint(path: str | os.PathLike, model: GPT | None = None,
                    device: torch.device | str | None = None) -> Checkpoint:
    """Load a checkpoint saved by :func:`save_checkpoint` (with ``weights_only=True``).

    With ``model``, the weights go into that model, after checking that its config matches.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}; train one with "
                                f"`python -m course_lib train --preset tiny --out DIR`")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # noqa: BLE001 - any unreadable file gets the same clear message
        raise ValueError(f"path: {path} is not a readable course checkpoint ({exc})") from exc
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"path: {path} is not a course checkpoint (format_version "
                         f"{payload.get('format_version') if isinstance(payload, dict) else None!r}, "
                         f"expected {FORMAT_VERSION})")
    config = GPTConfig.from_dict(payload["config"])
    if model is None:
        model = GPT(config)
    else:
        if not isinstance(model, GPT):
            raise TypeError(f"model: expected a course_lib GPT, got {type(model).__name__}")
        differences = _config_differences(config, model.config)
        if differences:
            raise ValueError("model: the checkpoint was trained with a different config, so its weights "
                             "do not fit:\n  " + "\n  ".join(differences)
                             + "\nBuild the model with the checkpoint's config, or call "
                               "load_checkpoint(path) without a model.")
    model.load_state_dict(payload["state_dict"])
    if device is not None:
        model.to(device)
    return Checkpoint(model, _tokenizer_from_dict(payload["tokenizer"]), payload["extra"])
