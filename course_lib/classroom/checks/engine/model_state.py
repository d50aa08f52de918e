"""The ``model_state`` probe: everything a context manager or a hook can change on a module tree, taken
before the student's code runs and compared after it, each difference named in words.

What it holds (:meth:`ModelState.of`), for the module and every submodule:

- the tree itself: which submodule sits at which name, and each one's class;
- every hooks dict of the module (forward, pre-forward, backward, state-dict ..., found by name, so a dict a
  later torch adds is held too), hook by hook: one left behind and one removed (someone else's, registered
  before the student's code ran) are both differences;
- the training flag; the public attributes (an instance ``forward`` patched in, a ``num_heads`` changed);
- every parameter and buffer by name: the same tensor object, its dtype, device, shape and values,
  ``requires_grad``, and the hooks on the tensor itself (``register_hook``);

and, beside the tree, torch's global module hooks (``register_module_forward_hook``) and autograd's mode
(grad mode, inference mode): a ``torch.no_grad()`` entered and never left is state the student's code changed.

Public attributes are compared by identity (plain values by equality), and buffers by value: a module that
writes to either on every forward (BatchNorm's running statistics in training mode, recorded attention
weights) shows as changed after the checker's own forward passes, so probe such a model with that switched off.

:meth:`ModelState.changes` lists the differences, most telling first; :func:`plant_hooks` registers hooks of
"someone else" (a profiler, another analysis) that must still be there afterwards; :func:`autograd_cause`
reads what made a backward through the student's model fail; :func:`global_hooks_kept` puts torch's global
module hooks back after a check.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from .._student_files import exception_message, exception_name
from .autograd_errors import saved_tensor_changed

# Taken when the checks are imported, before any student code runs: a patch of torch cannot reach them.
_equal = torch.equal
_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled

# Plain values compared by equality; any other attribute by identity (a config, a tensor, a function).
_PLAIN = (bool, int, float, str, bytes, type(None), tuple, torch.dtype, torch.device)

_HOOK_WORDS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
               "_backward_hooks": "backward hook", "_backward_pre_hooks": "backward pre-hook",
               "_forward_hooks_with_kwargs": "forward hook (with kwargs)",
               "_forward_pre_hooks_with_kwargs": "forward pre-hook (with kwargs)",
               "_forward_hooks_always_called": "forward hook (always called)",
               "_state_dict_hooks": "state-dict hook", "_state_dict_pre_hooks": "state-dict pre-hook",
               "_load_state_dict_pre_hooks": "load-state-dict pre-hook",
               "_load_state_dict_post_hooks": "load-state-dict post-hook"}


def _hook_dicts(owner: Any) -> dict[str, dict[Any, Any]]:
    """Every hooks dict an object holds, by attribute name (``_forward_hooks``, ...): found by name, so a kind
    of hook a later torch adds is held too."""
    found = vars(owner) if hasattr(owner, "__dict__") else {}
    return {name: dict(value) for name, value in found.items()
            if "hooks" in name and isinstance(value, dict)}


def _tensor_hooks(tensor: torch.Tensor) -> dict[str, dict[Any, Any]]:
    """The hooks registered on a tensor itself (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    held = {}
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        value = getattr(tensor, name, None)
        if isinstance(value, dict):
            held[name] = dict(value)
    return held


def _global_hooks() -> dict[str, dict[Any, Any]]:
    """torch's global module hooks (``register_module_forward_hook`` ...), which reach every module."""
    return {name: dict(value) for name, value in vars(_module).items()
            if name.startswith("_global_") and "hooks" in name and isinstance(value, dict)}


def _hook_name(hook: Any) -> str:
    hook = getattr(hook, "__func__", hook)
    return getattr(hook, "__name__", None) or type(hook).__name__


def _hook_word(attribute: str) -> str:
    return _HOOK_WORDS.get(attribute, attribute.strip("_").replace("_", " ")[:-1])


def _hook_changes(where: str, before: dict[str, dict[Any, Any]], after: dict[str, dict[Any, Any]],
                  planted: frozenset[int]) -> list[str]:
    found = []
    for attribute in sorted(set(before) | set(after)):
        old, new = before.get(attribute, {}), after.get(attribute, {})
        word = _hook_word(attribute)
        for key, hook in old.items():
            if key not in new or new[key] is not hook:
                whose = (f"a {word} that other code registered before yours ({_hook_name(hook)}, as a profiler "
                         f"or another analysis would)" if id(hook) in planted else
                         f"the {word} {_hook_name(hook)}, registered before your code ran,")
                found.append(f"{where}: {whose} was removed. Remove only your own hook, with the handle that "
                             f"registering it returned (handle.remove()); never clear a module's hooks")
        for key, hook in new.items():
            if key not in old:
                found.append(f"{where} still has a {word} that was not there before ({_hook_name(hook)}): "
                             f"remove it with handle.remove()")
    return found


@dataclass(frozen=True)
class _Tensor:
    """What a parameter or buffer was: the object, its kind, its numbers, its hooks."""

    obj: torch.Tensor
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]
    requires_grad: bool
    values: torch.Tensor
    hooks: dict[str, dict[Any, Any]]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Tensor:
        return cls(tensor, tensor.dtype, tensor.device, tuple(tensor.shape), bool(tensor.requires_grad),
                   tensor.detach().clone(), _tensor_hooks(tensor))

    def changes(self, name: str, now: Any, planted: frozenset[int]) -> list[str]:
        if now is None:
            return [f"{name} is gone (deleted, or set to None)"]
        if now is not self.obj:
            return [f"{name} is no longer the same tensor object (an optimizer holding it would lose it): change "
                    f"its values in place under torch.no_grad() and copy them back, or hook the module instead"]
        found = []
        if now.dtype != self.dtype or now.device != self.device:
            found.append(f"{name} is now {now.dtype} on {now.device}, it was {self.dtype} on {self.device}")
        elif tuple(now.shape) != self.shape:
            found.append(f"{name} now has shape {tuple(now.shape)}, it had {self.shape}")
        elif not _same_values(now.detach(), self.values):
            found.append(f"{name} holds other numbers than before (largest change "
                         f"{_largest_change(now.detach(), self.values):.3g})")
        if bool(now.requires_grad) != self.requires_grad:
            found.append(f"{name} has requires_grad={bool(now.requires_grad)}, it had {self.requires_grad}"
                         + (" (the model was frozen and never unfrozen)" if self.requires_grad else ""))
        found += _hook_changes(f"the tensor {name}", self.hooks, _tensor_hooks(now), planted)
        return found


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if _equal(a, b):   # the usual answer, in one pass; equal fails on NaN, which the NaN-aware pass below takes
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(_equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                    and _equal(torch.isnan(a), torch.isnan(b)))
    return bool(_equal(a, b))


