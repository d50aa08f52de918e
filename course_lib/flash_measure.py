"""Measuring attention on a CPU: the peak bytes of the tensors a call creates, its process peak RSS, its time.

``torch.cuda.max_memory_allocated`` answers "how much memory did this need?" on a GPU; the CPU has no such
counter, so notebook 10 uses two:

- :func:`peak_tensor_bytes`: every operation's new (non-view) output is counted while it is alive, and the
  peak of the sum is kept. It is exact for what PyTorch's operators return and the same on every machine,
  but a fused kernel's private working buffers (``scaled_dot_product_attention``'s blocks) are not tensors
  and are not seen.
- :func:`peak_rss_bytes`: the process's peak resident memory (Linux's VmHWM, reset before the call) above
  what it held before. It sees everything, fused kernels included, but moves with the allocator and the
  machine: a cross-check, not a figure to assert.
"""
from __future__ import annotations

import re
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import _validate as validate

__all__ = ["peak_tensor_bytes", "peak_rss_bytes", "seconds", "traffic_bytes"]


class _LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.tracked: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self.tracked.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            # a view shares its base's memory, and an in-place result is a tensor already counted
            if not isinstance(tensor, torch.Tensor) or tensor._is_view() or id(tensor) in self.tracked:
                continue
            size = tensor.untyped_storage().nbytes()
            self.tracked[id(tensor)] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._free, id(tensor))
        return out


def _check_fn(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn: expected a function of no arguments, got {validate.describe(fn)}")


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    """The largest number of bytes held at once by tensors that ``fn()`` creates (its result included)."""
    _check_fn(fn)
    counter = _LiveBytes()
    with torch.no_grad(), counter:
        result = fn()
    del result
    return counter.peak


_STATUS = Path("/proc/self/status")


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", _STATUS.read_text()).group(1)) * 1024


def peak_rss_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak resident memory of the process during ``fn()``, above its resident memory before; None where the
    platform cannot reset the peak (only Linux can: /proc/self/clear_refs)."""
    _check_fn(fn)
    try:
        Path("/proc/self/clear_refs").write_text("5")    # resets VmHWM to the current RSS
        before = _status("VmRSS")
    except OSError:
        return None
    with torch.no_grad():
        result = fn()
    del result
    return max(0, _status("VmHWM") - before)


def seconds(fn: Callable[[], Any], repeats: int = 1) -> float:
    """The fastest of ``repeats`` timed calls of ``fn()`` after one untimed warm-up call."""
    _check_fn(fn)
    repeats = validate.positive_int("repeats", repeats)
    with torch.no_grad():
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return best


def traffic_bytes(length: int, head_dim: int, *, block_q: int | None = None, bytes_per_number: int = 4) -> int:
    """Bytes one head of attention reads and writes in main memory (the GPU's HBM), to first order.

    Naive (``block_q=None``): read Q, K (2Ld), write S (L^2); read S, write P (2L^2); read P, V, write O
    (L^2 + 2Ld). Tiled: Q read and O written once (2Ld), K and V read once per query block (2Ld L/block_q);
    the scores stay in fast on-chip memory.
    """
    length = validate.positive_int("length", length)
    head_dim = validate.positive_int("head_dim", head_dim)
    ld, ll = length * head_dim, length * length
    if block_q is None:
        numbers = 2 * ld + ll + 2 * ll + ll + 2 * ld
    else:
        block_q = validate.positive_int("block_q", block_q)
        numbers = 2 * ld + 2 * ld * -(-length // block_q)
    return numbers * bytes_per_number
