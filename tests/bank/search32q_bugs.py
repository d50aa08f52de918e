"""Round 32 (notebook 11): tensors made on the CPU in the head scores and the ablation; a score of the first
sequence only.

11.1-11.3 never ran the student's code on another device, so a selector made with torch.ones(L, L) or
torch.arange(L), or a hook's keep-mask made without device=, passed, and failed on the first GPU. The texts now
ask for new tensors on the weights' (the activations') device, and the checks add the engine's device probe:
11.1 and 11.2 run every case again on meta weights; 11.3 runs the model inside the student's `with` on meta.
Indices of advanced indexing may stay on the CPU (a GPU takes them), and stay right.

A score of weights[0] (or weights[-1]): one sequence of the batch scored as if the batch held one. It got
`mismatch` with two lists of numbers; now `score_axes`, naming the batch, as a score that keeps the batch does.

11.3's proj columns zeroed in place and copied back in `finally` is right by the course's design (the check's
docstring: "zeroed columns of proj" passes; heads_bugs.ablate_proj_columns is a right attempt): filed as right.
"""
from __future__ import annotations

import contextlib

import torch

from bank.attempts import Attempt, new_bank  # noqa: F401 - the bank's style

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 11.1: a selector on the CPU

@bug("11.1", "device", "device")
def prev_mask_on_the_cpu(weights):
    """A 0/1 selector of the sub-diagonal made with torch.ones(L, L) on the CPU, multiplied with the weights."""
    length = weights.shape[-1]
    sel = torch.ones(length, length).tril(-1).triu(-1)
    return (weights * sel).sum(dim=(-2, -1)).mean(0) / (length - 1)


@bug("11.1", "device", "device")
def prev_eye_shifted_on_the_cpu(weights):
    """torch.eye(L) rolled one place down: the selector of (i, i - 1), on the CPU, with masked_select's mean."""
    length = weights.shape[-1]
    below = torch.eye(length, dtype=torch.bool).roll(1, dims=0)
    below[0] = False                                    # (0, L - 1) wrapped around: no previous token
    return weights.masked_fill(~below, 0).sum(dim=(-2, -1)).mean(0) / (length - 1)


@bug("11.1", "device", "device")
def prev_result_moved_to_the_cpu(weights):
    """The right score, returned with .cpu()."""
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2)).cpu()


@correct("11.1")
def prev_selector_like_weights(weights):
    """The selector made with ones_like (right device and dtype), then a masked mean."""
    sel = torch.ones_like(weights[0, 0]).tril(-1).triu(-1)
    return (weights * sel).sum(dim=(-2, -1)).mean(0) / (weights.shape[-1] - 1)


@correct("11.1")
def prev_index_on_the_cpu(weights):
    """Advanced indexing with CPU index tensors: a GPU takes those."""
    i = torch.arange(1, weights.shape[-1])
    return weights[..., i, i - 1].mean(dim=(0, -1))


@correct("11.1")
def prev_selector_on_weights_device(weights):
    """torch.ones(..., device=weights.device, dtype=weights.dtype)."""
    length = weights.shape[-1]
    sel = torch.ones(length, length, device=weights.device, dtype=weights.dtype).tril(-1).triu(-1)
    return (weights * sel).sum(dim=(-2, -1)).mean(0) / (length - 1)


@correct("11.1")
def prev_by_slicing(weights):
    """Rows 1.., columns ..L-2: the sub-diagonal is the main diagonal of that block."""
    return weights[..., 1:, :-1].diagonal(dim1=-2, dim2=-1).mean(dim=(0, 2))


# ============================================================================ 11.1/11.2: the first sequence only

@bug("11.1", "score_axes", "batch", "weights[0]")
def prev_first_sequence_only(weights):
    """weights[0]: written with one sequence in mind, the rest of the batch ignored."""
    return weights[0].diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)


@bug("11.1", "score_axes", "batch")
def prev_last_sequence_only(weights):
    """weights[-1] through unbind's last: one sequence scored."""
    *_, last = weights.unbind(0)
    return last[:, 1:, :-1].diagonal(dim1=-2, dim2=-1).mean(dim=-1)


@bug("11.2", "score_axes", "batch", "weights[0]")
def induction_first_sequence_only(weights, half):
    """weights[0]: one sequence's score returned as the head's score."""
    return weights[0].diagonal(offset=1 - half, dim1=-2, dim2=-1)[..., 1:].mean(-1)


@bug("11.2", "score_axes", "batch")
def induction_squeezed_first_sequence(weights, half):
    """weights[:1] squeezed: the batch of one assumed, written with keepdim."""
    one = weights[:1].squeeze(0)                                   # (heads, L, L) only where N = 1 ... or not
    i = torch.arange(half, weights.shape[-1])
    return one[:, i, i - half + 1].mean(dim=-1)


# ============================================================================ 11.2: a selector on the CPU

@bug("11.2", "device", "device")
def induction_index_on_cpu_with_where(weights, half):
    """A boolean selector (i - j == half - 1, i >= half) built on the CPU and used with torch.where."""
    length = weights.shape[-1]
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    sel = (i - j == half - 1) & (i >= half)
    picked = torch.where(sel, weights, torch.zeros((), dtype=weights.dtype))
    return picked.sum(dim=(-2, -1)).mean(0) / (length - half)