def _largest_change(a: torch.Tensor, b: torch.Tensor) -> float:
    try:
        diff = (a.double() - b.double()).abs()
        diff = diff[torch.isfinite(diff)]
        return float(diff.max()) if diff.numel() else float("nan")
    except (RuntimeError, TypeError):
        return float("nan")


def _attributes(module: nn.Module) -> dict[str, tuple[bool, Any]]:
    """The module's public attributes (``training`` apart): (plain, value), a plain value by equality."""
    return {name: (isinstance(value, _PLAIN), value) for name, value in vars(module).items()
            if not name.startswith("_") and name != "training"}


def _differs(before: Any, now: Any, plain: bool) -> bool:
    """A plain value by equality (a tuple holding tensors, whose == cannot answer, by identity), others by
    identity."""
    if now is before:
        return False
    if not plain or type(now) is not type(before):
        return True
    try:
        return bool(now != before)
    except Exception:  # noqa: BLE001 - a value whose comparison raises has changed as far as we can tell
        return True


@dataclass(frozen=True)
class _Module:
    obj: nn.Module
    cls: type
    training: bool
    hooks: dict[str, dict[Any, Any]]
    attributes: dict[str, tuple[bool, Any]]
    parameters: dict[str, _Tensor]
    buffers: dict[str, _Tensor]
    names: frozenset[str]   # every attribute it had, private ones too: one added (a handle kept) is a trace

    @classmethod
    def of(cls, module: nn.Module) -> _Module:
        return cls(module, type(module), bool(module.training), _hook_dicts(module), _attributes(module),
                   {n: _Tensor.of(p) for n, p in vars(module).get("_parameters", {}).items() if p is not None},
                   {n: _Tensor.of(b) for n, b in vars(module).get("_buffers", {}).items() if b is not None},
                   frozenset(vars(module)))

    def changes(self, name: str, now: nn.Module, planted: frozenset[int]) -> list[str]:
        where = name or "the model"
        prefix = f"{name}." if name else ""
        if type(now) is not self.cls:
            return [f"{where} is now a {type(now).__name__}, it was a {self.cls.__name__} (its class was swapped)"]
        found = []
        if bool(now.training) != self.training:
            found.append(f"{where} was left in {'training' if now.training else 'eval'} mode, it was in "
                         f"{'training' if self.training else 'eval'} mode (a model.eval() or model.train() never "
                         f"undone: leave the mode alone, an ablation does not need it)")
        found += _hook_changes(where, self.hooks, _hook_dicts(now), planted)
        attributes = _attributes(now)
        for attribute in sorted(set(self.attributes) | set(attributes)):
            if attribute not in attributes:
                found.append(f"{where}.{attribute} was deleted")
            elif attribute not in self.attributes:
                patched = " (a patched forward: delete it afterwards, del module.forward)" \
                    if attribute == "forward" else ""
                found.append(f"{where}.{attribute} was set on the module and is still there{patched}")
            else:
                plain, value = self.attributes[attribute]
                now_value = attributes[attribute][1]
                if _differs(value, now_value, plain):
                    found.append(f"{where}.{attribute} was changed" + (f" from {value!r} to {now_value!r}"
                                                                        if plain else ""))
        for attribute in sorted(set(vars(now)) - self.names - set(attributes)):   # the private ones added
            found.append(f"{where}.{attribute} was set on the module and is still there (a handle or a value kept "
                         f"there: keep it in a local variable of your function instead)")
        for kind, held, current in (("parameter", self.parameters, vars(now).get("_parameters", {})),
                                    ("buffer", self.buffers, vars(now).get("_buffers", {}))):
            for tensor_name, tensor in held.items():
                found += tensor.changes(prefix + tensor_name, current.get(tensor_name), planted)
            for tensor_name in sorted(set(current) - set(held)):
                if current[tensor_name] is not None:
                    found.append(f"{prefix}{tensor_name} is a new {kind}, not there before")
        return found


