"""The known slips of the two head scores of notebook 11 (11.1 previous_token_score, 11.2 induction_score).

Both scores read one diagonal of the attention weights (N, heads, L, L): query i looks ``back`` positions
behind itself, for the queries ``first`` .. L-1, averaged over the batch and those queries. Each slip is a
:class:`Mistake` whose spec changes one of those choices; :func:`variant` computes what it would output.
"""
from __future__ import annotations

from typing import Any

import torch

from ..exercises import Mistake


def score(weights: torch.Tensor, back: int, first: int, *, divide: str = "count",
          keep: str = "heads") -> torch.Tensor:
    """The mean of weights[n, h, i, i - back] over n and i = first .. L-1 (where i - back is a position).

    ``divide``: "count" (a mean), "length" (the sum over the queries divided by L), "none" (a sum).
    ``keep``: the axis left, "heads" (right) or "batch" (the batch and head axes taken the other way).
    """
    length = weights.shape[-1]
    first = max(first, back, 0)
    last = min(length, length + back)                     # a negative `back` looks ahead: stop before L
    if first >= last:
        entries = weights[..., :0, 0]                     # (N, heads, 0): nothing to average
    else:
        rows = torch.arange(first, last)
        entries = weights[..., rows, rows - back]         # (N, heads, queries)
    total = entries.sum(dim=-1)                           # (N, heads)
    total = total.sum(dim=0 if keep == "heads" else 1)    # (heads,) or (N,)
    count = {"count": entries.shape[-1] * weights.shape[0 if keep == "heads" else 1],
             "length": length * weights.shape[0 if keep == "heads" else 1], "none": 1}[divide]
    return total / max(count, 1)


def variant(weights: torch.Tensor, half: int | None = None, *, spec: dict[str, Any]) -> torch.Tensor:
    """What the score with the slip ``spec`` outputs: the previous-token score without ``half`` (offset 1 from
    query 1), the induction score with it (offset half - 1 from query half). ``shift`` moves the offset,
    ``first_shift`` the first query."""
    back, first = (1, 1) if half is None else (half - 1, half)
    return score(weights, back + spec.get("shift", 0), first + spec.get("first_shift", 0),
                 divide=spec.get("divide", "count"), keep=spec.get("keep", "heads"))


_EITHER = (
    Mistake("score_axes", "you averaged over the head axis and kept the batch axis: weights are laid out "
                          "(N, heads, L, L), so the batch is axis 0 and the heads axis 1; average over the "
                          "batch and the queries, keep one number per head.", {"keep": "batch"}),
    Mistake("scale", "you add the entries instead of averaging them: divide by how many there are "
                     "(.mean over the batch and the queries).", {"divide": "none"}),
)

PREVIOUS_MISTAKES = (
    Mistake("score_offset", "you read the main diagonal, each token's attention to ITSELF (offset 0). "
                            "The previous token of query i is key i - 1: the diagonal just below, "
                            "weights.diagonal(offset=-1, dim1=-2, dim2=-1).", {"shift": -1, "first_shift": -1}),
    Mistake("score_offset", "you read the diagonal ABOVE the main one (key i + 1, the next token), which a "
                            "causal mask keeps at zero. The previous token is key i - 1: "
                            "diagonal(offset=-1, ...) (a negative offset is below).", {"shift": -2, "first_shift": -1}),
    Mistake("score_offset", "you read key i - 2, two tokens back; the previous token is key i - 1.", {"shift": 1}),
    Mistake("score_positions", "you include position 0, which has no previous token: your mean divides "
                               "the L - 1 entries (i, i - 1) by L, as if position 0 gave a zero. Average "
                               "the L - 1 entries only.", {"divide": "length"}),
    *_EITHER,
)

INDUCTION_MISTAKES = (
    Mistake("score_offset", "you read the earlier copy of the current token itself (i - half). An "
                            "induction head looks at the token AFTER that copy, i - half + 1: the one "
                            "that came next last time, which is what it predicts now.", {"shift": 1}),
    Mistake("score_offset", "you read the key one place after the right one, i - half + 2; an induction "
                            "head attends to i - half + 1, the token after the earlier copy.", {"shift": -1}),
    Mistake("score_positions", "you include query half - 1, the last query of the FIRST half (the diagonal "
                               "at offset -(half - 1) starts there). Only queries i = half .. L-1 have an "
                               "earlier copy to look at: drop the first entry of that diagonal.", {"first_shift": -1}),
    Mistake("score_positions", "you average over every query, counting the ones of the first half as zeros "
                               "(a sum over the second half divided by L). Average over the second-half "
                               "queries i = half .. L-1 only.", {"divide": "length"}),
    *_EITHER,
)
