"""Round 35d (notebooks 05, 06, 07): slips the checks of 5.2 lm_loss, 5.4 sample_next_token, 6.1 flops_per_token,
7.1 split_c_attn and 7.2 the attention function for transformers let through or misnamed (tester round 35c).

5.2, 5.4 and 7.1: a new tensor made on the CPU whatever the inputs' device (torch.ones(targets.shape) as token
weights, a -inf filler of torch.full for top-k, uniform noise of torch.rand, buffers of torch.empty copied into, a
result moved with .cpu()) passed: no case ran on another device. 5.2 and 7.1 now list the engine's device probe
(every case again on the meta device); 5.4, a judge of its own, runs each path (greedy, temperature, top-k) on meta
logits last, with no generator (a meta tensor draws nothing; torch's random state is put back): ``device``. New
tensors made on the inputs' device (device=x.device, torch.full_like, x.new_empty) stay right.

5.2: a loss of one sequence alone (logits[0], the first sequence returned from a loop, or the last one a loop kept)
was ``mismatch``. The engine's batch probe does not fit a loss that reduces over the batch (the mean mixes the
sequences by design): the loss of the first or last sequence alone is now a mistake of its own, ``batch_mixing``.
7.2: the first sequence's padding mask used for every sequence (attention_mask[:1], [0], the masks combined over the
batch) was ``causal_mask`` "the attention_mask you were given is ignored": each sequence is now run alone with its
own rows of the mask, right alone and wrong together is ``batch_mixing`` (judged before the mask-ignored mistake,
after the mask that lost its heads axis).

6.1: a whole count off by one factor (a multiply-add counted as 1 FLOP: 3N + 6·n·H·Q·T, 1/2; the backward counted
as one forward: 4N + 8·n·H·Q·T, 2/3; both: N + 2·n·H·Q·T, 1/6; the factor 2 twice: 2x) was ``mismatch``, since
``_one_term_off`` names one wrong term only: each is a slip of its own, and any other factor the same on every
configuration is named by its value: ``flops_factor``.

5.2: whole sequences with any -100 dropped (their real targets too), or every sequence cut to the shortest, were
``mismatch``: ``loss_reduction`` (the mean is over the tokens not ignored). logits.reshape(N, V, L) passed as
classes-in-dim-1 was ``mismatch`` where L != V (the listed ``shape`` mistake applies only when L == V): now
``shape``, naming the transpose.

5.4: ids of shape (N, 1) from the greedy path alone (argmax/max with keepdim=True, topk(1).indices) were told
"torch.multinomial(..., 1) keeps a last dimension": the message now names the greedy path's keepdim (``shape``).

7.2: the first padding mask stored on the layer (``module``) and reused, or a cache keyed by the layer, was
``mismatch`` "Check the steps that change values": a call wrong on the layer after the calls before it and right
on a fresh layer of the same sizes is ``kept_state``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bank.attempts import new_bank

BUGGY, CORRECT, bug, correct = new_bank()


def _lhqt(config):
    return config.num_layers * config.num_heads * config.head_dim * config.max_tokens


def _bottom_right(lq, lk, device):
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


def _sdpa(query, key, value, mask, scaling):
    """Attention in transformers' layout, (N, L, heads, d), with a bool mask (True = may attend)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2)


# ============================================================================ 5.2, 5.4, 7.1: tensors made on the CPU

@bug("5.2", "device", "device")
def loss_mask_on_cpu(logits, targets):
    """Wrong: the weights of each token made on the CPU (torch.ones without device=)."""
    w = torch.ones(targets.shape, dtype=logits.dtype)
    w = w * (targets != -100)
    per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (per * w.flatten()).sum() / w.sum()


@bug("5.2", "device")
def loss_class_weights_on_cpu(logits, targets):
    """Wrong: uniform class weights made on the CPU, handed to F.cross_entropy."""
    weight = torch.ones(logits.shape[-1], dtype=logits.dtype)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=weight)


