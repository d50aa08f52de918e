"""The check of exercise 11.3, ``ablate_head(model, layer, head)``: a context manager that switches one head off.

Inside the ``with``, the model must compute what the reference computes with that head's slice of the merged
heads zeroed (any way that does so passes: a hook on ``proj``'s input, zeroed columns of ``proj`` or zeroed
value weights without a bias), and gradients must still reach the other layers. After the ``with`` (also
when the code inside it raised) the model must be as it was: the same parameters, values, hooks and outputs.
Wrong outputs are named by the mistakes below (what each would compute, on a copy of the model).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ... import heads as ref
from ...model import GPT, GPTConfig
from ..exercises import Mistake
from ..verdict import fail
from ._counterexample import Example, first_difference
from ._model_common import randomize_
from ._student_code import call_student, close, expect_callable
from .engine import first_mistake
from .engine.example import compare

_OWNS = "head h owns columns h * head_dim .. (h+1) * head_dim - 1"
_OTHER_LAYER = "a head of another layer is switched off: `layer` counts model.blocks from 0."
_OUTPUT = "Zero the head's OUTPUT, its columns of the input of attn.proj."

# The slips of an ablation, each with the ``kind`` of change that ``_mistaken`` makes to a copy of the model.
_MISTAKES = tuple(Mistake(code, why, {"kind": kind}) for code, kind, why in (
    ("ablation_method", "qk", "the head's query and key weights are zeroed. That makes its attention uniform, not "
                              f"absent: the head still outputs the average of its values. {_OUTPUT}"),
    ("ablation_method", "value_weight", "the head's value weights are zeroed, but not its value bias: the head "
                                        f"still outputs the bias. {_OUTPUT}"),
    ("ablation_slice", "layer", "every head of the layer is switched off (the whole input of attn.proj, or all of "
                                "its weight). Zero only head `head`'s columns, head * head_dim .. (head+1) * "
                                "head_dim - 1."),
    ("ablation_slice", "rows", "the ROWS of attn.proj.weight for the head are zeroed (proj.weight[slice, :]): those "
                               "are output dimensions of the residual stream, not the head. The head's output is "
                               "the input of proj, so its slice is the COLUMNS proj.weight[:, slice] (or zero "
                               "proj's input there)."),
    ("ablation_slice", "strided", "every num_heads-th column is zeroed (head::num_heads). merge_heads puts each "
                                  "head's head_dim numbers side by side: head h owns the block of columns h * "
                                  "head_dim .. (h+1) * head_dim - 1."),
    ("ablation_slice", "unscaled", "the zeroed block starts at column `head` instead of head * head_dim: multiply "
                                   "the head's index by head_dim."),
    ("ablation_slice", "others", "all heads but the chosen one are switched off: zero the chosen head's columns "
                                 "and keep the others."),
    ("ablation_slice", "next", f"the head after the chosen one is switched off (columns (head+1) * head_dim ..): "
                               f"{_OWNS}."),
    ("ablation_slice", "previous", f"the head before the chosen one is switched off: {_OWNS}, counting heads from 0."),
    ("ablation_slice", "layer_next", _OTHER_LAYER),
    ("ablation_slice", "layer_previous", _OTHER_LAYER),
))


def _models() -> list[tuple[str, nn.Module]]:
    generator = torch.Generator().manual_seed(11)
    small = ref.AttentionOnly(ref.InductionConfig(vocab_size=13, half=5, embed_dim=24, num_heads=3, num_layers=2,
                                                   min_period=2))
    gpt = GPT(GPTConfig(vocab_size=13, max_tokens=10, embed_dim=16, num_heads=4, num_layers=2, bias=True))
    return [("a 2-layer attention-only model with 3 heads per layer", randomize_(small, generator).eval()),
            ("a 2-layer GPT with 4 heads per layer and biases", randomize_(gpt, generator).eval())]


_CASES = {0: [(0, 1), (1, 2), (1, 0)], 1: [(1, 3), (0, 0)]}


def _columns(attn: nn.Module, kind: str, head: int) -> list[int]:
    size, count = attn.head_dim, attn.num_heads
    own = list(range(head * size, (head + 1) * size))
    return {"layer": list(range(size * count)), "strided": list(range(head, size * count, count)),
            "unscaled": list(range(head, min(head + size, size * count))),
            "others": [c for c in range(size * count) if c not in own],
            "next": list(range(((head + 1) % count) * size, ((head + 1) % count + 1) * size)),
            "previous": list(range(((head - 1) % count) * size, ((head - 1) % count + 1) * size))}.get(kind, own)


@torch.no_grad()
def _mistaken(model: nn.Module, layer: int, head: int, idx: torch.Tensor, kind: str) -> torch.Tensor:
    """What the model outputs with the mistake ``kind`` applied to a copy of it."""
    model = copy.deepcopy(model)
    if kind.startswith("layer_"):
        layer = layer + (1 if kind == "layer_next" else -1)
        if not 0 <= layer < len(model.blocks):
            raise ValueError("no such layer")
        kind = "own"
    attn = model.blocks[layer].attn
    own = slice(head * attn.head_dim, (head + 1) * attn.head_dim)
    if kind == "qk":
        for linear in (attn.query, attn.key):
            linear.weight[own] = 0.0
            if linear.bias is not None:
                linear.bias[own] = 0.0
    elif kind == "value_weight":
        attn.value.weight[own] = 0.0
    elif kind == "rows":
        attn.proj.weight[own] = 0.0
    else:
        attn.proj.weight[:, _columns(attn, kind, head)] = 0.0
    return model(idx)


class _Snapshot:
    """What ablate_head must leave as it found it: parameters, buffers, hooks, modes, attributes."""

    def __init__(self, model: nn.Module):
        self.tensors = [(name, t, t.detach().clone()) for name, t in
                        list(model.named_parameters()) + list(model.named_buffers())]
        self.modules = [(name, m, self._state(m)) for name, m in model.named_modules()]

    @staticmethod
    def _state(module: nn.Module) -> tuple[Any, ...]:
        return (module.training, len(module._forward_hooks), len(module._forward_pre_hooks),
                len(module._backward_hooks), sorted(k for k in vars(module) if not k.startswith("_")),
                vars(module).get("forward"))

    def changes(self, model: nn.Module) -> str | None:
        now = dict(list(model.named_parameters()) + list(model.named_buffers()))
        for name, tensor, values in self.tensors:
            if now.get(name) is not tensor:
                return f"{name} is no longer the same tensor object (an optimizer holding it would lose it)"
            if not torch.equal(tensor.detach(), values):
                return f"{name} holds other numbers than before"
        modules = dict(model.named_modules())
        for name, module, state in self.modules:
            where = name or "the model"
            if modules.get(name) is not module:
                return f"{where} was replaced by another module"
            now_state = self._state(module)
            if now_state[0] != state[0]:
                return f"{where} was left in {'training' if module.training else 'eval'} mode"
            if now_state[1:4] != state[1:4]:
                return f"{where} still has a hook that was not there before (remove it: handle.remove())"
            if now_state[4:] != state[4:]:
                return f"{where} has attributes that differ from before (a patched forward?)"
        return None


class _Probe(Exception):
    """Raised inside the student's ``with`` to see that the model is restored on the way out."""


