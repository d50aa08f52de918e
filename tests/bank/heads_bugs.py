"""Student attempts at the exercises of notebook 11 (11.1-11.3), correct and buggy, as students write them.

Each buggy attempt carries the diagnosis its checker must give (and words its message must contain);
each correct attempt must pass.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 11.1 previous_token_score

@correct("11.1")
def prev_by_indexing(weights):
    length = weights.shape[-1]
    i = torch.arange(1, length)
    return weights[:, :, i, i - 1].mean(dim=(0, 2))


@correct("11.1")
def prev_by_loop(weights):
    total = 0
    for i in range(1, weights.shape[-1]):
        total = total + weights[:, :, i, i - 1].mean(dim=0)
    return total / (weights.shape[-1] - 1)


@correct("11.1")
def prev_by_mask(weights):
    length = weights.shape[-1]
    below = torch.ones(length, length, device=weights.device).tril(-1).triu(-1)
    return (weights * below).sum(dim=(-1, -2)).mean(dim=0) / (length - 1)


@bug("11.1", "score_offset", "itself")
def prev_main_diagonal(weights):
    return weights.diagonal(dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.1", "score_offset", "above")
def prev_positive_offset(weights):
    return weights.diagonal(offset=1, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.1", "score_offset", "two tokens back")
def prev_two_back(weights):
    return weights.diagonal(offset=-2, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.1", "score_positions", "position 0")
def prev_divides_by_length(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).sum(dim=-1).mean(dim=0) / weights.shape[-1]


@bug("11.1", "score_positions", "position 0")
def prev_wraps_position_zero(weights):
    i = torch.arange(weights.shape[-1])
    return weights[:, :, i, i - 1].mean(dim=(0, 2))     # i - 1 = -1 reads the last key for position 0


@bug("11.1", "score_axes", "batch")
def prev_averages_heads(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(1, 2))


@bug("11.1", "score_axes", "batch")
def prev_keeps_batch(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=-1)


@bug("11.1", "score_axes")
def prev_averages_everything(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean()


@bug("11.1", "scale", "instead of averaging")
def prev_sums(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).sum(dim=(0, 2))


@bug("11.1", "gradient", "autograd")
def prev_through_item(weights):
    d = weights.diagonal(offset=-1, dim1=-2, dim2=-1)
    return torch.tensor([d[:, h].mean().item() for h in range(weights.shape[1])])


@bug("11.1", "gradient")
def prev_detached(weights):
    return weights.detach().diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.1", "dtype")
def prev_returns_list(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2)).tolist()


@bug("11.1", "shape", "nothing")
def prev_forgets_return(weights):
    weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.1", "mutation")
def prev_zeroes_in_place(weights):
    weights.data.fill_diagonal_(0) if weights.dim() == 2 else None
    weights.data[..., 0, 0] = 0.0
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.1", "not_implemented")
def prev_not_written(weights):
    raise NotImplementedError("Exercise 11.1: write previous_token_score")


# ============================================================================ 11.2 induction_score

@correct("11.2")
def induction_by_indexing(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 1].mean(dim=(0, 2))


@correct("11.2")
def induction_by_slicing_queries(weights, half):
    second = weights[:, :, half:, :]                                      # (N, heads, half, L)
    return second.diagonal(offset=1, dim1=-2, dim2=-1).mean(dim=(0, 2))   # (i, i - half + 1) -> column offset +1


@correct("11.2")
def induction_loop(weights, half):
    scores = []
    for h in range(weights.shape[1]):
        vals = [weights[:, h, i, i - half + 1] for i in range(half, weights.shape[-1])]
        scores.append(torch.stack(vals).mean())
    return torch.stack(scores)


@bug("11.2", "score_offset", "copy")
def induction_reads_the_copy(weights, half):
    return weights.diagonal(offset=-half, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.2", "score_offset", "copy")
def induction_reads_the_copy_by_index(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half].mean(dim=(0, 2))


@bug("11.2", "score_offset")
def induction_one_too_far(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 2].mean(dim=(0, 2))


@bug("11.2", "score_positions", "first half")
def induction_whole_diagonal(weights, half):
    return weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.2", "score_positions")
def induction_divides_by_length(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 1].sum(dim=-1).mean(dim=0) / weights.shape[-1]


@bug("11.2", "score_axes", "batch")
def induction_batch_heads_swapped(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 1].mean(dim=(1, 2))   # thinks weights are (heads, N, L, L): axis 1 is the batch


@bug("11.2", "score_axes", "batch")
def induction_keeps_batch(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 1].mean(dim=-1)


@bug("11.2", "score_axes")
def induction_keeps_positions(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 1].mean(dim=(0, 1))


@bug("11.2", "scale")
def induction_sums(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 1].sum(dim=(0, 2))


@bug("11.2", "gradient")
def induction_via_numpy(weights, half):
    w = weights.detach().numpy()
    i = list(range(half, w.shape[-1]))
    return torch.from_numpy(w[:, :, i, [j - half + 1 for j in i]].mean(axis=(0, 2)))


@bug("11.2", "exception")
def induction_forgets_half(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))


@bug("11.2", "not_implemented")
def induction_not_written(weights, half):
    raise NotImplementedError("Exercise 11.2: write induction_score")


# ============================================================================ 11.3 ablate_head

@correct("11.3")
@contextlib.contextmanager
def ablate_with_pre_hook(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_by_masking(model, layer, head):
    attn = model.blocks[layer].attn
    keep = torch.ones(attn.num_heads * attn.head_dim, device=attn.proj.weight.device, dtype=attn.proj.weight.dtype)
    keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0   # without dtype=: search38_bugs

    def hook(module, inputs):
        return (inputs[0] * keep,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_proj_columns(model, layer, head):
    proj = model.blocks[layer].attn.proj
    size = model.blocks[layer].attn.head_dim
    saved = proj.weight.detach().clone()
    with torch.no_grad():
        proj.weight[:, head * size:(head + 1) * size] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            proj.weight.copy_(saved)


class _Ablation:
    """A context manager written as a class."""

    def __init__(self, model, layer, head):
        self.attn = model.blocks[layer].attn
        self.head = head

    def __enter__(self):
        size = self.attn.head_dim
        cols = slice(self.head * size, (self.head + 1) * size)
        self.handle = self.attn.proj.register_forward_pre_hook(
            lambda m, inp: (torch.cat([inp[0][..., :cols.start], torch.zeros_like(inp[0][..., cols]),
                                       inp[0][..., cols.stop:]], dim=-1),))
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False


@correct("11.3")
def ablate_as_class(model, layer, head):
    return _Ablation(model, layer, head)


@bug("11.3", "ablation_method", "uniform")
@contextlib.contextmanager
def ablate_zeroes_query_key(model, layer, head):
    attn = model.blocks[layer].attn
    rows = slice(head * attn.head_dim, (head + 1) * attn.head_dim)
    saved = [p.detach().clone() for p in attn.parameters()]
    with torch.no_grad():
        for linear in (attn.query, attn.key):
            linear.weight[rows] = 0
            if linear.bias is not None:
                linear.bias[rows] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            for p, s in zip(attn.parameters(), saved):
                p.copy_(s)


@bug("11.3", "ablation_method", "bias")
@contextlib.contextmanager
def ablate_zeroes_value_weight(model, layer, head):
    attn = model.blocks[layer].attn
    rows = slice(head * attn.head_dim, (head + 1) * attn.head_dim)
    saved = attn.value.weight.detach().clone()
    with torch.no_grad():
        attn.value.weight[rows] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            attn.value.weight.copy_(saved)


@bug("11.3", "ablation_method", "no head")
@contextlib.contextmanager
def ablate_a_copy(model, layer, head):
    import copy
    clone = copy.deepcopy(model)
    attn = clone.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(lambda m, inp: (inp[0] * 0,))
    try:
        yield clone
    finally:
        handle.remove()


@bug("11.3", "not_restored", "hook")
@contextlib.contextmanager
def ablate_never_removes(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)

    attn.proj.register_forward_pre_hook(hook)
    yield model


@bug("11.3", "not_restored", "finally")
@contextlib.contextmanager
def ablate_no_finally(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    yield model
    handle.remove()


@bug("11.3", "not_restored")
@contextlib.contextmanager
def ablate_columns_forever(model, layer, head):
    proj = model.blocks[layer].attn.proj
    size = model.blocks[layer].attn.head_dim
    with torch.no_grad():
        proj.weight[:, head * size:(head + 1) * size] = 0
    yield model


@bug("11.3", "not_restored", "same tensor")
@contextlib.contextmanager
def ablate_replaces_parameter(model, layer, head):
    proj = model.blocks[layer].attn.proj
    size = model.blocks[layer].attn.head_dim
    original = proj.weight
    changed = original.detach().clone()
    changed[:, head * size:(head + 1) * size] = 0
    proj.weight = torch.nn.Parameter(changed)
    try:
        yield model
    finally:
        proj.weight = torch.nn.Parameter(original.detach().clone())


@bug("11.3", "exception", "swallowed")
@contextlib.contextmanager
def ablate_swallows_errors(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    except Exception:
        pass
    finally:
        handle.remove()


def _hooked(columns: Callable[[Any, int], Any]) -> Callable[..., Any]:
    @contextlib.contextmanager
    def ablate(model, layer, head):
        attn = model.blocks[layer].attn

        def hook(module, inputs):
            x = inputs[0].clone()
            x[..., columns(attn, head)] = 0
            return (x,)

        handle = attn.proj.register_forward_pre_hook(hook)
        try:
            yield model
        finally:
            handle.remove()
    return ablate


def _named(name: str, fn: Any) -> Any:
    fn.__name__ = name
    return fn


bug("11.3", "ablation_slice", "every head")(_named("ablate_whole_layer", _hooked(lambda a, h: slice(None))))
bug("11.3", "ablation_slice", "num_heads")(_named("ablate_strided", _hooked(lambda a, h: slice(h, None, a.num_heads))))
bug("11.3", "ablation_slice", "head_dim")(_named("ablate_unscaled", _hooked(lambda a, h: slice(h, h + a.head_dim))))
bug("11.3", "ablation_slice", "counting heads from 0")(
    _named("ablate_one_based", _hooked(lambda a, h: slice((h - 1) * a.head_dim, h * a.head_dim)
                                       if h else slice((a.num_heads - 1) * a.head_dim, None))))
bug("11.3", "ablation_slice", "all heads but")(_named("ablate_all_but", _hooked(
    lambda a, h: [c for c in range(a.num_heads * a.head_dim) if not h * a.head_dim <= c < (h + 1) * a.head_dim])))


@bug("11.3", "ablation_slice", "rows")
@contextlib.contextmanager
def ablate_proj_rows(model, layer, head):
    proj = model.blocks[layer].attn.proj
    size = model.blocks[layer].attn.head_dim
    saved = proj.weight.detach().clone()
    with torch.no_grad():
        proj.weight[head * size:(head + 1) * size] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            proj.weight.copy_(saved)


@bug("11.3", "ablation_slice", "another layer")
@contextlib.contextmanager
def ablate_one_based_layer(model, layer, head):
    attn = model.blocks[(layer + 1) % len(model.blocks)].attn
    size = attn.head_dim
    handle = attn.proj.register_forward_pre_hook(
        lambda m, inp: (inp[0].index_fill(-1, torch.arange(head * size, (head + 1) * size), 0.0),))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "gradient", "graph")
@contextlib.contextmanager
def ablate_detaches(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].detach().clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "exception", "contextmanager")
def ablate_plain_generator(model, layer, head):
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(lambda m, inp: (inp[0] * 0,))
    yield model
    handle.remove()


@bug("11.3", "exception", "nothing")
def ablate_returns_none(model, layer, head):
    model.blocks[layer].attn.proj.register_forward_pre_hook(lambda m, inp: (inp[0] * 0,))


@bug("11.3", "not_implemented")
def ablate_not_written(model, layer, head):
    raise NotImplementedError("Exercise 11.3: write ablate_head")


@bug("11.3", "ablation_slice", "the head after the chosen one")
@contextlib.contextmanager
def ablate_next_head_and_swallow(model, layer, head):
    """Two slips at once: the wrong head, and exceptions swallowed (the checker's verdict must not vanish)."""
    attn = model.blocks[layer].attn
    own = slice((head + 1) % attn.num_heads * attn.head_dim, ((head + 1) % attn.num_heads + 1) * attn.head_dim)

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., own] = 0
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    except Exception:
        pass
    finally:
        handle.remove()


