"""Round 40a (notebooks 05, 06, 08, 11): attempts at 5.1, 5.2, 5.3, 5.4, 6.1, 6.2, 8.1, 11.1, 11.2, 11.3.

Named by this round's fixes: 11.1 and 11.2 on a model of one head, as the notebook's (a .squeeze() that drops the
heads axis: ``shape``); 5.2 an extra term inside the value tolerance whose gradient differs (a z-loss: ``mismatch``,
not a cut path); 5.3 clipping by the max-abs or L1 norm (``clipping``) and a forward under torch.autocast
(``precision``); 5.4 the temperature divided twice (``scale``); 6.1 a count rounded (``precision``); 11.3 mean- and
resample-ablation (``ablation_method``). 8.1's fall of 0.05 holds where the reference's own run falls that far (the
text says so now). Left out: 5.4 topk(sorted=False), whose order a CPU cannot show, and 6.2 a manual_seed inside
greedy generation, which the text does not forbid.
"""
from __future__ import annotations

import contextlib
import fractions
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import Attempt, new_bank
from course_lib.classroom.training_runs import TrainingRun

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 5.1 lm_windows

@correct("5.1")
def windows_by_as_strided(ids, max_tokens):
    """as_strided over the long ids: (num, T + 1) windows with stride T, no copy until the cast."""
    ids = ids.long().contiguous()
    num = (len(ids) - 1) // max_tokens
    chunks = ids.as_strided((num, max_tokens + 1), (max_tokens, 1))
    return chunks[:, :-1].clone(), chunks[:, 1:].clone()


@correct("5.1")
def windows_by_index_grid(ids, max_tokens):
    """An index grid: starts[:, None] + arange(T + 1)[None, :], then gather by fancy indexing."""
    num = (len(ids) - 1) // max_tokens
    grid = torch.arange(num)[:, None] * max_tokens + torch.arange(max_tokens + 1)[None, :]
    chunks = ids[grid].to(torch.long)
    return chunks[..., :-1], chunks[..., 1:]


@correct("5.1")
def windows_returned_as_list_from_split(ids, max_tokens):
    """torch.split of the first num*T + 1 ids, dropping the last short piece; returned as a list."""
    ids = ids.to(dtype=torch.int64)
    num = (len(ids) - 1) // max_tokens
    x = torch.stack(ids[:num * max_tokens].split(max_tokens))
    y = torch.stack(ids[1:num * max_tokens + 1].split(max_tokens))
    return [x, y]


@bug("5.1", "mismatch", "first window")
def windows_aligned_to_the_end(ids, max_tokens):
    """'Keep the most recent text': windows aligned so that the last one ends at the last token."""
    num = (len(ids) - 1) // max_tokens
    offset = len(ids) - 1 - num * max_tokens
    chunks = torch.stack([ids[offset + s * max_tokens: offset + s * max_tokens + max_tokens + 1]
                          for s in range(num)]).long()
    return chunks[:, :-1], chunks[:, 1:]


@bug("5.1", "dropout", "random")
def windows_shuffled_like_a_dataloader(ids, max_tokens):
    """Shuffles the windows, as a DataLoader(shuffle=True) would: the text asks for windows starting 0, T, 2T ..."""
    starts = range(0, len(ids) - max_tokens, max_tokens)
    chunks = torch.stack([ids[s:s + max_tokens + 1] for s in starts]).long()
    order = torch.randperm(len(chunks))
    return chunks[order, :-1], chunks[order, 1:]