# Changes that a single call makes to every module or tensor (model.eval(), model.double(), freezing): told
# once, with how many more, rather than once per submodule. Each is known by the words after the name.
_ALIKE = (" was left in training mode", " was left in eval mode", " is now torch.", " has requires_grad=")


def _alike(change: str) -> str | None:
    return next((f"\0{words}" for words in _ALIKE if words in change), None)


def _grouped(changes: list[str]) -> str:
    if len(changes) == 1:
        return changes[0]
    names = [change.split(" ", 1)[0] for change in changes[1:]]
    shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    return f"{changes[0]}; the same for {len(names)} more ({shown})"


class ModelState:
    """A module tree as the student's code found it (``ModelState.of(model)``); ``changes(model)`` names,
    in words, every way in which the tree is not as it was."""

    def __init__(self, model: nn.Module, planted: Iterable[Any] = ()):
        self.modules = {name: _Module.of(module) for name, module in model.named_modules(remove_duplicate=False)}
        self.global_hooks = _global_hooks()
        self.grad_enabled = _is_grad_enabled()
        self.inference_mode = _is_inference_mode_enabled()
        self.planted = frozenset(id(hook) for hook in planted)

    @classmethod
    def of(cls, model: nn.Module, planted: Iterable[Any] = ()) -> ModelState:
        """The state of ``model`` now; ``planted`` are hooks someone else registered (named so if removed)."""
        return cls(model, planted)

    def changes(self, model: nn.Module) -> list[str]:
        """Every difference, in words: the tree and autograd's mode first, then each module's."""
        found = []
        if _is_grad_enabled() != self.grad_enabled:
            found.append(f"grad mode is {'on' if _is_grad_enabled() else 'off'}, it was "
                         f"{'on' if self.grad_enabled else 'off'} (a torch.no_grad() or torch.set_grad_enabled("
                         f"False) never undone)")
        if _is_inference_mode_enabled() != self.inference_mode:
            found.append("inference mode was left switched on (a torch.inference_mode() never left)")
        found += _hook_changes("torch", self.global_hooks, _global_hooks(), self.planted)
        try:
            modules = dict(model.named_modules(remove_duplicate=False))
        except Exception as exc:  # noqa: BLE001 - a tree the student broke is a difference, not our error
            return found + [f"the model's submodules can no longer be listed ({exception_name(exc)}: {exception_message(exc)})"]
        for name in self.modules:
            if name not in modules:
                found.append(f"{name} is gone from the model (deleted, or replaced by something that is not a "
                             f"module)")
            elif modules[name] is not self.modules[name].obj:
                found.append(f"{name} was replaced by another module ({type(modules[name]).__name__}): change the "
                             f"module you were given, and put back what you changed")
        for name in sorted(set(modules) - set(self.modules)):
            found.append(f"{name} is a new submodule ({type(modules[name]).__name__}), not there before")
        alike: dict[str, list[str]] = {}    # one change made to many modules or tensors (a whole model.eval())
        for name, held in self.modules.items():
            if modules.get(name) is held.obj:
                for change in held.changes(name, held.obj, self.planted):
                    kind = _alike(change)
                    if kind is None:
                        found.append(change)
                    else:
                        if kind not in alike:
                            found.append(kind)     # a placeholder, filled below in its place
                        alike.setdefault(kind, []).append(change)
        return [_grouped(alike[item]) if item in alike else item for item in found]

    def first_changes(self, model: nn.Module, most: int = 3) -> str | None:
        """The first ``most`` differences in one sentence (and how many more), or None when there is none."""
        found = self.changes(model)
        if not found:
            return None
        more = f" (and {len(found) - most} more)" if len(found) > most else ""
        return "; ".join(found[:most]) + more


