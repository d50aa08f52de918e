"""What to tell the room about each kind of mistake: one or two sentences, never the answer's code.

Advice is chosen per (exercise, diagnosis), because one code means different things in different
exercises (``scale`` is the 1/sqrt(d) of attention in 1.3, the ignored temperature in 5.4, the
frequencies of 4.1): ``EXERCISE_ADVICE`` holds what to say for an exercise's own mistakes. Where
it has nothing, ``ROOM_ADVICE`` speaks only for the codes that mean the same everywhere
(``GENERAL``: not written, raises, too slow, wrong shape ...); for any other code the room is told
what the checker told most of those students (its message names the mistake), never a sentence
written for another exercise. :func:`room_hint` adds the exercise's first hint from the checks
registry (the hint a student gets from ``checks.hint(...)``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ..exercises import BY_ID

__all__ = ["ROOM_ADVICE", "EXERCISE_ADVICE", "GENERAL", "room_advice", "room_hint", "exercise_title", "first_hint"]

# Codes whose advice is the same in every exercise.
GENERAL = frozenset({"not_implemented", "missing", "exception", "timeout", "crashed", "mutation", "shape", "dtype",
                     "device", "nan", "precision", "checker_error"})

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
    "precision": "Close to the right numbers, but further off than rounding explains: a step runs in a lower "
                 "precision (a .float(), float16) or rounds its numbers on the way.",
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
    "zero_grad": "Clear the gradients before each backward (optimizer.zero_grad()): they add up otherwise.",
    "flops_factor": "Training costs 6 FLOPs per weight and token (2 forward, 4 backward), not 2.",
    "split_transpose": "After the split into heads, move the head axis before the positions (transpose).",
    "final_norm": "The last block's output is normalised (ln_f) before the output layer.",
    "no_kv_cache": "After the prompt, feed only the new token: earlier keys and values come from the cache.",
    "overlapping_windows": "Training windows start max_tokens tokens apart, not one: each token is a target once.",
}

EXERCISE_ADVICE = {
    ("1.1", "precision"): "Nearly the softmax, but rounded too coarsely: compute the weights to two decimals or "
                          "more, with e = 2.718...",
    ("1.1", "normalization"): "The weights are the softmax of the scores: e^s over the sum of e^s, summing to one.",
    ("1.2", "scale"): "Toy attention has no scaling yet (1/sqrt(d) comes in 1.3): softmax of the raw scores.",
    ("1.3", "scale"): "Divide the scores by the square root of the key size, before the softmax.",
    ("2.2", "scale"): "Divide the scores by the square root of the head size, before the softmax.",
    ("3.3", "scale"): "Each head works in head_dim dimensions: divide its scores by sqrt(head_dim), before the softmax.",
    ("4.1", "scale"): "Each pair of dimensions turns at its own frequency, 1/10000^(2i/d): check the exponent and "
                      "which dimensions share an angle.",
    ("5.4", "scale"): "The temperature divides the logits before the softmax: below 1 it sharpens, above 1 it "
                      "flattens; a temperature that changes nothing is not applied.",
    ("7.2", "scale"): "Multiply the scores by the `scaling` argument the layer is given (head_dim ** -0.5).",
    ("5.3", "zero_grad"): "Gradients add up across backward() calls: clear them (optimizer.zero_grad()) before each "
                          "backward, or every step uses the sum of all steps so far.",
    ("6.1", "flops_factor"): "Training costs 6 FLOPs per weight and token (2 forward, 4 backward), not 2: the "
                             "forward pass alone is a third of it.",
    ("7.1", "split_transpose"): "Conv1D keeps c_attn's weight as (in, out) and nn.Linear as (out, in): transpose "
                                "each of the three (E, E) thirds after the split.",
    ("4.3", "final_norm"): "The GPT normalises the last block's output (ln_f) before the output layer.",
    ("6.2", "no_kv_cache"): "Generation with the cache feeds only the new token once the prompt is in: the keys and "
                            "values of earlier positions come from the cache, not from running the whole prefix again.",
    ("5.1", "overlapping_windows"): "Consecutive training windows start max_tokens tokens apart (the stride): "
                                    "each window cuts max_tokens + 1 tokens, and the last target of one is the "
                                    "first input of the next, so each token is a target once.",
    ("2.1", "causal_mask"): "The mask is lower-triangular (tril): True on and below the diagonal, so a position "
                            "sees itself and the past, never the future.",
    ("1.3", "causal_mask"): "Where the mask is False the score becomes -inf, before the softmax (not 0, not after "
                            "it); with no mask, nothing is hidden.",
    ("2.2", "causal_mask"): "Use the mask buffer, cropped to the sequence's length: -inf where it is False, before "
                            "the softmax.",
    ("3.3", "causal_mask"): "Use the mask buffer, cropped to the sequence's length, on every head's scores: -inf "
                            "where it is False, before the softmax.",
    ("2.1", "dtype"): "The mask is a bool tensor (True = may attend), not 0/1 numbers or -inf.",
    ("4.3", "dropout"): "The GPT's dropout must follow train() and eval(): use its nn.Dropout module.",
    ("5.3", "dropout"): "A training step starts by putting the model in training mode.",
    ("7.2", "causal_mask"): "With no mask given, the queries are the last positions of the keys: the causal "
                            "mask's diagonal is shifted to the bottom-right corner.",
    # issue 43: notebooks 04-06's named mistakes
    ("4.1", "sincos_layout"): "Sines on the even dimensions, cosines on the odd ones, interleaved: dimensions 2i and "
                              "2i+1 share one angle.",
    ("4.1", "positions"): "Positions count from 0: row 0 of the table reads 0, 1, 0, 1, ...",
    ("4.2", "sublayer_missing"): "A block is attention, then feed-forward: each sublayer's result is added to x.",
    ("4.2", "norm_placement"): "Each sublayer has its own LayerNorm, ln1 with attention and ln2 with the "
                               "feed-forward; pre-norm normalises the sublayer's input, post-norm the residual sum.",
    ("4.3", "positions"): "The model adds a position encoding to every token embedding, continuing after the "
                          "tokens already in a cache.",
    ("4.3", "block_chain"): "The blocks run in turn, first to last, each on the previous block's output.",
    ("4.3", "logits"): "The model returns logits; the loss and the sampler apply the softmax themselves.",
    ("4.3", "scale"): "This GPT adds token and position embeddings as they are: no sqrt(embed_dim) factor.",
    ("4.3", "context_limit"): "A sequence longer than max_tokens is an error the model raises; cropping is the "
                              "caller's choice.",
    ("5.1", "target_shift"): "The target at each position is the next token: targets are the inputs one step "
                             "ahead, cut from a chunk of max_tokens + 1 tokens.",
    ("5.2", "logits"): "F.cross_entropy takes raw logits and applies the log-softmax itself.",
    ("5.2", "loss_reduction"): "The loss is the mean over the real targets: padding (-100) ignored, every target "
                               "token weighing the same.",
    ("5.3", "step_order"): "One step: zero_grad, forward, loss, backward once, step once; return the loss of that "
                           "forward pass.",
    ("5.4", "greedy"): "Only temperature=0 means argmax; otherwise draw from the softmax with torch.multinomial.",
    ("5.4", "top_k"): "top_k keeps the k largest logits of each row (>= the k-th) and sets the others to -inf "
                      "before the softmax.",
    ("6.1", "attention_flops"): "Attention adds 12·n·H·Q·T per token: two products per head, in every layer, "
                                "forward and backward, over the T keys of the window.",
    ("6.1", "flops_units"): "Return plain FLOPs per token: no division into GFLOPs, no product over the window.",
    ("6.1", "weights_count"): "N is the num_weights argument (every weight but the position embeddings; the token "
                              "embedding, tied to the head, is in it): 6N uses it as given.",
    ("6.2", "positions"): "With the cache, the model itself places each new token at position cache length.",
    ("6.2", "greedy"): "Generation with the cache here is greedy: the argmax at every step, no sampling.",
}


def exercise_title(exercise: str) -> str:
    entry = BY_ID.get(exercise)
    return entry.title if entry else ""


def first_hint(exercise: str) -> str:
    entry = BY_ID.get(exercise)
    return entry.hints[0] if entry and entry.hints else ""


def room_advice(exercise: str, diagnosis: str, messages: Iterable[str] = ()) -> str:
    """What to tell the room about ``diagnosis`` on ``exercise`` (see the module docstring); ``messages``:
    the checker's messages to the students with that mistake."""
    if (exercise, diagnosis) in EXERCISE_ADVICE:
        return EXERCISE_ADVICE[exercise, diagnosis]
    if diagnosis in GENERAL:
        return ROOM_ADVICE.get(diagnosis, "")
    said = Counter(m.strip() for m in messages if m and m.strip()).most_common(1)
    if said:
        message, count = said[0]
        message = message if len(message) <= 400 else message[:400].rsplit(" ", 1)[0] + " ..."
        return f"The checker told {count} of them: \"{message}\""
    return ROOM_ADVICE.get(diagnosis, "")


def room_hint(exercise: str, diagnosis: str, messages: Iterable[str] = ()) -> str:
    """The advice for the room when ``diagnosis`` is the most common mistake on ``exercise``, and the
    exercise's first hint."""
    advice = room_advice(exercise, diagnosis, messages)
    hint = first_hint(exercise)
    if hint and diagnosis not in ("missing", "crashed", "checker_error"):
        return f"{advice} The exercise's first hint: {hint}".strip()
    return advice
