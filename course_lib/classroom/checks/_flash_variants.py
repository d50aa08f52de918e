"""What the known slips of notebook 10 would output: the online softmax (10.1), the tiled forward (10.2)
and the recomputing backward (10.3), each written with switches that turn one mistake on. The forward and
backward run in float64, so a mistake is told from float noise by a wide margin.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..exercises import Mistake
from ._student_code import close

# ============================================================================ every exercise of the topic


def unwritten_rows(out: torch.Tensor, expected: torch.Tensor, block_q: int) -> str | None:
    """When only some query rows (axis -2) are wrong and every other row is right, what that says about the query
    loop's bounds (None otherwise). Such rows are usually never written: their numbers are whatever torch.empty
    found in memory, so the message names rows, not a difference."""
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape != expected.shape:
        return None
    length = out.shape[-2]
    right = [close(out[..., i, :], expected[..., i, :]) for i in range(length)]
    wrong = [i for i, ok in enumerate(right) if not ok]
    if not wrong or len(wrong) == length:
        return None
    if wrong == list(range(wrong[0], length)):
        shown = f"query rows {wrong[0]} to {length - 1} are" if len(wrong) > 1 else f"query row {wrong[0]} is"
        return (f"{shown} wrong (the end of the sequence) while every other row is right: never written. Your "
                f"query loop stops early: loop over range(0, Lq, block_q); the last block may be shorter "
                f"(qe = min(qs + block_q, Lq)).")
    if all((i + 1) % block_q == 0 for i in wrong):
        return (f"the last query of each block ({', '.join(map(str, wrong[:6]))}{'...' if len(wrong) > 6 else ''}) "
                f"is wrong while every other row is right: it is never written. A query block is q[..., qs:qe, :] "
                f"with qe = min(qs + block_q, Lq); the slice already excludes qe (no - 1).")
    return None


def block_corner(advice: str) -> str:
    """The words of one mistake that 10.2 and 10.3 (and the future-leak probe) share: a causal mask built from
    positions counted from the block's corner, then ``advice``."""
    return (f"your causal mask counts positions from the block's corner (arange(Bk) > arange(Bq), or triu(1) of "
            f"the block), not from the start of the sequence: it is right only for a block that sits on the "
            f"diagonal. {advice}")


# ============================================================================ 10.1 online softmax


def _blocks(length: int, size: int, bounds: str) -> list[slice]:
    """The blocks a loop reads: right, or with one of the usual off-by-one slips (``bounds``):
    "short" x[s : s + B - 1], "shifted" x[s + 1 : s + B + 1] (each block starts one entry late),
    "stop_early" range(0, L - B, B) (the last block or two never read), "whole_blocks" range(L // B) blocks
    (a last, shorter block never read), "overlap" x[s : s + B + 1] (one entry read twice), "last_entry"
    x[s : min(s + B, L - 1)] (the row's last entry never read)."""
    if bounds == "last_entry":
        return [slice(s, min(s + size, length - 1)) for s in range(0, length - 1, size)]
    stop = {"stop_early": length - size, "whole_blocks": length - length % size}.get(bounds, length)
    start, end = {"shifted": (1, 1), "short": (0, -1), "overlap": (0, 1)}.get(bounds, (0, 0))
    return [slice(s + start, s + size + end) for s in range(0, stop, size)]