@contextlib.contextmanager
def global_hooks_kept() -> Iterator[None]:
    """torch's global module hooks as they were on entering, put back on leaving: a global hook the student's
    code left behind during a check (a verdict of its own) must not reach every module of their notebook."""
    saved = {name: dict(hooks) for name, hooks in vars(_module).items()
             if name.startswith("_global_") and "hooks" in name and isinstance(hooks, dict)}
    try:
        yield
    finally:
        for name, hooks in saved.items():
            now = getattr(_module, name)
            if now != hooks:
                now.clear()
                now.update(hooks)


def plant_hooks(model: nn.Module, modules: Iterable[nn.Module]) -> list[Callable[..., None]]:
    """Register hooks of "someone else" (as a profiler or another analysis would) on ``model`` and on each of
    ``modules``: a forward pre-hook and a forward hook on each, which change nothing. They must still be
    registered after the student's code ran. Returns the hooks (for :class:`ModelState`'s ``planted``)."""
    planted = []
    for module in [model, *modules]:
        def someone_elses_pre_hook(module: nn.Module, inputs: Any) -> None:
            return None

        def someone_elses_hook(module: nn.Module, inputs: Any, output: Any) -> None:
            return None
        module.register_forward_pre_hook(someone_elses_pre_hook)
        module.register_forward_hook(someone_elses_hook)
        planted += [someone_elses_pre_hook, someone_elses_hook]
    return planted


def autograd_cause(exc: BaseException | None, before: ModelState) -> tuple[str, str]:
    """Why a backward through the student's model failed, or gave no gradient: the verdict's code and its
    cause in words. Grad mode off, parameters frozen (``gradient``), a tensor saved for backward changed in
    place (``mutation``); else the error itself (``gradient``)."""
    text = exception_message(exc) if exc is not None else ""
    if _is_inference_mode_enabled():
        return "gradient", ("inference mode was on while the model ran (torch.inference_mode() around the "
                            "`yield`), so the output has no graph. Leave autograd's modes alone in an ablation")
    if not _is_grad_enabled():
        return "gradient", ("grad mode was off while the model ran (a torch.no_grad() or torch.set_grad_enabled("
                            "False) in your context manager, around the `yield`), so the output has no graph. Use "
                            "torch.no_grad() only around the lines that change weights, never around the `yield`")
    frozen = [f"{module_name}.{name}" if module_name else name
              for module_name, held in before.modules.items() for name, tensor in held.parameters.items()
              if tensor.requires_grad and not tensor.obj.requires_grad]
    if frozen:
        shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
        return "gradient", (f"requires_grad was switched off for {shown} (requires_grad_(False)), so those weights "
                            f"get no gradient. An ablation switches a head off; it does not freeze the model")
    if saved_tensor_changed(text):
        return "mutation", ("a tensor that autograd saved for the backward pass was changed in place: a hook that "
                            "writes into its input (inputs[0][...] = 0) overwrites the attention's own output. "
                            "Clone it first, x = inputs[0].clone(), zero the copy and return it")
    first = text.splitlines()[0] if text else "no gradient reached any weight"
    return "gradient", f"the backward pass through your model failed ({exception_name(exc) if exc else 'no graph'}: {first})"


def parameters_held(module: nn.Module) -> dict[str, _Tensor]:
    """Every parameter of ``module`` (its submodules' too) as it is now, by name: what ``parameters_changed``
    compares a forward's end against. Parameters only: a module may record what it likes in attributes and
    buffers (the last attention weights), but its weights are the optimizer's."""
    try:
        return {name: _Tensor.of(p) for name, p in module.named_parameters()}
    except Exception:  # noqa: BLE001 - a module whose parameters cannot be listed: other probes name it
        return {}


def parameters_changed(module: nn.Module, held: dict[str, _Tensor]) -> list[tuple[str, str]]:
    """(name, what changed) for each parameter ``held`` whose numbers a call changed in place (``weight.clamp_``,
    ``weight.data.abs_()``, ``weight.data = ...``): its values compared, the tensor found by name."""
    try:
        now = dict(module.named_parameters())
    except Exception:  # noqa: BLE001
        return []
    found = []
    for name, before in held.items():
        tensor = now.get(name)
        if tensor is None or tuple(tensor.shape) != before.shape or tensor.is_meta or before.values.is_meta:
            continue   # gone or reshaped: the gradient probe names a parameter replaced; meta holds no numbers
        values = tensor.detach()
        if values.dtype != before.values.dtype:
            values = values.to(before.values.dtype)
        if not _same_values(values, before.values):
            found.append((name, f"largest change {_largest_change(values, before.values):.3g}"))
    return found