# ---------------------------------------------------------------- 11.3: the model's state (issue 43, §1)
# Everything a context manager can leave changed, each named by the engine's model_state probe: other code's
# hooks cleared, the mode switched, weights frozen, dtype changed, a forward patched, a global hook left.

def _zero_head_hook(attn, head):
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)
    return hook


@bug("11.3", "not_restored", "other code registered")
@contextlib.contextmanager
def ablate_clears_proj_hooks(model, layer, head):
    attn = model.blocks[layer].attn
    attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        attn.proj._forward_pre_hooks.clear()          # removes someone else's hooks too


@bug("11.3", "not_restored", "other code registered")
@contextlib.contextmanager
def ablate_clears_every_hook_of_the_model(model, layer, head):
    attn = model.blocks[layer].attn
    attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        for module in model.modules():                # "clean up" everything
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()


@bug("11.3", "not_restored", "eval mode")
@contextlib.contextmanager
def ablate_switches_to_eval(model, layer, head):
    model.eval()                                      # "no dropout while we measure": never undone
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "not_restored", "training mode")
@contextlib.contextmanager
def ablate_trains_on_leaving(model, layer, head):
    model.eval()
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()
        model.train()                                 # assumes the model was training


@bug("11.3", "not_restored", "requires_grad")
@contextlib.contextmanager
def ablate_freezes_the_layer_for_good(model, layer, head):
    attn = model.blocks[layer].attn
    for p in attn.parameters():                       # the ablated layer is not trained: frozen, never unfrozen
        p.requires_grad_(False)
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "not_restored", "float64")
@contextlib.contextmanager
def ablate_leaves_model_in_float64(model, layer, head):
    model.double()                                    # "more precise", never put back
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "not_restored", "forward")
@contextlib.contextmanager
def ablate_patches_forward_and_rebinds(model, layer, head):
    attn = model.blocks[layer].attn
    proj, size = attn.proj, attn.head_dim
    original = proj.forward

    def forward(x):
        x = x.clone()
        x[..., head * size:(head + 1) * size] = 0
        return original(x)
    proj.forward = forward
    try:
        yield model
    finally:
        proj.forward = original                       # an instance attribute still: `del proj.forward` undoes it