def softmax_variant(x: torch.Tensor, size: int, *, rescale: str = "ok", maximum: str = "running",
                    normalize: str = "end", bounds: str = "ok") -> torch.Tensor:
    """Online softmax of x (..., L) over blocks of ``size``, with the named slips switched on. It runs in x's
    own dtype: whether exp overflows depends on it (float32 overflows past exp(88), underflows below -104).
    ``maximum``: "running" (right), "none" (nothing subtracted), "last" (this block's only), "zero" (a running
    maximum that starts at 0, not -inf), "shared" (one running maximum for all rows). ``rescale``: "ok",
    "none" (never rescaled), "inverted" (exp(m_new - m_old); "inverted_guarded": 0 while m is -inf), "block" (by this block's own maximum), "old_over_block"
    (exp(m_old - block_max), against this block's maximum, not the new running one), "after"
    (the old sum and the new terms both rescaled), "new" (the new terms rescaled, the old sum not), "block_own" (the
    block's own sum taken against its own maximum, merged without exp(block_max - m_new))."""
    m = torch.full(x.shape[:-1], 0.0 if maximum == "zero" else float("-inf"), dtype=x.dtype)
    total = torch.zeros(x.shape[:-1], dtype=x.dtype)
    out = torch.empty_like(x)
    with torch.no_grad():
        for cut in _blocks(x.shape[-1], size, bounds):
            block = x[..., cut]
            if block.shape[-1] == 0:
                continue
            if maximum == "none":        # no maximum subtracted at all: exp overflows for large scores
                m_new = torch.zeros_like(m)
            elif maximum == "last":      # the maximum of this block only, not the running one
                m_new = block.amax(-1)
            elif maximum == "shared":    # one maximum over every row (x.max() without dim=-1)
                m_new = torch.maximum(m, block.amax().expand_as(m))
            else:
                m_new = torch.maximum(m, block.amax(-1))
            old = torch.where(torch.isinf(m) & torch.isinf(m_new), torch.zeros_like(m), m - m_new)
            factor = {"ok": torch.exp(old), "block_own": torch.exp(old), "none": torch.ones_like(m),
                      "inverted": torch.exp(-old),
                      "inverted_guarded": torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(-old)),
                      "block": torch.exp(block.amax(-1) - m_new), "after": None, "new": None,
                      "old_over_block": torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf),
                                                              m - block.amax(-1)))}[rescale]
            own = block.amax(-1) if rescale == "block_own" else m_new   # the block merged without its own factor
            terms = torch.exp(block - own[..., None]).sum(-1)
            if rescale == "after":       # (l + new terms) * factor: the new terms shrunk too
                total = (total + terms) * torch.exp(old)
            elif rescale == "new":       # l + new terms * factor: the new terms shrunk, the old sum never
                total = total + terms * torch.exp(old)
            else:
                total = total * factor + terms
            m = m_new
            if normalize == "every":     # each block normalised with the statistics seen so far
                out[..., cut] = torch.exp(block - m[..., None]) / total[..., None]
    if normalize == "every":
        return out
    return torch.exp(x - m[..., None]) / total[..., None]


# ============================================================================ 10.2 tiled forward