@bug("5.1", "shape")
def windows_count_one_too_many_padded(ids, max_tokens):
    """A last window that does not fit is padded with token 0 instead of dropped."""
    num = -(-(len(ids) - 1) // max_tokens)
    padded = torch.cat([ids.long(), ids.new_zeros(num * max_tokens + 1 - len(ids)).long()])
    chunks = padded.unfold(0, max_tokens + 1, max_tokens)
    return chunks[:, :-1], chunks[:, 1:]


@bug("5.1", "target_shift")
def windows_targets_from_sorted_ids(ids, max_tokens):
    """The targets are the input values plus one (works for arange ids only)."""
    chunks = ids.long().unfold(0, max_tokens + 1, max_tokens)
    return chunks[:, :-1], chunks[:, :-1] + 1


# ============================================================================ 5.2 lm_loss

@correct("5.2")
def loss_by_categorical_log_prob(logits, targets):
    """torch.distributions.Categorical's log_prob, padding masked out."""
    real = targets != -100
    dist = torch.distributions.Categorical(logits=logits, validate_args=False)
    log_p = dist.log_prob(targets.clamp(min=0))                    # (N, L)
    return -(log_p * real).sum() / real.sum()


@correct("5.2")
def loss_in_float64_inside(logits, targets):
    """The cross-entropy computed in float64 and returned in float64 (more precise, still differentiable)."""
    return F.cross_entropy(logits.double().flatten(0, 1), targets.flatten())


@correct("5.2")
def loss_nll_on_log_softmax_classes_in_dim1(logits, targets):
    """log_softmax over the vocabulary, then nll_loss with the classes moved to dim 1 ((N, V, L) against (N, L))."""
    return F.nll_loss(F.log_softmax(logits, dim=-1).permute(0, 2, 1), targets)


@correct("5.2")
def loss_by_one_hot_and_masked_mean(logits, targets):
    """One-hot targets dotted with log-probabilities; the padding rows are all-zero one-hots."""
    real = targets.ne(-100)
    one_hot = F.one_hot(targets.clamp(min=0), logits.shape[-1]).to(logits.dtype) * real[..., None]
    return -(one_hot * logits.log_softmax(-1)).sum() / real.sum()


@bug("5.2", "mismatch")
def loss_with_z_loss(logits, targets):
    """PaLM's auxiliary z-loss (1e-4 * logsumexp^2) added on: not the plain cross-entropy asked."""
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    z = logits.logsumexp(-1)[targets != -100].pow(2).mean()
    return ce + 1e-4 * z


@bug("5.2", "magnitude")
def loss_clamped_logits(logits, targets):
    """Logits clamped to [-30, 30] 'for stability': wrong on large logits."""
    return F.cross_entropy(logits.clamp(-30, 30).flatten(0, 1), targets.flatten())


@bug("5.2", "loss_reduction")
def loss_mask_from_first_row(logits, targets):
    """Counts the real targets of the first sequence only, times the batch size."""
    per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return per.sum() / ((targets[0] != -100).sum() * targets.shape[0])


# ============================================================================ 5.3 train_step

@correct("5.3")
def step_clips_the_optimizers_params(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Clips the parameters the optimizer holds (all of the model's here)."""
    model.train()
    optimizer.zero_grad(set_to_none=False)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    if max_grad_norm is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm, error_if_nonfinite=True)
    optimizer.step()
    return float(loss)


@correct("5.3")
def step_with_retain_graph_and_detached_item(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """backward(retain_graph=True) (wasteful, harmless); returns loss.detach().cpu().item()."""
    model.train(True)
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    from course_lib.train import lm_loss
    loss = lm_loss(model(inputs), targets)
    loss.backward(retain_graph=True)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_grad_norm, norm_type=2)
    optimizer.step()
    return loss.detach().cpu().item()


@bug("5.3", "clipping", "not clipped")
def step_clips_an_exhausted_generator(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """params = model.parameters() (a generator) is used up clearing the gradients; the clip then sees nothing."""
    model.train()
    params = model.parameters()
    for p in params:
        p.grad = None
    from course_lib.train import lm_loss
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "clipping", "L2")
def step_clips_the_max_norm(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """norm_type=inf: clips by the largest absolute gradient entry, not the L2 norm."""
    model.train()
    optimizer.zero_grad()
    from course_lib.train import lm_loss
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, norm_type=float("inf"))
    optimizer.step()
    return loss.item()


@bug("5.3", "dropout")
def step_train_mode_after_the_forward(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """model.train() comes after the forward pass: the step's forward ran in eval mode (no dropout)."""
    optimizer.zero_grad()
    from course_lib.train import lm_loss
    loss = lm_loss(model(inputs), targets)
    model.train()
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "clipping")
def step_clips_after_the_step(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """optimizer.step() first, clip afterwards: the update uses the unclipped gradient."""
    model.train()
    optimizer.zero_grad()
    from course_lib.train import lm_loss
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return loss.item()


# ============================================================================ 5.4 sample_next_token

@correct("5.4")
def sample_power_of_probabilities(logits, temperature=1.0, top_k=None, generator=None):
    """softmax first, then probs ** (1 / T): proportional to exp(z / T); multinomial renormalises."""
    if temperature == 0:
        return logits.argmax(-1)
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1) ** (1.0 / temperature)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@correct("5.4")
def sample_inverse_cdf(logits, temperature=1.0, top_k=None, generator=None):
    """Inverse-CDF sampling: one uniform per row, count the cumulative probabilities below it."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits / temperature
    if top_k is not None:
        z = torch.where(z < z.topk(top_k, -1).values[:, -1:], torch.full_like(z, float("-inf")), z)
    probs = z.softmax(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=probs.dtype)
    ids = (probs.cumsum(-1) < u).sum(-1)
    return ids.clamp(max=probs.shape[-1] - 1)


@bug("5.4", "scale")
def sample_temperature_twice_with_top_k(logits, temperature=1.0, top_k=None, generator=None):
    """Divides by the temperature, and again inside the top-k branch: T squared there."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf")) / temperature
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "mutation")
def sample_top_k_in_place_on_the_callers_logits(logits, temperature=1.0, top_k=None, generator=None):
    """nanoGPT's in-place top-k, but on the caller's logits (before the division): the caller's tensor gets -inf."""
    if temperature == 0:
        return logits.argmax(-1)
    if top_k is not None:
        v, _ = torch.topk(logits, top_k)
        logits[logits < v[:, [-1]]] = -float("inf")
    probs = F.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)


