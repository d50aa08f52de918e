"""Attempts of the thirtieth search's classes C3 and C9 (notebook 05).

C3: a gradient step on a multiple of the loss (loss / 4 left from gradient accumulation, loss / batch size, 2 *
loss, 1.5 * loss, gradients multiplied by hand) is named as such whatever the factor: before, a factor below the
smallest clipping limit read as wrong clipping, and a factor that is not a whole number got ``mismatch``. The
exercise asks for one update on one batch's lm_loss (notebook 05, section 5), so a loss divided for accumulation is
wrong here. Right steps beside them: accumulation over one step, gradients through torch.autograd.grad, a loss
scaled up and the gradients divided back before clipping.

C9: a sampler whose draws are a permutation of the right distribution (the position in the sorted order returned
instead of the token id, in either order or through topk; the vocabulary reversed and never mapped back; mapped
back through the inverse permutation) is named for it, at temperature 0 too. Right samplers that sort, flip or
take topk and map the position back beside them.
"""
from __future__ import annotations

import torch

from bank.attempts import new_bank
from course_lib.train import lm_loss

BUGGY, CORRECT, bug, correct = new_bank()

_NEG = float("-inf")


def _step(model, optimizer, inputs, targets, max_grad_norm, scale=1.0):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    (loss * scale).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


# ============================================================================ C3: a multiple of the loss

@bug("5.3", "step_order", "multiple of the loss")
def step_loss_scaled_for_accumulation(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """loss / 4 'for gradient accumulation' left in, with one step per batch (r30)."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    (loss / 4).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "multiple of the loss")
def step_loss_doubled(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """(2 * loss).backward(): clipping hides it whenever the norm is clipped (r30)."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    (2 * loss).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "multiple of the loss")
def step_loss_divided_by_accumulation_steps(model, optimizer, inputs, targets, max_grad_norm=1.0,
                                            accumulation_steps=8):
    """The accumulation divisor as a parameter, each call still one step: a factor far below any limit."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    (loss / accumulation_steps).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "multiple of the loss")
def step_loss_divided_by_the_batch_size(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The mean loss divided by the batch size once more: a factor of 1/N, other for each batch."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    (loss / inputs.shape[0]).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "multiple of the loss")
def step_loss_halved(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """0.5 * loss: above the smallest limit, below one (was ``mismatch``)."""
    return _step(model, optimizer, inputs, targets, max_grad_norm, scale=0.5)


@bug("5.3", "step_order", "multiple of the loss")
def step_loss_times_one_and_a_half(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """1.5 * loss: not a whole number of backward passes (was ``mismatch``)."""
    return _step(model, optimizer, inputs, targets, max_grad_norm, scale=1.5)


@bug("5.3", "step_order", "multiple of the loss")
def step_gradients_scaled_by_hand(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Each gradient multiplied by 0.1 between backward and clipping: the same step as a tenth of the loss."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.1)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@correct("5.3")
def step_accumulation_over_one_step(model, optimizer, inputs, targets, max_grad_norm=1.0, accumulation_steps=1):
    """Written for accumulation, called with its default of one step: the loss divided by 1."""
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    (loss / accumulation_steps).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@correct("5.3")
def step_gradients_through_autograd_grad(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """torch.autograd.grad, its gradients set on the parameters by hand, then the given clip and step."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = lm_loss(model(inputs), targets)
    for p, grad in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
        p.grad = torch.zeros_like(p) if grad is None else grad
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return loss.item()


@correct("5.3")
def step_scaled_loss_unscaled_before_clipping(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """A loss scaled up (as for float16) and the gradients divided back before clipping: the right step."""
    scale = 1024.0
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    (loss * scale).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(scale)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


# ============================================================================ C9: a permutation of the token ids

@bug("5.4", "mismatch", "token id", "sort")
def sample_returns_the_rank(logits, temperature=1.0, top_k=None, generator=None):
    """Sorted probabilities cut to k and sampled, but the sorted position returned, not the token id (r30)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs, order = (logits / temperature).softmax(-1).sort(-1, descending=True)
    if top_k is not None:
        probs = probs[..., :top_k]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@bug("5.4", "mismatch", "token id", "topk")
def sample_top_k_returns_the_position_in_topk(logits, temperature=1.0, top_k=None, generator=None):
    """With top_k, topk's values sampled and the position among them returned, not topk's indices."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is None:
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    values, indices = logits.topk(top_k, dim=-1)
    return torch.multinomial(values.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "mismatch", "token id", "sort")
def sample_sorted_ascending_returns_the_position(logits, temperature=1.0, top_k=None, generator=None):
    """sort() ascending, the k last kept, the position in that order returned."""
    if temperature == 0:
        return logits.argmax(-1)
    values, order = (logits / temperature).sort(-1)
    if top_k is not None:
        values[..., :values.shape[-1] - top_k] = _NEG
    return torch.multinomial(values.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "mismatch", "token id", "revers")
def sample_flipped_vocabulary_not_flipped_back(logits, temperature=1.0, top_k=None, generator=None):
    """The vocabulary reversed (for a cumulative sum from the end) and the draw never mapped back."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = (logits / temperature).flip(-1)
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, _NEG)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "mismatch", "token id", "wrong tokens")
def sample_mapped_back_through_the_inverse_permutation(logits, temperature=1.0, top_k=None, generator=None):
    """Sorted and sampled, then mapped back through order.argsort() (the inverse permutation), not order."""
    if temperature == 0:
        return logits.argmax(-1)
    probs, order = (logits / temperature).softmax(-1).sort(-1, descending=True)
    if top_k is not None:
        probs = probs.clone()
        probs[..., top_k:] = 0
    position = torch.multinomial(probs, 1, generator=generator)
    return order.argsort(-1).gather(-1, position).squeeze(-1)


@bug("5.4", "greedy", "token id", "sort")
def sample_greedy_position_in_the_sorted_order(logits, temperature=1.0, top_k=None, generator=None):
    """Sorted first on every path: temperature 0 returns the argmax of the sorted logits, always position 0."""
    values, order = logits.sort(-1, descending=True)
    if temperature == 0:
        return values.argmax(-1)
    probs = (values / temperature).softmax(-1)
    if top_k is not None:
        probs = probs[..., :top_k]
    return order.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)


@correct("5.4")
def sample_sorted_and_mapped_back(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    probs, order = (logits / temperature).softmax(-1).sort(-1, descending=True)
    if top_k is not None:
        probs = probs[..., :top_k]
    return order.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)


@correct("5.4")
def sample_flipped_and_flipped_back(logits, temperature=1.0, top_k=None, generator=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = (logits / temperature).flip(-1)
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, _NEG)
    return logits.shape[-1] - 1 - torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "device")
def sample_sorted_ascending_searchsorted_mapped_back(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong since round 35d: ascending sort, inverse CDF over it, the position mapped back through the sort's
    indices, but its uniform number drawn on the CPU (no device=): on a GPU it meets the logits' device."""
    if temperature == 0:
        return logits.argmax(-1)
    values, order = (logits / temperature).sort(-1)
    if top_k is not None:
        values[..., :values.shape[-1] - top_k] = _NEG
    cdf = values.softmax(-1).cumsum(-1)
    u = torch.rand(*logits.shape[:-1], 1, generator=generator, dtype=cdf.dtype)
    position = torch.searchsorted(cdf, u * cdf[..., -1:]).clamp(max=logits.shape[-1] - 1)
    return order.gather(-1, position).squeeze(-1)