def forward_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int, causal: bool,
                    *, skip: str = "ok", diagonal_mask: bool = True, rescale_acc: bool = True,
                    rescale_sum: bool = True, scale_power: int = 1, last_block: str = "ok",
                    normalize: str = "end", ignore_causal: bool = False, maximum: str = "running",
                    k_bounds: str = "ok", mask: str = "absolute", always_causal: bool = False,
                    values: str = "v", factor_on: str = "old", exp_against: str = "new"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiled forward of (q, k, v) (..., L, d) in float64, with the named slips switched on: (out, lse).
    ``maximum`` as in ``softmax_variant`` ("zero", "none", "shared" one maximum for all rows of a query block);
    those run in q's own dtype, where exp overflows or underflows as the student's does. ``k_bounds``: "overlap"
    (k[ks : ks + B + 1]), "short" (the last key never read), "stop_early" (range(0, Lk - B, B)); ``mask``: "local"
    (positions counted inside the block, every block masked), "local_diagonal" (only blocks that cross the
    diagonal), "diagonal" (each query hidden from its own key too) or "flipped" (tril(ks - qs) of the block, the
    offset negated); ``skip="first_query"``: the key loop stops at the block's first query, ``"from_diagonal"``: it
    starts at the query block's diagonal key block; ``always_causal``: masked even when causal=False; ``values="keys"``: p @ k; ``normalize``:
    "every" (acc / l after each block) or "unrenormalised" (acc += p @ v / l_new, the old part never rescaled
    by l_old / l_new); ``factor_on``: what exp(m_old - m_new) multiplies in l and acc, "old" (right), "all"
    (the old part and the new block's) or "new" (the new block's only); ``exp_against="old"``: p = exp(s - m_old),
    against the running maximum before this block (the block's own maximum at the first block)."""
    causal = (causal and not ignore_causal) or always_causal
    work = torch.float64 if maximum == "running" else q.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    scale = q.shape[-1] ** (-0.5 * scale_power)
    lq, lk = q.shape[-2], k.shape[-2]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=work)
    lse = torch.zeros(q.shape[:-1], dtype=work)
    for i, q_start in enumerate(range(0, lq, block_q)):
        q_end = min(q_start + block_q, lq)
        m = torch.full(q[..., q_start:q_end, 0].shape, 0.0 if maximum == "zero" else float("-inf"), dtype=work)
        total = torch.zeros_like(m)
        acc = torch.zeros(*m.shape, v.shape[-1], dtype=work)
        k_stop = {"stop_early": lk - block_k, "short": lk - 1}.get(k_bounds, lk)
        for j, k_start in enumerate(range(0, k_stop, block_k)):
            k_end = min(k_start + block_k + (k_bounds == "overlap"), k_stop if k_bounds == "short" else lk)
            if last_block == "dropped" and k_end - k_start < block_k:
                continue
            if causal:
                if not {"ok": k_start <= q_end - 1, "index": j <= i, "strict": k_start < q_start,
                        "first_query": k_start <= q_start,
                        "from_diagonal": (q_start // block_k) * block_k <= k_start <= q_end - 1}[skip]:
                    continue
            kb, vb = k[..., k_start:k_end, :], (k if values == "keys" else v)[..., k_start:k_end, :]
            if last_block == "padded" and k_end - k_start < block_k:   # zeros appended, never masked
                kb, vb = (F.pad(t, (0, 0, 0, block_k - (k_end - k_start))) for t in (kb, vb))
            s = q[..., q_start:q_end, :] @ kb.transpose(-2, -1) * scale          # (..., Bq, Bk)
            crosses = k_start + s.shape[-1] - 1 > q_start
            if causal and diagonal_mask and (mask != "local_diagonal" or crosses):
                local = mask.startswith("local")          # positions counted from the block's corner
                rows = torch.arange(0 if local else q_start, (0 if local else q_start) + s.shape[-2])[:, None]
                cols = torch.arange(0 if local else k_start, (0 if local else k_start) + s.shape[-1])[None, :]
                if mask == "flipped":                     # tril(ks - qs): the block's offset negated
                    rows, cols = rows - q_start, cols - k_start
                    s = s.masked_fill(cols - rows > k_start - q_start, float("-inf"))
                else:
                    s = s.masked_fill(cols >= rows if mask == "diagonal" else cols > rows, float("-inf"))
            if maximum == "none":        # exp(s) itself: overflows past 88 in float32
                m_new = torch.zeros_like(m)
            elif maximum == "shared":    # s.max() without dim=-1: one maximum for every row of the block
                m_new = torch.maximum(m, s.amax().expand_as(m))
            else:
                m_new = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            if mask == "flipped":        # as written with it: a row with no key in a block gives -inf - -inf = NaN
                safe = m_new
            p = torch.exp(s - safe[..., None])
            if exp_against == "old":     # the exponentials taken before the maximum is updated
                base = torch.where(torch.isinf(m), s.amax(-1), m)
                p = torch.exp(s - torch.where(torch.isinf(base), torch.zeros_like(base), base)[..., None])
            correction = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf), m - safe))
            if maximum == "none":        # nothing subtracted, nothing to rescale
                correction = torch.ones_like(m)
            if factor_on != "old":       # the factor on the new block's terms too ("all") or only ("new")
                before, after = ((torch.ones_like(correction), correction) if factor_on == "all" else
                                 (correction, torch.ones_like(correction)))
                total = (total + p.sum(-1) * before) * after
                acc = (acc + p @ vb * before[..., None]) * after[..., None]
                m = m_new
                continue
            total = (total * correction if rescale_sum else total) + p.sum(-1)
            if normalize == "unrenormalised":
                acc = acc * correction[..., None] + p @ vb / total[..., None]
                m = m_new
                continue
            acc = (acc * correction[..., None] if rescale_acc else acc) + p @ vb
            if normalize == "every":
                acc = acc / total[..., None]
                total = torch.ones_like(total)
            m = m_new
        out[..., q_start:q_end, :] = acc if normalize == "unrenormalised" else acc / total[..., None]
        lse[..., q_start:q_end] = m + torch.log(total)
    return out, lse


