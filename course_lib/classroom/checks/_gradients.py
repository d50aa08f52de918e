"""Can the student's code learn? One backward pass, compared with the reference's, gradient by gradient.

Forward outputs alone cannot see code that computes the right numbers through a cut graph:
``torch.no_grad()`` around a projection, ``.detach()`` on a weight or a residual, a value rebuilt
from ``.item()``. So every checker of a module or a differentiable function runs both the student's
code and the reference once more, with gradients on, takes the same fixed loss of each output
(a weighted sum with fixed random weights, so every output element matters) and compares the
gradients of every parameter and of every floating-point input (:func:`check_module_gradients`,
:func:`check_function_gradients`). A failure is diagnosis ``gradient``; the message names the parameter (or
input) and the likely cause.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..verdict import Failure, fail
from ._student_code import call, close, max_diff
from ._student_files import exception_line, exception_message
from .engine.autograd_errors import is_in_place_error

# Why relative to the largest reference gradient, not element by element: a correct solution in
# another layout (einsum, a fused projection, softmax written out) moves float32 gradients by ~1e-6
# of their scale, while a cut path removes a whole term, a change of order one. Element-wise
# tolerances would trip on gradients that are near zero by cancellation.
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-6

CAUSES = ("computed under `torch.no_grad()`, cut with `.detach()` (or `.data`), or rebuilt from Python "
          "numbers (`.item()`, `.tolist()`, `torch.tensor(...)` of a result)")


def _outputs(value: Any) -> list[torch.Tensor] | None:
    """The tensors a run returned (one, or a tuple/list of them); None when it returned something else."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


