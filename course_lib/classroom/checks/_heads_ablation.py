"""The check of exercise 11.3, ``ablate_head(model, layer, head)``: a context manager that switches one head off.

Inside the ``with``, the model must compute what the reference computes with that head's slice of the merged
heads zeroed (any way that does so passes: a hook on ``proj``'s input, zeroed columns of ``proj``; zeroed value
weights pass on the models whose heads each have a value head of their own, not on the grouped one), and
gradients must still reach the other layers. After the ``with`` (also when the code inside it raised) the model
must be as it was: the engine's ``model_state`` probe compares
every hook (someone else's, planted before, too), mode, ``requires_grad``, parameter and buffer, and the
outputs. Anything that fails while the student's code or its effects run (the model with their hook, a
backward through it) is their verdict, with its cause. Wrong outputs are named by the mistakes below (what
each would compute, on a copy of the model): one mistake model for the topic, searched on every case. The text
asks for new tensors on the activations' device: the model's blocks run inside the ``with`` on meta (``_on_meta``).
"""
from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ... import heads as ref
from ...model import GPT, GPTConfig
from ...modern_gpt import ModernGPT, ModernGPTConfig
from ..exercises import Mistake
from ..verdict import Failure, fail
from ._counterexample import Example, first_difference
from ._device_probe import probe_module
from ._model_common import randomize_
from ._student_code import call_student, close, expect_callable, expect_settings_as, settings_now, with_block_step
from ._student_files import exception_line, raised_in_student_code
from .engine import first_mistake
from .engine.example import compare
from .engine.function import UNEXPLAINED, Afresh
from .engine.model_state import ModelState, autograd_cause, global_hooks_kept, plant_hooks
from .engine.probes import AFTER_A_STEP, called_in_bfloat16, expect_dtype_in_bfloat16, weight_step

_OWNS = "head h owns columns h * head_dim .. (h+1) * head_dim - 1"
_OTHER_LAYER = "a head of another layer is switched off: `layer` counts model.blocks from 0."
_OUTPUT = "Zero the head's OUTPUT, its columns of the input of attn.proj."
_LAST_AXIS = ("proj's input is the heads' outputs side by side, (N, L, heads * head_dim): axis 1 is the "
              "POSITION (the token), and the head is a block of COLUMNS on the last axis, "
              "x[..., head * head_dim:(head + 1) * head_dim].")
_PROJ_SIDE = ("Hook the other side of the heads: a forward pre-hook on attn.proj, whose input holds each head's "
              "output, and zero head `head`'s columns there.")
_SHARED_VALUE = ("Here the model has fewer key/value heads than query heads (attn.num_kv_heads < attn.num_heads): "
                 "the value projection's output holds num_kv_heads heads, and each feeds EVERY query head of its "
                 "group, so zeroing it silences other heads too (or the wrong ones). Zero the head's own output: its "
                 "columns of the input of attn.proj, head * head_dim .. (head+1) * head_dim - 1.")

# The slips of an ablation. A ``kind`` alone is a change that ``_mistaken`` makes to a copy of the model's
# weights (or, for column kinds, the columns of proj's input it zeroes); ``site`` with ``select`` is a hook at
# that site zeroing that selection of the tensor there.
_WEIGHTS = tuple(Mistake(code, why, {"kind": kind}) for code, kind, why in (
    ("ablation_method", "qk", "the head's query and key weights are zeroed. That makes its attention uniform, not "
                              f"absent: the head still outputs the average of its values. {_OUTPUT}"),
    ("ablation_slice", "embed_width", "the head's width is taken from the embedding (embed_dim // num_heads, or "
                                      "proj.out_features // num_heads), but here heads * head_dim is not "
                                      "embed_dim: a head is attn.head_dim numbers wide (proj.in_features // "
                                      f"num_heads), so {_OWNS} of proj's INPUT."),
    ("ablation_method", "value_weight", "the head's value weights are zeroed, but not its value bias: the head "
                                        f"still outputs the bias. {_OUTPUT}"),
    ("ablation_slice", "layer", "every head of the layer is switched off (the whole input of attn.proj, or all of "
                                "its weight). Zero only head `head`'s columns, head * head_dim .. (head+1) * "
                                "head_dim - 1."),
    ("ablation_slice", "rows", "the head's slice of the attention's OUTPUT is zeroed, after proj: the ROWS of "
                               "attn.proj.weight (proj.weight[slice, :]), or those columns of proj's output in a "
                               "forward hook on attn or attn.proj. Those are output dimensions of the residual "
                               "stream, each a mix of every head, not the head. The head's output is the input of "
                               "proj, so its slice is the COLUMNS proj.weight[:, slice] (or zero proj's input "
                               "there)."),
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
    ("ablation_slice", "swapped", "`layer` and `head` are swapped: you switch off head `layer` of "
                                  "model.blocks[head]. The arguments come in the order (model, layer, head): the "
                                  "block is model.blocks[layer], and the head's columns are head * head_dim .. "
                                  "(head+1) * head_dim - 1 of its attn.proj's input."),
    ("ablation_slice", "every_layer", "head `head` is switched off in every layer: switch it off in "
                                      "model.blocks[layer] only."),
    ("ablation_slice", "one_more", f"one column too many is zeroed, (head+1) * head_dim too: {_OWNS}."),
    ("ablation_slice", "one_fewer", f"one column too few is zeroed, the head's last is kept: {_OWNS}."),
))

