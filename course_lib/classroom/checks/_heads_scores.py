"""The known slips of the two head scores of notebook 11 (11.1 previous_token_score, 11.2 induction_score): one
mistake model for the topic, searched by both exercises.

Both scores read one diagonal of the attention weights (N, heads, L, L): query i looks ``back`` positions
behind itself, for the queries ``first`` .. L-1, averaged over the batch and those queries. Each slip is a
:class:`Mistake` whose spec changes those choices: the key (``shift``), the first query (``first_shift``),
whether a negative key wraps to the end of the row as Python's indexing does (``wrap``), what the sum is
divided by (``divide``), the axis kept (``keep``), one sequence of the batch scored alone (``sequence``).
:func:`variant` computes what it would output. The slips written by hand come first; then every combination
of one or two places off in the key and the first query, wrapped or not, with each divisor (:func:`_grid`),
each with a message composed from what it changes, so that a score one place off in any style gets its own
diagnosis.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ..exercises import Mistake


def score(weights: torch.Tensor, back: int, first: int, *, divide: str = "count", keep: str = "heads",
          wrap: bool = False, right: int | None = None, most: int | None = None) -> torch.Tensor:
    """The mean of weights[n, h, i, i - back] over n and i = first .. L-1 (where i - back is a position).

    ``wrap``: a negative key i - back is read as Python reads it, from the end of the row (key L + i - back),
    instead of the query being skipped. ``divide``: "count" (a mean of the entries read), "nominal" (the sum
    divided by the number of queries first .. L-1, skipped ones too), "right" (divided by ``right``, the number
    of entries the right score averages), "length" (by L), "none" (a sum), "queries" (a mean over the queries
    only: the batch summed). ``keep``: the axis left, "heads"
    (right) or "batch" (the batch and head axes taken the other way). ``most``: only the first ``most`` queries
    (a diagonal cut with [..., :most]).
    """
    length = weights.shape[-1]
    begin = max(first, 0) if wrap else max(first, back, 0)
    last = min(length, length + back)                     # a negative `back` looks ahead: stop before L
    last = last if most is None else min(last, begin + most)
    if begin >= last:
        entries = weights[..., :0, 0]                     # (N, heads, 0): nothing to average
    else:
        rows = torch.arange(begin, last)
        entries = weights[..., rows, (rows - back) % length]   # (N, heads, queries); % only wraps a negative key
    total = entries.sum(dim=-1)                           # (N, heads)
    total = total.sum(dim=0 if keep == "heads" else 1)    # (heads,) or (N,)
    per = {"count": entries.shape[-1], "nominal": length - max(first, 0), "length": length,
           "right": length if right is None else right, "none": 1, "queries": entries.shape[-1]}[divide]
    count = per * (weights.shape[0 if keep == "heads" else 1] if divide not in ("none", "queries") else 1)
    return total / max(count, 1)


def _right(weights: torch.Tensor, half: int | None) -> tuple[int, int]:
    """(back, first) of the right score: the previous-token score without ``half``, the induction score with it."""
    return (1, 1) if half is None else (half - 1, half)


def variant(weights: torch.Tensor, half: int | None = None, *, spec: dict[str, Any]) -> torch.Tensor:
    """What the score with the slip ``spec`` outputs: the previous-token score without ``half`` (offset 1 from
    query 1), the induction score with it (offset half - 1 from query half). ``shift`` moves the offset,
    ``first_shift`` the first query; ``half_of_length``: ``half`` taken as L // 2 instead of the argument; ``past``: every earlier key's weight
    added up per query (all the attention to the past)."""
    if "sequence" in spec:   # one sequence of the batch scored alone (weights[0], weights[-1])
        weights = weights.narrow(0, spec["sequence"] % weights.shape[0], 1)
    if half is not None and spec.get("half_of_length"):
        half = weights.shape[-1] // 2
    back, first = _right(weights, half)
    back = -back if spec.get("ahead") else back   # the diagonal as far above the main one as it should be below
    # ``drop_half``: the diagonal's first `half` entries dropped, not one, or `drop_more` more (a mean of nothing is
    # NaN, as torch's);
    # ``most``: only the first entries kept, `half` of them, or `half - 1` (the keys cut to the first half)
    if spec.get("past"):   # every earlier key's weight added up, not key i - back's alone
        return weights.tril(-1).sum(dim=-1)[..., max(first + spec.get("first_shift", 0), 0):].mean(dim=(0, -1))
    first += spec.get("first_shift", 0) + (half - 1 + spec.get("drop_more", 0) if spec.get("drop_half") else 0)
    if spec.get("drop_half") and first >= weights.shape[-1]:
        return torch.full(weights.shape[1:2], float("nan"), dtype=weights.dtype)
    most = {"first_half_entries": half, "keys_first_half": None if half is None else half - 1}
    return score(weights, back + spec.get("shift", 0), first,
                 divide=spec.get("divide", "count"), keep=spec.get("keep", "heads"), wrap=spec.get("wrap", False),
                 right=weights.shape[-1] - _right(weights, half)[1],
                 most=next((most[key] for key in most if spec.get(key)), None))


_SUMMED_OVER_THE_BATCH = ("you average over the queries but add over the batch, so the score grows with the batch "
                          "size N: average over both, .mean(dim=(0, 2)) of the diagonal's entries.")
_EITHER = (
    Mistake("score_axes", "you averaged over the head axis and kept the batch axis: weights are laid out "
                          "(N, heads, L, L), so the batch is axis 0 and the heads axis 1; average over the "
                          "batch and the queries, keep one number per head.", {"keep": "batch"}),
    # a batch of one assumed: the first (or last) sequence's score returned as the head's
    *(Mistake("score_axes", f"you score only {which} sequence of the batch ({indexed}): weights are (N, heads, L, "
                            f"L), and the score averages over all N sequences of the batch (axis 0) as well as the "
                            f"queries. Keep the batch axis until the mean: .mean(dim=(0, 2)) of the diagonal's "
                            f"entries, with no {indexed}.", {"sequence": sequence})
      for sequence, which, indexed in ((0, "the first", "weights[0]"), (-1, "the last", "weights[-1]"))),
    Mistake("scale", "you add the entries instead of averaging them: divide by how many there are "
                     "(.mean over the batch and the queries).", {"divide": "none"}),
    Mistake("scale", _SUMMED_OVER_THE_BATCH, {"divide": "queries"}),
)

PREVIOUS_MISTAKES = (
    Mistake("score_offset", "you read the main diagonal, each token's attention to ITSELF (offset 0). "
                            "The previous token of query i is key i - 1: the diagonal just below, "
                            "weights.diagonal(offset=-1, dim1=-2, dim2=-1).", {"shift": -1, "first_shift": -1}),
    Mistake("score_offset", "you read the diagonal ABOVE the main one (key i + 1, the next token), which a "
                            "causal mask keeps at zero. The previous token is key i - 1: "
                            "diagonal(offset=-1, dim1=-2, dim2=-1): a negative offset is below, with dim1 the "
                            "queries' axis (dims swapped, it is above).", {"shift": -2, "first_shift": -1}),
    Mistake("score_offset", "you read key i - 2, two tokens back; the previous token is key i - 1.", {"shift": 1}),
    Mistake("score_positions", "you include position 0, which has no previous token: your mean divides "
                               "the L - 1 entries (i, i - 1) by L, as if position 0 gave a zero. Average "
                               "the L - 1 entries only.", {"divide": "length"}),
    # all the attention to the past (every key j < i) added up, not the one key i - 1; with or without query 0
    *(Mistake("score_offset", "you add up the weights of every earlier key (as weights.tril(-1).sum(-1) does): "
                              "that is all of query i's attention to the past, not to its previous token. Read "
                              "only key i - 1, the diagonal just below the main one, weights.diagonal(offset=-1, "
                              "dim1=-2, dim2=-1), and average those entries.", {"past": True, "first_shift": shift})
      for shift in (0, -1)),
    *_EITHER,
)

INDUCTION_MISTAKES = (
    Mistake("score_offset", "you read the earlier copy at a distance that depends on L (as with half = L // 2, "
                            "half the sequence's length), not on the argument `half`: a sequence need not hold "
                            "exactly two copies (here L < 2 * half), so the earlier copy sits `half` tokens back "
                            "whatever L is. Use `half` itself.",
            {"half_of_length": True}),
    Mistake("score_offset", "you read the earlier copy of the current token itself (i - half). An "
                            "induction head looks at the token AFTER that copy, i - half + 1: the one "
                            "that came next last time, which is what it predicts now.", {"shift": 1}),
    Mistake("score_offset", "you read the key one place after the right one, i - half + 2; an induction "
                            "head attends to i - half + 1, the token after the earlier copy.", {"shift": -1}),
    Mistake("score_positions", "you include query half - 1, the last query of the FIRST half (the diagonal "
                               "at offset -(half - 1) starts there). Only queries i = half .. L-1 have an "
                               "earlier copy to look at: drop the first entry of that diagonal.", {"first_shift": -1}),
    Mistake("score_offset", "you read the diagonal ABOVE the main one (offset +(half - 1), key i + half - 1): "
                            "keys after the query, which a causal mask keeps at zero. The earlier copy is behind "
                            "the query: diagonal(offset=-(half - 1), dim1=-2, dim2=-1): a negative offset is "
                            "below, with dim1 the queries' axis (dims swapped, it is above).",
            {"ahead": True}),
    Mistake("score_positions", "you keep the first `half` entries of the diagonal ([..., :half]): that includes "
                               "query half - 1, the last of the FIRST half, and drops the last query. Drop the "
                               "first entry instead, [..., 1:]: the queries i = half .. L-1.",
            {"first_shift": -1, "first_half_entries": True}),
    # the diagonal's first entries dropped by a count that follows `half` (half of them, or one fewer or more)
    *(Mistake("score_positions", f"you drop the first `{count}` entries of the diagonal ([..., {count}:]); the "
                                 f"diagonal at offset -(half - 1) starts at query half - 1, so only its FIRST entry "
                                 f"has no earlier copy to look at. Drop one entry, [..., 1:]: the queries i = half .. "
                                 f"L-1.", {"drop_half": True, "drop_more": more})
      for more, count in ((0, "half"), (-1, "half - 1"), (1, "half + 1"))),
    Mistake("score_positions", "you cut the keys to the first half before taking the diagonal (weights[..., half:, "
                               ":half]): the last query's key, i - half + 1 = half for i = 2 * half - 1, lies in the "
                               "second half, so that query is dropped. Read the diagonal of the whole (L, L) "
                               "weights: diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:].",
            {"keys_first_half": True}),
    Mistake("score_positions", "you average over every query, counting the ones of the first half as zeros "
                               "(a sum over the second half divided by L). Average over the second-half "
                               "queries i = half .. L-1 only.", {"divide": "length"}),
    *_EITHER,
)


# ---------------------------------------------------------------- the grid: every slip one or two places off

# The words of each score: its name, how a key and a first query are written, and what a query needs.
_WORDS = {
    "previous": dict(score="previous-token score", key=lambda s: _offset("i", -(1 + s)), right_key="i - 1",
                     start=lambda f: str(1 + f), right_start="1", target="a previous token",
                     count="L - 1", diagonal="weights.diagonal(offset=-1, dim1=-2, dim2=-1)"),
    "induction": dict(score="induction score", key=lambda s: _offset("i - half", 1 - s), right_key="i - half + 1",
                      start=lambda f: _offset("half", f), right_start="half", target="an earlier copy to look at",
                      count="L - half", diagonal="weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:]"),
}

_DIVIDED = {"count": "", "nominal": ", counting the queries whose key does not exist as zeros",
            "length": ", divided by L", "none": ""}


def _offset(base: str, by: int) -> str:
    return base if by == 0 else f"{base} + {by}" if by > 0 else f"{base} - {-by}"


def _places(n: int) -> str:
    return "one place" if n == 1 else f"{n} places"


def _message(which: str, shift: int, first_shift: int, wrap: bool, divide: str) -> str:
    """What the slip computes, what the score is, and why they differ, in a student's words."""
    w = _WORDS[which]
    key, start = w["key"](shift), w["start"](first_shift)
    divided = f", divided by {w['count']}" if divide == "right" else _DIVIDED[divide]
    verb = "add up (not average)" if divide == "none" else "average"
    said = [f"you {verb} the entries (i, {key}) over the queries i = {start} .. L-1{divided}; the "
            f"{w['score']} averages (i, {w['right_key']}) over i = {w['right_start']} .. L-1, {w['count']} entries "
            f"per sequence."]
    if shift > 0:
        said.append(f"Your key is {_places(shift)} too far back: read key {w['right_key']}.")
    elif shift < 0:
        said.append(f"Your key is {_places(-shift)} too far ahead: read key {w['right_key']}.")
    if first_shift > 0:
        dropped = (f"query {w['right_start']}, which has" if first_shift == 1 else
                   f"queries {w['right_start']} and {w['start'](1)}, which have")
        said.append(f"You drop {dropped} {w['target']}: start at i = {w['right_start']}.")
    elif first_shift < 0:
        said.append(f"Queries before i = {w['right_start']} have no {w['target'].split(' ', 1)[1]}: start at "
                    f"i = {w['right_start']}.")
    if wrap:
        said.append("Where your key is negative, Python's indexing reads from the END of the row (key -1 is key "
                    "L - 1), a future key that the causal mask keeps at 0, and that zero still counts in your mean.")
    if divide == "length":
        said.append(f"Divide by the number of entries ({w['count']}), not by L.")
    elif divide == "nominal":
        said.append("Queries whose key does not exist are no entries: leave them out of the count.")
    elif divide == "none":
        said.append("A score is a mean: divide by the number of entries (.mean over the batch and the queries).")
    said.append(f"(The {w['score']} in one line: {w['diagonal']}.mean(dim=(0, 2)).)")
    return " ".join(said)


