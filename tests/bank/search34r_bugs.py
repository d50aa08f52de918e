"""Round 34r: what the checks of notebooks 01-06 never called, so could not see.

4.1: a table cached under a key that leaves out one argument (a dict keyed by max_tokens, a cache by embed_dim that
slices its first table, one held by an object) passed: no case reused one argument with the other changed. Two
cases now do, (12, 16) after (12, 8) and (20, 8) after it: ``kept_state``, the key named.

5.1: windows that keep the dtype of ids (unfold or reshape with no .long()) passed: every case fed int64 ids. A case
of int32 ids, once every case is right, now shows it: ``dtype``. Clamping the caller's ids in place without changing a
value is ``mutation`` by the engine's version-counter probe (in the working tree, not yet in HEAD).

5.3: a step that seeds torch's generator (torch.manual_seed at every step, or the state of the first step put back
each time) draws the same dropout masks at every step; the check's model had dropout 0. A model with dropout on now
runs the step from two random states and the first again: ``dropout`` (a step run inside fork_rng, which puts the
state back so that the next step draws the same masks, too).

6.2 and 1.3: a tensor made on the CPU (an output buffer, a -inf fill for torch.where) passed; their texts now ask
for new tensors on the input's device, and the device probe runs on meta inputs (6.2: a copy of the GPT on meta, its
forward without the vocabulary check that reads the ids; 1.3: after the dtype probe, so that a mask kept by shape is
still named ``kept_state``): ``device``.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from course_lib.train import lm_loss

BUGGY, CORRECT, bug, correct = new_bank()


# ---------------------------------------------------------------- 4.1 sinusoidal_table

def _sin_cos(max_tokens, embed_dim):
    pos = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    freq = 1.0 / 10000 ** (torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


_TABLES = {}


@bug("4.1", "kept_state", "key", "embed_dim")
def table_cached_by_max_tokens(max_tokens, embed_dim):
    """(The tester's.) Caches the table in a module-level dict keyed by max_tokens only: a second width gets the
    first table."""
    if max_tokens not in _TABLES:
        pos = torch.arange(max_tokens, dtype=torch.float32)[:, None]
        freq = 1.0 / 10000 ** (torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)
        table = torch.zeros(max_tokens, embed_dim)
        table[:, 0::2] = torch.sin(pos * freq)
        table[:, 1::2] = torch.cos(pos * freq)
        _TABLES[max_tokens] = table
    return _TABLES[max_tokens]


_BY_WIDTH = {}


@bug("4.1", "kept_state", "key", "max_tokens", "sinusoidal_table(12, 8)")
def table_cached_by_width_and_sliced(max_tokens, embed_dim):
    """A table per width, built at the first length asked and sliced to each later one: a longer table later gets
    the first one's rows only."""
    if embed_dim not in _BY_WIDTH:
        _BY_WIDTH[embed_dim] = _sin_cos(max_tokens, embed_dim)
    return _BY_WIDTH[embed_dim][:max_tokens]


class _TableStore:
    """A cache held by an object (which the check cannot reset between calls)."""

    def __init__(self):
        self.tables = {}

    def get(self, max_tokens, embed_dim):
        if max_tokens not in self.tables:
            self.tables[max_tokens] = _sin_cos(max_tokens, embed_dim)
        return self.tables[max_tokens]


_STORE = _TableStore()


@bug("4.1", "kept_state", "embed_dim", "sinusoidal_table(12, 8)")
def table_cached_on_an_object_by_length(max_tokens, embed_dim):
    """The cache on an object, keyed by the length only."""
    return _STORE.get(max_tokens, embed_dim)


_BOTH = {}


@correct("4.1")
def table_cached_by_both_arguments(max_tokens, embed_dim):
    """Right: a cache keyed by (max_tokens, embed_dim), a copy handed out."""
    if (max_tokens, embed_dim) not in _BOTH:
        _BOTH[max_tokens, embed_dim] = _sin_cos(max_tokens, embed_dim)
    return _BOTH[max_tokens, embed_dim].clone()


@functools.lru_cache(maxsize=None)  # noqa: UP033 - as students write it
def _cached_table(max_tokens, embed_dim):
    return _sin_cos(max_tokens, embed_dim)


@correct("4.1")
def table_lru_cached_by_both(max_tokens, embed_dim):
    """Right: functools.lru_cache over both arguments."""
    return _cached_table(max_tokens, embed_dim).clone()


# ---------------------------------------------------------------- 5.1 lm_windows

@bug("5.1", "dtype", "int32", ".long()")
def windows_unfold_keeps_the_ids_dtype(ids, max_tokens):
    """(The tester's.) unfold without .long(): right for int64 ids, but int32 ids stay so."""
    w = ids.unfold(0, max_tokens + 1, max_tokens)
    return w[:, :-1], w[:, 1:]


@bug("5.1", "dtype", "int32", ".long()")
def windows_stacked_slices_keep_the_ids_dtype(ids, max_tokens):
    """Windows stacked from slices of ids, never cast."""
    starts = range(0, len(ids) - max_tokens, max_tokens)
    inputs = torch.stack([ids[s:s + max_tokens] for s in starts])
    targets = torch.stack([ids[s + 1:s + max_tokens + 1] for s in starts])
    return inputs, targets


@bug("5.1", "mutation", "ids")
def windows_casts_ids_in_place(ids, max_tokens):
    """(The tester's.) Clamps "bad" ids in place (ids.clamp_(min=0)) before cutting: on right ids nothing changes,
    but it writes into the caller's tensor (the engine's version-counter probe)."""
    ids.clamp_(min=0)
    w = ids.long().unfold(0, max_tokens + 1, max_tokens)
    return w[:, :-1], w[:, 1:]


@correct("5.1")
def windows_cast_with_to_int64(ids, max_tokens):
    """Right: .to(torch.int64) before cutting."""
    n = (len(ids) - 1) // max_tokens
    ids = ids.to(torch.int64)
    return ids[:n * max_tokens].view(n, max_tokens), ids[1:n * max_tokens + 1].view(n, max_tokens)


@correct("5.1")
def windows_cast_at_the_end(ids, max_tokens):
    """Right: unfold in the ids' own dtype, each half cast with .long() at the end."""
    w = ids.unfold(0, max_tokens + 1, max_tokens)
    return w[:, :-1].long(), w[:, 1:].long()


# ---------------------------------------------------------------- 5.3 train_step

def _step(model, optimizer, inputs, targets, max_grad_norm):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "dropout", "seed", "same dropout masks")
def step_seeds_for_reproducibility(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """(The tester's.) torch.manual_seed(0) at every step "for reproducibility": every step draws the same dropout
    masks."""
    torch.manual_seed(0)
    return _step(model, optimizer, inputs, targets, max_grad_norm)


_FIRST_STATE = []


@bug("5.3", "dropout", "same dropout masks")
def step_puts_back_the_first_random_state(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Keeps torch's random state of its first call and puts it back at every later one, "so that runs repeat"."""
    if not _FIRST_STATE:
        _FIRST_STATE.append(torch.get_rng_state())
    torch.set_rng_state(_FIRST_STATE[0])
    return _step(model, optimizer, inputs, targets, max_grad_norm)


_STEPS_TAKEN = [0]


@bug("5.3", "dropout", "seed", "same random state")
def step_seeds_from_a_step_counter(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Seeds torch's generator with a step counter: new masks at each step, but never the ones the caller's seed
    gives (a run cannot be repeated from its seed)."""
    _STEPS_TAKEN[0] += 1
    torch.manual_seed(_STEPS_TAKEN[0])
    return _step(model, optimizer, inputs, targets, max_grad_norm)


@bug("5.3", "dropout", "random state", "same dropout masks")
def step_inside_fork_rng(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Runs the step inside torch.random.fork_rng(), "to leave the caller's random state alone": the state is put
    back after each step, so the next step draws the same masks again."""
    with torch.random.fork_rng():
        return _step(model, optimizer, inputs, targets, max_grad_norm)


@correct("5.3")
def step_draws_a_number_for_its_log(model, optimizer, inputs, targets, max_grad_norm=1.0):
    """Right: draws which sequence of the batch to log (torch.randint, from torch's generator, not seeded) before
    the step: other masks than the reference's, but new ones at every step."""
    shown = int(torch.randint(0, inputs.shape[0], ()))
    assert 0 <= shown < inputs.shape[0]
    return _step(model, optimizer, inputs, targets, max_grad_norm)


# ---------------------------------------------------------------- 6.2 generate_with_cache

@bug("6.2", "device", "device")
@torch.no_grad()
def cached_output_buffer_on_the_cpu(model, idx, max_new_tokens):
    """(The tester's.) Preallocates the output with torch.zeros(..., dtype=torch.long) without device=: CPU-only."""
    n, length = idx.shape
    out = torch.zeros(n, length + max_new_tokens, dtype=torch.long)
    out[:, :length] = idx
    cache = model.new_cache()
    logits = model(idx, cache)
    for t in range(max_new_tokens):
        nxt = logits[:, -1].argmax(dim=-1)
        out[:, length + t] = nxt
        if t + 1 < max_new_tokens:
            logits = model(out[:, length + t:length + t + 1].to(idx.device), cache)
    return out


@bug("6.2", "device", "device")
@torch.no_grad()
def cached_tokens_gathered_on_the_cpu(model, idx, max_new_tokens):
    """Each new token moved to the CPU with .cpu() (to collect them in a list), the result built there."""
    cache = model.new_cache()
    logits = model(idx, cache)
    tokens = [idx.cpu()]
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt.cpu())
        logits = model(nxt, cache)
    return torch.cat(tokens, dim=1)


@correct("6.2")
@torch.no_grad()
def cached_buffer_made_like_the_prompt(model, idx, max_new_tokens):
    """Right: the output preallocated with idx.new_zeros, on the prompt's device."""
    n, length = idx.shape
    out = idx.new_zeros(n, length + max_new_tokens)
    out[:, :length] = idx
    cache = model.new_cache()
    logits = model(idx, cache)
    for t in range(max_new_tokens):
        out[:, length + t] = logits[:, -1].argmax(-1)
        logits = model(out[:, length + t:length + t + 1], cache)
    return out


# ---------------------------------------------------------------- 1.3 scaled_dot_product_attention

@bug("1.3", "device", "device")
def sdpa_where_with_cpu_fill(q, k, v, mask=None):
    """(The tester's.) torch.where against a fill tensor built with torch.full on the CPU (no device=)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = torch.where(mask, scores, torch.full(scores.shape, float("-inf"), dtype=scores.dtype))
    return scores.softmax(-1) @ v


@bug("1.3", "device", "device")
def sdpa_scale_as_a_cpu_tensor(q, k, v, mask=None):
    """The scale 1/sqrt(d) as a tensor of the shape of the scores, made on the CPU."""
    scores = q @ k.transpose(-2, -1)
    scores = scores * torch.full(scores.shape, q.shape[-1] ** -0.5, dtype=q.dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


@correct("1.3")
def sdpa_where_with_full_like(q, k, v, mask=None):
    """Right: the fill made with torch.full_like, on the scores' device."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = torch.where(mask, scores, torch.full_like(scores, float("-inf")))
    return scores.softmax(-1) @ v


@correct("1.3")
def sdpa_where_with_a_python_number(q, k, v, mask=None):
    """Right: torch.where with -inf as a Python number (no tensor made at all)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))
    return scores.softmax(-1) @ v


@bug("6.2", "device", "device")
@torch.no_grad()
def cached_new_tokens_buffer_on_the_cpu(model, idx, max_new_tokens):
    """The new tokens collected in a buffer made after the prompt's call, torch.full(...) with no device=, then put
    after the prompt with torch.cat."""
    cache = model.new_cache()
    logits = model(idx, cache)
    new_tokens = torch.full((idx.shape[0], max_new_tokens), -1, dtype=torch.long)
    for t in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        new_tokens[:, t:t + 1] = nxt
        logits = model(nxt, cache)
    return torch.cat([idx, new_tokens], dim=1)
