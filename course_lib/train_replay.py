"""Train once, replay after: the notebook tests need not train twice what they trained once.

This is test machinery, kept out of the files students read: nothing in the lesson's code knows of it.
The Makefile's notebook targets put ``tests/train_replay_hook`` on ``PYTHONPATH``; its
``sitecustomize`` wraps the course's training entry points as they are imported, in every kernel, and
only while one of two variables is set:

- ``COURSE_TRAIN_RECORD=<folder>`` (``make notebooks``): each training runs as always, then its result
  (the trained weights, the losses and the random state it ended with) is recorded under a key made
  of everything the training depends on.
- ``COURSE_TRAIN_REPLAY=<folder>`` (``make learner-copies``, the browser test): a training whose key
  was recorded is replayed (the model gets the recorded weights, the random state moves on as the
  training moved it) instead of run again.

Any difference in what went in gives a different key, and that training simply runs. The entry points
(:data:`ENTRY_POINTS`): ``course_lib.train.train`` (notebooks 05, 07, 09, 11 and every preset),
``course_lib.heads.train_induction`` (notebook 11) and ``course_lib.classroom.capstone.train_parts``
(notebook 08, also each trial of ``find_blame``).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ._atomic import atomic_file
from ._rng import preserved
from .runtime import __version__
from .runtime import device as default_device

__all__ = ["RECORD_ENV", "REPLAY_ENV", "ENTRY_POINTS", "active", "run_key", "replay", "record",
           "replayable", "replayable_induction", "replayable_parts", "wrap_module"]

RECORD_ENV = "COURSE_TRAIN_RECORD"
REPLAY_ENV = "COURSE_TRAIN_REPLAY"
REPLAYED = f"(replayed a training recorded by the solution notebooks' test run: {REPLAY_ENV} is set)"


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


@functools.lru_cache(maxsize=1)
def _course_code() -> str:
    """The SHA-256 of every source file of course_lib: a record made before any change of the course's
    code (the training loop, the models) is never replayed after it."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _key(*parts: Any) -> str:
    """The SHA-256 of ``parts``, the versions of torch and the course, and the course's code."""
    digest = hashlib.sha256()
    for part in (*parts, torch.__version__, __version__, _course_code()):
        _hash_value(digest, part)
    return digest.hexdigest()


def run_key(model: nn.Module, splits: Iterable[Any], config: Any, device: torch.device) -> str:
    """The SHA-256 of everything a training's result depends on."""
    return _key(type(model).__name__, model.config, model.state_dict(), list(splits), config,
                torch.get_rng_state(), device.type)


def _path(env: str, key: str) -> Path | None:
    folder = os.environ.get(env)
    return Path(folder) / f"{key}.pt" if folder else None


def _load(key: str, same_pass: bool = False) -> dict[str, Any] | None:
    """The record of the training ``key`` under COURSE_TRAIN_REPLAY (the solutions' pass), saying so.

    ``same_pass``: for a training that prints nothing, also a record from earlier in this recording
    pass, silently, since the stored outputs strict nbval compares are the same either way (notebook 08
    trains the reference and the solution's own parts: the same code on the same batches)."""
    for env in (REPLAY_ENV, RECORD_ENV) if same_pass else (REPLAY_ENV,):
        path = _path(env, key)
        if path is not None and path.is_file():
            if env == REPLAY_ENV:
                print(REPLAYED)
            return torch.load(path, map_location="cpu", weights_only=True)
    return None


def _save(key: str, recorded: dict[str, Any]) -> None:
    path = _path(RECORD_ENV, key)
    if path is not None:
        with atomic_file(path, "wb") as handle:
            torch.save(recorded, handle)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu() for name, t in model.state_dict().items()}


def replay(key: str, model: nn.Module) -> dict[str, Any] | None:
    """Give ``model`` the recorded result of the training ``key`` and return its history as a dict;
    None when replay is off or nothing was recorded under that key."""
    recorded = _load(key)
    if recorded is None:
        return None
    model.load_state_dict(recorded["state_dict"])
    model.train(recorded["training"])
    torch.set_rng_state(recorded["rng_state"])
    return recorded["history"]


def record(key: str, model: nn.Module, history: dict[str, Any]) -> None:
    """Record the result of the training ``key``, when recording is on."""
    _save(key, {"state_dict": _weights(model), "training": model.training, "rng_state": torch.get_rng_state(),
                "history": history})


