"""Device slips seen on a CPU-only machine: run the student's code once more on the ``meta`` device.

A meta tensor has a shape, a dtype and a device but no numbers, so every operation is free. A
tensor the student's code creates without ``device=x.device`` (a mask from ``torch.ones(L, L)``, a
table from ``torch.arange``) lands on the CPU, and mixing it with meta inputs raises at once (a
dispatch mode checks the operations whose meta kernels do not look, such as ``index_select``); a
result moved with ``.cpu()`` comes back on the CPU. On a GPU the same code would fail or slow down.

The probe only ever *adds* a diagnosis: code that cannot run on meta for another reason (it reads
numbers, ``.item()``, a data-dependent branch) is not judged by it.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..verdict import Failure, fail
from ._student_files import exception_message

# what torch says when meta meets the CPU: mixed in one operation, or copied out to it (.cpu(), a CPU buffer)
_MIXED = ("is not on the expected device", "Expected all tensors to be on the same device",
          "Cannot copy out of meta tensor")


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of one argument or result of an ATen operation: a tensor, or a list of them (Tensor[], Tensor?[]).
    Not torch's pytree, whose Python calls cost more than the meta kernels themselves."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _advice(what: str, copied: bool = False) -> str:
    did = ("copies numbers to the CPU (a .cpu() or .to('cpu') on a result, or a tensor it created on the CPU and "
           "writes into)" if copied else "mixes in a tensor it created on the CPU (in this call, or in an earlier "
           "one and kept, as in a cache of masks, tables or cast weights keyed by shape or dtype but not by device)")
    return (f"{what}: on inputs of another device (here the `meta` device; on a GPU it would be cuda) your code "
            f"{did}. Create new tensors on the input's device, "
            f"`torch.ones(L, L, device=x.device)` or `torch.zeros_like(x)`; register fixed tensors such as masks "
            f"with self.register_buffer(...) so that model.to(device) moves them; never call .cpu() on a result.")


# Where a GPU takes a CPU tensor beside its own: copies to the device, tensor_split's split points (which must be
# on the CPU), and the indices of advanced indexing (x[idx], x[idx] = v), though not the values written there.
_CPU_ALLOWED = {"aten::copy_", "aten::_to_copy", "aten::tensor_split"}
_INDICES_ALLOWED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


class _CpuBesideMeta(Exception):
    """An operation given a meta tensor and a CPU tensor (not a 0-d one, which a GPU takes as a number)."""


class _NoCpuBesideMeta(TorchDispatchMode):
    """Meta kernels of some operations never look at their other tensors' device (index_select, gather and
    the like take a CPU index beside meta inputs, where CUDA raises): every operation is checked here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        # the second argument of an indexing operation is its indices, which may stay on the CPU
        checked = (args[:1] + args[2:]) if name in _INDICES_ALLOWED else args
        tensors = [t for value in (*checked, *(kwargs or {}).values()) for t in _tensors(value)]
        if name not in _CPU_ALLOWED and any(t.device.type == "meta" for t in tensors) \
                and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
            raise _CpuBesideMeta(name)
        return func(*args, **(kwargs or {}))


def probe(run: Callable[[], Any], what: str) -> None:
    """Call ``run()`` (the student's code on meta inputs); fail with ``device`` on a device slip."""
    try:
        with warnings.catch_warnings(), _NoCpuBesideMeta():
            warnings.simplefilter("ignore")
            out = run()
    except _CpuBesideMeta:
        fail("device", _advice(what))
    except Exception as exc:  # noqa: BLE001 - only a device mix is judged; anything else is inconclusive
        if isinstance(exc.__cause__ or exc.__context__, _CpuBesideMeta):
            fail("device", _advice(what))
        said = exception_message(exc)
        if any(marker in said for marker in _MIXED):
            fail("device", _advice(what, copied="Cannot copy out of meta tensor" in said))
        return
    for tensor in _tensors(out):
        if tensor.device.type != "meta":
            fail("device", f"{what} returned a tensor on {tensor.device} for inputs on the meta device. "
                           + _advice(what).split(": ", 1)[1])


def meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def module_on_meta(module: nn.Module) -> nn.Module | None:
    """A copy of the student's module on meta; None when it cannot be copied or moved (inconclusive)."""
    try:
        return copy.deepcopy(module).to("meta")
    except Exception:  # noqa: BLE001
        return None


def kept_advice(what: str) -> str:
    """The words of a device slip seen only after calls on the CPU at the same shapes: a tensor kept from them."""
    return (f"{what}: after calls on the CPU at these very shapes, your code, moved to another device (here the "
            f"`meta` device; on a GPU it would be cuda; the module moved with model.to(device)), mixes in a tensor "
            f"it kept from those calls (a mask, a table of positions or a cast weight, cached on the module, in a "
            f"global or with functools.lru_cache, keyed by its length or dtype but not by its device), which stayed "
            f"on the CPU. Key such a cache by x.device too, make the tensor on x.device at every call, or register "
            f"it with self.register_buffer(...) so that model.to(device) moves it.")


