"""Helpers shared by the checkers of notebooks 04-07: copying weights, randomising them, recording
calls. Building a candidate is ``_student_code.construct``; comparing is ``_student_code.close``."""
from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._student_code import close, expect_parameters, load_parameters


def as_tensor(value: Any) -> Any:
    """A numpy array (or anything numpy-like) becomes a tensor (one of a dtype torch cannot read, such as numpy's
    long double, in float64); everything else is left alone."""
    if isinstance(value, torch.Tensor) or value is None:
        return value
    if type(value).__module__.startswith("numpy") and hasattr(value, "shape"):
        try:
            return torch.as_tensor(value)
        except (TypeError, RuntimeError, ValueError):   # a dtype torch cannot read: numpy's long double, objects
            wider = {"f": "float64", "c": "complex128"}.get(getattr(value.dtype, "kind", ""), "float64")
            try:
                return torch.as_tensor(value.astype(wider))
            except (TypeError, RuntimeError, ValueError):
                return value   # not numbers: the caller names what came back
    return value


def as_values(result: Any, count: int) -> Any:
    """A generator, map or zip a student returned where ``count`` values are asked (`a, b = f(...)` unpacks it
    the same) becomes a tuple of its first ``count + 1`` values (one more shows a surplus); the rest is left."""
    if isinstance(result, Iterator):
        return tuple(itertools.islice(result, count + 1))
    return result


def accepts(fn: Any, name: str, *, named: bool = False) -> bool:
    """Whether ``fn`` (a function, or a class's constructor) takes a parameter called ``name``: by that name,
    or through ``**kwargs`` (a constructor passing it on), unless ``named`` (an option the student chose to write,
    such as 5.1's ``stride``, is only theirs if it has its name)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or (not named and any(p.kind is p.VAR_KEYWORD for p in params.values()))


def copy_weights(reference: nn.Module, candidate: nn.Module, what: str) -> None:
    """Give ``candidate`` the reference's parameters, matched by name."""
    params = dict(reference.named_parameters())
    expect_parameters(candidate, {name: tuple(p.shape) for name, p in params.items()}, what,
                      "Keep the constructor exactly as given (same attribute names and sizes), so the checker "
                      "can copy the same weights into your version and the reference.", diagnosis="mismatch")
    load_parameters(candidate, params)


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
    """Record how ``module`` is called: its first argument (and shape), the cache and its length, its mode and
    the dtype of the torch.autocast it ran under (None outside one)."""
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
                      "cache": cache, "cache_length": length, "training": module.training,
                      "autocast": next((torch.get_autocast_dtype(device) for device in ("cpu", "cuda")
                                        if torch.is_autocast_enabled(device)), None)})

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


@dataclass(frozen=True)
class ProcedureExample:
    """What ``engine.function_example`` needs of a procedure (5.3, 5.4, 6.2, 7.2), whose verdict comes from a
    judge of its own: the reference as a function of the cases' arguments, the tiny cases (``engine.Case``),
    the arguments' names. The student's procedure is wrapped into the same function of those arguments."""

    reference: Callable[..., Any]
    cases: Callable[[], Sequence[Any]]
    arg_names: tuple[str, ...]
    examples: None = None   # the cases are tiny already
