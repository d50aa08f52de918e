"""The counter-example searchers of the attention exercises (1.2-3.3) and of notebook 09 (9.1-9.6).

Each tries tiny inputs, smallest first, with values of one decimal so that a student can follow
them by hand, and returns the first on which the student's code and the reference differ
(see ``_counterexample``). Modules are built at tiny sizes with the reference's weights copied in.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ... import attention as attn
from ... import modern
from ._counterexample import Example, differs, first_difference, searcher
from ._model_common import as_tensor, copy_weights

_SEEDS = (0, 1, 2)


def _values(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * 1.5).round(decimals=1)


def _compare(call: str, inputs: list[tuple[str, torch.Tensor]], yours: Callable[[], Any],
             expected: Callable[[], torch.Tensor], notes: list[tuple[str, torch.Tensor]] | None = None
             ) -> Example | None:
    with torch.no_grad():
        right = expected()
        got = as_tensor(yours())
    if isinstance(got, torch.Tensor) and differs(got, right):
        return Example(call, inputs, got.detach(), right.detach(), notes or [])
    return None


def _cases(sizes: list[Any], seeds: tuple[int, ...] = _SEEDS) -> list[tuple[Any, torch.Generator]]:
    return [(size, torch.Generator().manual_seed(seed)) for size in sizes for seed in seeds]


def _module_pair(make: Callable[[], nn.Module], make_reference: Callable[[], nn.Module],
                 generator: torch.Generator) -> tuple[nn.Module, nn.Module]:
    reference = make_reference()
    with torch.no_grad():
        for p in reference.parameters():   # two decimals: the weights are shown, and redone by hand
            p.copy_((_values(generator, *p.shape) / max(1, p.shape[-1]) ** 0.5).round(decimals=2))
    candidate = make()
    copy_weights(reference, candidate, "your module")
    return candidate.eval(), reference.eval()


def _module_search(name: str, make: Callable[[], nn.Module], make_reference: Callable[[], nn.Module],
                   embed: int, lengths: tuple[int, ...] = (1, 2, 3)) -> Example | None:
    def case(length: int, generator: torch.Generator) -> Callable[[], Example | None]:
        def run() -> Example | None:
            candidate, reference = _module_pair(make, make_reference, generator)
            x = _values(generator, 1, length, embed)
            return _compare(f"{name} on x of shape (1, {length}, {embed}) (the reference's weights copied in)",
                            [("x", x)], lambda: candidate(x.clone()), lambda: reference(x), _weights(reference))
        return run
    return first_difference([case(length, g) for length, g in _cases(list(lengths))])


# Modules up to this many parameters have every weight shown beside a counter-example (RMSNorm, SwiGLU, a
# tiny attention): without them a student cannot redo the computation by hand.
_SHOWN_PARAMETERS = 100


def _weights(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's weights as notes of a counter-example, named as the student's module names them."""
    named = list(module.named_parameters())
    if sum(p.numel() for _, p in named) > _SHOWN_PARAMETERS:
        return []
    notes = []
    for name, p in named:
        linear = name.endswith(".weight") and p.dim() == 2     # nn.Linear: y = x @ weight.T
        notes.append((f"self.{name}" + (f" (shape {tuple(p.shape)}; nn.Linear computes x @ weight.T)" if linear
                                        else f" (shape {tuple(p.shape)})"), p.detach().clone()))
    return notes


# ---------------------------------------------------------------- notebooks 01-03

@searcher("1.2")
def _toy(fn: Any) -> Example | None:
    def case(size: tuple[int, int], generator: torch.Generator) -> Callable[[], Example | None]:
        n, d = size
        query, keys, values = _values(generator, d), _values(generator, n, d), _values(generator, n)
        return lambda: _compare("toy_attention(query, keys, values)",
                                [("query", query), ("keys", keys), ("values", values)],
                                lambda: fn(query.clone(), keys.clone(), values.clone()),
                                lambda: attn.toy_attention(query, keys, values),
                                [("scores (keys @ query)", keys @ query)])
    return first_difference([case(s, g) for s, g in _cases([(1, 1), (2, 1), (2, 2), (3, 2)])])


@searcher("1.3")
def _sdpa(fn: Any) -> Example | None:
    def case(size: tuple[int, int, bool], generator: torch.Generator) -> Callable[[], Example | None]:
        length, d, masked = size
        q, k, v = (_values(generator, 1, length, d) for _ in range(3))
        mask = attn.causal_mask(length)[None] if masked else None
        scores = q @ k.transpose(-2, -1) / d ** 0.5
        args = (q, k, v) + ((mask,) if masked else ())
        inputs = [("q", q), ("k", k), ("v", v)] + ([("mask", mask)] if masked else [])
        return lambda: _compare(f"scaled_dot_product_attention(q, k, v{', mask' if masked else ''})", inputs,
                                lambda: fn(*(a.clone() for a in args)),
                                lambda: attn.scaled_dot_product_attention(*args),
                                [("scores = q @ k^T / sqrt(d) (the reference's)", scores)])
    sizes = [(1, 1, False), (2, 2, False), (3, 2, False), (2, 2, True), (3, 2, True)]
    return first_difference([case(s, g) for s, g in _cases(sizes)])