def _expect_context_manager(value: Any, shown: str) -> None:
    if hasattr(value, "__enter__") and hasattr(value, "__exit__"):
        return
    if value is None:
        fail("exception", f"{shown} returned nothing, so it cannot be used in a `with` statement. Write it as a "
                          f"generator decorated with @contextlib.contextmanager, which `yield`s once.")
    if hasattr(value, "__next__") and hasattr(value, "send"):
        fail("exception", f"{shown} returned a plain generator, which `with` cannot use: decorate the function "
                          f"with @contextlib.contextmanager.")
    fail("exception", f"{shown} returned a {type(value).__name__}, which is not a context manager: write it as a "
                      f"generator decorated with @contextlib.contextmanager, which `yield`s once.")


def _grads(model: nn.Module, out: torch.Tensor, weights: torch.Tensor, layer: int) -> dict[str, torch.Tensor | None]:
    # The ablated layer's own attention is left out: zeroed proj columns (a correct ablation) get other
    # gradients there than a hook does. Every other parameter must receive the reference's gradient.
    skip = f"blocks.{layer}.attn."
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith(skip)]
    grads = torch.autograd.grad((out * weights).sum(), [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, grads)}


def _diagnose(model: nn.Module, layer: int, head: int, idx: torch.Tensor, out: torch.Tensor,
              base: torch.Tensor, shown: str) -> None:
    if close(out, base):
        fail("ablation_method", f"{shown}: inside the `with`, the model computes exactly what it computed before: "
                                f"no head was switched off. (A hook registered on a copy of the model, or weights "
                                f"changed only on leaving the block, do that.)")
    first_mistake(_MISTAKES, lambda mistake: close(out, _mistaken(model, layer, head, idx, mistake.spec["kind"])),
                  f"{shown}: ")     # a mistake that raises does not apply here (no layer before layer 0)
    fail("mismatch", f"{shown}: inside the `with`, the model's output is not that of the model with head {head} of "
                     f"layer {layer} switched off, nor like any mistake we know. The head's output is its "
                     f"head_dim columns of the input of model.blocks[{layer}].attn.proj.")