# What each forward slip looks like, with the switches that produce it (the order is the order tried).
FORWARD_MISTAKES = tuple(Mistake(code, f"flash_attention: {why}", spec) for code, why, spec in (
    ("magnitude", "one maximum is shared by all the rows of a query block (s.max() or s.amax() without dim=-1): "
                  "a query whose scores are far below another's then gets exp(s - m) = 0 for every key, and 0/0. "
                  "Keep one running maximum per query, m_new = torch.maximum(m, s.amax(dim=-1)).",
     {"maximum": "shared"}),
    ("running_max", "your running maximum starts at 0 (or another finite number), not at -inf: when every score of a query is below about "
                    "-104 (float32), exp(s - 0) underflows to 0 for every key and you divide 0 by 0. Start each "
                    "query block with m = -inf, so the first key block's maximum replaces it.", {"maximum": "zero"}),
    ("overflow", "no maximum is subtracted: exp(s) overflows to inf for scores above about 88 (float32) and "
                 "underflows to 0 below about -104, and inf/inf or 0/0 is NaN. Subtract the running maximum m in "
                 "every exp and rescale l and acc by exp(m - m_new) when it grows.", {"maximum": "none"}),
    *(("block_skip", why, {"skip": skip}) for skip, why in {
        "index": "you skip a key block that some query of the block still needs: query block i needs every key "
                 "block whose FIRST key is not after the block's LAST query (k_start <= q_end - 1). Comparing the "
                 "block numbers (j <= i) is only right when block_q == block_k.",
        "strict": "you skip the diagonal block (the key block that crosses the diagonal): its keys up to each "
                  "query are needed. Skip only blocks whose first key is after the block's last query.",
        "first_query": "your key loop stops at the query block's FIRST query (range(0, q_start + 1, block_k)): the "
                       "block's later queries need the keys up to the block's LAST query. Stop at q_end: a key "
                       "block is needed while its first key is not after q_end - 1."}.items()),
    ("causal_mask", "your mask hides each query's own key too (cols >= rows): a query may see the keys up to AND "
                    "including its own position, so mask only cols > rows. The first query then has no key at "
                    "all, and 0/0 is NaN.", {"mask": "diagonal"}),
    ("causal_mask", "`causal` is ignored: with causal=True, query i may only see keys 0..i; skip the key blocks "
                    "after the query block and mask inside the blocks that cross the diagonal.",
     {"ignore_causal": True}),
    ("causal_mask", "the key blocks that cross the diagonal are not masked: inside them, keys after the query "
                    "still get weight. Set s[row, col] = -inf where the key's position is after the query's "
                    "(use the absolute positions q_start + row and k_start + col).", {"diagonal_mask": False}),
    ("online_rescale", "the output accumulator is not rescaled when the running maximum grows: the running sum "
                       "is multiplied by exp(m_old - m_new), and so must the accumulated p @ v.",
     {"rescale_acc": False}),
    ("online_rescale", "the running sum is not rescaled when the running maximum grows (the accumulator is): "
                       "multiply it by exp(m_old - m_new) before adding the new block's sum.", {"rescale_sum": False}),
    ("online_rescale", "neither the running sum nor the accumulator is rescaled when the maximum grows: both "
                       "must be multiplied by exp(m_old - m_new).", {"rescale_sum": False, "rescale_acc": False}),
    *(("online_rescale", why, {"factor_on": factor_on}) for factor_on, why in {
        "all": "the factor exp(m_old - m_new) multiplies the new block's terms too, (l + p.sum) * factor and (acc "
               "+ p @ v) * factor: p is exp(s - m_new) already. Only the old l and acc are rescaled before the new "
               "block's are added.",
        "new": "the factor exp(m_old - m_new) multiplies the new block's terms instead of the old l and acc: p is "
               "exp(s - m_new) already, and the old sums, made with m_old, are what need it: l = l * factor + "
               "p.sum(-1), acc = acc * factor + p @ v."}.items()),
    ("online_rescale", "your exponentials are taken against the old running maximum, p = exp(s - m_old), before "
                       "it is updated with this block, and nothing corrects them: each key block's terms are then "
                       "measured against another maximum, and a block whose scores exceed m_old can overflow. "
                       "Update the maximum first, m_new = torch.maximum(m, s.amax(-1)), then take p = exp(s - "
                       "m_new) and rescale the old l and acc by exp(m_old - m_new).",
     {"exp_against": "old", "rescale_sum": False, "rescale_acc": False}),
    ("online_rescale", "your exponentials are taken against the old running maximum, p = exp(s - m_old), before "
                       "it is updated with this block, while l and acc are rescaled to the new one: the new terms "
                       "are then too large by exp(m_new - m_old). Update the maximum first, m_new = "
                       "torch.maximum(m, s.amax(-1)), then take p = exp(s - m_new).", {"exp_against": "old"}),
    *(("scale", why, {"scale_power": power}) for power, why in {
        2: "the scores are scaled by 1/sqrt(d) twice (say, q scaled once and the scores again): scale once.",
        0: "the scores are not scaled by 1/sqrt(d)."}.items()),
    *(("block_bounds", why, {"last_block": last}) for last, why in {
        "padded": "a last key block shorter than block_k is padded with zeros that are not masked: a zero key "
                  "scores 0 and takes weight. Slice the last block short (k[..., k_start:k_end]), or set the "
                  "padded scores to -inf.",
        "dropped": "the last keys are never read: the key loop must visit range(0, Lk, block_k) to the end, with "
                   "Lk = k.shape[-2], the number of keys (not of queries), and k_end = min(k_start + block_k, Lk), "
                   "so that a last block shorter than block_k is read too."}.items()),
    *(("block_bounds", why, {"k_bounds": bounds}) for bounds, why in {
        "overlap": "your key blocks overlap: k[..., ks:ks + block_k + 1] reads the first key of the next block "
                   "too, so it is counted twice. The end of a slice is excluded already: k[..., ks:ke] with ke = "
                   "min(ks + block_k, Lk).",
        "stop_early": "your key loop stops one block early (range(0, Lk - block_k, block_k)): the last key block "
                      "is never read. Loop over range(0, Lk, block_k).",
        "short": "the last key is never read: a key block ends at ke = min(ks + block_k, Lk), and the slice "
                 "k[..., ks:ke] already excludes ke (no Lk - 1)."}.items()),
    *(("causal_mask", block_corner(advice), {"mask": mask}) for mask, advice in {
        "local": "A query may see every key whose position is not after its own, so compare the absolute "
                 "positions ks + col and qs + row.",
        "local_diagonal": "In a block that crosses the diagonal, compare the absolute positions ks + col and qs + "
                          "row."}.items()),
    ("causal_mask", "your block's mask is tril(ks - qs), the offset's sign reversed: in the blocks below the "
                    "diagonal it hides keys the queries may see (every one of them, where a block is far enough "
                    "down, so a row has no key at all and 0/0 is NaN). Key ks + col is visible to query qs + row "
                    "when ks + col <= qs + row: tril(qs - ks) of the block.", {"mask": "flipped"}),
    ("block_skip", "with causal, your key loop starts at the query block's diagonal key block: the key blocks "
                   "before it, which every query of the block may see, are never read. A query sees every key from "
                   "position 0: the key loop runs over range(0, min(Lk, qe), block_k).", {"skip": "from_diagonal"}),
    ("causal_mask", "you mask the future although causal=False: only causal attention hides later keys; mask "
                    "(and skip key blocks) only when causal is True.", {"always_causal": True}),
    ("values", "the weights multiply the keys (p @ k): the output is the weighted sum of the VALUES, acc += p @ "
               "v[..., ks:ke, :].", {"values": "keys"}),
    *(("early_normalization", why, {"normalize": normalize}) for normalize, why in {
        "unrenormalised": "you keep the accumulator normalised (acc += p @ v / l) but never renormalise its old "
                          "part when l grows: divide once, after the last key block (or rescale the old part by "
                          "l_old * exp(m - m_new) / l_new).",
        "every": "you divide by the running sum after every key block: the accumulator then holds averages that "
                 "later blocks mix up with the wrong weights. Keep the unnormalised sum p @ v and divide once, "
                 "after the last key block."}.items()),
))


