"""The ``saved_tensors`` probe: a student's ``torch.autograd.Function`` run forward and backward, and every tensor
it was given, every tensor it saved for backward and the incoming gradient found unchanged afterwards.

A backward that rescales the saved ``q`` in place (``q.mul_(scale)``) can still return the right gradients, but
the saved ``q`` IS the caller's ``q``: after ``loss.backward()`` the caller holds other numbers. The same holds
for the forward's output (saved, and returned to the caller), and for ``grad_out``, which autograd may hand to
other functions too. The probe names the tensor that changed and the pass (forward or backward) that changed it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...verdict import Failure, fail
from .._student_code import call_student
from .._student_files import exception_message, exception_name

_ADVICE = ("Write a new tensor instead (`q = q * scale`, not `q.mul_(scale)` or `q *= scale`; `x = x + ...`, "
           "not `x.add_(...)` or `x[...] = ...`).")


def unchanged(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Bit for bit the same values (NaN where NaN was), shape and dtype."""
    now = now.detach()
    if now.shape != before.shape or now.dtype != before.dtype:
        return False
    if now.is_floating_point():
        return bool(torch.equal(torch.isnan(now), torch.isnan(before))
                    and torch.equal(torch.nan_to_num(now, nan=0.0), torch.nan_to_num(before, nan=0.0)))
    return bool(torch.equal(now, before))


def _student_node(out: torch.Tensor) -> Any:
    """The student's own node in the graph of ``out``: ``out.grad_fn`` or, when the forward's output went through
    a view or another operation first, the nearest ``BackwardCFunction`` behind it (None if there is none)."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return node
        todo.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()


def _saved(node: Any, named: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor, what: str
           ) -> list[tuple[str, torch.Tensor]]:
    """The tensors the student's ctx holds for backward (``save_for_backward`` and tensor attributes), each named
    by what it is to the caller: an input's name, the forward's output, else its place and shape."""
    if node is None:
        return []
    try:
        saved = list(node.saved_tensors)
    except RuntimeError as exc:      # autograd's own check: a saved tensor changed after it was saved
        said = (exception_message(exc).splitlines() or [exception_name(exc)])[0][:160]
        fail("mutation", f"{what}: your forward changed a tensor in place after saving it with "
                         f"ctx.save_for_backward ({said}). Save the tensors the backward "
                         f"needs as they are at the end of the forward, and change none of them afterwards. "
                         f"{_ADVICE}", argument="saved tensor")
    attributes = [(f"ctx.{name}", value) for name, value in vars(node).items() if isinstance(value, torch.Tensor)]
    found = []
    for index, tensor in enumerate(saved):
        if not isinstance(tensor, torch.Tensor):
            continue
        name = next((name for name, given in named if _same_storage(tensor, given)), None)
        if name is None and _same_storage(tensor, out):
            name = "the forward's output (saved for backward, and returned to the caller)"
        found.append((name or f"the tensor at position {index + 1} of ctx.save_for_backward "
                              f"(shape {tuple(tensor.shape)})", tensor))
    return found + attributes


def _first_changed(watched: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> str | None:
    return next((name for name, tensor, before in watched if not unchanged(tensor, before)), None)


def _first_tensor(out: Any) -> torch.Tensor | None:
    """The output autograd differentiates: ``out``, or the first tensor of a tuple the forward returned."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