@bug("11.2", "device", "device")
def induction_mask_from_ones_on_the_cpu(weights, half):
    """torch.ones(L, L).tril(...).triu(...) cut to the second half's rows, multiplied with the weights."""
    length = weights.shape[-1]
    sel = torch.ones(length, length, dtype=weights.dtype).tril(1 - half).triu(1 - half)
    sel[:half] = 0
    return (weights * sel).sum(dim=(-2, -1)).mean(0) / (length - half)


@correct("11.2")
def induction_fancy_index(weights, half):
    """Advanced indexing with index tensors on the weights' device."""
    i = torch.arange(half, weights.shape[-1], device=weights.device)
    return weights[..., i, i - half + 1].mean(dim=(0, -1))


@correct("11.2")
def induction_mask_like_weights(weights, half):
    """The selector made from ones_like of one map: the weights' device and dtype."""
    sel = torch.ones_like(weights[0, 0]).tril(1 - half).triu(1 - half)
    sel[:half] = 0
    return (weights * sel).sum(dim=(-2, -1)).mean(0) / (weights.shape[-1] - half)


@correct("11.2")
def induction_diagonal_drop_first(weights, half):
    """Diagonal at offset 1 - half starts at query half - 1: drop that first entry."""
    return weights.diagonal(offset=1 - half, dim1=-2, dim2=-1)[..., 1:].mean(dim=(0, -1))


# ============================================================================ 11.3: a mask on the CPU

@bug("11.3", "device", "device")
@contextlib.contextmanager
def ablate_mask_made_on_cpu(model, layer, head):
    """A 0/1 mask of the input's dtype but made without device=: a GPU model fails."""
    attn = model.blocks[layer].attn
    a, b = head * attn.head_dim, (head + 1) * attn.head_dim

    def hook(module, inputs):
        x = inputs[0]
        keep = torch.ones(x.shape[-1], dtype=x.dtype)
        keep[a:b] = 0
        return (x * keep, *inputs[1:])

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "device", "device")
@contextlib.contextmanager
def ablate_mask_made_on_entry_on_cpu(model, layer, head):
    """The keep-mask made once on entering, from the sizes alone (torch.ones(E)), on the CPU."""
    attn = model.blocks[layer].attn
    keep = torch.ones(attn.num_heads, attn.head_dim)
    keep[head] = 0
    keep = keep.flatten()

    def hook(module, inputs):
        return (inputs[0] * keep.to(inputs[0].dtype),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "device", "device")
@contextlib.contextmanager
def ablate_zeros_cat_on_cpu(model, layer, head):
    """torch.cat of the left part, torch.zeros(...) without device=, and the right part."""
    attn = model.blocks[layer].attn
    a, b = head * attn.head_dim, (head + 1) * attn.head_dim

    def hook(module, inputs):
        x = inputs[0]
        zeros = torch.zeros(*x.shape[:-1], b - a, dtype=x.dtype)
        return (torch.cat([x[..., :a], zeros, x[..., b:]], dim=-1),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_mask_on_the_weights_device(model, layer, head):
    """The keep-mask made on entering, on proj's weight's device and in its dtype."""
    attn = model.blocks[layer].attn
    weight = attn.proj.weight
    keep = torch.ones(weight.shape[1], device=weight.device, dtype=weight.dtype)
    keep[head * attn.head_dim:(head + 1) * attn.head_dim] = 0

    def hook(module, inputs):
        return (inputs[0] * keep,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_head_by_cat(model, layer, head):
    """The merged input rebuilt with torch.cat of the head's left part, zeros and the right part."""
    attn = model.blocks[layer].attn
    a, b = head * attn.head_dim, (head + 1) * attn.head_dim

    def hook(module, inputs):
        x = inputs[0]
        return (torch.cat([x[..., :a], torch.zeros_like(x[..., a:b]), x[..., b:]], dim=-1), *inputs[1:])

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_columns_indexed_by_cpu_arange(model, layer, head):
    """The head's columns written through a CPU index tensor (x[..., columns] = 0): indices may stay on the CPU."""
    attn = model.blocks[layer].attn
    columns = torch.arange(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs):
        merged = inputs[0].clone()
        merged[..., columns] = 0.0
        return (merged,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


# ============================================================================ 11.3: proj's columns zeroed in place

@correct("11.3")
@contextlib.contextmanager
def ablate_zeroes_proj_columns_and_restores(model, layer, head):
    """Zeroes the head's columns of proj.weight under no_grad and copies them back in finally. Right by the course's
    design: the head's output reaches nothing (heads_bugs.ablate_proj_columns is filed right)."""
    proj = model.blocks[layer].attn.proj
    a, b = head * model.blocks[layer].attn.head_dim, (head + 1) * model.blocks[layer].attn.head_dim
    saved = proj.weight[:, a:b].detach().clone()
    with torch.no_grad():
        proj.weight[:, a:b] = 0
    try:
        yield model
    finally:
        with torch.no_grad():
            proj.weight[:, a:b] = saved
