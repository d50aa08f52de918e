"""What a student's code must hand back: a tensor of the right kind, or a module.

One ``expect_tensor`` for every exercise (it replaces the attention checkers' ``expect_output``)
and one ``construct`` for every module exercise (it replaces ``build``). Each stops the check
with a Failure that says what came back instead.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..verdict import fail
from ._harness import call


def expect_cpu(value: torch.Tensor, what: str, device: torch.device | str | None = None) -> None:
    """Checks run on the CPU (the harness clears any default device), so results belong there too."""
    expected = torch.device(device or "cpu")
    if value.device.type != expected.type:
        fail("device", f"{what} returned a tensor on {value.device}, but its inputs are on {expected}: create "
                       f"new tensors with `device=x.device` (or `torch.zeros_like(x)`), and do not move the "
                       f"result with .to(...) / .cuda().")


def expect_finite(value: torch.Tensor, what: str) -> None:
    if value.is_floating_point() and not torch.isfinite(value).all():
        fail("nan", f"{what} returned NaN or infinite values. A softmax over a row whose scores are all -inf "
                    f"gives NaN: check that every query can attend to at least one key, and that you do "
                    f"not divide by zero.")


def _kind(value: Any) -> str:
    module = type(value).__module__
    return type(value).__name__ if module == "builtins" else module.split(".")[0] + "." + type(value).__name__


def expect_tensor(value: Any, shape: tuple[int, ...], what: str, *, dtype: torch.dtype | None = None,
                  device: torch.device | None = None, finite: bool = True) -> torch.Tensor:
    """A returned value must be a tensor of the given shape (dtype, device), with finite numbers.

    ``finite=False`` leaves NaN for later: the attention checkers first look for a known mistake,
    which says more than "NaN" (a mask applied after the softmax gives NaN too)."""
    if not isinstance(value, torch.Tensor):
        if value is None:
            fail("shape", f"{what} should return a torch.Tensor of shape {shape}, but returned nothing "
                          f"(did you forget `return`?).")
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            extra = " It looks like you return several things: return only the output tensor."
        else:
            extra = " Build the result with torch operations (or convert it with torch.as_tensor)."
        fail("dtype", f"{what} should return a torch.Tensor of shape {shape}, but returned a {_kind(value)}.{extra}")
    if tuple(value.shape) != tuple(shape):
        fail("shape", f"{what} returned shape {tuple(value.shape)}, expected {tuple(shape)}.",
             got=tuple(value.shape), expected=tuple(shape))
    expect_cpu(value, what, device)
    if dtype is not None and value.dtype != dtype:
        fail("dtype", f"{what} returned dtype {value.dtype}, expected {dtype} (the dtype of its inputs).")
    if finite:
        expect_finite(value, what)
    return value


def construct(cls: Any, *args: Any, what: str, shown: str | None = None, **kwargs: Any) -> nn.Module:
    """Instantiate a student's class; it must give an nn.Module. ``shown`` is the call as messages
    name it (default ``what(...)``)."""
    shown = shown or f"{what}(...)"
    if not callable(cls):
        fail("exception", f"Pass the class itself (e.g. `{what}`), not {type(cls).__name__}: it should be an "
                          f"nn.Module subclass.")
    module = call(cls, *args, what=f"{shown} (the constructor)", **kwargs)
    if not isinstance(module, nn.Module):
        fail("exception", f"{shown} should build an nn.Module, but gave {type(module).__name__}. "
                          f"Pass the class (not an instance) and keep `super().__init__()` in the constructor.")
    return module