def _loss(outputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((out.double() * w).sum() for out, w in zip(outputs, weights))  # type: ignore[return-value]


def _inplace_message(what: str, exc: BaseException) -> str:
    return (f"Backpropagating through {what} failed: {exception_message(exc)}. An in-place operation (`x += ...`, `t[...] = ...`, "
            f"`.masked_fill_`, `relu_`, `out=`) overwrote a tensor autograd still needed, or changed a leaf that "
            f"requires grad. Write `y = x + ...` (or the operation without the trailing underscore) instead.")


def check_gradients(run_candidate: Callable[[], Any], run_reference: Callable[[], Any],
                    candidate_leaves: Mapping[str, torch.Tensor], reference_leaves: Mapping[str, torch.Tensor],
                    *, what: str, seed: int = 0, inputs: Sequence[str] = ()) -> None:
    """Fail with diagnosis ``gradient`` unless the student's run backpropagates like the reference's.

    ``run_candidate`` / ``run_reference`` take no argument and return a tensor or a tuple of tensors
    (the candidate is called through the harness, so its errors are the student's). The leaves are
    the tensors whose gradients are compared, by name; a name missing from ``candidate_leaves`` is
    not compared. ``inputs`` lists the leaf names that are inputs rather than parameters (messages
    differ: a wrong input gradient alone points at a detached residual). Leaves' ``.grad`` are
    cleared before and after, so the modules are left as they were given.
    """
    leaves = [t for t in (*candidate_leaves.values(), *reference_leaves.values())]
    for leaf in leaves:
        leaf.grad = None
    first: list[torch.Tensor] = []   # the student's answer, as it was before the backward pass

    def kept() -> None:
        how = first and _answers_as_before(run_candidate, run_reference, candidate_leaves, reference_leaves,
                                           first, what)
        if how == "wrong" and not all(close(b, e.detach(), nan_ok=True) for b, e in zip(first, expected_out)):
            # wrong already before anything moved, on these random inputs (the forward checks' may be whole
            # numbers, which survive a rounding): a value mistake, not something kept from an earlier call
            fail("mismatch", f"{what}: your output differs from the reference's by up to "
                             f"{max(max_diff(b, e.detach()) for b, e in zip(first, expected_out)):.3g} on these "
                             f"random inputs. Check the steps that change values (a rounding, a lower precision, a "
                             f"constant), not only the shapes.")
        if how == "near":
            fail("precision", f"{what}: after its inputs and weights changed in place (as an optimizer step changes "
                              f"them), your output differs from the reference's by a rounding's size: part of your "
                              f"computation runs in a lower precision (bfloat16, float16). Keep the inputs' dtype "
                              f"throughout.")
        if how:
            did = ("returned exactly what it returned before, where the reference's answer changed" if how == "as "
                   "before" else "no longer agrees with the reference's answer, though it did before")
            fail("kept_state", f"{what}: after its inputs and weights changed in place (as an optimizer step changes "
                               f"them), your code {did}. It keeps something from an earlier call (in an attribute, a "
                               f"global or a cache keyed on the shape, the length or the tensor itself), so a new "
                               f"batch, or the weights after an optimizer step, get an old answer. Compute the "
                               f"output from the inputs and weights at every call.")
    try:
        with torch.enable_grad():
            expected_out = _outputs(run_reference())
            if expected_out is None:
                raise TypeError("the reference run returned no tensor")
            generator = torch.Generator().manual_seed(seed)
            weights = [torch.randn(out.shape, generator=generator, dtype=torch.float64) for out in expected_out]
            _loss(expected_out, weights).backward()
            expected = {name: (None if leaf.grad is None else leaf.grad.detach().clone())
                        for name, leaf in reference_leaves.items()}
            try:
                got_value = call(run_candidate, what=what)
            except Failure as failure:
                if failure.diagnosis == "exception" and is_in_place_error(failure):
                    fail("gradient", _inplace_message(what, failure))
                if failure.diagnosis == "exception" and "requires grad" in failure.message:
                    fail("gradient", f"{failure.message.rstrip()} It runs on plain tensors, but not on inputs that "
                                     f"require gradients, as in training: your code leaves torch (.numpy(), "
                                     f".tolist(), Python numbers), where no gradient can follow, so nothing "
                                     f"before it could learn. Compute with torch operations on the tensors.")
                raise
            got_out = _outputs(got_value)
            if got_out is None or [o.shape for o in got_out] != [o.shape for o in expected_out]:
                return   # the forward checks judge the output itself; nothing to compare here
            first[:] = [out.detach().clone() for out in got_out]
            try:
                if not any(out.requires_grad for out in got_out):
                    fail("gradient", f"{what} returns the right numbers, but no gradient can flow back through "
                                     f"them: the output was {CAUSES}. Training would never change anything. "
                                     f"Compute the output with ordinary torch operations on the inputs and "
                                     f"parameters.")
                try:
                    _loss([o for o in got_out], weights).backward()
                except Exception as exc:  # the student's graph: a broken backward is their mistake
                    if is_in_place_error(exc):
                        fail("gradient", _inplace_message(what, exc))
                    fail("gradient", f"Backpropagating through {what} raised {exception_line(exc)}")
                got = {name: leaf.grad for name, leaf in candidate_leaves.items()}
                _compare(got, expected, what, set(inputs))
            except Failure as failure:
                if failure.diagnosis == "gradient":   # a graph from an earlier call has no path to these inputs
                    kept()
                    if failure.details.get("wrong"):
                        _small_term(first, expected_out, what)
                raise
        kept()
    finally:
        for leaf in leaves:
            leaf.grad = None


def _answers_as_before(run_candidate: Callable[[], Any], run_reference: Callable[[], Any],
                       candidate_leaves: Mapping[str, torch.Tensor], reference_leaves: Mapping[str, torch.Tensor],
                       before: Sequence[torch.Tensor], what: str) -> str | None:
    """How the student's run answers once every input and weight moved in place (the same random step on both
    sides, the same tensors): "as before" (bit for bit, where the reference's answer moved), "near" (within a
    rounding's size of the reference's new answer: a lower precision) or "wrong" (it was
    right before, so something from the earlier call is kept); None when it answers as the reference does. The
    leaves are put back after; the backward pass that read them has run already."""
    generator = torch.Generator().manual_seed(1)
    steps = {}
    for name, leaf in reference_leaves.items():
        if (name in candidate_leaves and leaf.is_floating_point() and leaf.numel() and leaf.device.type == "cpu"
                and bool(torch.isfinite(leaf).all())):   # a mask of -inf moved by a step is no mask
            size = float(leaf.detach().abs().mean()) or 1.0
            steps[name] = 0.5 * size * torch.randn(leaf.shape, generator=generator, dtype=leaf.dtype)
    moved = [leaf for name in steps for leaf in (candidate_leaves[name], reference_leaves[name])]
    saved = [leaf.detach().clone() for leaf in moved]
    try:
        with torch.no_grad():
            for name, step in steps.items():
                candidate_leaves[name].add_(step)
                reference_leaves[name].add_(step)
        with torch.enable_grad():   # the mode of the first run: a cache keyed on it answers alike
            try:
                expected = _outputs(run_reference())
                again = _outputs(call(run_candidate, what=what))
            except Exception:  # noqa: BLE001 - inputs the moved values make invalid: the probes before judge
                return None
            # copies, both: a view of a leaf (split_heads returns one) moves back with the leaves just below
            expected = None if expected is None else [e.detach().clone() for e in expected]
            again = None if again is None else [a.detach().clone() for a in again]
    finally:
        with torch.no_grad():
            for leaf, value in zip(moved, saved):
                leaf.copy_(value)
            for leaf in moved:
                leaf.grad = None
    if (not steps or again is None or expected is None or len(again) != len(before)
            or [a.shape for a in again] != [b.shape for b in before]):
        return None
    if all(close(e.detach(), b, nan_ok=True) for e, b in zip(expected, before)):
        return None   # the reference's answer did not move: nothing to tell
    if all(bool(torch.equal(a.detach(), b)) for a, b in zip(again, before)):
        return "as before"
    if all(close(a.detach(), e.detach(), nan_ok=True) for a, e in zip(again, expected)):
        return None
    if all(bool(torch.allclose(a.detach().double(), e.detach().double(), rtol=1e-2, atol=1e-2, equal_nan=True))
           for a, e in zip(again, expected)):
        return "near"   # off by a rounding's size only: a lower precision, no answer kept from before
    return "wrong"


def _small_term(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str) -> None:
    """``mismatch`` where the gradients differ and so do the outputs, by less than the value checks' tolerance
    but by more than float rounding: a small term added or left out (a z-loss, an epsilon), not a cut path, which
    leaves the values exactly as they are."""
    gaps = []
    for out, want in zip(got, expected):
        want = want.detach()
        if not (out.is_floating_point() and want.is_floating_point()):
            return
        eps = max(torch.finfo(out.dtype).eps, torch.finfo(want.dtype).eps)
        scale = float(want.double().abs().max()) if want.numel() else 0.0
        gap = float((out.double() - want.double()).abs().max()) if want.numel() else 0.0
        if eps > torch.finfo(torch.float32).eps or not gap > 256 * eps * max(scale, 1.0):
            return   # half precision, or the values agree to their own rounding
        gaps.append(gap)
    if gaps:
        fail("mismatch", f"{what}: your output is close to the reference's but not equal (up to {max(gaps):.3g} "
                         f"apart, more than float rounding), and its gradient differs more: your code adds or leaves "
                         f"out a small term (a regulariser such as a z-loss, an epsilon, a constant factor near 1). "
                         f"Compute exactly what the exercise asks, nothing more.")


def _describe(name: str, inputs: set[str]) -> str:
    return f"the input `{name}`" if name in inputs else f"parameter `{name}`"


def _compare(got: Mapping[str, torch.Tensor | None], expected: Mapping[str, torch.Tensor | None], what: str,
             inputs: set[str]) -> None:
    wrong: list[tuple[str, float, float]] = []
    # NaN compares false with everything, so a NaN gradient would read as none at all (a cut graph): it is
    # named first, as what it is
    for name, reference in expected.items():
        grad = got.get(name)
        if grad is not None and reference is not None and bool(torch.isfinite(reference).all()) \
                and not bool(torch.isfinite(grad).all()):
            fail("gradient", f"{what}: the gradient of {_describe(name, inputs)} holds NaN or infinity "
                             f"although the reference's is finite. Look for a square root or a division "
                             f"at zero (0/0, x/inf, exp of -inf minus -inf), or -inf masking whose gradient "
                             f"leaks (mask before the softmax).", parameter=name)
    cut = [name for name, reference in expected.items()
           if name in got and reference is not None and reference.numel() and bool(reference.abs().max() > 0)
           and (got[name] is None or not bool(got[name].abs().max() > 0))]   # type: ignore[union-attr]
    if cut:
        shown = [f"`{n}`" + (" (an input)" if n in inputs else "") for n in cut[:4]]
        listed = ", ".join(shown) + (f" and {len(cut) - 4} more" if len(cut) > 4 else "")
        first = cut[0]
        if len(cut) == 1:
            whom = (f"the input `{first}`, so nothing that computed it could learn" if first in inputs
                    else f"parameter `{first}`, so it would never learn")
        else:
            whom = f"{listed}, so they would never learn"
        fail("gradient", f"{what}: no gradient reaches {whom}. The path to the output was {CAUSES}. The forward "
                         f"values can be right and still carry no gradient.", parameter=first, cut=cut)
    for name, reference in expected.items():
        if name not in got or reference is None:
            continue
        grad = got[name]
        scale = float(reference.abs().max()) if reference.numel() else 0.0
        if scale == 0.0 or grad is None:
            continue   # nothing flows there in the reference either
        if grad.shape != reference.shape:
            continue   # a parameter of another shape is the parameter checks' business
        diff = float((grad.double() - reference.double()).abs().max())
        if diff > GRAD_RTOL * scale + GRAD_ATOL:
            wrong.append((name, diff, scale))
    if not wrong:
        return
    names = [name for name, _, _ in wrong]
    name, diff, scale = wrong[0]
    if set(names) <= inputs and set(expected) - inputs:
        cause = ("the parameters' gradients are right, so only a path back to the input was cut: the input "
                 "itself detached on its way into a layer (`self.key(x.detach())`), a residual added as "
                 "`x.detach()`, a part computed from x under `torch.no_grad()`, a hook that changes x's gradient, "
                 "or the input modified in place")
    else:
        cause = ("part of its path to the output was " + CAUSES + ", or the forward pass uses a tensor "
                 "other than the one the gradient should reach (an in-place op on a leaf, a detached weight)")
    listed = ", ".join(f"`{n}`" for n in names)
    fail("gradient", f"{what} computes the right output, but the gradient of {_describe(name, inputs)} differs "
                     f"from the reference's by up to {diff:.3g} (its scale is {scale:.3g}); wrong gradients: "
                     f"{listed}. The cause: {cause}.", parameter=name, wrong=names)


def _leaf(value: torch.Tensor) -> torch.Tensor:
    return value.detach().clone().requires_grad_(True)


def _as_leaves(args: Sequence[Any], names: Sequence[str]
               ) -> tuple[list[Any], list[Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two copies of ``args`` whose floating-point tensors are fresh leaves (one set per side), and those
    leaves by name, in order."""
    floats = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    cand_args, ref_args = list(args), list(args)
    cand_leaves: dict[str, torch.Tensor] = {}
    ref_leaves: dict[str, torch.Tensor] = {}
    for name, i in zip(names, floats):
        cand_args[i] = cand_leaves[name] = _leaf(args[i])
        ref_args[i] = ref_leaves[name] = _leaf(args[i])
    return cand_args, ref_args, cand_leaves, ref_leaves


def check_module_gradients(candidate: nn.Module, reference: nn.Module, *args: Any, what: str,
                           input_names: Sequence[str] | None = None, seed: int = 0,
                           forward: Callable[..., Any] | None = None, **kwargs: Any) -> None:
    """Backpropagate the same loss through both modules (same weights, eval mode is the caller's);
    compare every parameter's gradient, by name, and every floating-point input's.

    ``args``/``kwargs`` are the forward's inputs; floating tensors among the positional ones become
    leaves named by ``input_names`` (default ``x``, ``x2``, ...). ``forward(module, *args, **kwargs)``
    replaces ``module(*args, **kwargs)`` where the call differs (e.g. picks the logits out of a tuple)."""
    run = forward or (lambda module, *a, **k: module(*a, **k))
    floats = sum(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args)
    names = list(input_names) if input_names is not None else ["x" if n == 0 else f"x{n + 1}" for n in range(floats)]
    cand_args, ref_args, cand_inputs, ref_inputs = _as_leaves(args, names)
    try:
        cand_params = dict(candidate.named_parameters())
    except Exception as exc:  # a broken module is the student's to fix
        fail("exception", f"Listing the parameters of {what} raised {exception_line(exc)}")
    ref_params = dict(reference.named_parameters())
    # The names were the reference's when the weights were copied in: a difference now is the forward's doing.
    gone = [n for n in ref_params if n not in cand_params]
    if gone:
        fail("gradient", f"{what}: after your forward ran, `{gone[0]}` is no longer a parameter of your module (it "
                         f"was replaced by a plain tensor, or deleted), so the optimizer would never update it. "
                         f"Use the layer's weight as it is; never assign to it in forward.", parameter=gone[0])
    new = [n for n in cand_params if n not in ref_params]
    if new:
        fail("gradient", f"{what}: after your forward ran, your module has a parameter `{new[0]}` that it did not "
                         f"have when built: an optimizer would train it (a table of constants, a buffer, turned into "
                         f"an nn.Parameter). Create nothing in forward; keep constants as buffers.", parameter=new[0])
    frozen = [n for n, p in ref_params.items() if n in cand_params and not cand_params[n].requires_grad]
    if frozen:
        fail("gradient", f"{what}: parameter `{frozen[0]}` has requires_grad=False, so it would never learn. "
                         f"Leave parameters trainable (do not call .requires_grad_(False) on them, nor wrap "
                         f"them in a plain tensor).", parameter=frozen[0])
    check_gradients(lambda: run(candidate, *cand_args, **kwargs), lambda: run(reference, *ref_args, **kwargs),
                    {**cand_params, **cand_inputs}, {**ref_params, **ref_inputs},
                    what=what, seed=seed, inputs=list(cand_inputs))


def check_function_gradients(fn: Callable[..., Any], reference: Callable[..., Any], *args: Any, what: str,
                             names: Sequence[str] | None = None, seed: int = 0, **kwargs: Any) -> None:
    """Backpropagate the same loss through ``fn(*args, **kwargs)`` and ``reference(...)``; compare the
    gradients of the floating-point tensors among ``args`` (named by ``names``, default ``argument 1``, ...)."""
    labels = list(names) if names is not None else [f"argument {i + 1}" for i, a in enumerate(args)
                                                    if isinstance(a, torch.Tensor) and a.is_floating_point()]
    cand_args, ref_args, cand_leaves, ref_leaves = _as_leaves(args, labels)
    check_gradients(lambda: fn(*cand_args, **kwargs), lambda: reference(*ref_args, **kwargs),
                    cand_leaves, ref_leaves, what=what, seed=seed, inputs=list(cand_leaves))