@bug("11.3", "not_restored", "global")
@contextlib.contextmanager
def ablate_with_a_global_hook(model, layer, head):
    target = model.blocks[layer].attn.proj
    hook = _zero_head_hook(model.blocks[layer].attn, head)
    torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, inputs: hook(module, inputs) if module is target else None)   # every module, never removed
    yield model


@bug("11.3", "not_restored", "same tensor")
@contextlib.contextmanager
def ablate_swaps_proj_weight_for_a_copy(model, layer, head):
    proj = model.blocks[layer].attn.proj
    size = model.blocks[layer].attn.head_dim
    saved = proj.weight.data
    proj.weight.data = saved.clone()                  # same Parameter, but restored below as a new one
    proj.weight.data[:, head * size:(head + 1) * size] = 0
    try:
        yield model
    finally:
        proj.weight = torch.nn.Parameter(saved)


@correct("11.3")
@contextlib.contextmanager
def ablate_saves_and_restores_the_mode(model, layer, head):
    was_training = model.training
    model.eval()
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()
        model.train(was_training)


@correct("11.3")
@contextlib.contextmanager
def ablate_patches_forward_and_deletes_it(model, layer, head):
    attn = model.blocks[layer].attn
    proj, size = attn.proj, attn.head_dim

    def forward(x):
        x = x.clone()
        x[..., head * size:(head + 1) * size] = 0
        return type(proj).forward(proj, x)
    proj.forward = forward
    try:
        yield model
    finally:
        del proj.forward


