r"""A counted n-gram model whose log-probabilities the network's logits are added to.

Counting is the oldest language model: how often did each token follow these :math:`n-1` tokens in
the training text? On a megabyte of text it is also fast and good. A Kneser-Ney 7-gram model of
tinyshakespeare's characters, counted in a few seconds, predicts the validation text better than a
small GPT trained for minutes on a CPU. So the network need not learn what counting already knows:
its logits are added to the counted model's log-probabilities,

.. math:: \text{logits}_i = \log p_{\text{KN}}(\,\cdot \mid t_{i-n+2} \dots t_i) + \text{network}(t_{\le i}),

and it learns only the correction, the long-range structure that short contexts cannot see.

**Interpolated Kneser-Ney** (Chen & Goodman, 1998, in their "modified" form). For a context :math:`h` of
:math:`k-1` tokens,

.. math:: p_k(v \mid h) = \frac{c(h v) - D(c(h v))}{c(h)} + \frac{\sum_u D(c(h u))}{c(h)}\, p_{k-1}(v \mid h'),

where :math:`h'` drops the oldest token of :math:`h`, :math:`c(h) = \sum_v c(h v)`, and :math:`p_0` is
uniform. Each count gives up a little probability, its discount :math:`D`, and what the context's counts
gave up goes to the shorter context's distribution. The longest order counts how often :math:`h v`
occurred; every shorter order counts in how many different contexts it occurred (the "continuation"
count :math:`N_{1+}(\bullet\, h v)`), since a shorter order is only asked when the longer context was
rare. A context never seen passes the shorter order's distribution on unchanged. Each order has three
discounts, for a count of 1, of 2, and of 3 or more, estimated from how many of its counts are 1, 2, 3
and 4.

**Leave one out.** Scored on the text it was counted from, a counted model is overconfident: every
7-gram there occurred at least once, the one being predicted. A network trained on top would learn to
trust it more than it deserves on new text. So in training (``targets`` given) each position's own
occurrence is taken out of the counts first, as if that character had never been counted: one
occurrence fewer of each n-gram that ends with it, and so one context fewer in a continuation count
whose longer n-gram occurred only there. A target the counts never saw (other text) is left as it is.
In a window's first tokens, where that longer n-gram would reach back before the window, its
continuation count is left as counted.
"""
from __future__ import annotations

import torch
from torch import nn

from . import _validate as validate
from .data import IGNORE_INDEX

__all__ = ["NgramPrior"]

# The tables of each order, as buffers: contexts (sorted keys), where each context's entries start,
# the entries' tokens and counts; for orders 2 and up, the raw counts of every n-gram of that length
# (leave-one-out needs them); and, for an order with few contexts, its counts as dense rows.
_TABLES = ("context_keys", "context_starts", "entry_tokens", "entry_counts", "raw_keys", "raw_counts", "dense_counts")
# An order with few contexts also keeps its counts as one dense row per context (at most this many
# numbers): reading rows is faster than assembling them from the entries.
_DENSE_LIMIT = 2 ** 20


def _all_keys(ids: torch.Tensor, longest: int, vocab_size: int) -> list[torch.Tensor]:
    """ids (..., T) -> the keys of the 0, 1, ..., ``longest`` tokens ending at each position, each (..., T).

    A key is the tokens' number in base ``vocab_size``, the newest token its last digit, so ``key //
    vocab_size`` is the key of the tokens before the newest. -1 where fewer tokens came before.
    """
    T = ids.shape[-1]
    position = torch.arange(T, device=ids.device)
    keys = [torch.zeros_like(ids)]
    for back in range(longest):
        earlier = torch.nn.functional.pad(ids[..., :max(T - back, 0)], (min(back, T), 0))   # ids[j - back]
        keys.append(keys[-1] + earlier * vocab_size ** back)
    return [keys[0]] + [torch.where(position >= length - 1, key, -1) for length, key in enumerate(keys[1:], start=1)]