@bug("5.2", "device")
def loss_moved_to_cpu(logits, targets):
    """Wrong: the loss moved to the CPU before it is returned (for logging)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).cpu()


@bug("5.2", "device")
def loss_count_on_cpu(logits, targets):
    """Wrong: the number of real targets rebuilt with torch.tensor (on the CPU) and divided by."""
    per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    count = torch.zeros(1, dtype=logits.dtype) + (targets != -100).sum()
    return (per / count).squeeze(0)


@correct("5.2")
def loss_mask_on_logits_device(logits, targets):
    """Right: the token weights made on the logits' device, in their dtype."""
    w = torch.ones(targets.shape, dtype=logits.dtype, device=logits.device) * (targets != -100)
    per = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (per * w.flatten()).sum() / w.sum()


@bug("5.4", "device", "device")
def sample_mask_on_cpu(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: the -inf filler made with torch.full(logits.shape, -inf): on the CPU whatever the logits' device."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, -1).values[:, -1:]
        filler = torch.full(logits.shape, float("-inf"), dtype=logits.dtype)
        logits = torch.where(logits < kth, filler, logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)


@bug("5.4", "device")
def sample_topk_keep_mask_on_cpu(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: the top-k tokens marked in a bool mask made on the CPU (torch.zeros without device=)."""
    if temperature == 0:
        return logits.argmax(-1)
    z = logits / temperature
    if top_k is not None:
        keep = torch.zeros(z.shape, dtype=torch.bool)
        keep.scatter_(-1, z.topk(top_k, -1).indices, True)
        z = z.masked_fill(~keep, float("-inf"))
    return torch.multinomial(z.softmax(-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "device")
def sample_ids_moved_to_cpu(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: the ids moved to the CPU (to print them) before they are returned."""
    if temperature == 0:
        return logits.argmax(-1).cpu()
    z = logits / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, -1).values[:, -1:], float("-inf"))
    return torch.multinomial(z.softmax(-1), 1, generator=generator).squeeze(-1).cpu()


@bug("5.4", "device")
def sample_gumbel_noise_on_cpu(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: Gumbel-max whose uniform noise is made without device= (on the CPU)."""
    if temperature == 0:
        return logits.argmax(-1)
    z = logits / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, -1).values[:, -1:], float("-inf"))
    u = torch.rand(z.shape, generator=generator, dtype=z.dtype).clamp_min(1e-20)
    return (z - torch.log(-torch.log(u))).argmax(-1)


@correct("5.4")
def sample_filler_like_logits(logits, temperature=1.0, top_k=None, generator=None):
    """Right: the -inf filler made like the logits (torch.full_like: their device and dtype)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)


@bug("7.1", "device", "device")
def split_into_cpu_buffers(weight):
    """Wrong: copies into new (E, E) buffers made on the CPU."""
    e = weight.shape[0]
    out = []
    for i in range(3):
        buf = torch.empty(e, e, dtype=weight.dtype)
        buf.copy_(weight[:, i * e:(i + 1) * e].T)
        out.append(buf)
    return tuple(out)


@bug("7.1", "device")
def split_stacked_into_cpu_buffer(weight):
    """Wrong: one (3, E, E) buffer made on the CPU, each block written into it."""
    e = weight.shape[0]
    out = torch.empty(3, e, e, dtype=weight.dtype)
    for i, block in enumerate(weight.split(e, dim=1)):
        out[i] = block.T
    return out[0], out[1], out[2]


@bug("7.1", "device")
def split_moved_to_cpu(weight):
    """Wrong: each matrix moved to the CPU, to be loaded into a model there."""
    return tuple(block.T.cpu() for block in weight.chunk(3, dim=1))