@bug("5.4", "mutation")
def sample_divides_the_callers_logits_in_place(logits, temperature=1.0, top_k=None, generator=None):
    """logits /= temperature: the caller's logits are changed; drawing twice from the same logits sharpens them."""
    if temperature == 0:
        return logits.argmax(-1)
    logits /= temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


# ============================================================================ 6.1 flops_per_token

@correct("6.1")
def flops_as_fraction(config, num_weights):
    """A fractions.Fraction (exact rational arithmetic)."""
    return fractions.Fraction(6) * num_weights + fractions.Fraction(12) * config.num_layers * config.num_heads \
        * config.head_dim * config.max_tokens


@correct("6.1")
def flops_with_math_prod_and_getattr(config, num_weights):
    """math.prod over the fields read with getattr."""
    n, h, q, t = (getattr(config, name) for name in ("num_layers", "num_heads", "head_dim", "max_tokens"))
    return 6 * num_weights + 12 * math.prod((n, h, q, t))


@bug("6.1", "precision", "rounded")
def flops_rounded_to_thousands(config, num_weights):
    """Rounded to the nearest thousand 'for readability'."""
    return round(6 * num_weights + 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens,
                 -3)


# ============================================================================ 6.2 generate_with_cache

@correct("6.2")
@torch.no_grad()
def cached_chunked_prefill(model, idx, max_new_tokens):
    """The prompt fed in two chunks through the cache (a chunked prefill), then one token at a time."""
    cache = model.new_cache()
    cut = idx.shape[1] // 2
    if cut:
        model(idx[:, :cut], cache)
    logits = model(idx[:, cut:], cache)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1, :].argmax(-1, keepdim=True)
        idx = torch.cat((idx, nxt), dim=1)
        logits = model(nxt, cache)
    return idx


@correct("6.2")
@torch.inference_mode()
def cached_under_inference_mode(model, idx, max_new_tokens):
    """torch.inference_mode instead of no_grad; the new ids collected in a list and concatenated once."""
    cache = model.new_cache()
    logits = model(idx, cache)
    new = []
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1).unsqueeze(1)
        new.append(nxt)
        if step < max_new_tokens - 1:
            logits = model(nxt, cache)
    return torch.cat([idx, *new], dim=1)