@correct("11.3")
@contextlib.contextmanager
def ablate_hook_with_kwargs(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, args, kwargs):
        x = args[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x, *args[1:]), kwargs

    handle = attn.proj.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "ablation_method", "value")   # refiled: with grouped key/value heads the value projection feeds a group (round 34)
@contextlib.contextmanager
def ablate_value_weight_and_bias(model, layer, head):
    value = model.blocks[layer].attn.value
    rows = slice(head * model.blocks[layer].attn.head_dim, (head + 1) * model.blocks[layer].attn.head_dim)
    saved = [p.detach().clone() for p in value.parameters()]
    with torch.no_grad():
        value.weight[rows] = 0                        # values of zero: the head outputs zero whatever it attends to
        if value.bias is not None:
            value.bias[rows] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            for p, s in zip(value.parameters(), saved):
                p.copy_(s)


@bug("11.3", "ablation_method", "value")   # refiled: with grouped key/value heads the value projection feeds a group (round 34)
@contextlib.contextmanager
def ablate_hook_on_value_output(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs, output):
        out = output.clone()
        out[..., head * size:(head + 1) * size] = 0
        return out

    handle = attn.value.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


# ---------------------------------------------------------------- 11.3: the student's error is never the course's (§1)
# Each of these ended in checker_error ("a bug in the course"): an exception raised in the checker's frames (a
# backward, the model with the student's hook) because of the student's state. Each is now their verdict.