@correct("7.1")
def split_into_buffers_on_weight_device(weight):
    """Right: new buffers made like the weight (new_empty: its device and dtype), copied into."""
    e = weight.shape[0]
    return tuple(weight.new_empty(e, e).copy_(weight[:, i * e:(i + 1) * e].T) for i in range(3))


# ============================================================================ 5.2, 7.2: one sequence for the batch

@bug("5.2", "batch_mixing", "first sequence")
def loss_first_sequence(logits, targets):
    """Wrong: only the first sequence (right for batch 1)."""
    return F.cross_entropy(logits[0], targets[0])


@bug("5.2", "batch_mixing", "first sequence")
def loss_returns_inside_loop(logits, targets):
    """Wrong: a loop over the batch whose return sits inside it: the first sequence's loss."""
    for i in range(logits.shape[0]):
        return F.cross_entropy(logits[i], targets[i], ignore_index=-100)


@bug("5.2", "batch_mixing", "last sequence")
def loss_last_of_loop(logits, targets):
    """Wrong: a loop over the batch that overwrites the loss: the last sequence's alone."""
    for x, y in zip(logits, targets):
        loss = F.cross_entropy(x, y)
    return loss


@correct("5.2")
def loss_loop_summed_over_batch(logits, targets):
    """Right: a loop over the batch that adds up each sequence's summed loss, divided by every real target."""
    total = logits.new_zeros(())
    for x, y in zip(logits, targets):
        total = total + F.cross_entropy(x, y, reduction="sum")
    return total / (targets != -100).sum()