def _probes(which: str) -> list[tuple[torch.Tensor, int | None]]:
    """Causal attention weights, as the checks make them, on which two slips that always agree do agree."""
    generator = torch.Generator().manual_seed(0)
    made = []
    for length in (6, 8, 10):
        scores = torch.randn(2, 3, length, length, generator=generator, dtype=torch.float64)
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)          # (N, heads, L, L)
        made.append((weights, None if which == "previous" else length // 2))
    return made


def _grid(which: str, written: tuple[Mistake, ...]) -> tuple[Mistake, ...]:
    """Every slip of one or two places in the key and the first query, wrapped or not, with each divisor: the
    ones whose outputs differ from the right score's and from every slip before them (``written`` first)."""
    probes = _probes(which)

    def outputs(spec: dict[str, Any]) -> tuple[float, ...]:
        return tuple(round(v, 9) for weights, half in probes for v in variant(weights, half, spec=spec).tolist())
    seen = {outputs({})} | {outputs(m.spec) for m in written}
    found = []
    # the fewest changes first: a slip of one place is tried before a combination of two
    specs = sorted(itertools.product((0, 1, -1, 2, -2), (0, 1, -1, 2, -2), (False, True),
                                     ("count", "nominal", "right", "length", "none")),
                   key=lambda c: (abs(c[0]) + abs(c[1]) + c[2] + (c[3] != "count"), abs(c[0]), abs(c[1])))
    for shift, first_shift, wrap, divide in specs:
        if which == "previous" and 1 + first_shift < 0:
            continue
        spec = {"shift": shift, "first_shift": first_shift, "wrap": wrap, "divide": divide}
        key = outputs(spec)
        if key in seen:
            continue
        seen.add(key)
        found.append(Mistake("score_offset" if shift else "score_positions",
                             _message(which, shift, first_shift, wrap, divide), spec))
    return tuple(found)


class _Slips(Sequence[Mistake]):
    """The slips written by hand, then the grid, made on first use: only a wrong answer pays for the grid."""

    def __init__(self, which: str, written: tuple[Mistake, ...]):
        self.which, self.written = which, written

    @functools.cached_property
    def _all(self) -> tuple[Mistake, ...]:
        return self.written + _grid(self.which, self.written)

    def __getitem__(self, index: Any) -> Any:
        return self._all[index]

    def __len__(self) -> int:
        return len(self._all)


PREVIOUS_MISTAKES: Sequence[Mistake] = _Slips("previous", PREVIOUS_MISTAKES)
INDUCTION_MISTAKES: Sequence[Mistake] = _Slips("induction", INDUCTION_MISTAKES)