@bug("11.3", "gradient", "grad mode was off")
@contextlib.contextmanager
def ablate_under_no_grad(model, layer, head):
    attn = model.blocks[layer].attn
    with torch.no_grad():                             # "an ablation is not training"
        handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
        try:
            yield model
        finally:
            handle.remove()


@bug("11.3", "gradient", "grad mode was off")
@contextlib.contextmanager
def ablate_switches_grad_off(model, layer, head):
    attn = model.blocks[layer].attn
    torch.set_grad_enabled(False)
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()
        torch.set_grad_enabled(True)


@bug("11.3", "gradient", "inference mode")
@contextlib.contextmanager
def ablate_in_inference_mode(model, layer, head):
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        with torch.inference_mode():
            yield model
    finally:
        handle.remove()


@bug("11.3", "gradient", "requires_grad")
@contextlib.contextmanager
def ablate_freezes_the_model(model, layer, head):
    for p in model.parameters():                      # frozen, and never unfrozen
        p.requires_grad_(False)
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "gradient", "requires_grad")
@contextlib.contextmanager
def ablate_freezes_and_unfreezes(model, layer, head):
    model.requires_grad_(False)
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()
        model.requires_grad_(True)


@bug("11.3", "mutation", "in place")
@contextlib.contextmanager
def ablate_edits_the_hook_input(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        inputs[0][..., head * size:(head + 1) * size] = 0   # writes into the attention's own output

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "mutation", "in place")
@contextlib.contextmanager
def ablate_zeroes_the_hook_input_with_mul_(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0]
        x[..., head * size:(head + 1) * size].mul_(0.0)
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "mutation", "in place")
@contextlib.contextmanager
def ablate_fills_the_hook_input(model, layer, head):
    attn = model.blocks[layer].attn
    cols = torch.arange(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs):
        return (inputs[0].index_fill_(-1, cols, 0.0),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "dtype", "float64")
@contextlib.contextmanager
def ablate_with_a_float64_mask(model, layer, head):
    attn = model.blocks[layer].attn
    keep = torch.ones(attn.num_heads * attn.head_dim, dtype=torch.float64)
    keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0
    handle = attn.proj.register_forward_pre_hook(lambda module, inputs: (inputs[0] * keep,))
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "dtype", "float32")
@contextlib.contextmanager
def ablate_with_a_float32_hook(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].float().clone()                 # right in a float32 notebook only
        x[..., head * size:(head + 1) * size] = 0
        return (x.to(torch.float32),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "exception", "shape")
@contextlib.contextmanager
def ablate_hook_drops_the_columns(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0]
        return (torch.cat([x[..., :head * size], x[..., (head + 1) * size:]], dim=-1),)   # removed, not zeroed

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "exception", "exactly once")
@contextlib.contextmanager
def ablate_yields_per_block(model, layer, head):
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    for _ in model.blocks:                            # one yield per block: `with` needs exactly one
        yield model
    handle.remove()


@bug("11.3", "exception", "didn't yield")
@contextlib.contextmanager
def ablate_yields_only_sometimes(model, layer, head):
    attn = model.blocks[layer].attn
    if layer >= len(model.blocks):                    # meant as a guard; the yield sits under it
        handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
        yield model
        handle.remove()


@bug("11.3", "exception", "ValueError")
@contextlib.contextmanager
def ablate_fails_on_leaving(model, layer, head):
    attn = model.blocks[layer].attn
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()
        raise ValueError("cleanup went wrong")


