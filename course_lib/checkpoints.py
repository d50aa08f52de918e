"""Checkpoints: weights, the config that built them, the tokenizer and (for resuming) the training
state, saved atomically and verified with a checksum when loaded.

A checkpoint is what ``torch.save`` writes for a dict of tensors and plain values, so that
``torch.load(path, weights_only=True)`` opens it like any PyTorch file. Its SHA-256 travels inside
the file: torch's file is a zip archive, and a zip archive may end with a comment; ours is
``course_lib sha256=<hex>``, the hash of every byte before the comment's length field. The hash
covers every byte torch reads (torch checks only some of its records), the comment checks itself,
and copying the file alone keeps it.
"""
from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _validate as validate
from ._atomic import atomic_file
from .model import GPT
from .modern_gpt import ARCHITECTURES, ModernGPT

__all__ = ["Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint", "unwrap_model", "architecture_of",
           "remove_stale_temporaries"]

FORMAT_VERSION = 3
# The zip archive's comment holding the checksum; it is the file's last bytes, after the 2-byte
# comment length that closes the end-of-central-directory record (whose 4-byte signature is EOCD).
CHECKSUM_PREFIX = b"course_lib sha256="
_COMMENT_LENGTH = len(CHECKSUM_PREFIX) + 64
_EOCD = b"PK\x05\x06"
_EOCD_SIZE = 22   # the record without its comment
# A name no user file is likely to end with: remove_stale_temporaries deletes only these.
TMP_SUFFIX = ".course_lib-partial"


class CheckpointError(ValueError):
    """A file that is not a readable course checkpoint (damaged, truncated, or something else)."""


@dataclass
class Checkpoint:
    model: GPT | ModernGPT
    tokenizer: Any
    extra: dict[str, Any]
    training: dict[str, Any] | None = None   # what train() needs to continue exactly; None for weights only


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DistributedDataParallel and torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def architecture_of(model: nn.Module) -> str:
    """``"gpt"`` or ``"modern"``: which of :data:`ARCHITECTURES` ``model`` is."""
    for name, (cls, _) in ARCHITECTURES.items():
        if type(model) is cls:
            return name
    raise TypeError(f"model: expected a course_lib GPT or ModernGPT, got {type(model).__name__}")


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


_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _plain(name: str, value: Any) -> Any:
    """``value`` as data ``torch.load(weights_only=True)`` accepts, or a TypeError naming the key.

    Types that only look plain are converted without losing their value: NumPy scalars
    (``np.float64(1.5)`` -> ``1.5``), subclasses of int, float and str (an IntEnum), and
    OrderedDict/defaultdict/namedtuple (-> dict, tuple). Anything else is refused now, at save time,
    rather than making the file unloadable.
    """
    if type(value) in _SCALARS:
        return value
    if type(value) in (torch.Tensor, nn.Parameter):
        return value
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item) and getattr(value, "ndim", None) == 0:
        return _plain(name, item())   # a NumPy scalar: its Python value
    for base in (bool, int, float, str):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, (list, tuple)):
        items = [_plain(f"{name}[{i}]", item) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        plain = {}
        for key, item in value.items():
            if type(key).__module__ == "numpy" and getattr(key, "ndim", None) == 0:
                key = key.item()
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"{name}: expected str or int keys, got key {validate.describe(key)}")
            plain[str(key) if isinstance(key, str) else int(key)] = _plain(f"{name}[{key!r}]", item)
        return plain
    hint = ("; convert it with .to_dict()" if hasattr(value, "to_dict") else
            "; convert it with torch.as_tensor()" if type(value).__module__ == "numpy" else "")
    raise TypeError(f"{name}: expected plain data (None, bool, int, float, str, tensors, and lists or "
                    f"dicts of them) that a checkpoint can load back safely, got "
                    f"{type(value).__name__}{hint}")


