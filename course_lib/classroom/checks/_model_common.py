"""Helpers shared by the checkers of notebooks 04-07: copying weights, randomising them, recording
calls. Building a candidate is ``_student_code.construct``; comparing is ``_student_code.close``."""
from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..verdict import fail
from ._student_code import close


def as_tensor(value: Any) -> Any:
    """A numpy array (or anything numpy-like) becomes a tensor; everything else is left alone."""
    if isinstance(value, torch.Tensor) or value is None:
        return value
    if type(value).__module__.startswith("numpy") and hasattr(value, "shape"):
        return torch.as_tensor(value)
    return value


def accepts(fn: Any, name: str) -> bool:
    """Whether ``fn`` (a function, or a class's constructor) takes a parameter called ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def copy_weights(reference: nn.Module, candidate: nn.Module, what: str) -> None:
    """Give ``candidate`` the reference's parameters, matched by name."""
    ref = dict(reference.named_parameters())
    got = dict(candidate.named_parameters())
    missing = [name for name in ref if name not in got]
    extra = [name for name in got if name not in ref]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if extra:
            parts.append(f"unexpected {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")
        fail("mismatch", f"{what}'s parameters are not named like the reference's ({'; '.join(parts)}). "
                         f"Keep the constructor exactly as given (same attribute names), so the checker "
                         f"can copy the same weights into your version and the reference.")
    for name, param in ref.items():
        if got[name].shape != param.shape:
            fail("shape", f"{what}: parameter {name} has shape {tuple(got[name].shape)}, the reference's "
                          f"has {tuple(param.shape)}. Keep the constructor as given.")
    with torch.no_grad():
        for name, param in ref.items():
            got[name].copy_(param)


def randomize_(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Weights far from their defaults, so that every sublayer visibly changes the output."""
    with torch.no_grad():
        for sub in module.modules():
            for name, param in sub.named_parameters(recurse=False):
                noise = torch.randn(param.shape, generator=generator)
                if isinstance(sub, nn.LayerNorm):
                    param.copy_((1.0 if name == "weight" else 0.0) + 0.3 * noise)
                elif isinstance(sub, nn.Embedding):
                    param.copy_(noise)
                elif param.dim() >= 2:
                    param.copy_(noise / math.sqrt(param.shape[-1]))
                else:
                    param.copy_(0.2 * noise)
    return module


@contextlib.contextmanager
def recording_calls(module: nn.Module) -> Iterator[list[dict[str, Any]]]:
    """Record how ``module`` is called: its first argument (and shape), the cache and its length."""
    calls: list[dict[str, Any]] = []

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else next(iter(kwargs.values()), None)
        cache = args[1] if len(args) > 1 else kwargs.get("cache")
        length = None
        if cache:
            with contextlib.suppress(Exception):
                length = cache[0].length
        calls.append({"shape": tuple(first.shape) if isinstance(first, torch.Tensor) else None,
                      "ids": first.detach().clone() if isinstance(first, torch.Tensor) else None,
                      "cache": cache, "cache_length": length, "training": module.training})

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def extend(message: str, more: str) -> str:
    """Append a sentence to a message that may already end with a full stop."""
    return f"{message.rstrip().rstrip('.')}. {more}"


def same_when_called_twice(run: Callable[[], torch.Tensor]) -> bool:
    first = run()
    second = run()
    return close(first, second)