def probe_after_cpu_calls(calls: Sequence[tuple[str, Callable[[], Any], Callable[[], Any]]],
                          move: Callable[[], Any] = lambda: None) -> None:
    """The device probe after the same calls on the CPU: ``calls`` are (what, the call on the CPU, the same call on
    meta). Every CPU call runs first (torch's random state kept; one that raises leaves the probe inconclusive), then
    ``move()`` (a module moved to meta, as model.to(device) moves it), so that a cache keyed by shape or dtype but not
    by device (a memo on the module, in a global, an lru_cache) holds the shapes the meta calls then look up: a
    device slip there is a tensor kept from the CPU calls."""
    with torch.random.fork_rng(), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            for _, on_cpu, _ in calls:
                on_cpu()
            move()
        except Exception:  # noqa: BLE001 - code that does not run (or move) here is judged elsewhere
            return
        for what, _, on_meta in calls:
            try:
                probe(on_meta, what)
            except Failure as failure:
                if failure.diagnosis != "device":
                    raise
                fail("device", kept_advice(what))


Placed = Callable[[Callable[[torch.Tensor], torch.Tensor]], Any]   # a call, given where to place its inputs


def _module_calls(model: nn.Module, x: torch.Tensor, what: str, cache: Callable[[], Any] | None
                  ) -> list[tuple[str, Placed]]:
    """(what, a call of ``model`` given how to place its input): ``x`` whole, then with ``cache`` (a new, empty one
    each call) split into a prompt and the rest three ways, a token, half or all but one token first."""
    calls: list[tuple[str, Placed]] = [(what, lambda place: model(place(x)))]
    if cache is not None and x.shape[1] > 1:
        for split in sorted({1, x.shape[1] // 2, x.shape[1] - 1}):   # a prompt, then a chunk or one token
            def run(place: Callable[[torch.Tensor], torch.Tensor], split: int = split) -> Any:
                held = cache()
                return model(place(x[:, :split]), held), model(place(x[:, split:]), held)
            calls.append((f"{what}, the first {split} tokens then the rest with a KV cache", run))
    return calls


def probe_module(model: nn.Module, x: torch.Tensor, what: str, cache: Callable[[], Any] | None = None) -> None:
    """The student's module, copied to meta, on ``x`` there (a module that cannot be copied or moved is
    inconclusive), then in training mode; with ``cache`` (a new, empty cache each call), also ``x`` split into a
    prompt and the rest three ways, a token, half or all but one token first: a branch taken only with a cache,
    a chunk, or in training mode may make its tensors on the CPU. Then the same calls on another copy, first on the
    CPU, then moved to meta (``probe_after_cpu_calls``): a tensor kept from those calls (a cache keyed by shape or
    dtype, not by device, on the module or in a global) meets meta inputs."""
    moved = module_on_meta(model)
    if moved is None:
        return
    for shown, run in _module_calls(moved, x, what, cache):
        probe(lambda run=run: run(meta), shown)
    if moved.training is False:   # a branch taken only in training mode (dropout's)
        try:
            moved.train()
        except Exception:  # noqa: BLE001 - a module whose train() fails is judged elsewhere
            return
        probe(lambda: moved(meta(x)), f"{what} in training mode")
    try:
        warm = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - a module that cannot be copied: inconclusive
        return
    probe_after_cpu_calls([(shown, lambda run=run: run(torch.Tensor.clone), lambda run=run: run(meta))
                           for shown, run in _module_calls(warm, x, what, cache)], move=lambda: warm.to("meta"))


def probe_kept_on_device(model: nn.Module, seen: torch.Tensor, unseen: torch.Tensor, what: str) -> None:
    """The student's module, after its calls on the CPU, moved to meta (a copy) and run there on an input of a shape
    it has not seen (``unseen``), then on one of a shape it has (``seen``): a tensor kept from those calls (a mask
    cached by length, on the module or in a global) is still on the CPU, and only the shape seen before meets it.
    Judged only where the new shape runs: a module that makes a CPU tensor at every call is the device probe's to
    judge, where the exercise has one."""
    moved = module_on_meta(model)
    if moved is None:
        return
    try:
        probe(lambda: moved(meta(unseen)), what)
    except Failure:
        return
    try:
        probe(lambda: moved(meta(seen)), what)
    except Failure as failure:
        if failure.diagnosis != "device":
            raise
        fail("device", f"{what} on x of shape {tuple(seen.shape)}: your module, moved to another device after calls "
                       f"on the CPU (here the `meta` device; on a GPU it would be cuda), mixes in a tensor it kept "
                       f"from those calls (a mask cached by its length, on the module or in a global), which stayed "
                       f"on the CPU; at a length it had not seen it runs. Key such a cache by the device too, or make "
                       f"the tensor on x.device at every call, or register it with self.register_buffer(...) so that "
                       f"model.to(device) moves it.")