def write_atomically(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` next to ``path``, flush it to disk, then rename it over ``path``.

    A reader sees the old file or the new one, never half of one, even if the process is
    killed mid-write; the temporary file is removed on any error (``remove_stale_temporaries``
    cleans up after a kill that gave it no chance).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path, got {validate.describe(path)}")
    if not isinstance(data, bytes):
        raise TypeError(f"data: expected bytes, got {type(data).__name__}")
    with atomic_file(path, "wb", suffix=TMP_SUFFIX) as handle:
        handle.write(data)
    return Path(path)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that runs killed mid-write (SIGKILL, power loss) left in ``folder``.

    Only files this module names (``.NAME.<random>.course_lib-partial``) are removed, never a user's
    ``.tmp``. Call it only while holding the folder (``RunFolder.prepare``): a live run's
    half-written file has the same kind of name.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder: expected a folder path, got {validate.describe(folder)}")
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for tmp in folder.glob(f".*{TMP_SUFFIX}"):
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
    return removed


def save_checkpoint(path: str | os.PathLike, model: nn.Module, tokenizer: Any = None,
                    extra: dict[str, Any] | None = None, *,
                    training: dict[str, Any] | None = None) -> Path:
    """Write model weights, its GPTConfig, the tokenizer, ``extra`` and ``training`` (plain data) to ``path``.

    ``torch.load(path, weights_only=True)`` reads the file as a dict. It ends with a SHA-256
    checksum (see the module's docstring) that :func:`load_checkpoint` verifies, and it is
    written next to its destination and then renamed, so an interrupted save never leaves a
    half-written checkpoint behind. ``extra`` and ``training`` must be plain data (see the
    error message otherwise): what could not be loaded back safely is refused now, not later.
    """
    validate.path("path", path, "a file path for the checkpoint")
    model = unwrap_model(model)
    architecture = architecture_of(model)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra: expected a dict or None, got {validate.describe(extra)}")
    if training is not None and not isinstance(training, dict):
        raise TypeError(f"training: expected a dict or None, got {validate.describe(training)}")
    extra = _plain("extra", extra)
    training = _plain("training", training)
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path: expected a file name for the checkpoint, got the folder {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": FORMAT_VERSION,
        "architecture": architecture,
        "config": _plain("config", model.config.to_dict()),   # a numpy int in a config becomes an int
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "tokenizer": _tokenizer_to_dict(tokenizer),
        "extra": dict(extra or {}),
        "training": training,
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return write_atomically(path, _with_checksum(buffer.getvalue()))


def _with_checksum(archive: bytes) -> bytes:
    """torch.save's zip archive with our checksum as its comment (torch writes it without one)."""
    if archive[-_EOCD_SIZE:-_EOCD_SIZE + 4] != _EOCD or archive[-2:] != b"\x00\x00":
        raise RuntimeError("torch.save wrote a file that does not end like a zip archive without a comment; "
                           "this torch version is not supported by course_lib's checkpoints")
    body = archive[:-2]
    comment = CHECKSUM_PREFIX + hashlib.sha256(body).hexdigest().encode("ascii")
    return body + len(comment).to_bytes(2, "little") + comment


def _read_verified(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    body, length, comment = raw[:-_COMMENT_LENGTH - 2], raw[-_COMMENT_LENGTH - 2:-_COMMENT_LENGTH], \
        raw[-_COMMENT_LENGTH:]
    if raw.startswith(b"COURSE-CHECKPOINT"):
        raise CheckpointError(f"path: {path} was written by an earlier course_lib (a text header before the "
                              f"data), which this version no longer reads; train the run again (its checkpoints "
                              f"are now plain PyTorch files)")
    if not raw.startswith(b"PK\x03\x04"):
        raise CheckpointError(f"path: {path} is not a course checkpoint (it does not start like a torch.save "
                              f"file); expected a file written by save_checkpoint or `python -m course_lib train`")
    if (len(raw) < _EOCD_SIZE + _COMMENT_LENGTH or not comment.startswith(CHECKSUM_PREFIX)
            or int.from_bytes(length, "little") != _COMMENT_LENGTH
            or body[-_EOCD_SIZE + 2:-_EOCD_SIZE + 6] != _EOCD):
        raise CheckpointError(f"path: {path} is damaged or was not written by save_checkpoint (it does not end "
                              f"with course_lib's checksum); use an earlier checkpoint or train again")
    if hashlib.sha256(body).hexdigest().encode("ascii") != comment[len(CHECKSUM_PREFIX):]:
        raise CheckpointError(f"path: {path} is damaged (its SHA-256 does not match the one recorded at its "
                              f"end); use an earlier checkpoint or train again")
    try:
        payload = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # never repeat torch's advice to unpickle unsafely
        raise CheckpointError(f"path: {path} is not a course checkpoint: its checksum is right but torch "
                              f"refuses its contents ({type(exc).__name__})") from None
    version = payload.get("format_version") if isinstance(payload, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"path: {path} is not a course checkpoint (format_version {version!r}, "
                              f"expected {FORMAT_VERSION})")
    return payload


def _config_differences(saved: Any, wanted: Any) -> list[str]:
    a, b = saved.to_dict(), wanted.to_dict()
    return [f"{k}: checkpoint has {a[k]!r}, your model has {b[k]!r}" for k in a if a[k] != b.get(k)]


def load_checkpoint(path: str | os.PathLike, model: GPT | ModernGPT | None = None,
                    device: torch.device | str | None = None) -> Checkpoint:
    """Load and verify a checkpoint saved by :func:`save_checkpoint` (never unpickling code).

    With ``model``, the weights go into that model, after checking that its config matches.
    A damaged file raises :class:`CheckpointError` naming the file.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path, got {validate.describe(path)}")
    if isinstance(path, str) and not path.strip():   # Path("") is ".", the current folder
        raise ValueError(f"path: expected the path of a checkpoint file, got {validate.describe(path)}")
    path = Path(path)
    if device is not None:
        device = validate.device("device", device)   # before reading: 'gpu' is named, not torch's own error
    if path.is_dir():
        inside = path / "checkpoint.pt"
        hint = (f"; the checkpoint in it is {inside}" if inside.is_file() else
                "; pass the checkpoint file itself (a run folder holds checkpoint.pt)")
        raise IsADirectoryError(f"path: {path} is a folder, not a checkpoint file{hint}")
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}; train one with "
                                f"`python -m course_lib train --preset tiny --out DIR`")
    payload = _read_verified(path)
    architecture = payload.get("architecture")
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"path: {path} holds a model of unknown architecture {architecture!r}; "
                              f"expected one of {sorted(ARCHITECTURES)} (a newer course_lib wrote it?)")
    _check_payload(path, payload)
    model_class, config_class = ARCHITECTURES[architecture]
    try:
        config = config_class.from_dict(payload["config"])
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"path: {path} holds a config that builds no model "
                              f"({_first_line(exc)}); use an earlier checkpoint or train again") from None
    if model is None:
        # The random initial weights are replaced below: draw them from a forked generator, so
        # loading a checkpoint leaves the caller's random numbers as they were.
        with torch.random.fork_rng(devices=[]):
            model = model_class(config)
    else:
        if architecture_of(model) != architecture:
            raise TypeError(f"model: the checkpoint holds a {model_class.__name__}, got a {type(model).__name__}; "
                            f"call load_checkpoint(path) without a model to build the right one")
        differences = _config_differences(config, model.config)
        if differences:
            raise ValueError("model: the checkpoint was trained with a different config, so its weights "
                             "do not fit:\n  " + "\n  ".join(differences)
                             + "\nBuild the model with the checkpoint's config, or call "
                               "load_checkpoint(path) without a model.")
    state = payload["state_dict"]
    if not all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()):
        raise CheckpointError(f"path: {path} holds NaN or infinite weights; use an earlier checkpoint")
    _check_weights_fit(path, state, model)
    try:
        tokenizer = _tokenizer_from_dict(payload["tokenizer"])
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"path: {path} holds a tokenizer that cannot be rebuilt ({_first_line(exc)}); "
                              f"use an earlier checkpoint or train again") from None
    model.load_state_dict(state)
    if device is not None:
        model.to(device)
    return Checkpoint(model, tokenizer, payload["extra"], payload.get("training"))


# What save_checkpoint writes under each key: a file edited by hand (its checksum recomputed) is named here,
# in one line, rather than failing later with a KeyError or load_state_dict's page of text.
_PAYLOAD_KINDS = {"config": (dict,), "state_dict": (dict,), "tokenizer": (dict, type(None)), "extra": (dict,),
                  "training": (dict, type(None))}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _check_payload(path: Path, payload: dict[str, Any]) -> None:
    for key, kinds in _PAYLOAD_KINDS.items():
        if key == "training" and key not in payload:
            continue   # checkpoints from before training state was saved
        if key not in payload:
            raise CheckpointError(f"path: {path} has no {key!r} entry (changed by hand?); expected what "
                                  f"save_checkpoint writes: {sorted(_PAYLOAD_KINDS)}")
        if not isinstance(payload[key], kinds):
            raise CheckpointError(f"path: {path} has a {key!r} entry of type {type(payload[key]).__name__}, "
                                  f"expected {' or '.join(k.__name__ for k in kinds)} (changed by hand?)")
    for name, value in payload["state_dict"].items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"path: {path} has a state_dict entry {name!r} that is "
                                  f"{validate.describe(value)}, expected a tensor (changed by hand?)")


def _check_weights_fit(path: Path, state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Every weight the model has, of its shape, and no other: or one line naming the first that is not."""
    wanted = model.state_dict()
    missing = [k for k in wanted if k not in state]
    extra = [k for k in state if k not in wanted]
    if missing or extra:
        what = (f"no weight {missing[0]!r}" + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
                if missing else f"a weight {extra[0]!r} the model does not have"
                + (f" ({len(extra)} such)" if len(extra) > 1 else ""))
        raise CheckpointError(f"path: {path} has {what} for its config (changed by hand?); use an earlier "
                              f"checkpoint or train again")
    # parameters only: buffers such as a counted n-gram model's tables take the size of what was counted
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for key, value in state.items():
        if key in parameters and tuple(value.shape) != tuple(wanted[key].shape):
            raise CheckpointError(f"path: {path} has weight {key!r} of shape {tuple(value.shape)}, its config "
                                  f"needs {tuple(wanted[key].shape)} (changed by hand?); use an earlier checkpoint")
        if value.is_floating_point() != wanted[key].is_floating_point():
            raise CheckpointError(f"path: {path} has weight {key!r} of dtype {value.dtype}, expected "
                                  f"{wanted[key].dtype} (changed by hand?); use an earlier checkpoint")
