"""The counter-example of any exercise, derived from its own cases: no searcher written by hand.

A function exercise's ``examples()`` are its own cases at tiny sizes, with values of one decimal
(``tiny``) so that a student can redo them by hand; a module exercise gives the sizes to build it at and
how to make an input. The engine runs the student's code and the reference on each, smallest first, and
keeps the first on which they differ (``_counterexample.Example``). It never raises: an error in the
student's code just ends that try. It runs inside the check, under the harness's isolation and time limit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .._counterexample import Example, first_difference
from .._model_common import as_tensor, copy_weights
from .._student_code import close

SEEDS = (0, 1, 2)

# Modules up to this many parameters have every weight shown beside a counter-example (RMSNorm, SwiGLU, a
# tiny attention): without them a student cannot redo the computation by hand.
SHOWN_PARAMETERS = 100


def tiny(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Values of one decimal, spread like a unit normal: easy to follow by hand."""
    return (torch.randn(*shape, generator=generator) * 1.5).round(decimals=1)


def compare(call: str, inputs: list[tuple[str, torch.Tensor]], yours: Callable[[], Any],
            expected: Callable[[], torch.Tensor], notes: Sequence[tuple[str, torch.Tensor]] = ()) -> Example | None:
    """The Example when the student's output differs from the reference's on this input, else None."""
    with torch.no_grad():
        right = expected()
        got = as_tensor(yours())
    if isinstance(got, torch.Tensor) and not close(got, right):
        return Example(call, inputs, got.detach(), right.detach(), list(notes))
    return None


def function_example(exercise: Any) -> Callable[..., Example | None]:
    """The counter-example searcher of a ``FunctionExercise``: its ``examples()`` (else its own cases), in order."""
    def search(fn: Any, *_: Any, **__: Any) -> Example | None:
        cases = exercise.examples() if exercise.examples is not None else exercise.cases()

        def attempt(case: Any) -> Callable[[], Example | None]:
            inputs = [(name, a) for name, a in zip(exercise.arg_names, case.args) if isinstance(a, torch.Tensor)]
            return lambda: compare(case.what, inputs, lambda: fn(*case.given()),
                                   lambda: exercise.reference(*case.args), case.notes)
        return first_difference([attempt(case) for case in cases])
    return search


def _weights(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's weights as notes of a counter-example, named as the student's module names them."""
    named = list(module.named_parameters())
    if sum(p.numel() for _, p in named) > SHOWN_PARAMETERS:
        return []
    notes = []
    for name, p in named:
        linear = name.endswith(".weight") and p.dim() == 2     # nn.Linear: y = x @ weight.T
        notes.append((f"self.{name}" + (f" (shape {tuple(p.shape)}; nn.Linear computes x @ weight.T)" if linear
                                        else f" (shape {tuple(p.shape)})"), p.detach().clone()))
    return notes


def _pair(make: Callable[[], nn.Module], make_reference: Callable[[], nn.Module],
          generator: torch.Generator) -> tuple[nn.Module, nn.Module]:
    reference = make_reference()
    with torch.no_grad():
        for p in reference.parameters():   # two decimals: the weights are shown, and redone by hand
            p.copy_((tiny(generator, *p.shape) / max(1, p.shape[-1]) ** 0.5).round(decimals=2))
    candidate = make()
    copy_weights(reference, candidate, "your module")
    return candidate.eval(), reference.eval()


def module_example(shown: str, make: Callable[[], nn.Module], make_reference: Callable[[], nn.Module],
                   embed: int, lengths: Sequence[int] = (1, 2, 3),
                   inputs: Callable[[torch.Generator, int], torch.Tensor] | None = None) -> Example | None:
    """The first length (and seed) on which the student's module, with the reference's weights copied in,
    differs from the reference: ``shown`` names the module as built ("MaskedAttention(2, 4, 0.0)");
    ``inputs(generator, length)`` makes x (default: one sequence of ``embed`` features)."""
    make_x = inputs or (lambda generator, length: tiny(generator, 1, length, embed))

    def attempt(length: int, generator: torch.Generator) -> Callable[[], Example | None]:
        def run() -> Example | None:
            candidate, reference = _pair(make, make_reference, generator)
            x = make_x(generator, length)
            return compare(f"{shown} on x of shape {tuple(x.shape)} (the reference's weights copied in)",
                           [("x", x)], lambda: candidate(x.clone()), lambda: reference(x), _weights(reference))
        return run
    return first_difference([attempt(length, torch.Generator().manual_seed(seed))
                             for length in lengths for seed in SEEDS])
