"""What to tell the room about each kind of mistake: one or two sentences, never the answer's code.

``ROOM_ADVICE`` has one line per diagnosis code; ``EXERCISE_ADVICE`` says it more precisely where
an exercise's version of a mistake has a better pointer. :func:`room_hint` adds the exercise's
first hint from the checks registry (the hint a student gets from ``checks.hint(...)``).
"""
from __future__ import annotations

__all__ = ["ROOM_ADVICE", "EXERCISE_ADVICE", "room_hint", "exercise_title", "first_hint"]

ROOM_ADVICE = {
    "not_implemented": "Not written yet: give the room time, or walk through the exercise's first step together.",
    "missing": "Not in the submission: check that everyone hands in the saved notebook under its course name.",
    "exception": "Their code raises: have them run the cell and read the last line of the traceback, which "
                 "names the line.",
    "timeout": "Their code does not finish: look for a loop whose condition never changes.",
    "crashed": "The process running their code died (os._exit, a kill, or memory far beyond the limit): "
               "look at these submissions by hand.",
    "mutation": "They change an input in place (+=, /=, t[...] = ...): build a new tensor instead.",
    "shape": "Print the shape after every line and compare with the shape comments of the exercise.",
    "dtype": "Check the type of what is returned: a tensor, of the dtype the exercise asks for.",
    "device": "New tensors should be made on the input's device.",
    "nan": "NaN or infinity: usually a row of the scores that is all -inf, or a division by zero.",
    "precision": "The right numbers, rounded too coarsely: keep two decimals.",
    "softmax_dim": "The softmax runs over the keys: the last axis of the scores.",
    "scale": "Divide the scores by the square root of the head size, before the softmax.",
    "normalization": "The weights must sum to one over the keys: one softmax, over the last axis.",
    "causal_mask": "Check the mask is lower-triangular (tril): True on and below the diagonal, so a position "
                   "sees itself and the past; hidden places get -inf before the softmax.",
    "head_split": "Heads are split as (N, L, heads, head_dim), then the head axis moves before the positions; "
                  "merging undoes that move before flattening.",
    "values": "The weighted sum takes the values, from the value projection.",
    "batch_mixing": "A reshape across the batch or position axes mixes examples: move axes with transpose first.",
    "dropout": "Dropout goes on the attention weights and on the output, through the module, so that eval() "
               "turns it off.",
    "residual": "Each sublayer adds its own input back (the residual), around attention and around the MLP.",
    "norm_placement": "Pre-norm normalises what goes into each sublayer; post-norm normalises after the residual "
                      "sum.",
    "clipping": "Clip the gradient norm to max_grad_norm after backward and before the optimizer's step.",
    "generator": "Sampling must draw from the generator it is given, not the global random state.",
    "mismatch": "Wrong in a way none of the known mistakes explains: compare with the exercise's steps one by one.",
    "checker_error": "The checker itself failed: a bug in the course; please report it with the message.",
}

EXERCISE_ADVICE = {
    ("1.1", "normalization"): "The weights are the softmax of the scores: e^s over the sum of e^s, summing to one.",
    ("1.3", "causal_mask"): "Where the mask is False the score becomes -inf, before the softmax (not 0, not after "
                            "it); with no mask, nothing is hidden.",
    ("2.2", "causal_mask"): "Use the mask buffer, cropped to the sequence's length: -inf where it is False, before "
                            "the softmax.",
    ("3.3", "causal_mask"): "Use the mask buffer, cropped to the sequence's length, on every head's scores: -inf "
                            "where it is False, before the softmax.",
    ("2.1", "dtype"): "The mask is a bool tensor (True = may attend), not 0/1 numbers or -inf.",
    ("4.3", "dropout"): "The GPT's dropout must follow train() and eval(): use its nn.Dropout module.",
    ("5.3", "dropout"): "A training step starts by putting the model in training mode.",
    ("6.1", "mismatch"): "FLOPs per token: 6 per weight (forward 2, backward 4) plus 12·n·H·Q·T for attention.",
    ("7.2", "causal_mask"): "With no mask given, the queries are the last positions of the keys: the causal "
                            "mask's diagonal is shifted to the bottom-right corner.",
}


def exercise_title(exercise: str) -> str:
    from ..checks._core import EXERCISES
    entry = EXERCISES.get(exercise)
    return entry.title if entry else ""


def first_hint(exercise: str) -> str:
    from ..checks._core import EXERCISES
    entry = EXERCISES.get(exercise)
    return entry.hints[0] if entry and entry.hints else ""


def room_hint(exercise: str, diagnosis: str) -> str:
    """The advice for the room when ``diagnosis`` is the most common mistake on ``exercise``."""
    advice = EXERCISE_ADVICE.get((exercise, diagnosis)) or ROOM_ADVICE.get(diagnosis, "")
    hint = first_hint(exercise)
    if hint and diagnosis not in ("missing", "crashed", "checker_error"):
        return f"{advice} The exercise's first hint: {hint}".strip()
    return advice