def _lookup(sorted_keys: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, found) of each query in ``sorted_keys``."""
    if sorted_keys.numel() == 0:
        return torch.zeros_like(queries), torch.zeros_like(queries, dtype=torch.bool)
    queries = queries.contiguous()
    index = torch.searchsorted(sorted_keys, queries).clamp(max=sorted_keys.numel() - 1)
    return index, (sorted_keys[index] == queries) & (queries >= 0)


class NgramPrior(nn.Module):
    """Interpolated Kneser-Ney over contexts of up to ``order - 1`` tokens; ``count(ids)`` fills it."""

    def __init__(self, vocab_size: int, order: int):
        super().__init__()
        self.vocab_size = validate.positive_int("vocab_size", vocab_size)
        if isinstance(order, bool) or not isinstance(order, int) or order < 1:
            raise ValueError(f"order: expected an int >= 1 (1 counts single tokens), got {validate.describe(order)}")
        if vocab_size ** order >= 2 ** 62:
            raise ValueError(f"order: {order} tokens of a vocabulary of {vocab_size} do not fit a 64-bit key; "
                             f"expected an order of at most {_max_order(vocab_size)} for this vocabulary")
        self.order = order
        self.register_buffer("discounts", torch.zeros(order, 3))   # per order: for a count of 1, of 2, of 3 or more
        self.register_buffer("counted_tokens", torch.zeros((), dtype=torch.long))   # 0: not counted yet
        for k in range(1, order + 1):
            for name in _TABLES:
                self.register_buffer(f"{name}_{k}", torch.zeros(0, dtype=torch.long if "keys" in name or
                                                                  "starts" in name or "tokens" in name else torch.float32))

    @property
    def counted(self) -> bool:
        return bool(self.counted_tokens > 0)

    def _table(self, name: str, k: int) -> torch.Tensor:
        return getattr(self, f"{name}_{k}")

    @torch.no_grad()
    def count(self, ids: torch.Tensor) -> None:
        """Count the n-grams of one long run of token ids (T,), replacing any earlier counts."""
        validate.token_ids("ids", ids, dim=1)
        validate.in_vocabulary("ids", ids, self.vocab_size)
        if ids.numel() < 2:
            raise ValueError(f"ids: expected at least 2 tokens to count, got {ids.numel()}")
        ids = ids.to(self.discounts.device).long()
        V = self.vocab_size
        every = _all_keys(ids, self.order, V)
        for k in range(1, self.order + 1):
            grams = every[k][every[k] >= 0]                            # every k-gram of the text
            raw_keys, raw_counts = torch.unique(grams, return_counts=True)
            if k < self.order:
                # the continuation count of a k-gram: how many distinct tokens came before it
                longer = torch.unique(every[k + 1][every[k + 1] >= 0])
                keys, counts = torch.unique(longer % V ** k, return_counts=True)
            else:
                keys, counts = raw_keys, raw_counts
            contexts = keys // V                                       # the k-1 tokens before the last
            context_keys, per_context = torch.unique_consecutive(contexts, return_counts=True)
            starts = torch.zeros(len(context_keys) + 1, dtype=torch.long, device=ids.device)
            starts[1:] = torch.cumsum(per_context, 0)
            self.discounts[k - 1] = _discounts(counts)
            tables = dict(context_keys=context_keys, context_starts=starts, entry_tokens=keys % V,
                          entry_counts=counts.float(), raw_keys=raw_keys if k > 1 else raw_keys[:0],
                          raw_counts=raw_counts.float() if k > 1 else raw_counts[:0].float(),
                          dense_counts=torch.zeros(0, V, device=ids.device))
            if len(context_keys) * V <= _DENSE_LIMIT:
                rows = torch.repeat_interleave(torch.arange(len(context_keys), device=ids.device), per_context)
                tables["dense_counts"] = torch.zeros(len(context_keys), V, device=ids.device)
                tables["dense_counts"][rows, keys % V] = counts.float()
            for name, value in tables.items():
                setattr(self, f"{name}_{k}", value)
        self.counted_tokens.fill_(ids.numel())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                before: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (N, L) -> log-probabilities of the next token (N, L, vocab_size).

        ``targets`` (N, L), in training: leave each position's own occurrence out of the counts.
        ``before`` (N, k): the tokens just before ``idx`` (a KV cache's recent ones), used as context.
        """
        # An id outside the vocabulary would index another context's counts (or none): name it instead.
        validate.token_ids("idx", idx, dim=2, vocab_size=self.vocab_size)
        if targets is not None:
            validate.token_ids("targets", targets, dim=2, padding=IGNORE_INDEX, vocab_size=self.vocab_size)
            if targets.shape != idx.shape:
                raise ValueError(f"targets: expected the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if before is not None:
            validate.token_ids("before", before, dim=2, vocab_size=self.vocab_size)
            if before.shape[0] != idx.shape[0]:
                raise ValueError(f"before: expected the last tokens of the same {idx.shape[0]} sequences (N, k), "
                                 f"got shape {tuple(before.shape)}")
        N, L = idx.shape
        V = self.vocab_size
        tokens = idx.long() if before is None else torch.cat([before, idx], dim=1).long()   # (N, k + L)
        skip = tokens.shape[1] - L
        probs = torch.full((N * L, V), 1.0 / V, device=idx.device)                         # p_0: uniform
        flat_targets = targets.reshape(-1).long() if targets is not None else None
        if not self.counted:
            return probs.log().view(N, L, V)
        keys = [key[:, skip:].reshape(-1) for key in _all_keys(tokens, self.order - 1, V)]   # each (N*L,)
        for k in range(1, self.order + 1):
            context = keys[k - 1]
            index, found = _lookup(self._table("context_keys", k), context)
            if not bool(found.any()):
                continue
            where = found.nonzero().squeeze(1)
            counts = self._dense_counts(k, index[where])                                     # (F, V)
            if flat_targets is not None:
                self._leave_out(k, keys, where, counts, flat_targets)
            d1, d2, d3 = self.discounts[k - 1]
            discount = torch.where(counts >= 3, d3, torch.where(counts >= 2, d2, d1)) * (counts > 0)   # (F, V)
            total = counts.sum(-1, keepdim=True)                                             # (F, 1)
            safe = total.clamp(min=1)
            mixed = (counts - discount) / safe + discount.sum(-1, keepdim=True) / safe * probs[where]
            # a context left with no counts (its one occurrence left out) passes the shorter order on
            probs[where] = torch.where(total > 0, mixed, probs[where])
        return probs.clamp(min=1e-12).log().view(N, L, V)

    def _dense_counts(self, k: int, index: torch.Tensor) -> torch.Tensor:
        """The counts after each of the contexts ``index`` (F,), as dense rows (F, V) of their own."""
        dense = self._table("dense_counts", k)
        if dense.numel():
            return dense[index]                                                             # a copy
        starts = self._table("context_starts", k)
        first, lengths = starts[index], starts[index + 1] - starts[index]
        row = torch.repeat_interleave(torch.arange(len(index), device=index.device), lengths)
        offset = torch.arange(int(lengths.sum()), device=index.device) - \
            torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        entry = torch.repeat_interleave(first, lengths) + offset
        counts = torch.zeros(len(index), self.vocab_size, device=index.device)
        counts[row, self._table("entry_tokens", k)[entry]] = self._table("entry_counts", k)[entry]
        return counts

    def _leave_out(self, k: int, keys: list[torch.Tensor], where: torch.Tensor, counts: torch.Tensor,
                   flat_targets: torch.Tensor) -> None:
        """Take each position's own occurrence out of order k's counts (F, V), in place."""
        target = flat_targets[where]
        real = target != IGNORE_INDEX
        target = target.clamp(min=0)
        row = torch.arange(len(where), device=where.device)
        here = counts[row, target]
        if k == self.order:
            remove = real & (here >= 1)
        else:
            # a continuation count drops only if this was the one occurrence of the longer n-gram
            longer = keys[k][where]                                                         # the k tokens before the target
            key = torch.where(longer >= 0, longer * self.vocab_size + target, -1)
            index, found = _lookup(self._table("raw_keys", k + 1), key)
            raw = torch.where(found, self._table("raw_counts", k + 1)[index], torch.zeros_like(here))
            remove = real & found & (raw == 1) & (here >= 1)
        counts[row, target] = here - remove.float()

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, order={self.order}, counted_tokens={int(self.counted_tokens)}"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The tables' sizes depend on the text counted: take the saved ones' shapes before loading.
        for k in range(1, self.order + 1):
            for name in _TABLES:
                saved = state_dict.get(f"{prefix}{name}_{k}")
                if isinstance(saved, torch.Tensor):
                    setattr(self, f"{name}_{k}", torch.empty_like(saved, device=self.discounts.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _discounts(counts: torch.Tensor) -> torch.Tensor:
    """Chen & Goodman's estimates of the discounts for a count of 1, 2, and 3 or more, from the counts of counts."""
    n1, n2, n3, n4 = (float((counts == r).sum()) for r in (1, 2, 3, 4))
    if min(n1, n2, n3, n4) == 0:    # too few counts to estimate them: one discount for all
        return torch.full((3,), 0.75)
    y = n1 / (n1 + 2 * n2)
    return torch.tensor([1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3]).clamp(min=0)


def _max_order(vocab_size: int) -> int:
    order = 1
    while vocab_size ** (order + 1) < 2 ** 62:
        order += 1
    return order