_HOOKS = tuple(Mistake(code, why, {"site": site, "select": select}) for code, site, select, why in (
    # the right site, the wrong axis: positions (token rows), a sequence, one column, a chunk of the sequence
    ("ablation_slice", "proj_in", "tokens", "token ROWS were zeroed, not the head's columns: x[:, a:b] on proj's "
                                            f"input picks positions a .. b-1 of every sequence. {_LAST_AXIS}"),
    ("ablation_slice", "proj_in", "position", "token position `head` was zeroed (x[:, head], or x[..., head, :]): "
                                              f"a row of positions, not a head. {_LAST_AXIS}"),
    ("ablation_slice", "proj_in", "batch", "sequence `head` of the batch was zeroed (x[head]), not a head. "
                                           f"{_LAST_AXIS}"),
    ("ablation_slice", "proj_in", "column", "only column `head` of proj's input was zeroed: a head owns head_dim "
                                            f"columns, {_OWNS}."),
    ("ablation_slice", "proj_in", "chunk", "a chunk of each sequence's positions was zeroed: .view(N, heads, L, "
                                           "head_dim) straight on the merged (N, L, heads * head_dim) cuts the "
                                           "SEQUENCE into pieces, not the features. View it as (N, L, heads, "
                                           "head_dim) and zero [:, :, head], or zero x[..., head * head_dim:"
                                           "(head + 1) * head_dim]."),
    # the right site and columns, but not zeros: mean-ablation and resample-ablation, the interpretability papers'
    *(("ablation_method", "proj_in", select, f"the head's columns of proj's input are replaced by {how}, not by "
                                             f"zeros: that is {name}, which keeps what the head outputs on average "
                                             f"(or on another input). This exercise switches the head off: its "
                                             f"output is 0, x[..., head * head_dim:(head + 1) * head_dim] = 0 on "
                                             f"proj's input.")
      for select, how, name in (
          ("mean_all", "their mean over the batch and the positions", "mean-ablation"),
          ("mean_positions", "their mean over each sequence's positions", "mean-ablation"),
          ("mean_batch", "their mean over the batch", "mean-ablation"),
          ("resample", "another sequence's (the batch rolled by one)", "resample-ablation"),
          ("resample_back", "another sequence's (the batch rolled back by one)", "resample-ablation"))),
    # the attention's input (or the block's), where every head reads the same features
    ("ablation_method", "attn_in", "own", "the hook is on the attention's INPUT (a pre-hook on "
                                          "model.blocks[layer].attn): columns of x zeroed before the query, key "
                                          "and value projections change what EVERY head sees, not what head "
                                          f"`head` outputs. {_PROJ_SIDE}"),
    ("ablation_method", "attn_in", "tokens", "the hook is on the attention's INPUT, and zeroes token rows there "
                                             "(x[:, a:b]): every head loses those positions' features. "
                                             f"{_PROJ_SIDE}"),
    ("ablation_method", "block_in", "own", "the hook is on the block's INPUT, the residual stream (a pre-hook on "
                                           "model.blocks[layer]): features every head reads, and the residual "
                                           f"connection too, are zeroed. {_PROJ_SIDE}"),
    # the attention's output, after proj has mixed the heads
    ("ablation_slice", "proj_out", "own", "columns of the attention's OUTPUT were zeroed (a forward hook on "
                                          "attn or on attn.proj, after proj): those are features of the residual "
                                          "stream, each a mix of every head. The head's own output is proj's "
                                          f"INPUT. {_PROJ_SIDE}"),
    ("ablation_slice", "proj_out", "tokens", "token rows of the attention's OUTPUT were zeroed (a forward hook on "
                                             "attn or attn.proj, x[:, a:b]): positions, after proj mixed the "
                                             f"heads. {_PROJ_SIDE}"),
))