# ============================================================================ 10.3 backward


def backward_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, causal: bool,
                     block_q: int, block_k: int, *, delta: str = "ok", ds_scale: bool = True,
                     dv_transposed: bool = False, dk_transposed: bool = False, mask: str = "ok",
                     dq_scale: bool = True, dk_scale: bool = True, dp: str = "ok", always_causal: bool = False,
                     values: str = "v", recompute: str = "ok", twice: bool = False, score_scale: float | None = None,
                     grad_scale: float | None = None, recompute_scale: float | None = None, ds_sign: bool = False,
                     swapped: bool = False, assigned: str = "") -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of attention in float64 by the recomputation formulas, block by block, with the named slips
    switched on. A transposed product (P @ dO for P^T @ dO) only fits square blocks; elsewhere it raises.
    ``delta`` also "everything" (one D for all queries, heads and batches), "key_block" (rowsum(P * dP) over one
    key block) and "query_block" (one D per query block); ``dp="no_transpose"``: dO @ V (fits only dv == block_k);
    ``always_causal``: the recomputed weights masked although the forward was not; ``mask="strict"``: they hide the
    diagonal too; ``values="keys"``: dP = dO K^T;
    ``recompute="unscaled"``: P = exp(q k^T - lse), the scale left out; ``recompute="key_lse"``: P = exp(S - lse)
    with lse read at the key block's rows (lse[..., ks:ke, None]: row i of a block takes lse[ks + i]); ``twice``: dQ and dK scaled by 1/d;
    ``delta="outside"``: dS = P * dP - D in every block computed; ``mask="skip_diagonal"``: the key loop stops
    before the query block's start (range(0, q_start, block_k)); ``ds_sign``: dS = P * (D - dP); ``score_scale``: another factor on the scores,
    forward and backward alike; ``grad_scale``: another factor on dQ and dK alone; ``recompute_scale``: another
    factor on the recomputed scores alone, P = exp(q k^T * factor - lse); ``swapped``: dk returned as dq and dq as
    dk (only where they have one shape); ``mask="local"``: every block computed masked with positions counted from
    its corner ("local_diagonal": only those that cross the diagonal); ``assigned``: "dq", "dk" or "dv" written
    with = where += is meant, so that only the last block of the inner loop counts (the last key block a query
    block computes, for dq; the last query block, for dk and dv)."""
    q, k, v, do = q.double(), k.double(), v.double(), grad_out.double()
    scale = q.shape[-1] ** -0.5 if score_scale is None else score_scale
    s = q @ k.transpose(-2, -1) * scale
    future = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
    masked = s.masked_fill(future, float("-inf")) if causal else s
    lse = torch.logsumexp(masked, -1, keepdim=True)
    if always_causal and not causal:      # the forward's lse is unmasked; the recomputation masks
        p = torch.exp(s.masked_fill(future, float("-inf")) - lse)
    elif recompute == "key_lse":          # lse[..., ks:ke, None] for a block: row i of it reads lse[ks + i]
        rows = torch.empty_like(s)
        for q_start in range(0, q.shape[-2], block_q):
            q_end = min(q_start + block_q, q.shape[-2])
            for k_start in range(0, k.shape[-2], block_k):
                k_end = min(k_start + block_k, k.shape[-2])
                if k_end - k_start not in (q_end - q_start, 1):
                    raise ValueError("lse's rows of the key block do not broadcast against the block")
                rows[..., q_start:q_end, k_start:k_end] = lse[..., k_start:k_end, :]
        p = torch.exp((masked if mask == "ok" else s) - rows)
    elif recompute == "unscaled" or recompute_scale is not None:   # the forward's lse is of the scaled scores
        p = torch.exp((masked if mask == "ok" else s) / scale * (recompute_scale or 1.0) - lse)
    else:
        p = torch.exp((masked if mask == "ok" else s) - lse)
    if causal and mask == "strict":       # the recomputation hides each query's own key too
        p = torch.exp(s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(0), float("-inf")) - lse)
    if causal and mask == "diagonal":     # unmasked inside the computed blocks; the future blocks are skipped
        rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        last_query = torch.clamp((rows // block_q + 1) * block_q, max=q.shape[-2]) - 1
        p = p.masked_fill((cols // block_k) * block_k > last_query, 0.0)
    if causal and mask in ("local", "local_diagonal"):
        p = torch.exp(s.masked_fill(_corner_mask(q.shape[-2], k.shape[-2], block_q, block_k, mask), float("-inf"))
                      - lse)
    if causal and mask == "skip_diagonal":
        rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        p = p.masked_fill((cols // block_k) * block_k >= (rows // block_q) * block_q, 0.0)
    out = torch.softmax(masked, -1) @ v
    dp_all = do @ (k if values == "keys" else v).transpose(-2, -1)
    d = {"ok": lambda: (do * out).sum(-1, keepdim=True), "grad_only": lambda: do.sum(-1, keepdim=True),
         "zero": lambda: torch.zeros_like(lse), "values": lambda: (do * v).sum(-1, keepdim=True),   # Lq == Lk only
         "dp": lambda: dp_all.sum(-1, keepdim=True), "everything": lambda: (do * out).sum().expand(lse.shape),
         }.get(delta, lambda: (do * out).sum(-1, keepdim=True))()
    if delta in ("key_block", "query_block") or dp != "ok":
        ds = _blocked_ds(p, do, v, out, d, block_q, block_k, delta, dp)
    elif delta == "outside":              # D outside the product: nonzero wherever a block is computed
        rows, cols = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        last_query = torch.clamp((rows // block_q + 1) * block_q, max=q.shape[-2]) - 1
        computed = (cols // block_k) * block_k <= last_query if causal else torch.ones_like(future)
        ds = torch.where(computed, p * dp_all - d, torch.zeros_like(p))
    else:
        ds = p * (dp_all - d)
    ds = -ds if ds_sign else ds
    factor = (scale ** 2 if twice else scale) if ds_scale else 1.0
    factor = factor if grad_scale is None else grad_scale
    dq = ds @ k * factor * (1.0 if dq_scale else 1 / scale)
    dk = ds.transpose(-2, -1) @ q * factor * (1.0 if dk_scale else 1 / scale)
    dv = p.transpose(-2, -1) @ do
    if dv_transposed or dk_transposed:
        lq, lk = q.shape[-2], k.shape[-2]
        dk_blocks, dv_blocks = torch.zeros_like(dk), torch.zeros_like(dv)
        for qs in range(0, lq, block_q):
            qe = min(qs + block_q, lq)
            for ks in range(0, lk, block_k):
                ke = min(ks + block_k, lk)
                p_blk, ds_blk = p[..., qs:qe, ks:ke], ds[..., qs:qe, ks:ke]
                dv_blocks[..., ks:ke, :] += (p_blk @ do[..., qs:qe, :] if dv_transposed
                                             else p_blk.transpose(-2, -1) @ do[..., qs:qe, :])
                dk_blocks[..., ks:ke, :] += (ds_blk @ q[..., qs:qe, :] if dk_transposed
                                             else ds_blk.transpose(-2, -1) @ q[..., qs:qe, :]) * factor
        dk, dv = dk_blocks, dv_blocks
    if assigned:
        dq, dk, dv = _last_block_only(assigned, p, ds, q, k, do, dq, dk, dv, factor, block_q, block_k, causal)
    if swapped and dq.shape != dk.shape:
        raise ValueError("dq and dk of different shapes cannot be swapped")
    return (dk, dq, dv) if swapped else (dq, dk, dv)


def _corner_mask(length_q: int, length_k: int, block_q: int, block_k: int, mask: str) -> torch.Tensor:
    """(Lq, Lk): what a causal mask in block coordinates hides, triu(1) of each block the key loop computes
    ("local": every one; "local_diagonal": those that cross the diagonal), and every block it skips."""
    hide = torch.ones(length_q, length_k, dtype=torch.bool)
    for qs in range(0, length_q, block_q):
        qe = min(qs + block_q, length_q)
        for ks in range(0, min(length_k, qe), block_k):
            ke = min(ks + block_k, length_k)
            crosses = ke - 1 > qs
            block = hide[qs:qe, ks:ke]
            block.copy_(torch.ones_like(block).triu(1) if mask == "local" or crosses else torch.zeros_like(block))
    return hide


def _last_block_only(name: str, p: torch.Tensor, ds: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     do: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, factor: float,
                     block_q: int, block_k: int, causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) with ``name`` holding only the last block's share of its sum: dq[qs:qe] = (the last key block
    the query block computes), dk[ks:ke] and dv[ks:ke] = (the last query block's)."""
    lq, lk = q.shape[-2], k.shape[-2]
    if name == "dq":
        dq = torch.zeros_like(dq)
        for qs in range(0, lq, block_q):
            qe = min(qs + block_q, lq)
            ks = (((min(lk, qe) if causal else lk) - 1) // block_k) * block_k
            ke = min(ks + block_k, lk)
            dq[..., qs:qe, :] = ds[..., qs:qe, ks:ke] @ k[..., ks:ke, :] * factor
        return dq, dk, dv
    qs = ((lq - 1) // block_q) * block_q
    if name == "dk":
        return dq, ds[..., qs:, :].transpose(-2, -1) @ q[..., qs:, :] * factor, dv
    return dq, dk, p[..., qs:, :].transpose(-2, -1) @ do[..., qs:, :]


def _blocked_ds(p: torch.Tensor, do: torch.Tensor, v: torch.Tensor, out: torch.Tensor, d: torch.Tensor,
                block_q: int, block_k: int, delta: str, dp: str) -> torch.Tensor:
    """dS = P * (dP - D), block by block, where a slip depends on the blocks: D from one key block or one query
    block, or dP = dO @ V without its transpose (raises where dv != block_k: the slip does not apply)."""
    ds = torch.zeros_like(p)
    lq, lk = p.shape[-2], p.shape[-1]
    for qs in range(0, lq, block_q):
        qe = min(qs + block_q, lq)
        for ks in range(0, lk, block_k):
            ke = min(ks + block_k, lk)
            p_blk, do_blk, v_blk = p[..., qs:qe, ks:ke], do[..., qs:qe, :], v[..., ks:ke, :]
            dp_blk = do_blk @ v_blk if dp == "no_transpose" else do_blk @ v_blk.transpose(-2, -1)
            if delta == "key_block":
                d_blk = (p_blk * dp_blk).sum(-1, keepdim=True)
            elif delta == "query_block":
                d_blk = (do_blk * out[..., qs:qe, :]).sum((-2, -1), keepdim=True)
            else:
                d_blk = d[..., qs:qe, :]
            ds[..., qs:qe, ks:ke] = p_blk * (dp_blk - d_blk)
    return ds


BACKWARD_MISTAKES = tuple(Mistake(code, f"Your backward: {why}", spec) for code, why, spec in (
    *(("backward_delta", why, {"delta": delta}) for delta, why in {
        "grad_only": "D is computed from the wrong tensors: D = rowsum(dO * O), the gradient of the output times "
                     "the output itself, one number per query.",
        "zero": "D is left out (or zero): dS = P * (dP - D) with D = rowsum(dO * O).",
        "values": "D is computed from the wrong tensors (dO and V): D = rowsum(dO * O), with the output O.",
        "dp": "D is rowsum(dP), not rowsum(dO * O): D is the row sum of P * dP, which equals rowsum(dO * O), "
              "computed once from the saved output.",
        "everything": "D is one number summed over everything (every query, head and batch): D is one number per "
                      "query, D = rowsum(dO * O) = (dO * O).sum(dim=-1).",
        "key_block": "D is summed over one key block only (rowsum(P * dP) of the block): D is one number per query "
                     "over every key, D = rowsum(dO * O), computed once before the loops.",
        "query_block": "D is one number for a whole query block: it is one number per query, D = rowsum(dO * O) = "
                       "(dO * O).sum(dim=-1), not summed over the block's rows too.",
        "outside": "D is subtracted outside the product with P (dS = P * dP - D): dS = P * (dP - D), P multiplies "
                   "both terms, so a key with no weight gets no gradient."}.items()),
    ("scale", "the recomputed scores are not scaled: P = exp(S - lse) needs S = q k^T / sqrt(d), as in the "
              "forward, whose lse was taken over the scaled scores.", {"recompute": "unscaled"}),
    ("logsumexp", "the log-sum-exp is read at the key block's rows (lse[..., ks:ke]): lse holds one number per "
                  "QUERY, so a block's P = exp(S - lse[..., qs:qe, None]), the query block's rows.",
     {"recompute": "key_lse"}),
    ("scale", "dQ and dK are scaled by 1/d, the scale twice: the chain rule through S = q k^T / sqrt(d) brings "
              "1/sqrt(d) once, dQ = dS @ K / sqrt(d) and dK = dS^T @ Q / sqrt(d).", {"twice": True}),
    # the scale left out of one gradient
    ("scale", "the scale 1/sqrt(d) is missing from dK (dQ has it): the scores are q k^T / sqrt(d), so dK = dS^T @ Q "
              "/ sqrt(d) as dQ = dS @ K / sqrt(d).", {"dk_scale": False}),
    ("scale", "the scale 1/sqrt(d) is missing from dQ (dK has it): the scores are q k^T / sqrt(d), so dQ = dS @ K "
              "/ sqrt(d) as dK = dS^T @ Q / sqrt(d).", {"dq_scale": False}),
    ("transposed", "dP is dO @ V: it should be dP = dO @ V^T (one number per query and key: how the loss moves "
                   "with each weight). It only fits here because d equals block_k.", {"dp": "no_transpose"}),
    ("values", "dP is computed from the keys: dP = dO @ V^T, the gradient of the output times the values (the "
               "output is P @ V).", {"values": "keys"}),
    ("gradient", "your dq and dk are each other's: backward returns one gradient per argument of forward, in "
                 "the same order: return dq, dk, dv, None, None, None (q, k, v, causal, block_q, block_k).",
     {"swapped": True}),
    ("causal_mask", "the recomputed weights are masked although causal=False: the forward attended to every key, "
                    "so its lse is over every key; mask only when ctx.causal.", {"always_causal": True}),
    ("scale", "the scale 1/sqrt(d) is missing from dQ and dK: the scores are q k^T / sqrt(d), so dQ = dS @ K / "
              "sqrt(d) and dK = dS^T @ Q / sqrt(d).", {"ds_scale": False}),
    *(("transposed", why, {switch: True}) for switch, why in {
        "dv_transposed": "dV is P @ dO: it should be P^T @ dO (each key's value collects the gradients of the "
                         "queries that weighted it).",
        "dk_transposed": "dK is dS @ Q: it should be dS^T @ Q (the keys are the columns of dS)."}.items()),
    *(("causal_mask", why, {"mask": mask}) for mask, why in {
        "diagonal": "the recomputed weights are not masked in the blocks that cross the diagonal: P = exp(S - lse) "
                    "must use the masked scores, or the future keys get gradient.",
        "none": "the recomputed weights are not masked: P = exp(S - lse) must use the masked scores, or the future "
                "keys get gradient.",
        "strict": "the recomputed weights hide each query's own key too (a mask of key >= query, not key > query): "
                  "query i sees keys 0..i, its own included, as in the forward, whose lse counts it."}.items()),
    ("block_skip", "your key loop stops at the query block's start (range(0, q_start, block_k)), so it skips the "
                   "diagonal block: its keys up to each query are needed, as in the forward. A key block is needed "
                   "while its first key is not after the block's last query.", {"mask": "skip_diagonal"}),
    *(("causal_mask", block_corner(advice), {"mask": mask}) for mask, advice in {
        "local": "Your backward recomputes P = exp(S - lse) with it, so in the blocks below the diagonal keys a "
                 "query may see get no weight. Mask where ks + col > qs + row, the absolute positions, as in the "
                 "forward.",
        "local_diagonal": "In the blocks that cross the diagonal but do not sit on it (block_q != block_k, or a "
                          "block that does not divide L), your recomputed P = exp(S - lse) then hides the wrong "
                          "keys. Mask where ks + col > qs + row, the absolute positions, as in the forward."}.items()),
    *(("gradient", f"{name} is written with = where += is meant ({name}[...] = ... inside the loop over the "
                   f"{inner} blocks): each block overwrites the share of the blocks before it, so {name} holds only "
                   f"the last {inner} block's. {name} is a sum over every {inner} block: start it at zeros and "
                   f"add, {name}[...] += ...", {"assigned": name})
      for name, inner in (("dq", "key"), ("dk", "query"), ("dv", "query"))),
    ("scale", "dQ and dK are exactly -1 times the right ones: dS has its sign flipped. dS = P * (dP - D), not "
              "P * (D - dP).", {"ds_sign": True}),
))
