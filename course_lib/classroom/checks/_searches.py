"""The counter-example searchers of notebook 09 (9.1-9.6), until it is ported to the engine.

Each tries tiny inputs, smallest first, with values of one decimal so that a student can follow
them by hand, and returns the first on which the student's code and the reference differ
(see ``_counterexample``). The pieces are the engine's (``engine.example``); a ported exercise
declares its tiny cases instead (``checks/DESIGN.md``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import modern
from ._counterexample import Example, first_difference, searcher
from ._model_common import as_tensor
from .engine.example import SEEDS, compare, module_example, tiny


def _cases(sizes: list[Any], seeds: tuple[int, ...] = SEEDS) -> list[tuple[Any, torch.Generator]]:
    return [(size, torch.Generator().manual_seed(seed)) for size in sizes for seed in seeds]


# ---------------------------------------------------------------- notebook 09

@searcher("9.1")
def _tables(fn: Any) -> Example | None:
    def case(head_dim: int, tokens: int, theta: float | None) -> Callable[[], Example | None]:
        args = (head_dim, tokens) if theta is None else (head_dim, tokens, theta)
        shown = f"rope_tables({head_dim}, {tokens}" + ("" if theta is None else f", theta={theta:g}") + ")"

        def run() -> Example | None:
            yours, right = fn(*args), modern.rope_tables(head_dim, tokens, theta or 10000.0)
            got = torch.stack([as_tensor(t) for t in yours]) if isinstance(yours, (tuple, list)) else yours
            return compare(shown + "  (cos table first, then sin)", [], lambda: got, lambda: torch.stack(right))
        return run
    sizes = [(2, 2, None), (4, 2, None), (4, 3, None), (4, 3, 100.0), (8, 3, 100.0)]
    return first_difference([case(*size) for size in sizes])


@searcher("9.2")
def _rotary(fn: Any) -> Example | None:
    def case(size: tuple[int, int, int], generator: torch.Generator) -> Callable[[], Example | None]:
        length, d, offset = size
        x = tiny(generator, 1, 1, length, d)
        cos, sin = modern.rope_tables(d, 4, 10.0)
        return lambda: compare(f"apply_rotary(x, cos, sin, offset={offset}) with the tables of rope_tables({d}, "
                                f"4, theta=10)", [("x", x)], lambda: fn(x.clone(), cos, sin, offset=offset),
                                lambda: modern.apply_rotary(x, cos, sin, offset))
    sizes = [(1, 2, 0), (2, 2, 0), (1, 2, 1), (2, 4, 0), (2, 4, 1)]
    return first_difference([case(s, g) for s, g in _cases(sizes)])


@searcher("9.3")
def _rms(cls: Any) -> Example | None:
    return first_difference([
        (lambda dim=dim: module_example(f"RMSNorm({dim})", lambda: cls(dim), lambda: modern.RMSNorm(dim), dim,
                                        (1, 2))) for dim in (2, 3, 4)])


@searcher("9.4")
def _swiglu(cls: Any) -> Example | None:
    return module_example("SwiGLU(2, 3)", lambda: cls(2, 3), lambda: modern.SwiGLU(2, 3), 2)


@searcher("9.5")
def _repeat(fn: Any) -> Example | None:
    def case(kv: int, groups: int, length: int) -> Callable[[], Example | None]:
        x = torch.arange(float(kv * length)).reshape(1, kv, length, 1)
        return lambda: compare(f"repeat_kv(x, {groups})", [("x", x)], lambda: fn(x.clone(), groups),
                                lambda: modern.repeat_kv(x, groups))
    return first_difference([case(*size) for size in ((1, 2, 1), (2, 2, 1), (2, 2, 2), (2, 3, 1))])


@searcher("9.6")
def _gqa(cls: Any) -> Example | None:
    return module_example("GroupedQueryAttention(4, 2, 1, 4, 10.0)", lambda: cls(4, 2, 1, 4, 10.0),
                          lambda: modern.GroupedQueryAttention(4, 2, 1, 4, 10.0), 4)