@correct("6.2")
def cached_without_the_decorator(model, idx, max_new_tokens):
    """No @torch.no_grad(): the graph is built and thrown away (slower, same tokens)."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
        logits = model(nxt, cache)
    return idx


@bug("6.2", "kv_cache")
@torch.no_grad()
def cached_prompt_fed_without_the_cache(model, idx, max_new_tokens):
    """The prompt runs without the cache; only the new tokens go through it (it never holds the prompt)."""
    cache = model.new_cache()
    logits = model(idx)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
        logits = model(nxt, cache)
    return idx


@bug("6.2", "exception", "2 tokens")
@torch.no_grad()
def cached_feeds_the_last_two_tokens(model, idx, max_new_tokens):
    """Feeds idx[:, -2:] each step (the previous token again with the new one): the cache holds duplicates."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
        logits = model(idx[:, -2:], cache)
    return idx


# ============================================================================ 8.1 (two TrainingRuns)

def _run40(label, val, train=(3.0, 2.5, 2.2), failure=None, **kw):
    return TrainingRun(label, [1, 2, 3][:len(train)], list(train), [50, 100][:len(val)], list(val),
                       failure=failure, trained_on=("names", 0, 3e-3), **kw)


_REF40 = _run40("reference", [2.4, 2.0], yours_asked=())

BUGGY.append(Attempt("8.1", "yours_raised_exception",
                     (_run40("yours", [], train=(3.0,), failure="exception: RuntimeError: boom", not_yours=()),
                      _REF40), "exception"))
BUGGY.append(Attempt("8.1", "yours_val_nan_only", (_run40("yours", [float("nan"), 2.0], not_yours=()), _REF40),
                     "nan"))
# neither run learns in so few steps: the text's fall of 0.05 holds where the reference's own loss falls that far
CORRECT.append(Attempt("8.1", "yours_stalls_within_tolerance_of_stalled_ref",
                       (_run40("yours", [2.99, 2.99], train=(3.0, 3.0, 3.0), not_yours=()),
                        _run40("reference", [2.99, 2.98], train=(3.0, 3.0, 3.0), yours_asked=())), None))
CORRECT.append(Attempt("8.1", "runs_alike_with_numpy_losses",
                       (_run40("yours", [np.float64(2.41), np.float64(2.01)], not_yours=()), _REF40), None))
CORRECT.append(Attempt("8.1", "runs_exactly_at_the_tolerance", (_run40("yours", [2.4, 2.02], not_yours=()), _REF40),
                       None))


# ============================================================================ 11.1 previous_token_score

@bug("11.1", "shape")
def prev_squeezed_keepdim(weights):
    """mean with keepdim=True then .squeeze(): for a model of ONE head (the notebook's) the head axis goes too."""
    below = weights.diagonal(offset=-1, dim1=-2, dim2=-1)
    return below.mean(dim=(0, 2), keepdim=True).squeeze()


@correct("11.1")
def prev_strided_flat_index(weights):
    """Flatten each (L, L) map; entries (i, i-1) sit at i*L + i - 1: start L, step L + 1."""
    length = weights.shape[-1]
    return weights.flatten(-2)[..., length::length + 1].mean(dim=(0, -1))


@correct("11.1")
def prev_mean_of_means(weights):
    """Mean over the queries, then over the batch: equal counts, so the same mean."""
    return torch.diagonal(weights, -1, 2, 3).mean(-1).mean(0)


# ============================================================================ 11.2 induction_score

@bug("11.2", "shape")
def induction_squeezed_keepdim(weights, half):
    """keepdim=True then .squeeze(): with one head the result is a 0-d tensor, not (heads,)."""
    diag = weights.diagonal(offset=1 - half, dim1=-2, dim2=-1)[..., 1:]
    return diag.mean(dim=(0, -1), keepdim=True).squeeze()


