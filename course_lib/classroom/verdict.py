"""The verdict on one exercise, and the mistakes it can name.

A checker stops at the first problem it finds by raising :class:`Failure` (``fail(...)``) with one
of the :data:`DIAGNOSES`; the run (``checks.engine.run``) turns that into a :class:`CheckResult`,
which the notebook shows, the grader records and the live room counts.
"""
from __future__ import annotations

import html
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

DIAGNOSES = (
    # What a CheckResult's ``diagnosis`` can say, one code per kind of mistake (Failure rejects others).
    "not_implemented",   # the exercise still raises NotImplementedError
    "exception",         # the student's code raised (or called sys.exit), or was passed the wrong thing
    "timeout",           # the student's code ran past the time limit (an endless loop?)
    "mutation",          # the student's code changed one of its inputs in place
    "shape",             # the result (or a parameter) has the wrong shape, or nothing was returned
    "dtype",             # the result has the wrong dtype, or is not a tensor at all
    "device",            # the result is on another device than its inputs
    "nan",               # the result holds NaN or infinity (or training went NaN, 8.1)
    "precision",         # the right numbers, rounded too coarsely
    "softmax_dim",       # the softmax runs over the wrong axis
    "scale",             # the scores, positional frequencies or embeddings are scaled by the wrong factor
    "normalization",     # weights that do not sum to one: no softmax, or half of one
    "causal_mask",       # the mask is wrong: the future leaks, or the wrong positions are hidden
    "head_split",        # heads split or merged along the wrong axes
    "values",            # values taken from the wrong projection or the wrong tensor
    "batch_mixing",      # a reshape that mixes batch entries or positions
    "dropout",           # dropout missing, in the wrong place, or active in eval mode
    "residual",          # a residual connection missing, adding the wrong tensor, or added where none belongs
    "norm_placement",    # a norm in the wrong place: pre/post swapped, ln1/ln2 swapped, reused or left out, QK-norm
    "clipping",          # the gradient norm not clipped to max_grad_norm, or clipped at the wrong moment
    "generator",         # sampling ignores the generator it was given (uses the global RNG)
    "rope_layout",       # RoPE pairs the wrong dimensions: interleaved (2i, 2i+1) against the half-split tables
    "rope_rotation",     # RoPE turns each pair the wrong way: sign, sin and cos swapped, or no rotate_half term
    "rope_frequencies",  # RoPE's angles turn at the wrong rates: theta ignored, the wrong exponent or base
    "rope_positions",    # RoPE turns tokens to the wrong positions: offset ignored or read after appending, from 1
    "rope_axes",         # RoPE applied on the wrong axes: before the head split, or along the head axis
    "rope_missing",      # RoPE left out on the queries, the keys, or both
    "rotated_values",    # RoPE applied to the values too (only queries and keys turn)
    "epsilon",           # a norm's epsilon forgotten, outside the square root, not self.eps, or another value
    "norm_weight",       # a norm's learned weight forgotten or applied the wrong way (added, 1 + weight)
    "norm_statistic",    # RMSNorm divides by the wrong statistic: centred, a plain norm, over the wrong axis
    "gating",            # SwiGLU's gate is wrong: SiLU on the wrong branch, no gate, another activation
    "kv_grouping",       # key/value heads shared in the wrong order (repeat where repeat_interleave is meant)
    "kv_cache",          # the KV cache ignored, its keys turned again, or holding repeated heads or unrotated keys
    "gradient",          # the right outputs, but a parameter or input gets no gradient or a wrong one (a cut graph)
    "zero_grad",         # optimizer.zero_grad missing (gradients pile up), or placed where it wipes the new ones
    "flops_factor",      # FLOPs per token counted as 2N (the forward pass) where 6N (forward and backward) is meant
    "split_transpose",   # the head split reshapes without the transpose that puts heads before positions
    "final_norm",        # the final LayerNorm (ln_f) left out before the language-model head
    "no_kv_cache",       # generation without the KV cache: none passed, a new one each step, or dropped later
    "overlapping_windows",  # training windows that overlap: they start closer together than the stride
    "online_rescale",    # 10: the running sum (or output accumulator) not rescaled when the maximum grows
    "running_max",       # 10: the maximum of the latest block, not the running one (the rescale overflows)
    "overflow",          # exp of unshifted scores overflows (no maximum subtracted): NaN or inf on large inputs
    "magnitude",         # right on well-scaled inputs, wrong on large, very negative or mixed-scale ones
    "early_normalization",  # 10: normalised at every block instead of once at the end
    "block_bounds",      # 10: a block boundary off by one, or a short last block dropped or padded unmasked
    "block_skip",        # 10: causal tiling skips the wrong key blocks, or none
    "full_scores",       # 10: the full L x L score matrix materialised where tiling should avoid it
    "not_tiled",         # 10: whole rows reduced at once, blocks larger than asked, or a fused kernel called
    "logsumexp",         # 10: the per-row log-sum-exp wrong (m alone, log(l) alone, unscaled)
    "backward_delta",    # 10: D = rowsum(dO * O) computed from the wrong tensors, or left out
    "transposed",        # 10: a gradient with a transposed factor (dV = P dO, dK = dS Q)
    "score_offset",      # a head score reads the wrong diagonal: the copy itself, the token itself, one too far
    "score_positions",   # a head score averages over positions that have no target (position 0, the first half)
    "score_axes",        # a head score averages over the wrong axes: batch and heads swapped, one left unaveraged
    "ablation_method",   # a head "switched off" by changing the wrong thing (its attention pattern), or not at all
    "ablation_slice",    # the wrong part of the merged heads zeroed: another head, the whole layer, proj's rows
    "not_restored",      # a context manager that leaves the model changed (hooks, weights), also after an exception
    "global_setting",    # a setting of the whole process left changed: the default dtype, gradients turned off
    "kept_state",        # something kept between calls: an old result, a buffer cut in forward, a handle left behind
    "patched",           # torch's or the course's own functions replaced (torch.equal = ...): no check can be trusted
    "calls_reference",   # the student's code is, wraps, subclasses or calls the course's own version of the exercise
    # notebooks 04-06 (issue 43): the mistakes that ended in mismatch, named
    "sincos_layout",     # 4.1: sines and cosines swapped, or the halves concatenated where they interleave
    "positions",         # token positions wrong: left out, counted from 1, or not continued after the cache
    "sublayer_missing",  # 4.2: the attention or the feed-forward sublayer never applied (or its result dropped)
    "block_chain",       # 4.3: the blocks not chained in order: one skipped, reversed, or fed the embeddings
    "logits",            # logits and probabilities confused: a softmax where logits belong, logits where log-probs do
    "context_limit",     # 4.3: more than max_tokens tokens accepted silently (cropped) instead of an error
    "target_shift",      # 5.1: targets not the next token: not shifted, or shifted the wrong way or too far
    "loss_reduction",    # 5.2: per-token losses combined the wrong way: summed, padding counted, per sequence first
    "step_order",        # 5.3: backward or step missing, repeated or out of order; the loss taken after the update
    "greedy",            # argmax where a draw is asked (no randomness), or a random draw where greedy is asked
    "top_k",             # 5.4: top-k keeps the wrong tokens: one too many or few, the least likely, 0 not -inf, none
    "attention_flops",   # 6.1: the attention term of the FLOPs count wrong: left out, one product, a factor off
    "flops_units",       # 6.1: FLOPs in the wrong unit: per window instead of per token, GFLOPs instead of FLOPs
    "weights_count",     # 6.1: the N of 6N not the num_weights given (counted again from the config, or ignored)
    "mismatch",          # wrong, and like none of the mistakes we know
    "checker_error",     # the checker itself failed: a bug in the course, not in the student's code
    "missing",           # grading: the exercise (its notebook, or its cell) is not in the submission
    "crashed",           # grading: the process running the student's code died (os._exit, a signal, memory)
    "state_order",       # 12: a recurrent state read before the current token is added to it (or after the next)
    "feature_map",       # 12: linear attention's feature map phi left out, on one side only, or another map
    "bias",              # a layer's biases left out: its projections computed with their weights alone
)

