"""Student attempts from a twelfth scripted search (2026-11-29): what an exercise's text asks that no probe looked
at (the ids' values, the optimizer handed over, the model's mode, what a cache holds), and messages that said
something false of the code that reached them, in notebooks 05, 06, 09, 10 and 12.

Before, the first six below passed; the others were refused with a message whose advice the code already
followed (or which described other code). Now each gets the diagnosis of what it does, in words that hold for it.
"""
from __future__ import annotations

import torch

from bank.attempts import new_bank
from bank.flash_bugs import _tiled
from bank.scale_bugs import _GQAScaled
from bank.search_bugs import _mla
from course_lib.train import lm_loss

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 5.1: values are names, not numbers
def _windows(ids, max_tokens, source):
    starts = range(0, len(ids) - max_tokens, max_tokens)
    inputs = torch.stack([source[s:s + max_tokens] for s in starts]).long()   # (num_windows, max_tokens)
    return inputs, inputs + 1


@bug("5.1", "target_shift", "values plus one")
def windows_targets_are_the_values_plus_one(ids, max_tokens):
    """'The same tokens shifted by one' read as a shift of the values: right only where ids count up."""
    return _windows(ids, max_tokens, ids)


@bug("5.1", "mismatch", "not a token of ids", "torch.arange")
def windows_of_positions(ids, max_tokens):
    """Windows of the positions 0, 1, ..., not of the ids there (it was told its first window starts at -100)."""
    return _windows(ids, max_tokens, torch.arange(len(ids)))


# ============================================================================ 5.3: the optimizer it was given
def _step(model, optimizer, inputs, targets, max_grad_norm, clip=None, update=None):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        (clip or (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))()
    (update or optimizer.step)()
    return loss.item()


@bug("5.3", "step_order", "never stepped")
def step_by_hand(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """p -= lr * p.grad: plain SGD's update, so it passed where the check handed over plain SGD."""
    def update():
        with torch.no_grad():
            for p in model.parameters():
                p -= optimizer.param_groups[0]["lr"] * p.grad
    return _step(model, optimizer, inputs, targets, max_grad_norm, update=update)


@bug("5.3", "step_order", "never stepped")
def step_with_an_own_optimizer(model, optimizer, inputs, targets, max_grad_norm=1.0):
    lr = optimizer.param_groups[0]["lr"]
    return _step(model, optimizer, inputs, targets, max_grad_norm,
                 update=lambda: torch.optim.SGD(model.parameters(), lr=lr).step())


@bug("5.3", "mismatch", "each parameter on its own")
def step_clips_each_parameter(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """It was told to use lm_loss, backward and one step, which it does."""
    def clip():
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_(p, max_grad_norm)
    return _step(model, optimizer, inputs, targets, max_grad_norm, clip=clip)


@bug("5.3", "clipping", "L2 norm")
def step_clips_the_l1_norm(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """It clips to the argument; it was told to clip to the argument, not a fixed number."""
    return _step(model, optimizer, inputs, targets, max_grad_norm,
                 clip=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, norm_type=1))


@bug("5.3", "kept_state", "learning rate")
def step_halves_the_learning_rate(model, optimizer, inputs, targets, max_grad_norm=1.0):
    def update():
        optimizer.step()
        for group in optimizer.param_groups:
            group["lr"] *= 0.5
    return _step(model, optimizer, inputs, targets, max_grad_norm, update=update)


# ============================================================================ 5.4 and 6.1: the advice fits the code
@bug("5.4", "scale", "every path")
def sampling_tempers_only_without_top_k(logits, temperature=1.0, top_k=None, generator=None):
    """It divides the logits before the softmax, as it was told to, but only when top_k is not given."""
    if temperature == 0:
        return logits.argmax(-1)
    if top_k is None:
        logits = logits / temperature
    else:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("6.1", "attention_flops", "causal mask")
def flops_halved_for_the_causal_mask(config, num_weights):
    """Both products counted, then the term halved for the mask (it was told it counts one product)."""
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens
    return 6 * num_weights + attention // 2


# ============================================================================ 6.2: the caller's model, as handed over
def _generate(model, idx, max_new_tokens, fed=1):
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)   # (N, L + 1)
        logits = model(idx[:, -fed:], cache)
    return idx


@bug("6.2", "dropout", "training mode")
@torch.no_grad()
def generation_switches_to_training(model, idx, max_new_tokens):
    model.train()
    return _generate(model, idx, max_new_tokens)


@bug("6.2", "exception", "2 tokens at a step")
@torch.no_grad()
def generation_feeds_the_last_two_tokens(model, idx, max_new_tokens):
    """It was told it feeds the whole sequence again."""
    return _generate(model, idx, max_new_tokens, fed=2)


# ============================================================================ 9.6 and 12.2: what the cache holds
@bug("9.6", "kv_cache", "values where the keys go")
class GQACachesValuesAsKeys(_GQAScaled):
    """cache.append(v, k), read back as v, k: the outputs are right, the cache's keys are the values."""

    def cached(self, cache, k, v):
        v, k = cache.append(v, k)
        return k, v


@bug("12.2", "kv_cache", "before kv_a_layernorm")
def mla_normalises_after_the_cache(layer, x, cache=None):
    return _mla(layer, x, cache, slip="norm_after_cache")


# ============================================================================ 10.2 and 12.3
@bug("10.2", "block_bounds", "number of keys")
def flash_key_loop_bounded_by_the_queries(q, k, v, *, block_q, block_k, causal=False):
    """Lq for Lk: the keys past the queries' count are never read (it was told L is not a multiple of block_k)."""
    return _tiled(q, k, v, block_q, block_k, causal, keys_to_lq=True)


@bug("12.3", "gradient", "in-place")
def linear_attention_state_updated_in_place(q, k, v):
    """Right outputs; the text asks for a layer that can learn, and `s += ...` breaks its backward."""
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1      # (..., L, d)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])                     # (..., d, d_v)
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])                                  # (..., d)
    outputs = []
    for i in range(q.shape[-2]):
        s += fk[..., i, :, None] * v[..., i, None, :]
        z += fk[..., i, :]
        outputs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outputs, dim=-2)                                          # (..., L, d_v)