@correct("11.2")
def induction_strided_flat_index(weights, half):
    """Entries (i, i - half + 1) for i >= half lie at flat index half*L + 1 + k*(L + 1)."""
    length = weights.shape[-1]
    return weights.flatten(-2)[..., half * length + 1::length + 1].mean(dim=(0, -1))


@correct("11.2")
def induction_rows_then_offset_one(weights, half):
    """Rows half .. L-1, then the diagonal just above the main one of that (L - half, L) block."""
    return weights[..., half:, :].diagonal(offset=1, dim1=-2, dim2=-1).mean(dim=(0, 2))


# ============================================================================ 11.3 ablate_head

@correct("11.3")
@contextlib.contextmanager
def ablate_subtract_the_heads_contribution(model, layer, head):
    """A forward hook on proj that subtracts the head's contribution x_h @ W_h^T from proj's output."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs, output):
        return output - inputs[0][..., cols] @ module.weight[:, cols].T

    handle = attn.proj.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_pre_hook_with_kwargs(model, layer, head):
    """register_forward_pre_hook(..., with_kwargs=True): the hook returns (args, kwargs)."""
    attn = model.blocks[layer].attn
    d = attn.head_dim

    def hook(module, args, kwargs):
        x = args[0]
        keep = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        keep[head * d:(head + 1) * d] = 0
        return (x * keep, *args[1:]), kwargs

    handle = attn.proj.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_by_wrapping_proj(model, layer, head):
    """attn.proj swapped for nn.Sequential(zeroing module, proj) and put back in finally."""
    attn = model.blocks[layer].attn
    original = attn.proj
    d = attn.head_dim

    class _ZeroHead(nn.Module):
        def forward(self, x):
            x = x.clone()
            x[..., head * d:(head + 1) * d] = 0
            return x

    attn.proj = nn.Sequential(_ZeroHead(), original)
    try:
        yield model
    finally:
        attn.proj = original


@correct("11.3")
@contextlib.contextmanager
def ablate_by_a_zeroing_parametrization(model, layer, head):
    """torch.nn.utils.parametrize: proj.weight's head columns zeroed by a parametrization, removed after."""
    from torch.nn.utils import parametrize
    attn = model.blocks[layer].attn
    d = attn.head_dim

    class _ZeroCols(nn.Module):
        def forward(self, w):
            keep = torch.ones_like(w)
            keep[:, head * d:(head + 1) * d] = 0
            return w * keep

    parametrize.register_parametrization(attn.proj, "weight", _ZeroCols())
    try:
        yield model
    finally:
        parametrize.remove_parametrizations(attn.proj, "weight", leave_parametrized=False)


