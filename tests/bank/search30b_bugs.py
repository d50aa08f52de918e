"""Student attempts at 5.3's gradient clipping (2026-12-01): each clipping that is not one global norm scaled down
to max_grad_norm, named for what it does.

Before, clipping by value (clip_grad_value_, or each gradient clamped) and each parameter's own norm got the
general "not along the gradient" message; the norm squared, the mean instead of the norm, and a rescale to
max_grad_norm even below it were told only by their numbers (or not at all). Right code beside them, in the
unusual styles a probe could refuse: clip_grad_norm_ with foreach, the global norm by hand through torch.cat or a
sum of squares, torch's foreach kernels, get_total_norm with clip_grads_with_norm_.
"""
from __future__ import annotations

import math

import torch

from bank.attempts import new_bank
from course_lib.train import lm_loss

BUGGY, CORRECT, bug, correct = new_bank()


def _step(model, optimizer, inputs, targets, max_grad_norm, clip):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        clip([p for p in model.parameters() if p.grad is not None], max_grad_norm)
    optimizer.step()
    return loss.item()


def _global_norm(params):
    return torch.sqrt(sum((p.grad ** 2).sum() for p in params))


# ============================================================================ 5.3: by value

@bug("5.3", "clipping", "each value", "global norm")
def step_clips_by_value(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """torch's other clipping function: every entry clamped to [-max_grad_norm, max_grad_norm]."""
    return _step(model, optimizer, inputs, targets, max_grad_norm,
                 lambda params, c: torch.nn.utils.clip_grad_value_(params, c))


@bug("5.3", "clipping", "each value", "global norm")
def step_clamps_each_gradient(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The same by hand: p.grad.clamp_(-c, c)."""
    def clip(params, c):
        for p in params:
            p.grad.clamp_(-c, c)
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


# ============================================================================ 5.3: not the one global norm

@bug("5.3", "mismatch", "each parameter on its own", "global norm")
def step_scales_each_parameter_by_its_norm(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Each parameter's gradient scaled down to max_grad_norm by its own norm."""
    def clip(params, c):
        for p in params:
            p.grad.mul_(min(1.0, c / (float(p.grad.norm()) + 1e-6)))
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


@bug("5.3", "clipping", "squared")
def step_clips_the_squared_norm(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The sum of squares taken for the norm (no square root)."""
    def clip(params, c):
        total = float(sum((p.grad ** 2).sum() for p in params))
        if total > c:
            for p in params:
                p.grad.mul_(c / total)
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


@bug("5.3", "clipping", "mean")
def step_clips_the_mean(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The mean of the absolute gradients taken for the norm."""
    def clip(params, c):
        total = float(torch.cat([p.grad.flatten() for p in params]).abs().mean())
        if total > c:
            for p in params:
                p.grad.mul_(c / total)
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


@bug("5.3", "clipping", "mean")
def step_clips_the_root_mean_square(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The root of the mean square (the norm divided by the square root of the count)."""
    def clip(params, c):
        flat = torch.cat([p.grad.flatten() for p in params])
        total = float(flat.pow(2).mean().sqrt())
        for p in params:
            p.grad.mul_(min(1.0, c / total))
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


@bug("5.3", "clipping", "below", "max_grad_norm")
def step_always_rescales_to_the_limit(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The gradient always rescaled to norm max_grad_norm, longer too when it was shorter."""
    def clip(params, c):
        scale = c / float(_global_norm(params))
        for p in params:
            p.grad.mul_(scale)
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


# ============================================================================ 5.3: right, in unusual styles

@correct("5.3")
def step_clip_grad_norm_foreach(model, optimizer, inputs, targets, max_grad_norm=1.0):
    return _step(model, optimizer, inputs, targets, max_grad_norm,
                 lambda params, c: torch.nn.utils.clip_grad_norm_(params, c, foreach=True))


@correct("5.3")
def step_global_norm_through_cat(model, optimizer, inputs, targets, max_grad_norm=1.0):
    def clip(params, c):
        norm = torch.cat([p.grad.reshape(-1) for p in params]).norm()
        coef = torch.clamp(c / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


@correct("5.3")
def step_global_norm_sum_of_squares(model, optimizer, inputs, targets, max_grad_norm=1.0):
    def clip(params, c):
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
        if norm > c:
            for p in params:
                p.grad *= c / norm
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


@correct("5.3")
def step_foreach_kernels(model, optimizer, inputs, targets, max_grad_norm=1.0):
    def clip(params, c):
        grads = [p.grad for p in params]
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        torch._foreach_mul_(grads, (c / (total + 1e-6)).clamp(max=1.0))
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)


@correct("5.3")
def step_total_norm_then_clip(model, optimizer, inputs, targets, max_grad_norm=1.0):
    def clip(params, c):
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, c, total)
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip)