def _fresh(fn: Callable[..., Any], built: nn.Module, layer: int, head: int, shown: str
           ) -> tuple[nn.Module, _Snapshot, Any]:
    """A copy of the model, what it holds now, and the student's context manager on it."""
    model = copy.deepcopy(built)
    snapshot = _Snapshot(model)
    manager = call_student(fn, model, layer, head, what=shown)
    _expect_context_manager(manager, shown)
    return model, snapshot, manager


def judge_ablate_head(fn: Callable[..., Any]) -> str:
    expect_callable(fn, "ablate_head")
    generator = torch.Generator().manual_seed(12)
    for number, (described, built) in enumerate(_models()):
        idx = torch.randint(13, (2, 10), generator=generator)               # (N, L)
        weights = torch.randn(2, 10, 13, generator=generator)              # (N, L, vocab): a probe of the logits
        with torch.no_grad():
            base = built(idx)
        for layer, head in _CASES[number]:
            shown = f"ablate_head(model, layer={layer}, head={head}) on {described}"
            reference = copy.deepcopy(built)
            with ref.ablate_head(reference, layer, head):
                expected = reference(idx)
                expected_grads = _grads(reference, expected, weights, layer)
            model, snapshot, manager = _fresh(fn, built, layer, head, shown)
            with manager:
                out = model(idx)
                right = isinstance(out, torch.Tensor) and close(out, expected)
                grads = _grads(model, out, weights, layer) if right else {}
            if not right:      # named outside the `with`: a manager that swallows exceptions would hide it
                _diagnose(built, layer, head, idx, out, base, shown)
            for name, grad in expected_grads.items():
                if grad is not None and (grads[name] is None or not close(grads[name], grad)):
                    fail("gradient", f"{shown}: the output is right, but gradients no longer flow as they "
                                        f"should (first wrong at {name}): the ablation must stay part of the "
                                        f"graph. Replace the head's columns with zeros in a copy of proj's input "
                                        f"(clone, then assign), without torch.no_grad() or .detach().")
            changed = snapshot.changes(model)
            if changed is None and not close(model(idx), base):
                changed = "its output differs from before"
            if changed:
                fail("not_restored", f"{shown}: after the `with`, the model is not as it was: {changed}. Undo "
                                     f"everything on leaving the block: remove the hook, or copy the saved "
                                     f"weights back.")
            model, snapshot, manager = _fresh(fn, built, layer, head, shown)
            try:
                with manager:
                    model(idx)
                    raise _Probe("raised inside the with block by the checker")
            except _Probe:
                pass
            else:
                fail("exception", f"{shown}: an exception raised inside the `with` block disappeared: your "
                                  f"context manager swallowed it. Use try/finally around the `yield`, not "
                                  f"try/except.")
            changed = snapshot.changes(model)
            if changed:
                fail("not_restored", f"{shown}: when the code inside the `with` raises, the model is not restored: "
                                     f"{changed}. Put the undoing in a `finally:` around the `yield`, so it runs "
                                     f"however the block ends.")
    return ("Inside the `with`, exactly that head is off (both models, five layer/head pairs, gradients still "
            "flowing); afterwards, and after an exception inside, the model is exactly as before.")


def ablation_example(fn: Callable[..., Any], *_: Any, **__: Any) -> Example | None:
    """The counter-example: the logits of a tiny attention-only model (2 layers of 2 heads of 2 numbers) inside
    the student's ``with`` beside the reference's, for the first layer and head where they differ."""
    def attempt(layer: int, head: int, seed: int) -> Callable[[], Example | None]:
        def run() -> Example | None:
            generator = torch.Generator().manual_seed(seed)
            config = ref.InductionConfig(vocab_size=5, half=2, embed_dim=4, num_heads=2, num_layers=2, min_period=2)
            model = randomize_(ref.AttentionOnly(config), generator).eval()
            reference, idx = copy.deepcopy(model), torch.randint(5, (1, 4), generator=generator)   # idx: (1, 4)

            def logits(ablate: Callable[..., Any], built: nn.Module) -> torch.Tensor:
                with ablate(built, layer, head):
                    return built(idx)
            return compare(f"the logits inside `with ablate_head(model, layer={layer}, head={head})`, model a "
                           f"2-layer attention-only model with 2 heads of 2 numbers", [("idx", idx)],
                           lambda: logits(fn, model), lambda: logits(ref.ablate_head, reference))
        return run
    return first_difference([attempt(layer, head, seed) for seed in (0, 1) for layer in (0, 1) for head in (0, 1)])