@bug("11.1", "mutation", "in place")
def prev_scales_in_place_after_exp(weights):
    logs = weights.diagonal(offset=-1, dim1=-2, dim2=-1).clamp_min(1e-30).log()
    entries = logs.exp()                              # exp saves its output for the backward
    entries.div_(weights.shape[0] * (weights.shape[-1] - 1))   # ... which is then scaled in place
    return entries.sum(dim=(0, 2))


# ---------------------------------------------------------------- names, not `mismatch` (issue 43, §2)
# A score with the first query dropped, an offset one place too far (11.1 and 11.2, in several styles):
# found by the topic's one grid of slips (``_heads_scores``).

@bug("11.1", "score_positions", "drop query 1")
def prev_diagonal_drops_its_first_entry(weights):
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1)[..., 1:].mean(dim=(0, 2))   # 11.2's [..., 1:] copied


@bug("11.1", "score_positions", "drop query 1")
def prev_arange_from_two(weights):
    i = torch.arange(2, weights.shape[-1])
    return weights[:, :, i, i - 1].mean(dim=(0, 2))


@bug("11.1", "score_positions", "drop query 1")
def prev_loop_from_two(weights):
    total = 0
    for i in range(2, weights.shape[-1]):
        total = total + weights[:, :, i, i - 1].mean(dim=0)
    return total / (weights.shape[-1] - 2)


@bug("11.1", "score_positions", "drop query 1")
def prev_loop_from_two_divides_by_l_minus_one(weights):
    total = torch.zeros(weights.shape[1])
    for i in range(2, weights.shape[-1]):
        total = total + weights[:, :, i, i - 1].sum(dim=0)
    return total / (weights.shape[0] * (weights.shape[-1] - 1))


@bug("11.1", "score_offset", "too far back")
def prev_two_back_from_query_one(weights):
    i = torch.arange(1, weights.shape[-1])
    return weights[:, :, i, i - 2].mean(dim=(0, 2))   # i - 2 = -1 at query 1: the last key, a zero


@bug("11.1", "score_offset", "too far back")
def prev_loop_two_back_skips_missing(weights):
    total = torch.zeros(weights.shape[1])
    for i in range(1, weights.shape[-1]):
        if i - 2 >= 0:
            total = total + weights[:, :, i, i - 2].sum(dim=0)
    return total / (weights.shape[0] * (weights.shape[-1] - 1))


@bug("11.1", "score_offset", "too far back")
def prev_mask_two_below(weights):
    length = weights.shape[-1]
    band = torch.ones(length, length).tril(-2).triu(-2)    # the diagonal two below
    return (weights * band).sum(dim=(-1, -2)).mean(dim=0) / (length - 1)


@bug("11.2", "score_positions", "drop query half")
def induction_diagonal_drops_two(weights, half):
    return weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 2:].mean(dim=(0, 2))


@bug("11.2", "score_positions", "drop query half")
def induction_arange_after_half(weights, half):
    i = torch.arange(half + 1, weights.shape[-1])
    return weights[:, :, i, i - half + 1].mean(dim=(0, 2))


@bug("11.2", "score_positions", "drop query half")
def induction_loop_after_half(weights, half):
    scores = []
    for h in range(weights.shape[1]):
        vals = [weights[:, h, i, i - half + 1] for i in range(half + 1, weights.shape[-1])]
        scores.append(torch.stack(vals).mean())
    return torch.stack(scores)


@bug("11.2", "score_offset", "too far")
def induction_diagonal_one_too_far(weights, half):
    return weights.diagonal(offset=-(half - 2), dim1=-2, dim2=-1)[..., 1:].mean(dim=(0, 2))


@bug("11.2", "score_offset", "too far back")
def induction_copy_diagonal_drops_first(weights, half):
    return weights.diagonal(offset=-half, dim1=-2, dim2=-1)[..., 1:].mean(dim=(0, 2))


@bug("11.2", "score_offset", "too far back")
def induction_one_before_the_copy(weights, half):
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half - 1].mean(dim=(0, 2))   # at query half: key -1, the last one, a zero


@bug("11.2", "score_offset", "i - half + 2")
def induction_mask_one_too_far(weights, half):
    length = weights.shape[-1]
    band = torch.zeros(length, length)
    for i in range(half, length):
        band[i, i - half + 2] = 1.0
    return (weights * band).sum(dim=(-1, -2)).mean(dim=0) / (length - half)