@bug("7.2", "batch_mixing", "own", avoids=("is ignored",))
def attn_first_sequence_mask(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Wrong: uses the first sequence's padding mask for every sequence (right for batch 1)."""
    mask = attention_mask[:1] if attention_mask is not None else _bottom_right(query.shape[2], key.shape[2],
                                                                                query.device)
    return _sdpa(query, key, value, mask, scaling), None


@bug("7.2", "batch_mixing", avoids=("is ignored",))
def attn_mask_of_item_zero(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Wrong: attention_mask[0], (1, Lq, Lk), broadcast over the batch."""
    mask = attention_mask[0] if attention_mask is not None else _bottom_right(query.shape[2], key.shape[2],
                                                                               query.device)
    return _sdpa(query, key, value, mask, scaling), None


@bug("7.2", "batch_mixing")
def attn_masks_combined_over_batch(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Wrong: one mask for the batch, the keys every sequence may see (all over the batch)."""
    if attention_mask is None:
        mask = _bottom_right(query.shape[2], key.shape[2], query.device)
    else:
        mask = attention_mask.all(0, keepdim=True)
    return _sdpa(query, key, value, mask, scaling), None


@bug("7.2", "batch_mixing")
def attn_last_sequence_mask(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Wrong: the last sequence's mask for every sequence (attention_mask[-1:])."""
    mask = attention_mask[-1:] if attention_mask is not None else _bottom_right(query.shape[2], key.shape[2],
                                                                                 query.device)
    return _sdpa(query, key, value, mask, scaling), None


@correct("7.2")
def attn_mask_first_head_slice(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Right: attention_mask[:, :1] (the heads axis, already of size one): every sequence keeps its own rows."""
    mask = attention_mask[:, :1] if attention_mask is not None else _bottom_right(query.shape[2], key.shape[2],
                                                                                   query.device)
    return _sdpa(query, key, value, mask, scaling), None


# ============================================================================ 6.1: the whole count off by a factor

@bug("6.1", "flops_factor", "multiply-add", "1/2")
def flops_multiply_adds(config, num_weights):
    """Wrong: counts multiply-adds as one FLOP: 3N + 6nHQT (the factor 2 forgotten everywhere)."""
    return 3 * num_weights + 6 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "flops_factor", "2/3", "backward")
def flops_backward_once(config, num_weights):
    """Wrong: backward counted as one more forward: 4N + 8nHQT."""
    return 4 * num_weights + 8 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


@bug("6.1", "flops_factor", "2/3")
def flops_forward_twice(config, num_weights):
    """Wrong: forward + backward with the backward as costly as the forward: 2 x (2N + 4nHQT)."""
    forward = 2 * num_weights + 4 * _lhqt(config)
    return forward + forward


@bug("6.1", "flops_factor", "1/6")
def flops_forward_multiply_adds(config, num_weights):
    """Wrong: the forward pass's multiply-adds only: N + 2nHQT."""
    return num_weights + 2 * _lhqt(config)


@bug("6.1", "flops_factor", "2 times")
def flops_factor_two_twice(config, num_weights):
    """Wrong: 2 FLOPs per multiply-add applied on top of 6N + 12nHQT, which already holds it."""
    return 2 * (6 * num_weights + 12 * _lhqt(config))


@bug("6.1", "flops_factor", "1.333 times")
def flops_backward_thrice(config, num_weights):
    """Wrong: the backward counted as three forwards: 8N + 16nHQT (a factor 4/3 no slip lists)."""
    forward = 2 * num_weights + 4 * _lhqt(config)
    return forward + 3 * forward


@correct("6.1")
def flops_multiply_adds_doubled(config, num_weights):
    """Right: the multiply-adds (N + 2nHQT forward) times 2 FLOPs each, times 3 for forward and backward."""
    multiply_adds = num_weights + 2 * _lhqt(config)
    return 2 * 3 * multiply_adds


# ============================================================================ 5.2: padding dropped by the sequence

@bug("5.2", "loss_reduction", "not ignored")
def loss_weighted_by_nonpad_rows(logits, targets):
    """Wrong: the padded rows dropped entirely (any -100 in the row), not just their padding."""
    keep = ~(targets == -100).any(1)
    return F.cross_entropy(logits[keep].flatten(0, 1), targets[keep].flatten())


@bug("5.2", "loss_reduction", "not ignored")
def loss_skips_padded_rows_in_loop(logits, targets):
    """Wrong: a loop that skips every sequence holding padding."""
    total, count = logits.new_zeros(()), 0
    for x, y in zip(logits, targets):
        if bool((y == -100).any()):
            continue
        total = total + F.cross_entropy(x, y, reduction="sum")
        count += y.numel()
    return total / count


@bug("5.2", "loss_reduction", "shortest")
def loss_cut_to_shortest(logits, targets):
    """Wrong: every sequence cut to the positions where no sequence is padded."""
    real = ~(targets == -100).any(0)
    return F.cross_entropy(logits[:, real].reshape(-1, logits.shape[-1]), targets[:, real].reshape(-1))


@correct("5.2")
def loss_real_targets_by_row(logits, targets):
    """Right: each sequence's real targets summed in a loop (padding skipped token by token), over their count."""
    total, count = logits.new_zeros(()), 0
    for x, y in zip(logits, targets):
        real = y != -100
        if bool(real.any()):
            total = total + F.cross_entropy(x[real], y[real], reduction="sum")
            count += int(real.sum())
    return total / count


# ============================================================================ 5.2: a reshape where a transpose is meant

@bug("5.2", "shape", "transpose", "memory order")
def loss_view_without_transpose(logits, targets):
    """Wrong: .view(N, V, L) instead of a transpose, then cross_entropy with classes in dim 1."""
    n, l, v = logits.shape
    return F.cross_entropy(logits.reshape(n, v, l), targets)


@bug("5.2", "shape", "transpose")
def loss_view_minus_one(logits, targets):
    """Wrong: .view(N, -1, L) to get (N, V, L), the vocabulary never moved."""
    return F.cross_entropy(logits.contiguous().view(logits.shape[0], -1, logits.shape[1]), targets,
                           ignore_index=-100)


@correct("5.2")
def loss_permuted_classes(logits, targets):
    """Right: the vocabulary moved to dimension 1 with permute."""
    return F.cross_entropy(logits.permute(0, 2, 1), targets)


# ============================================================================ 5.4: a kept axis on the greedy path

@bug("5.4", "shape", "keepdim", "greedy", avoids=("multinomial",))
def sample_greedy_keepdim(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: greedy path returns (N, 1) (keepdim=True), the sampled one (N,)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    z = logits / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    return torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator).squeeze(-1)


@bug("5.4", "shape", "greedy", "max(-1, keepdim=True)", avoids=("multinomial",))
def sample_greedy_max_indices(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: the greedy path's max(-1, keepdim=True).indices, (N, 1)."""
    if temperature == 0:
        return logits.max(-1, keepdim=True).indices
    z = logits / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    return torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator)[:, 0]


@bug("5.4", "shape", "topk(1)", avoids=("multinomial",))
def sample_greedy_topk_one(logits, temperature=1.0, top_k=None, generator=None):
    """Wrong: the greedy path's topk(1).indices, (N, 1)."""
    if temperature == 0:
        return logits.topk(1, dim=-1).indices
    z = logits / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    return torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator).flatten()


@correct("5.4")
def sample_greedy_keepdim_squeezed(logits, temperature=1.0, top_k=None, generator=None):
    """Right: keepdim=True on both paths, one squeeze(-1) at the end."""
    if temperature == 0:
        ids = logits.argmax(-1, keepdim=True)
    else:
        z = logits / temperature
        if top_k is not None:
            z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        ids = torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator)
    return ids.squeeze(-1)


# ============================================================================ 7.2: a mask kept on the layer

@bug("7.2", "kept_state", "fresh layer")
def attn_mask_kept_on_module(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Wrong: the first padding mask stored on the layer and reused when a mask is given."""
    if attention_mask is not None and not hasattr(module, "_saved_mask"):
        module._saved_mask = attention_mask
    mask = getattr(module, "_saved_mask", None) if attention_mask is not None else None
    if mask is None:
        mask = _bottom_right(query.shape[2], key.shape[2], query.device)
    return _sdpa(query, key, value, mask, scaling), None


@bug("7.2", "kept_state", "fresh layer")
def attn_mask_cached_on_module_by_size(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                       **kwargs):
    """Wrong: the given masks cached on the layer by (Lq, Lk), so a new batch's mask of the same size is not read."""
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None:
        return _sdpa(query, key, value, _bottom_right(lq, lk, query.device), scaling), None
    cache = module.__dict__.setdefault("_masks_by_size", {})
    mask = cache.setdefault((lq, lk), attention_mask)
    return _sdpa(query, key, value, mask, scaling), None


_MASKS_BY_LAYER = {}


@bug("7.2", "kept_state")
def attn_mask_cached_by_layer(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Wrong: the first mask given kept in a global, keyed by the layer."""
    if attention_mask is None:
        return _sdpa(query, key, value, _bottom_right(query.shape[2], key.shape[2], query.device), scaling), None
    mask = _MASKS_BY_LAYER.setdefault(id(module), attention_mask)
    return _sdpa(query, key, value, mask, scaling), None


@correct("7.2")
def attn_mask_noted_on_module(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Right: the last mask noted on the layer (for inspection), but each call uses its own argument."""
    module.last_attention_mask = attention_mask
    mask = attention_mask if attention_mask is not None else _bottom_right(query.shape[2], key.shape[2], query.device)
    return _sdpa(query, key, value, mask, scaling), None


@correct("5.4")
def sample_gumbel_max_on_the_logits_device(logits, temperature=1.0, top_k=None, generator=None):
    """Right: the Gumbel-max trick with its noise drawn on the logits' device (model_bugs.sample_gumbel_max without
    device= is wrong)."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    uniform = torch.rand(scaled.shape, generator=generator, device=logits.device).clamp_min(1e-20)
    return (scaled - torch.log(-torch.log(uniform))).argmax(-1)