# ------------------------------------------------------------------ course_lib.train.train

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
    """Wrap the training loop ``train(model, train_split, val_split, config, **options)``.

    With neither variable set it calls the loop and nothing else. Otherwise it replays a recorded
    training with the same key, or trains and records the result.
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


# ------------------------------------------------------------------ course_lib.heads.train_induction

def replayable_induction(train_induction: Callable[..., Any], heads: ModuleType) -> Callable[..., Any]:
    """Wrap notebook 11's ``train_induction(config=None)``: it seeds its own model and data and leaves
    the caller's random state alone, so its configuration (and the versions) is all its result depends on."""
    @functools.wraps(train_induction)
    def wrapper(config=None):
        if not active() or not isinstance(config, (heads.InductionConfig, type(None))):
            return train_induction(config)
        config = heads.InductionConfig() if config is None else config
        key = _key("train_induction", config)
        recorded = _load(key)
        if recorded is not None:
            with preserved():   # building the model draws initial weights: the caller's stream is untouched
                model = heads.AttentionOnly(config)
            model.load_state_dict(recorded["state_dict"])
            model.eval()
            return heads.InductionRun(model, config, **recorded["curves"])
        run = train_induction(config)
        _save(key, {"state_dict": _weights(run.model), "curves": {
            "steps": run.steps, "first_half": run.first_half, "second_half": run.second_half,
            "seconds": run.seconds}})
        return run
    return wrapper


# ------------------------------------------------------------------ course_lib.classroom.capstone.train_parts

def _parts_key(collection: Any, yours: Any, setup: Any, steps: Any) -> str:
    """What a run of ``train_parts`` depends on: the code of every part it defines (the student's or the
    solution's, by syntax tree: comments and layout aside), the setup's data, model and schedule."""
    chosen = set(collection.yours() if yours is None else yours)
    code = {ex_id: ast.dump(ast.parse(part.source if ex_id in chosen else part.exercise.solution))
            for ex_id, part in collection.parts.items()}
    first_batch = setup.batches(torch.Generator().manual_seed(setup.seed))   # the batches' stream, by its start
    return _key("train_parts", code, setup.name, setup.config, setup.val_inputs, setup.val_targets, first_batch,
                setup.steps if steps is None else steps, setup.learning_rate, setup.eval_every, setup.seed)


def replayable_parts(train_parts: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap notebook 08's ``train_parts(collection, yours, setup, *, steps=None, label="")``. A replay
    builds the run with a one-step training (its label, its parts and its model, exactly as the real
    call makes them), then gives it the recorded losses, weights and random state."""
    @functools.wraps(train_parts)
    def wrapper(collection, yours, setup, *, steps=None, label=""):
        if not active():
            return train_parts(collection, yours, setup, steps=steps, label=label)
        try:
            key = _parts_key(collection, yours, setup, steps)
        except Exception:   # a wrong argument or a part that does not parse: train_parts says what is wrong
            return train_parts(collection, yours, setup, steps=steps, label=label)
        recorded = _load(key, same_pass=True)
        if recorded is not None:
            run = train_parts(collection, yours, setup, steps=1, label=label)
            for name in ("step", "train_loss", "val_step", "val_loss", "failure"):
                setattr(run, name, recorded[name])
            run.model.load_state_dict(recorded["state_dict"])
            run.model.train(recorded["training"])
            torch.set_rng_state(recorded["rng_state"])
            return run
        run = train_parts(collection, yours, setup, steps=steps, label=label)
        if run.model is not None:   # a run that raised is quick, and left the random state where it was
            _save(key, {"step": run.step, "train_loss": run.train_loss, "val_step": run.val_step,
                        "val_loss": run.val_loss, "failure": run.failure, "rng_state": torch.get_rng_state(),
                        "state_dict": _weights(run.model), "training": run.model.training})
        return run
    return wrapper


# ------------------------------------------------------------------ the hook

def _wrap_train(module: ModuleType) -> None:
    module.train = replayable(module.History.from_dict)(module.train)


def _wrap_heads(module: ModuleType) -> None:
    module.train_induction = replayable_induction(module.train_induction, module)


def _wrap_capstone(module: ModuleType) -> None:
    module.train_parts = replayable_parts(module.train_parts)


ENTRY_POINTS: dict[str, Callable[[ModuleType], None]] = {
    "course_lib.train": _wrap_train,
    "course_lib.heads": _wrap_heads,
    "course_lib.classroom.capstone": _wrap_capstone,
}


def wrap_module(module: ModuleType) -> None:
    """Wrap the training entry point of ``module`` (one of :data:`ENTRY_POINTS`), once, right after it
    is executed and before anything imports its names. Called by ``tests/train_replay_hook``."""
    if getattr(module, "_train_replay_wrapped", False):
        return
    ENTRY_POINTS[module.__name__](module)
    module._train_replay_wrapped = True