# The value projection's output: with grouped key/value heads one value head feeds a whole group of query heads.
# Searched first: without a value bias, zeroed value weights (``value_weight``) are the same slip there, and on a
# model with as many value heads as query heads these give the right answer, so they never name a wrong one.
_VALUE_HEADS = tuple(Mistake("ablation_method", why, {"site": "value_out", "select": select}) for select, why in (
    ("own", f"columns head * head_dim .. (head+1) * head_dim - 1 of the value projection (attn.value's output, or "
            f"its weights) were zeroed. {_SHARED_VALUE}"),
    ("group", f"the value head of the head's group (head // groups) was zeroed. {_SHARED_VALUE}"),
))

ABLATION_MISTAKES = _VALUE_HEADS + _WEIGHTS + _HOOKS


def _models() -> list[tuple[str, nn.Module]]:
    """The two models of the check: one in eval mode, one in training mode (no dropout, so the same outputs),
    so that a context manager that calls model.eval() or model.train() and leaves it shows on one of them."""
    generator = torch.Generator().manual_seed(11)
    small = ref.AttentionOnly(ref.InductionConfig(vocab_size=13, half=5, embed_dim=24, num_heads=3, num_layers=2,
                                                   min_period=2))
    gpt = GPT(GPTConfig(vocab_size=13, max_tokens=10, embed_dim=16, num_heads=4, num_layers=2, bias=True))
    return [("a 2-layer attention-only model with 3 heads per layer (in eval mode)",
             randomize_(small, generator).eval()),
            ("a 2-layer GPT with 4 heads per layer and biases (in training mode, no dropout)",
             randomize_(gpt, generator).train())]


def _grouped_model() -> tuple[str, nn.Module]:
    """Notebook 09's model, whose heads are not embed_dim / heads wide and share key/value heads in pairs: a head's
    width taken from the embedding, or its value head zeroed, shows here only. The main cases only (it costs)."""
    generator = torch.Generator().manual_seed(16)
    config = ModernGPTConfig(vocab_size=13, max_tokens=10, embed_dim=16, num_heads=4, num_kv_heads=2, head_dim=6,
                             num_layers=2)
    model = randomize_(ModernGPT(config), generator)
    with torch.no_grad():   # RMSNorm weights near 1, as a trained model's (randomize_ leaves them near 0)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
    return ("notebook 09's 2-layer ModernGPT with 4 heads of head_dim 6 (embed_dim 16) sharing 2 key/value heads "
            "(in eval mode)", model.eval())


# the second model repeats a head (0) and a (layer, head) pair (1, 0) of the first, at other widths: a mask, a slice
# or a size kept from an earlier call under a key that leaves the model out shows there; the third's head 1 has a
# value head of its own (1) and a group's (0) to tell apart
_CASES = {0: [(0, 1), (1, 2), (1, 0)], 1: [(1, 3), (0, 0), (1, 0)], 2: [(1, 1), (0, 2)]}


def _columns(attn: nn.Module, kind: str, head: int) -> list[int]:
    size, count = attn.head_dim, attn.num_heads
    own = list(range(head * size, (head + 1) * size))
    return {"layer": list(range(size * count)), "strided": list(range(head, size * count, count)),
            "unscaled": list(range(head, min(head + size, size * count))),
            "others": [c for c in range(size * count) if c not in own],
            "next": list(range(((head + 1) % count) * size, ((head + 1) % count + 1) * size)),
            "one_more": own + [own[-1] + 1] if own[-1] + 1 < size * count else own, "one_fewer": own[:-1],
            "previous": list(range(((head - 1) % count) * size, ((head - 1) % count + 1) * size))}.get(kind, own)


def _zeroed(x: torch.Tensor, select: str, head: int, size: int, count: int) -> torch.Tensor:
    """``x`` (N, L, E) with the selection ``select`` of head ``head`` (head_dim ``size``, ``count`` heads) zeroed."""
    x = x.clone()
    n, length = x.shape[:2]
    if select in ("own", "group"):   # "group": ``head`` is already the group's value head (_mistaken)
        x[..., head * size:(head + 1) * size] = 0.0
    elif select == "tokens":
        if head * size >= length:
            raise ValueError("no such positions")   # the slip would zero nothing here: it does not apply
        x[:, head * size:(head + 1) * size] = 0.0
    elif select == "position":
        if head >= length:
            raise ValueError("no such position")
        x[:, head] = 0.0
    elif select == "batch":
        if head >= n:
            raise ValueError("no such sequence")
        x[head] = 0.0
    elif select == "column":
        x[..., head] = 0.0
    elif select.startswith(("mean", "resample")):
        if select.startswith("resample") and n == 1:
            raise ValueError("no other sequence")
        own = x[..., head * size:(head + 1) * size]                       # (N, L, head_dim)
        x[..., head * size:(head + 1) * size] = (
            own.roll(1 if select == "resample" else -1, dims=0) if select.startswith("resample") else
            own.mean(dim={"mean_all": (0, 1), "mean_positions": 1, "mean_batch": 0}[select], keepdim=True))
    elif select == "chunk":
        x.view(n, count, -1)[:, head] = 0.0       # (N, heads, L * E / heads): a slice of the flat sequence
    return x