@searcher("2.1")
def _causal(fn: Any) -> Example | None:
    return first_difference([(lambda n=n: _compare(f"causal_mask({n})", [], lambda: fn(n),
                                                    lambda: attn.causal_mask(n))) for n in (1, 2, 3, 4)])


@searcher("2.2")
def _masked(cls: Any) -> Example | None:
    return _module_search("MaskedAttention(2, 4, 0.0)", lambda: cls(2, 4, 0.0),
                          lambda: attn.MaskedAttention(2, 4, 0.0), 2)


@searcher("3.1")
def _split(fn: Any) -> Example | None:
    def case(length: int) -> Callable[[], Example | None]:
        x = torch.arange(float(4 * length)).reshape(1, length, 4)
        return lambda: _compare("split_heads(x, 2)", [("x", x)], lambda: fn(x.clone(), 2),
                                lambda: attn.split_heads(x, 2))
    return first_difference([case(length) for length in (1, 2, 3)])


@searcher("3.2")
def _merge(fn: Any) -> Example | None:
    def case(length: int) -> Callable[[], Example | None]:
        x = torch.arange(float(4 * length)).reshape(1, 2, length, 2)
        return lambda: _compare("merge_heads(x)", [("x", x)], lambda: fn(x.clone()), lambda: attn.merge_heads(x))
    return first_difference([case(length) for length in (1, 2, 3)])


@searcher("3.3")
def _multi_head(cls: Any) -> Example | None:
    return _module_search("MultiHeadMaskedAttention(4, 2, 4, 0.0)", lambda: cls(4, 2, 4, 0.0),
                          lambda: attn.MultiHeadMaskedAttention(4, 2, 4, 0.0), 4)


# ---------------------------------------------------------------- notebook 09

@searcher("9.1")
def _tables(fn: Any) -> Example | None:
    def case(head_dim: int, tokens: int, theta: float | None) -> Callable[[], Example | None]:
        args = (head_dim, tokens) if theta is None else (head_dim, tokens, theta)
        shown = f"rope_tables({head_dim}, {tokens}" + ("" if theta is None else f", theta={theta:g}") + ")"

        def run() -> Example | None:
            yours, right = fn(*args), modern.rope_tables(head_dim, tokens, theta or 10000.0)
            got = torch.stack([as_tensor(t) for t in yours]) if isinstance(yours, (tuple, list)) else yours
            return _compare(shown + "  (cos table first, then sin)", [], lambda: got, lambda: torch.stack(right))
        return run
    sizes = [(2, 2, None), (4, 2, None), (4, 3, None), (4, 3, 100.0), (8, 3, 100.0)]
    return first_difference([case(*size) for size in sizes])


@searcher("9.2")
def _rotary(fn: Any) -> Example | None:
    def case(size: tuple[int, int, int], generator: torch.Generator) -> Callable[[], Example | None]:
        length, d, offset = size
        x = _values(generator, 1, 1, length, d)
        cos, sin = modern.rope_tables(d, 4, 10.0)
        return lambda: _compare(f"apply_rotary(x, cos, sin, offset={offset}) with the tables of rope_tables({d}, "
                                f"4, theta=10)", [("x", x)], lambda: fn(x.clone(), cos, sin, offset=offset),
                                lambda: modern.apply_rotary(x, cos, sin, offset))
    sizes = [(1, 2, 0), (2, 2, 0), (1, 2, 1), (2, 4, 0), (2, 4, 1)]
    return first_difference([case(s, g) for s, g in _cases(sizes)])


@searcher("9.3")
def _rms(cls: Any) -> Example | None:
    return first_difference([
        (lambda dim=dim: _module_search(f"RMSNorm({dim})", lambda: cls(dim), lambda: modern.RMSNorm(dim), dim,
                                        (1, 2))) for dim in (2, 3, 4)])


@searcher("9.4")
def _swiglu(cls: Any) -> Example | None:
    return _module_search("SwiGLU(2, 3)", lambda: cls(2, 3), lambda: modern.SwiGLU(2, 3), 2)


@searcher("9.5")
def _repeat(fn: Any) -> Example | None:
    def case(kv: int, groups: int, length: int) -> Callable[[], Example | None]:
        x = torch.arange(float(kv * length)).reshape(1, kv, length, 1)
        return lambda: _compare(f"repeat_kv(x, {groups})", [("x", x)], lambda: fn(x.clone(), groups),
                                lambda: modern.repeat_kv(x, groups))
    return first_difference([case(*size) for size in ((1, 2, 1), (2, 2, 1), (2, 2, 2), (2, 3, 1))])


@searcher("9.6")
def _gqa(cls: Any) -> Example | None:
    return _module_search("GroupedQueryAttention(4, 2, 1, 4, 10.0)", lambda: cls(4, 2, 1, 4, 10.0),
                          lambda: modern.GroupedQueryAttention(4, 2, 1, 4, 10.0), 4)