# 11.3: token rows instead of head columns, a hook on the attention's input (or its output after proj):
# found by the topic's one mistake model (``_heads_ablation``: a hook at each site zeroing each selection).

def _pre_hook_on(site, zero):
    @contextlib.contextmanager
    def ablate(model, layer, head):
        attn = model.blocks[layer].attn
        module = {"proj": attn.proj, "attn": attn, "block": model.blocks[layer]}[site]

        def hook(module, inputs):
            return (zero(inputs[0].clone(), attn, head),)

        handle = module.register_forward_pre_hook(hook)
        try:
            yield model
        finally:
            handle.remove()
    return ablate


def _rows(x, attn, head):
    x[:, head * attn.head_dim:(head + 1) * attn.head_dim] = 0      # axis 1 is the position
    return x


def _own(x, attn, head):
    x[..., head * attn.head_dim:(head + 1) * attn.head_dim] = 0
    return x


def _position(x, attn, head):
    x[:, head] = 0
    return x


def _split_by_view(x, attn, head):
    n, length, _ = x.shape
    x.view(n, attn.num_heads, length, attn.head_dim)[:, head] = 0   # the view cuts the sequence, not the features
    return x


bug("11.3", "ablation_slice", "token ROWS")(_named("ablate_token_rows", _pre_hook_on("proj", _rows)))
bug("11.3", "ablation_slice", "position")(_named("ablate_token_position", _pre_hook_on("proj", _position)))
bug("11.3", "ablation_slice", "view")(_named("ablate_heads_split_by_view", _pre_hook_on("proj", _split_by_view)))
bug("11.3", "ablation_method", "INPUT")(_named("ablate_hooks_the_attention_input", _pre_hook_on("attn", _own)))
bug("11.3", "ablation_method", "INPUT")(_named("ablate_hooks_the_block_input", _pre_hook_on("block", _own)))
bug("11.3", "ablation_method", "INPUT")(_named("ablate_token_rows_of_the_attention_input",
                                               _pre_hook_on("attn", _rows)))


@bug("11.3", "ablation_slice", "token ROWS")
@contextlib.contextmanager
def ablate_token_rows_by_index_fill(model, layer, head):
    attn = model.blocks[layer].attn
    rows = torch.arange(head * attn.head_dim, (head + 1) * attn.head_dim)
    rows = rows[rows < 10]                            # positions past the sequence do not exist

    def hook(module, inputs):
        return (inputs[0].index_fill(1, rows, 0.0),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "ablation_slice", "OUTPUT")
@contextlib.contextmanager
def ablate_forward_hook_on_attention(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs, output):
        out = output.clone()
        out[..., head * size:(head + 1) * size] = 0   # after proj: residual features, not the head
        return out

    handle = attn.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "ablation_slice", "OUTPUT")
@contextlib.contextmanager
def ablate_forward_hook_on_proj(model, layer, head):
    attn = model.blocks[layer].attn
    keep = torch.ones(attn.embed_dim)
    keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0
    handle = attn.proj.register_forward_hook(lambda module, inputs, output: output * keep)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "ablation_method", "INPUT")
@contextlib.contextmanager
def ablate_query_key_value_inputs(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., head * size:(head + 1) * size] = 0
        return (x,)

    handles = [linear.register_forward_pre_hook(hook) for linear in (attn.query, attn.key, attn.value)]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_heads_split_the_right_way(model, layer, head):
    attn = model.blocks[layer].attn

    def hook(module, inputs):
        n, length, _ = inputs[0].shape
        x = inputs[0].reshape(n, length, attn.num_heads, attn.head_dim).clone()   # (N, L, heads, head_dim)
        x[:, :, head] = 0
        return (x.reshape(n, length, -1),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_with_a_mask_like_the_input(model, layer, head):
    attn = model.blocks[layer].attn

    def hook(module, inputs):
        keep = torch.ones_like(inputs[0][0, 0])                              # (heads * head_dim,), its dtype
        keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0
        return (inputs[0] * keep,)

    with contextlib.ExitStack() as stack:
        handle = attn.proj.register_forward_pre_hook(hook)
        stack.callback(handle.remove)
        yield model


@bug("11.3", "exception", "backward pass")
@contextlib.contextmanager
def ablate_with_a_backward_hook_that_raises(model, layer, head):
    attn = model.blocks[layer].attn
    handles = [attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head)),
               attn.proj.register_full_backward_hook(lambda module, grad_in, grad_out: 1 / 0)]   # a "debug" hook
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