@bug("11.3", "ablation_method")
@contextlib.contextmanager
def ablate_mean_ablation(model, layer, head):
    """Mean-ablation (the head's output replaced by its mean over the batch and positions), not zeros."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., cols] = x[..., cols].mean(dim=(0, 1), keepdim=True)
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.3", "mismatch")
@contextlib.contextmanager
def ablate_subtracts_the_bias_too(model, layer, head):
    """Subtracts proj(head's columns alone) from proj's output: that takes proj's bias away as well."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs, output):
        only = torch.zeros_like(inputs[0])
        only[..., cols] = inputs[0][..., cols]
        return output - F.linear(only, module.weight, module.bias)

    handle = attn.proj.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


# ============================================================================ second batch

@correct("5.3")
def step_with_an_optimizer_closure(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """The closure pattern (as LBFGS needs): zero_grad, forward, backward and clip inside the closure."""
    from course_lib.train import lm_loss
    model.train()

    def closure():
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        return loss

    return optimizer.step(closure).item()


@correct("5.3")
def step_back_to_eval_afterwards(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """model.train() first, and model.eval() at the end 'to be safe' (the next step switches it on again)."""
    from course_lib.train import lm_loss
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    model.eval()
    return loss.item()


@bug("5.3", "precision")
def step_under_bfloat16_autocast(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Mixed precision on the CPU (autocast to bfloat16): the loss and the gradient are bfloat16-rounded."""
    from course_lib.train import lm_loss
    model.train()
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(inputs)
    loss = lm_loss(logits.float(), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order")
def step_skips_the_update_on_a_high_loss(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """'Skip a spike': no update when the loss is above 2 (a threshold that fits one data set only)."""
    from course_lib.train import lm_loss
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if loss.item() < 2.0:
        optimizer.step()
    return loss.item()


@correct("5.4")
def sample_top_k_by_scatter(logits, temperature=1.0, top_k=None, generator=None):
    """top-k by scattering the top values into a -inf tensor like the logits."""
    if temperature == 0:
        return torch.max(logits, dim=-1).indices
    logits = logits / temperature
    if top_k is not None:
        top = logits.topk(top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator).flatten()


@correct("5.4")
def sample_log_softmax_then_exp(logits, temperature=1.0, top_k=None, generator=None):
    """log_softmax, then exp: the same probabilities, computed stably."""
    if not temperature:
        return logits.argmax(dim=1)
    z = logits.div(temperature)
    if top_k:
        z = z.masked_fill(z < z.topk(top_k, dim=1).values[:, [-1]], -math.inf)
    return z.log_softmax(dim=1).exp().multinomial(1, generator=generator)[:, 0]


@bug("5.4", "top_k")
def sample_top_k_by_rank_with_argsort(logits, temperature=1.0, top_k=None, generator=None):
    """The rank from ONE argsort (the sort's indices, not the rank): keeps the wrong tokens."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        rank = logits.argsort(dim=-1, descending=True)          # indices, mistaken for ranks
        logits = logits.masked_fill(rank >= top_k, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@correct("5.4")
def sample_top_k_by_rank_with_double_argsort(logits, temperature=1.0, top_k=None, generator=None):
    """Each token's rank by argsort of argsort: keep ranks below k."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        rank = logits.argsort(dim=-1, descending=True).argsort(dim=-1)
        logits = logits.masked_fill(rank >= top_k, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("6.2", "shape")
@torch.no_grad()
def cached_stops_when_every_row_says_zero(model, idx, max_new_tokens):
    """Stops early once every row's new token is 0 (an end-of-text token the exercise never mentions)."""
    cache = model.new_cache()
    logits = model(idx, cache)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
        if bool((nxt == 0).all()):
            break
        logits = model(nxt, cache)
    return idx


@correct("6.2")
@torch.no_grad()
def cached_argmax_of_softmax(model, idx, max_new_tokens):
    """argmax of the probabilities (the softmax keeps the order)."""
    cache = model.new_cache()
    logits = model(idx, cache)
    out = idx
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits[:, -1, :], dim=-1)
        nxt = torch.argmax(probs, dim=-1, keepdim=True)
        out = torch.cat((out, nxt), dim=-1)
        logits = model(nxt, cache)
    return out


@bug("11.3", "not_restored")
@contextlib.contextmanager
def ablate_restores_with_a_new_parameter(model, layer, head):
    """Zeroes proj's columns, then 'restores' by assigning a NEW nn.Parameter: an optimizer holds the old one."""
    attn = model.blocks[layer].attn
    d = attn.head_dim
    saved = attn.proj.weight.detach().clone()
    with torch.no_grad():
        attn.proj.weight[:, head * d:(head + 1) * d] = 0
    try:
        yield model
    finally:
        attn.proj.weight = nn.Parameter(saved)


@correct("11.3")
@contextlib.contextmanager
def ablate_by_zeroed_columns_restored_by_copy(model, layer, head):
    """proj.weight's head columns zeroed in place (no_grad), copied back from a clone in finally."""
    proj = model.blocks[layer].attn.proj
    d = model.blocks[layer].attn.head_dim
    saved = proj.weight.detach().clone()
    with torch.no_grad():
        proj.weight[:, head * d:(head + 1) * d].zero_()
    try:
        yield model
    finally:
        with torch.no_grad():
            proj.weight.copy_(saved)


@bug("11.3", "ablation_method")
@contextlib.contextmanager
def ablate_resample_from_another_sequence(model, layer, head):
    """Resample-ablation: the head's output replaced by another sequence's (rolled over the batch)."""
    attn = model.blocks[layer].attn
    cols = slice(head * attn.head_dim, (head + 1) * attn.head_dim)

    def hook(module, inputs):
        x = inputs[0].clone()
        x[..., cols] = inputs[0][..., cols].roll(1, dims=0)
        return (x,)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@bug("11.1", "shape")
def prev_stacked_heads_squeezed(weights):
    """A loop over heads, stacked and squeezed: one head gives a 0-d tensor."""
    scores = [weights[:, h].diagonal(offset=-1, dim1=-2, dim2=-1).mean() for h in range(weights.shape[1])]
    return torch.stack(scores).squeeze()


@bug("11.2", "mismatch")
def induction_flattened_then_viewed(weights, half):
    """Reshaped to (-1, L, L) and the mean taken per map, then viewed as (N, heads) and averaged over dim 0."""
    n, h, length, _ = weights.shape
    maps = weights.reshape(-1, length, length)
    per = maps.diagonal(offset=1 - half, dim1=-2, dim2=-1)[:, 1:].mean(-1)
    return per.view(h, n).mean(1)


# ============================================================================ third batch

_SLOW_REF = _run40("reference", [2.96, 2.94], train=(3.0,) + (2.95,) * 9, yours_asked=())
_SLOW_REF = TrainingRun("reference", list(range(1, 11)), [3.0] + [2.95] * 9, [50, 100], [2.96, 2.94],
                        trained_on=("names", 0, 3e-3), yours_asked=())
BUGGY.append(Attempt("8.1", "trained_on_another_learning_rate",
                     (_run40("yours", [2.41, 2.01], not_yours=()).__class__(
                         "yours", [1, 2, 3], [3.0, 2.5, 2.2], [50, 100], [2.41, 2.01], trained_on=("names", 0, 1e-2),
                         not_yours=()), _REF40), "exception", ("same training",)))


@bug("5.2", "mismatch")
def loss_last_position_only(logits, targets):
    """Scores only the last position of each sequence (as a classifier would)."""
    return F.cross_entropy(logits[:, -1], targets[:, -1], ignore_index=-100)


@correct("5.2")
def loss_nanmean_of_masked_per_token(logits, targets):
    """Per-token losses with the padding set to NaN, then nanmean."""
    per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    per = per.masked_fill(targets.flatten() == -100, float("nan"))
    return per.nanmean()


@correct("11.3")
@contextlib.contextmanager
def ablate_by_get_submodule(model, layer, head):
    """The projection found by name, model.get_submodule(f'blocks.{layer}.attn.proj'); the hook returns a tensor."""
    attn = model.get_submodule(f"blocks.{layer}.attn")
    lo, hi = head * attn.head_dim, (head + 1) * attn.head_dim

    def hook(module, args):
        x = args[0]
        return torch.cat([x[..., :lo], torch.zeros_like(x[..., lo:hi]), x[..., hi:]], dim=-1)

    handle = model.get_submodule(f"blocks.{layer}.attn.proj").register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.1")
def prev_by_unfold_free_gather(weights):
    """torch.gather of key i - 1 for queries 1 .. L-1."""
    n, h, length, _ = weights.shape
    keys = torch.arange(length - 1, device=weights.device).view(1, 1, -1, 1).expand(n, h, -1, 1)
    return weights[..., 1:, :].gather(-1, keys).squeeze(-1).mean(dim=(0, 2))


@bug("6.2", "kv_cache")
@torch.no_grad()
def cached_prompt_fed_by_its_last_token_only(model, idx, max_new_tokens):
    """Only the prompt's LAST token goes into the cache ('the cache only needs the newest token')."""
    cache = model.new_cache()
    logits = model(idx[:, -1:], cache)
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
        logits = model(nxt, cache)
    return idx


@bug("5.4", "greedy")
def sample_greedy_below_a_small_temperature(logits, temperature=1.0, top_k=None, generator=None):
    """Greedy already at temperature <= 0.5 ('close enough to 0'): temperature 0.5 must still sample."""
    if temperature <= 0.5:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[:, -1:], float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
