"""Watching a student's attention run: every tensor it creates, and every block of scores it computes.

A ``TorchDispatchMode`` sees each ATen operation below autograd, so a matrix built by any route
(``@``, einsum, a loop of ``torch.outer``...) is seen with its shape (``Record`` lists what is read back).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PRODUCTS = {"mm", "bmm", "mv", "dot", "addmm", "baddbmm", "addmv", "addbmm"}
_REDUCTIONS = {"_softmax", "_log_softmax", "logsumexp", "amax", "max", "sum", "mean", "amin", "min", "cumsum"}


@dataclass
class Record:
    """A reduction over a whole row at once is not a tiled loop; an empty slice along the positions is a loop
    bound one block too far."""

    shapes: set[tuple[int, ...]] = field(default_factory=set)   # of every tensor returned (``score_shaped``)
    score_elements: int = 0                # output elements of products over d: the share of scores computed
    largest_tile: tuple[int, ...] = ()     # the largest single score product's last two axes
    tiles: set[tuple[int, ...]] = field(default_factory=set)   # every score product's last two axes
    fused: list[str] = field(default_factory=list)   # fused attention kernels called
    reduced: list[tuple[str, int]] = field(default_factory=list)   # (reduction, its input's last axis)
    empty: list[tuple[int, int]] = field(default_factory=list)     # (length, start) of empty slices along -2

    def score_shaped(self, length_q: int, length_k: int) -> tuple[int, ...] | None:
        """The largest tensor made that is shaped like the full score matrix: a query axis and a key axis as long as
        the sequences (heads or batch folded in), or an axis of whole Lq x Lk score matrices flattened; None if
        none. A stack of q, k, v or of their gradients may hold as many numbers, but not in that shape."""
        def full(shape: tuple[int, ...]) -> bool:
            axes = sorted(shape, reverse=True)
            return any(axis and axis % (length_q * length_k) == 0 for axis in axes) or \
                len(axes) >= 2 and axes[1] >= min(length_q, length_k) and axes[0] >= max(length_q, length_k)
        return max((shape for shape in self.shapes if full(shape)), key=math.prod, default=None)


class Recorder(TorchDispatchMode):
    """Record what every operation run inside ``with Recorder(head_dim) as r:`` returns."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.record = Record()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        record = self.record
        if "scaled_dot_product" in name or "flash_attention" in name:
            record.fused.append(name)
        outs = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ()
        record.shapes.update(tuple(t.shape) for t in outs if isinstance(t, torch.Tensor))
        first = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else None
        if first is not None and name in _REDUCTIONS:
            record.reduced.append((name, first.shape[-1]))
        if first is not None and name == "slice" and first.dim() >= 2 and isinstance(out, torch.Tensor):
            dim = (args[1] if len(args) > 1 else 0) % first.dim()
            if dim == first.dim() - 2 and out.shape[dim] == 0:
                start = args[2] if len(args) > 2 and args[2] is not None else 0
                record.empty.append((int(first.shape[dim]), int(min(start, first.shape[dim]))))
        if name in _PRODUCTS and isinstance(out, torch.Tensor):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            first = operands[-2] if name.startswith("add") and len(operands) >= 3 else operands[0]
            if first.dim() and first.shape[-1] == self.head_dim:      # contracts over d: q k^T scores
                record.score_elements += out.numel()
                tile = tuple(out.shape[-2:]) if out.dim() >= 2 else tuple(out.shape)
                record.tiles.add(tile)
                if math.prod(tile) > math.prod(record.largest_tile or (0,)):
                    record.largest_tile = tile
        return out