class CheckResult(NamedTuple):
    """The verdict on one exercise: ``passed``, a ``diagnosis`` code and a ``message`` to act on.

    A tuple, so that nothing can change a verdict once made: code of a student's that finds it in memory (through
    the garbage collector, a frame, a finalizer) cannot set ``passed`` on it, ``object.__setattr__`` included."""

    exercise: str
    passed: bool
    diagnosis: str | None
    message: str
    details: Mapping[str, Any] = MappingProxyType({})

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(exercise={self.exercise!r}, passed={self.passed!r}, "
                f"diagnosis={self.diagnosis!r}, message={self.message!r})")

    def __str__(self) -> str:
        mark = "PASSED" if self.passed else f"NOT YET ({self.diagnosis})"
        return f"Exercise {self.exercise}: {mark}. {self.message}"

    def _repr_html_(self) -> str:
        colour, border, mark = (("#e6f4ea", "#34a853", "&#10004; Passed") if self.passed
                                else ("#fce8e6", "#d93025", f"&#10008; Not yet: <code>{self.diagnosis}</code>"))
        return (f'<div style="background:{colour};border-left:4px solid {border};padding:6px 10px;'
                f'margin:4px 0;font-family:sans-serif;color:#202124">'
                f"<b>Exercise {html.escape(self.exercise)}</b> &mdash; {mark}<br>"
                f"{html.escape(self.message)}</div>")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


class Failure(Exception):
    """Raised inside a checker to stop at the first problem found."""

    def __init__(self, diagnosis: str, message: str, **details: Any):
        if diagnosis not in DIAGNOSES:
            raise ValueError(f"diagnosis: expected one of {DIAGNOSES}, got {diagnosis!r}")
        super().__init__(message)
        self.diagnosis = diagnosis
        self.message = message
        self.details = details


def fail(diagnosis: str, message: str, **details: Any) -> None:
    raise Failure(diagnosis, message, **details)
