"""Train once, replay after: the test of the learner copies need not train what the solution pass trained.

``make notebooks`` runs the solution notebooks with ``COURSE_TRAIN_RECORD=<folder>``: every
:func:`course_lib.train.train` trains as always, then records the trained weights, the history and
the random state it ended with under a key made of everything the training depends on (the initial
weights, the model's and the training's configuration, the data, the random state, the device and
the versions). ``make learner-copies`` then runs the learner copies with ``COURSE_TRAIN_REPLAY=<folder>``:
a training whose key was recorded is replayed (the model gets the recorded weights, the random state
moves on as the training moved it) instead of run again. Any difference in what went in gives a
different key, and that training simply runs.

Neither variable is set anywhere but the Makefile's test targets: students and instructors always train.
"""
from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._atomic import atomic_file
from .runtime import __version__
from .runtime import device as default_device

__all__ = ["RECORD_ENV", "REPLAY_ENV", "active", "run_key", "replay", "record", "replayable"]

RECORD_ENV = "COURSE_TRAIN_RECORD"
REPLAY_ENV = "COURSE_TRAIN_REPLAY"


def active() -> bool:
    """Whether this process records or replays trainings at all."""
    return bool(os.environ.get(RECORD_ENV) or os.environ.get(REPLAY_ENV))


def _hash_tensor(digest: Any, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().cpu().contiguous()
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.numel():
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def _hash_value(digest: Any, value: Any) -> None:
    """Tensors by their bytes, data classes by their fields, splits by their attributes, the rest by repr."""
    if isinstance(value, torch.Tensor):
        _hash_tensor(digest, value)
    elif is_dataclass(value) and not isinstance(value, type):
        digest.update(type(value).__name__.encode())
        _hash_value(digest, asdict(value))
    elif isinstance(value, dict):
        for name in sorted(value, key=str):
            digest.update(repr(name).encode())
            _hash_value(digest, value[name])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _hash_value(digest, item)
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(repr(value).encode())
    else:   # a data split: its type and its attributes (the token ids)
        digest.update(type(value).__name__.encode())
        _hash_value(digest, dict(vars(value)))


def run_key(model: nn.Module, splits: Iterable[Any], config: Any, device: torch.device) -> str:
    """The SHA-256 of everything a training's result depends on."""
    digest = hashlib.sha256()
    for part in (type(model).__name__, model.config, model.state_dict(), list(splits), config,
                 torch.get_rng_state(), device.type, torch.__version__, __version__):
        _hash_value(digest, part)
    return digest.hexdigest()


def _path(env: str, key: str) -> Path | None:
    folder = os.environ.get(env)
    return Path(folder) / f"{key}.pt" if folder else None


def replay(key: str, model: nn.Module) -> dict[str, Any] | None:
    """Give ``model`` the recorded result of the training ``key`` and return its history as a dict;
    None when replay is off or nothing was recorded under that key."""
    path = _path(REPLAY_ENV, key)
    if path is None or not path.is_file():
        return None
    recorded = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(recorded["state_dict"])
    model.train(recorded["training"])
    torch.set_rng_state(recorded["rng_state"])
    print(f"(replayed a training recorded by the solution notebooks' test run: {REPLAY_ENV} is set)")
    return recorded["history"]


def record(key: str, model: nn.Module, history: dict[str, Any]) -> None:
    """Record the result of the training ``key``, when recording is on."""
    path = _path(RECORD_ENV, key)
    if path is None:
        return
    recorded = {"state_dict": {name: t.detach().cpu() for name, t in model.state_dict().items()},
                "training": model.training, "rng_state": torch.get_rng_state(), "history": history}
    with atomic_file(path, "wb") as handle:
        torch.save(recorded, handle)


def _key_if_replayable(model: nn.Module, splits: tuple[Any, Any], config: Any,
                       options: dict[str, Any]) -> tuple[str, torch.device] | None:
    """The run's key and device when this training may be recorded or replayed, else None.

    Only a whole training from scratch on one process, stopped by its step count: a resumed run,
    torchrun, a clock, a stop request or a checkpoint callback each make it one of a kind.
    Anything that cannot even be keyed (a wrong argument) is left to the training loop to refuse.
    """
    ctx = options.get("ctx")
    if (not active() or options.get("state") is not None or (ctx is not None and ctx.enabled)
            or options.get("on_checkpoint") is not None or options.get("should_stop") is not None
            or getattr(config, "seconds", 0) is not None):   # (no .seconds: not a TrainConfig; the loop says so)
        return None
    try:
        device = options.get("device")
        device = torch.device(device) if device is not None else default_device()
        return run_key(model, splits, config, device), device
    except Exception:   # the loop's own checks name the wrong argument
        return None


def replayable(history_from_dict: Callable[[dict[str, Any]], Any]):
    """Decorate the training loop ``train(model, train_split, val_split, config, **options)``.

    Outside the Makefile's notebook tests it calls the loop and nothing else. Under them it
    replays a recorded training with the same key, or trains and records the result.
    """
    def decorate(loop: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(loop)
        def train(model, train_split, val_split, config, **options):   # named as the loop: errors say train()
            keyed = _key_if_replayable(model, (train_split, val_split), config, options)
            if keyed is not None:
                key, device = keyed
                replayed = replay(key, model.to(device))
                if replayed is not None:
                    return history_from_dict(replayed)
            history = loop(model, train_split, val_split, config, **options)
            if keyed is not None:
                record(keyed[0], model, history.to_dict())
            return history
        return train
    return decorate