@torch.no_grad()
def _mistaken(model: nn.Module, layer: int, head: int, idx: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    """What the model outputs with the mistake ``spec`` applied to a copy of it."""
    model = copy.deepcopy(model)
    kind = spec.get("kind", "hook")
    if kind.startswith("layer_"):
        layer = layer + (1 if kind == "layer_next" else -1)
        if not 0 <= layer < len(model.blocks):
            raise ValueError("no such layer")
        kind = "own"
    if kind == "swapped":   # model.blocks[head], head `layer`
        if layer == head or head >= len(model.blocks) or layer >= model.blocks[head].attn.num_heads:
            raise ValueError("the same ablation, or no such layer or head")
        layer, head, kind = head, layer, "own"
    attn = model.blocks[layer].attn
    own = slice(head * attn.head_dim, (head + 1) * attn.head_dim)
    if kind == "hook":
        def zero(x: torch.Tensor) -> torch.Tensor:
            return _zeroed(x, spec["select"], head, attn.head_dim, attn.num_heads)
        site = spec["site"]
        if site == "value_out":
            groups = attn.num_heads // getattr(attn, "num_kv_heads", attn.num_heads)
            if groups == 1:   # every head has a value head of its own: zeroing it is the right ablation
                raise ValueError("no shared value heads")
            if spec["select"] == "group":
                head = head // groups
            attn.value.register_forward_hook(lambda module, inputs, output: zero(output))
        elif site == "proj_out":
            attn.proj.register_forward_hook(lambda module, inputs, output: zero(output))
        else:
            module = {"proj_in": attn.proj, "attn_in": attn, "block_in": model.blocks[layer]}[site]
            module.register_forward_pre_hook(lambda module, inputs: (zero(inputs[0]), *inputs[1:]))
    elif kind == "qk":
        for linear in (attn.query, attn.key):
            linear.weight[own] = 0.0
            if linear.bias is not None:
                linear.bias[own] = 0.0
    elif kind == "embed_width":   # head * E/H .. (head+1) * E/H - 1 of proj's input
        width = attn.proj.out_features // attn.num_heads
        if width == attn.head_dim:
            raise ValueError("the embedding's width per head is head_dim here")
        attn.proj.weight[:, head * width:(head + 1) * width] = 0.0
    elif kind == "value_weight":
        attn.value.weight[own] = 0.0
    elif kind == "rows":
        attn.proj.weight[own] = 0.0
    elif kind == "every_layer":
        for block in model.blocks:
            block.attn.proj.weight[:, own] = 0.0
    else:
        attn.proj.weight[:, _columns(attn, kind, head)] = 0.0
    return model(idx)


# Words of torch's errors when two dtypes meet in one operation ("expected scalar type Float but found Double").
_DTYPE_WORDS = ("dtype", "scalar type", "Double", "Float", "Half")


def _sentence(text: str) -> str:
    text = text.rstrip()
    return text if text.endswith((".", "!", "?", "]")) else text + "."


class _Probe(Exception):
    """Raised inside the student's ``with`` to see that the model is restored on the way out."""


def _expect_context_manager(value: Any, shown: str) -> None:
    if hasattr(type(value), "__enter__") and hasattr(type(value), "__exit__"):
        return
    if value is None:
        fail("exception", f"{shown} returned nothing, so it cannot be used in a `with` statement. Write it as a "
                          f"generator decorated with @contextlib.contextmanager, which `yield`s once.")
    if hasattr(type(value), "__next__") and hasattr(type(value), "send"):   # the class's, run no code of theirs
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


def _diagnose(model: nn.Module, layer: int, head: int, idx: torch.Tensor, out: Any,
              base: torch.Tensor, shown: str) -> None:
    if close(out, base):
        attn = model.blocks[layer].attn
        head_dim = attn.proj.in_features // attn.num_heads
        fail("ablation_method", f"{shown}: inside the `with`, the model computes exactly what it computed before: "
                                f"no head was switched off. (A hook registered on a copy of the model, or weights "
                                f"changed only on leaving the block, do that; so does an empty slice of features: "
                                f"head {head} holds the columns {head * head_dim} .. {(head + 1) * head_dim - 1} of "
                                f"the input of attn.proj here, head_dim = {head_dim}, so take head_dim from the "
                                f"model, not a number.)")
    if isinstance(out, torch.Tensor):
        first_mistake(ABLATION_MISTAKES, lambda mistake: close(out, _mistaken(model, layer, head, idx, mistake.spec)),
                      f"{shown}: ")     # a mistake that raises does not apply here (no layer before layer 0)
    fail("mismatch", f"{shown}: inside the `with`, the model's output is not that of the model with head {head} of "
                     f"layer {layer} switched off, and {UNEXPLAINED}. The head's output is its "
                     f"head_dim columns of the input of model.blocks[{layer}].attn.proj.")


class _Fresh:
    """A copy of the model with someone else's hooks planted on it, its state before the student's code, and
    the student's context manager on it, entered and left through the one door to student code."""

    def __init__(self, fn: Callable[..., Any], built: nn.Module, layer: int, head: int, shown: str,
                 copied: bool = True):
        self.model, self.shown = copy.deepcopy(built) if copied else built, shown
        attn = self.model.blocks[layer].attn
        planted = plant_hooks(self.model, [attn, attn.proj])
        self.before = ModelState.of(self.model, planted)
        _distinctive_random_state()
        self.random = _random_state()   # the caller's, before the student's code (a class may reseed in __init__)
        self.settings = settings_now()
        self.manager = call_student(fn, self.model, layer, head, what=shown)
        _expect_context_manager(self.manager, shown)

    def enter(self) -> None:
        self.settings = settings_now()   # the block may change them until it ends, not after
        try:
            with with_block_step():
                call_student(type(self.manager).__enter__, self.manager, what=f"entering `with {self.shown}`")
        except Failure as failure:
            if failure.diagnosis == "exception" and "generator didn't yield" in failure.message:
                fail("exception", f"{_sentence(failure.message)} Your generator ended before its `yield`: the "
                                  f"`yield` must run on every call (not under an `if` that can be false).")
            raise
        _random_kept(self.random, self.shown, "on entering the `with`")

    def leave(self, raised: BaseException | None = None) -> bool:
        """Leave the ``with`` (with ``raised`` inside it, or not): whether the manager swallowed ``raised``."""
        manager = self.manager

        def exit_() -> bool:
            try:
                return bool(type(manager).__exit__(manager, type(raised) if raised else None, raised,
                                                   raised.__traceback__ if raised else None))
            except _Probe:    # re-raising the exception it was given is not swallowing it
                return False
        before = _random_state()
        try:
            with with_block_step():
                swallowed = call_student(exit_, what=f"leaving `with {self.shown}`")
        except Failure as failure:
            if failure.diagnosis == "exception" and "generator didn't stop" in failure.message:
                fail("exception", f"{_sentence(failure.message)} Your generator must `yield` exactly once: one "
                                  f"`yield` in a try/finally, not one in a loop or two.")
            raise
        _random_kept(before, self.shown, "on leaving the `with`")
        expect_settings_as(self.settings, f"`with {self.shown}`, from entering to leaving,")
        return swallowed

    def run(self, idx: torch.Tensor, where: str) -> Any:
        """The model on ``idx`` with the student's changes in place: what fails there is theirs."""
        try:
            return call_student(self.model, idx, what=f"the model {where} `with {self.shown}` (your hook runs in it)")
        except Failure as failure:
            if failure.diagnosis == "exception" and any(w in failure.message for w in _DTYPE_WORDS):
                fail("dtype", f"{_sentence(failure.message)} A tensor of another dtype reached a layer (float64 in a float32 "
                              f"model, or float32 in a float64 or bfloat16 one): a dtype is written into your code "
                              f"(torch.float32, .float(), dtype=torch.float64). Make new tensors like the one you "
                              f"change: torch.ones_like(x), x.new_zeros(...), dtype=x.dtype.")
            raise

    def output_inside(self, idx: torch.Tensor) -> Any:
        """One run inside the ``with``, without gradients; it leaves the ``with`` even when the run fails."""
        self.enter()
        try:
            with torch.no_grad():
                out = self.run(idx, "inside")
        except Failure:
            self.leave()
            raise
        self.leave()
        return out


def _distinctive_random_state() -> None:
    """Put torch's and Python's global random state where no one seeds it, before the student's code: a reseed to any
    usual seed (0, 42, 1337) then shows whatever state the caller had left (a test that seeded 0 and drew nothing
    since would hide ``random.seed(0)``). The check puts the caller's own state back when it ends."""
    torch.manual_seed(0x113_5EED)
    random.seed(0x113_5EED)


def _random_state() -> tuple[torch.Tensor, Any]:
    """torch's global random state and Python's: what the caller's own draws come from."""
    return torch.get_rng_state(), random.getstate()


def _random_kept(before: tuple[torch.Tensor, Any], shown: str, when: str) -> None:
    """The student's code, entering or leaving the ``with``, left the caller's random state as it found it (the
    run's guard puts it back after the check, so only a comparison here shows a reseed)."""
    torch_before, python_before = before
    torch_now, python_now = _random_state()
    changed = ("torch's global random state" if not torch.equal(torch_before, torch_now) else
               "Python's random state (the random module)" if python_before != python_now else None)
    if changed:
        fail("not_restored", f"{shown}: {when}, your context manager changed {changed}: it reseeds it "
                             f"(torch.manual_seed, random.seed) or draws from it (torch.rand, torch.randn). The "
                             f"caller's random numbers, inside the block and after it, are then no longer the ones "
                             f"their own seed gives. A context manager must not touch the caller's random state: "
                             f"switching a head off needs no random numbers, so remove the seed; if you do need "
                             f"some, draw them from a torch.Generator of your own (torch.Generator().manual_seed(0)), "
                             f"or inside torch.random.fork_rng().")


def _inside(fresh: _Fresh, layer: int, idx: torch.Tensor, weights: torch.Tensor, expected: torch.Tensor
            ) -> tuple[Any, bool, dict[str, Any], tuple[str, str] | None]:
    """Inside the student's ``with``: the output, whether it is right, its gradients and why they failed (their
    cause read inside, where grad mode and frozen weights still show). A failure here is raised after leaving."""
    fresh.enter()
    problem: Failure | None = None
    out, right, grads, cause = None, False, {}, None
    try:
        out = fresh.run(idx, "inside")
        right = isinstance(out, torch.Tensor) and close(out, expected)
        if right:
            try:
                grads = _grads(fresh.model, out, weights, layer)
            except Exception as exc:  # noqa: BLE001 - a backward through the student's model: theirs
                if raised_in_student_code(exc):     # their backward hook raised
                    fail("exception", f"the backward pass through the model inside `with {fresh.shown}` raised "
                                      f"{exception_line(exc)}")
                cause = autograd_cause(exc, fresh.before)   # no graph, frozen, changed in place
            else:
                if all(g is None for g in grads.values()):
                    cause = autograd_cause(None, fresh.before)
    except Failure as failure:     # left normally first, then named: a manager that swallows would hide it
        problem = failure
    fresh.leave()
    if problem is not None:
        raise problem
    return out, right, grads, cause


def judge_ablate_head(fn: Callable[..., Any]) -> str:
    expect_callable(fn, "ablate_head")
    with global_hooks_kept():
        return _judge(fn)


def _judge(fn: Callable[..., Any]) -> str:
    # the places the student's code could keep something in (globals, defaults, closure), as before the first call;
    # @contextmanager's wrapper keeps the student's generator function as __wrapped__
    start = Afresh(getattr(fn, "__wrapped__", fn))
    generator = torch.Generator().manual_seed(12)
    for number, (described, built) in enumerate([*_models(), _grouped_model()]):
        idx = torch.randint(13, (2, 10), generator=generator)               # (N, L)
        weights = torch.randn(2, 10, 13, generator=generator)              # (N, L, vocab): a probe of the logits
        for index, (layer, head) in enumerate(_CASES[number]):
            shown = f"ablate_head(model, layer={layer}, head={head}) on {described}"
            try:
                _one_case(fn, built, layer, head, idx, weights, shown)
            except Failure as failure:
                if number or index:   # an earlier call could have left something behind
                    _kept_from_earlier(failure, start, fn, built, layer, head, idx, weights, shown)
                raise
    _after_a_step(fn)
    _on_meta(fn)
    _in_float64(fn)
    _in_bfloat16(fn)
    return ("Inside the `with`, exactly that head is off (three models, one with grouped key/value heads and "
            "head_dim != embed_dim / heads, eight layer/head pairs, gradients still "
            "flowing, a float64 and a bfloat16 model too, on another device too); afterwards, and after an exception inside, the model is exactly as "
            "before, other code's hooks included.")


def _one_case(fn: Callable[..., Any], built: nn.Module, layer: int, head: int, idx: torch.Tensor,
              weights: torch.Tensor, shown: str) -> None:
    with torch.no_grad():
        base = built(idx)
    reference = copy.deepcopy(built)
    with torch.enable_grad(), ref.ablate_head(reference, layer, head):   # whatever mode the student's code left
        expected = reference(idx)
        expected_grads = _grads(reference, expected, weights, layer)
    fresh = _Fresh(fn, built, layer, head, shown)
    out, right, grads, cause = _inside(fresh, layer, idx, weights, expected)
    if not right:
        _diagnose(built, layer, head, idx, out, base, shown)
    if cause is not None:
        code, why = cause
        fail(code, f"{shown}: the output is right, but the gradient cannot flow through it: {why}.")
    for name, grad in expected_grads.items():
        if grad is not None and (grads[name] is None or not close(grads[name], grad)):
            fail("gradient", f"{shown}: the output is right, but gradients no longer flow as they "
                             f"should (first wrong at {name}): the ablation must stay part of the "
                             f"graph. Replace the head's columns with zeros in a copy of proj's input "
                             f"(clone, then assign), without torch.no_grad() or .detach().")
    _restored(fresh, idx, base, "after the `with`", "Undo everything on leaving the block: remove your hook "
              "(its handle), or copy the saved weights back.")

    fresh = _Fresh(fn, built, layer, head, shown)
    fresh.enter()
    try:
        fresh.run(idx, "inside")
        raise _Probe("raised inside the with block by the checker")
    except _Probe as probe:
        swallowed = fresh.leave(probe)
    except Failure:
        fresh.leave()
        raise
    if swallowed:
        fail("exception", f"{shown}: an exception raised inside the `with` block disappeared: your "
                          f"context manager swallowed it. Use try/finally around the `yield`, not "
                          f"try/except.")
    _restored(fresh, idx, base, "when the code inside the `with` raises", "Put the undoing in a `finally:` "
              "around the `yield`, so it runs however the block ends.")


def _head_dim(model: nn.Module, layer: int) -> int:
    attn = model.blocks[layer].attn
    return attn.proj.in_features // attn.num_heads


def _kept_from_earlier(failure: Failure, start: Afresh, fn: Callable[..., Any], built: nn.Module, layer: int,
                       head: int, idx: torch.Tensor, weights: torch.Tensor, shown: str) -> None:
    """``kept_state`` where a case that failed in the course of the check passes when the student's code starts
    afresh (its globals, defaults and closure as before the check's first call): a mask, a slice or a size made for
    an earlier model or call was reused on this one."""
    if failure.diagnosis == "kept_state" or not start.places:
        return
    with start.restored():
        try:
            _one_case(fn, built, layer, head, idx, weights, shown)
        except Failure:
            return   # wrong afresh too: the first verdict stands
    said = failure.message.removeprefix(f"{shown}: ").splitlines()[0].rstrip(".")
    if len(said) > 300:
        said = said[:300].rstrip() + " [...]"
    fail("kept_state", f"{shown}: this case fails ({said}), yet the same case is right when your code starts afresh "
                       f"(its globals, default arguments and closure as they were before the checker's first call). "
                       f"Your context manager keeps something from an earlier call (a keep-mask, a slice of columns "
                       f"or a head_dim, stored in a global or a default argument, or cached under a key that leaves "
                       f"out the model, such as the head alone) and reuses it on a model it does not fit: this "
                       f"model's heads are {_head_dim(built, layer)} numbers wide. Make it in each call "
                       f"from the model you are given (attn.head_dim, attn.num_heads, x.shape), or key a cache by "
                       f"everything it depends on.")


def _restored(fresh: _Fresh, idx: torch.Tensor, base: torch.Tensor, when: str, advice: str) -> None:
    """The ``model_state`` probe after leaving: every hook, mode, flag and tensor as before, then the outputs."""
    changed = fresh.before.first_changes(fresh.model)
    if changed is None:
        try:
            out = fresh.run(idx, "after")
        except Failure as failure:
            changed = f"running it raises ({failure.message})"
        else:
            changed = None if close(out, base) else "its output differs from before"
    if changed:
        fail("not_restored", f"{fresh.shown}: {when}, the model is not as it was: {changed}. {advice}")


def _after_a_step(fn: Callable[..., Any]) -> None:
    """The first case twice on one model, with a weight step between (``engine.probes.weight_step``): the second time,
    the head is off on the weights as they are now, and afterwards those weights are back, not the ones the first
    call saved (in a global, or on the model)."""
    described, built = _models()[0]
    layer, head = _CASES[0][0]
    idx = torch.randint(13, (2, 10), generator=torch.Generator().manual_seed(14))   # (N, L)
    shown = f"ablate_head(model, layer={layer}, head={head}) on {described}"
    first = _Fresh(fn, built, layer, head, shown)
    first.enter()
    first.leave()
    model = first.model
    weight_step(model)
    shown = f"{shown}, used again on the same model {AFTER_A_STEP}"
    reference = copy.deepcopy(model)
    with torch.no_grad():
        base = model(idx)
        with ref.ablate_head(reference, layer, head):
            expected = reference(idx)
    again = _Fresh(fn, model, layer, head, shown, copied=False)
    out = again.output_inside(idx)
    kept = ("your code uses weights it saved in an earlier call (in a global, or on the model), not what they are "
            "now: save them inside each call, right before you change them.")
    if not (isinstance(out, torch.Tensor) and close(out, expected)):
        fail("kept_state", f"{shown}: inside the `with`, the output is not the model's with that head off: {kept}")
    changed = again.before.first_changes(model)
    if changed is None:
        with torch.no_grad():
            after = again.run(idx, "after")
        changed = None if isinstance(after, torch.Tensor) and close(after, base) else "its output differs from before"
    if changed:
        fail("kept_state", f"{shown}: after the `with`, the model is not as it was: {changed}. Here {kept}")


class _Ablated(nn.Module):
    """The model's blocks run inside the student's ``with``, on hidden states (N, L, embed_dim): one module, so
    that the engine's device probe for modules (``_device_probe.probe_module``) can copy it to meta and run it
    there with the student's hook in it. The blocks, not the model: the model reads its token ids' values to
    validate them, which meta tensors do not hold."""

    def __init__(self, fn: Callable[..., Any], model: nn.Module, layer: int, head: int):
        super().__init__()
        self.fn, self.model, self.layer, self.head = fn, model, layer, head

    def forward(self, x: torch.Tensor) -> Any:
        with self.fn(self.model, self.layer, self.head):
            for block in self.model.blocks:
                x = block(x)                        # (N, L, embed_dim)
            return x


def _on_meta(fn: Callable[..., Any]) -> None:
    """The device probe (the text asks for new tensors on the activations' device): the first case of each model
    again on the meta device, where a keep-mask or zeros made on the CPU meet the heads' outputs."""
    generator = torch.Generator().manual_seed(15)
    for number, (described, built) in enumerate(_models()):
        layer, head = _CASES[number][0]
        shown = f"the model's blocks inside `with ablate_head(model, layer={layer}, head={head})` on {described}"
        x = torch.randn(2, 10, built.blocks[0].attn.proj.in_features, generator=generator)   # (N, L, embed_dim)
        try:
            probe_module(_Ablated(fn, built, layer, head).train(built.training), x, shown)
        except Failure as failure:
            if failure.diagnosis != "device":
                raise
            fail("device", f"{_sentence(failure.message)} In your hook, make new tensors like the one it changes: "
                           f"torch.ones_like(x), x.new_zeros(...), or device=x.device (and dtype=x.dtype).")


def _in_float64(fn: Callable[..., Any]) -> None:
    """The dtype probe: one case again in a float64 notebook, the model built in float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        described, built = _models()[0]
        layer, head = _CASES[0][0]
        shown = (f"ablate_head(model, layer={layer}, head={head}) on {described} in a float64 notebook "
                 f"(torch.set_default_dtype(torch.float64), the model in float64)")
        idx = torch.randint(13, (2, 10), generator=torch.Generator().manual_seed(13))   # (N, L)
        reference = copy.deepcopy(built)
        with torch.no_grad(), ref.ablate_head(reference, layer, head):
            expected = reference(idx)
        out = _Fresh(fn, built, layer, head, shown).output_inside(idx)
        if isinstance(out, torch.Tensor) and out.dtype != expected.dtype:
            fail("dtype", f"{shown}: the model's output is {out.dtype}, expected {expected.dtype}: your hook "
                          f"changes the dtype of what it returns (a .float(), a float32 tensor of zeros). Make new "
                          f"tensors like the one you change (torch.zeros_like(x), dtype=x.dtype).")
        if not close(out, expected):
            fail("precision", f"{shown}: the output differs from the reference's, which float64 does not explain: "
                              f"part of your ablation runs in a lower precision (a .float(), a float32 tensor). "
                              f"Keep the model's dtype throughout.")
    finally:
        torch.set_default_dtype(previous)


def _in_bfloat16(fn: Callable[..., Any]) -> None:
    """The bfloat16 probe (the text asks for new tensors in the activations' dtype): one case on the model in
    bfloat16, where a float32 tensor of the hook (torch.ones(D) without dtype=) is not promoted away as float64
    promotes it. The output must be bfloat16; its values are not judged (judged in float32 and float64)."""
    described, built = _models()[0]
    layer, head = _CASES[0][0]
    shown = f"ablate_head(model, layer={layer}, head={head}) on {described} in bfloat16 (model.to(torch.bfloat16))"
    idx = torch.randint(13, (2, 10), generator=torch.Generator().manual_seed(13))   # (N, L)
    model = copy.deepcopy(built).to(torch.bfloat16)
    made = ("A tensor of your hook is made in float32 whatever the activations' dtype (torch.ones(D) or torch.zeros "
            "without dtype=, .float()): a float64 model hides it, since float32 with float64 gives float64.")
    out = called_in_bfloat16(lambda: _Fresh(fn, model, layer, head, shown, copied=False).output_inside(idx), shown,
                             made)
    expect_dtype_in_bfloat16(out, shown, made)


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