def forward_backward(cls: Any, args: Sequence[Any], grad_out: torch.Tensor, *, names: Sequence[str], what: str,
                     check_output: Callable[[Any], None] | None = None) -> tuple[Any, tuple[Any, ...]]:
    """``cls.apply(*args)`` and its backward with ``grad_out``, watched: (the output, the gradients of the
    floating-point tensors among ``args``, None where the backward gave none).

    Each floating-point tensor of ``args`` is given as a fresh leaf that requires grad. ``check_output(out)`` may
    fail on the forward's output before the backward runs. ``mutation`` when the forward changed an input, or the
    backward changed an input, ``grad_out``, or a tensor saved for backward (``ctx.save_for_backward`` or a tensor
    attribute of ``ctx``); the message names the tensor, by ``names`` where it is an input.
    """
    given = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
             else a for a in args]
    named = [(name, a) for name, a in zip(names, given) if isinstance(a, torch.Tensor)]
    inputs = [(name, a, a.detach().clone()) for name, a in named]
    grad_out = grad_out.detach().clone()
    with torch.enable_grad():
        out = call_student(lambda: cls.apply(*given), what=f"{what} (the forward)")
        changed = _first_changed(inputs)
        if changed:
            fail("mutation", f"{what}: your forward changed its input {changed} in place; the caller still needs "
                             f"it (and autograd fails when a tensor saved for backward is overwritten). {_ADVICE}",
                 argument=changed)
        if check_output is not None:
            check_output(out)
        first = _first_tensor(out)
        if first is None or first.grad_fn is None:
            problem = "is not a tensor" if first is None else "has no gradient function"
            fail("gradient", f"{what}: the forward's output {problem}; return the output of forward, computed "
                             f"from its inputs, so that autograd calls your backward.")
        saved = _saved(_student_node(first), named, first, what)
        watched = [*inputs, ("grad_out", grad_out, grad_out.clone())]
        known = {id(tensor) for _, tensor, _ in watched}
        for name, tensor in [*saved, ("the forward's output", first)]:
            if id(tensor) not in known and not any(_same_storage(tensor, t) for _, t, _ in watched):
                watched.append((name, tensor, tensor.detach().clone()))
                known.add(id(tensor))
        differentiable = [a for a in given if isinstance(a, torch.Tensor) and a.requires_grad]
        try:
            grads = call_student(lambda: torch.autograd.grad(first, differentiable, grad_out, allow_unused=True),
                                 what=f"{what}: your backward")
        except Failure as failure:
            changed = _first_changed(watched)
            if failure.diagnosis != "exception" or not changed:
                raise
            fail("mutation", f"{what}: your backward changed {changed} in place, and autograd then refused to "
                             f"read it back ({failure.message.split(': ', 1)[-1][:120]}...). A tensor saved for "
                             f"backward must stay as the forward left it. {_ADVICE}", argument=changed)
    changed = _first_changed(watched)
    if changed == "grad_out":
        fail("mutation", f"{what}: your backward changed grad_out in place. That tensor belongs to autograd: the "
                         f"same one may be handed to other functions (a tensor used twice gets it twice), and the "
                         f"caller may still read it. {_ADVICE}", argument="grad_out")
    if changed:
        fail("mutation", f"{what}: your backward changed {changed} in place. A tensor saved for backward is the "
                         f"very tensor of the forward (the caller's input, or the output they hold), not a copy: "
                         f"after loss.backward() the caller would find other numbers in it, and a second backward "
                         f"(retain_graph=True) would compute with them. {_ADVICE}", argument=changed)
    return out, tuple(grads)


def _bindings(cls: Any) -> dict[str, tuple[Any, int]]:
    """What the class and its code's module hold, each name with (its value, held so that its id is not reused,
    and the length of a container): a forward that stores on either outside ctx changes one of them."""
    forward = getattr(cls, "forward", None)
    places = [(f"{cls.__name__}.", vars(cls)), ("", getattr(forward, "__globals__", {}))]
    found = {}
    for prefix, names in places:
        for name, value in list(names.items()):
            if not (name.startswith("__") and name.endswith("__")):
                found[prefix + name] = (value, len(value) if isinstance(value, (dict, list, set)) else -1)
    return found


def in_flight_together(cls: Any, calls: Sequence[tuple[Sequence[Any], torch.Tensor]], *, what: str,
                       first_backward_first: bool = False) -> tuple[list[tuple[Any, ...] | None], list[str]]:
    """Every call's forward first, as the layers of a model run, then their backwards in reverse order, as autograd
    runs them (or, with ``first_backward_first``, in the calls' order, as two losses' backwards run one after the
    other): (each call's gradients of its floating-point tensors, in the calls' order, None for a call whose
    forward gave no differentiable output; the names, on the class or in its module, that the forwards set or
    changed). A Function that keeps what its backward needs on the class or in a global, not on ctx, gives the
    earlier calls the later call's numbers; one that keeps a stack there, the backwards the wrong call's in one
    of the two orders."""
    before = _bindings(cls)
    pending = []
    with torch.enable_grad():
        for index, (args, _) in enumerate(calls):
            given = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args]
            out = call_student(lambda given=given: cls.apply(*given), what=f"{what} (forward {index + 1})")
            pending.append((given, _first_tensor(out)))
        after = _bindings(cls)
        kept = [name for name, (value, size) in after.items()
                if name not in before or before[name][0] is not value or before[name][1] != size]
        grads: list[tuple[Any, ...] | None] = [None] * len(calls)
        for index in (range(len(calls)) if first_backward_first else reversed(range(len(calls)))):
            given, first = pending[index]
            differentiable = [a for a in given if isinstance(a, torch.Tensor) and a.requires_grad]
            if first is None or first.grad_fn is None:
                continue
            grad_out = calls[index][1].detach().clone()
            grads[index] = call_student(
                lambda first=first, differentiable=differentiable, grad_out=grad_out: torch.autograd.grad(
                    first, differentiable, grad_out, allow_unused=True), what=f"{what} (backward {index + 1})")
    return grads, kept