@bug("11.3", "not_restored", "the tensor")
@contextlib.contextmanager
def ablate_leaves_a_gradient_hook(model, layer, head):
    attn = model.blocks[layer].attn
    size = attn.head_dim
    attn.proj.weight.register_hook(lambda grad: grad.index_fill(1, torch.arange(head * size, (head + 1) * size), 0))
    handle = attn.proj.register_forward_pre_hook(_zero_head_hook(attn, head))
    try:
        yield model
    finally:
        handle.remove()


class _ZeroColumns(torch.nn.Module):
    """A parametrization: the weight seen by the module, with some columns zeroed."""

    def __init__(self, columns):
        super().__init__()
        self.columns = columns

    def forward(self, weight):
        mask = torch.ones_like(weight)
        mask[:, self.columns] = 0
        return weight * mask


@correct("11.3")
@contextlib.contextmanager
def ablate_by_parametrization(model, layer, head):
    from torch.nn.utils import parametrize
    attn = model.blocks[layer].attn
    parametrize.register_parametrization(attn.proj, "weight",
                                         _ZeroColumns(slice(head * attn.head_dim, (head + 1) * attn.head_dim)))
    try:
        yield model
    finally:
        parametrize.remove_parametrizations(attn.proj, "weight", leave_parametrized=False)


@bug("11.3", "not_restored", "other numbers")
@contextlib.contextmanager
def ablate_by_parametrization_left_parametrized(model, layer, head):
    from torch.nn.utils import parametrize
    attn = model.blocks[layer].attn
    parametrize.register_parametrization(attn.proj, "weight",
                                         _ZeroColumns(slice(head * attn.head_dim, (head + 1) * attn.head_dim)))
    try:
        yield model
    finally:
        parametrize.remove_parametrizations(attn.proj, "weight")    # keeps the zeroed weight


@correct("11.3")
@contextlib.contextmanager
def ablate_by_wrapping_the_attention_forward(model, layer, head):
    attn = model.blocks[layer].attn
    forward, size = attn.forward, attn.head_dim

    def ablated(x, *args, **kwargs):
        handle = attn.proj.register_forward_pre_hook(lambda module, inputs: (inputs[0].index_fill(
            -1, torch.arange(head * size, (head + 1) * size, device=inputs[0].device), 0.0),))
        try:
            return forward(x, *args, **kwargs)
        finally:
            handle.remove()

    attn.forward = ablated
    try:
        yield model
    finally:
        del attn.forward


@bug("11.2", "score_offset", "L // 2")
def induction_half_from_the_length(weights, half):
    half = weights.shape[-1] // 2                      # "the second half starts in the middle"
    i = torch.arange(half, weights.shape[-1])
    return weights[:, :, i, i - half + 1].mean(dim=(0, 2))


@correct("11.2")
def induction_by_a_band_mask(weights, half):
    length = weights.shape[-1]
    rows = torch.arange(length, device=weights.device)[:, None]
    cols = torch.arange(length, device=weights.device)[None, :]
    band = ((cols == rows - half + 1) & (rows >= half)).to(weights.dtype)   # (L, L): 1 at (i, i - half + 1)
    return (weights * band).sum(dim=(-1, -2)).mean(dim=0) / (length - half)


@bug("11.3", "not_implemented", "not written yet")
@contextlib.contextmanager
def ablate_learner_copy_stub(model, layer, head):
    raise NotImplementedError("Exercise 11.3: write ablate_head")   # the learner copy keeps the decorator
    yield model


@bug("11.1", "score_offset", "add up (not average)")
def prev_sums_two_back(weights):
    return weights.diagonal(offset=-2, dim1=-2, dim2=-1).sum(dim=(0, 2))   # two slips: the key, and a sum


@bug("11.2", "score_positions", "add up (not average)")
def induction_sums_from_the_first_half(weights, half):
    return weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1).sum(dim=(0, 2))   # query half - 1 too, summed
