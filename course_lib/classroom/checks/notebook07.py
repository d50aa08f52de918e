"""Exercises of notebook 07 (Hugging Face): 7.1 split_c_attn, 7.2 an attention function for transformers."""
from __future__ import annotations

import copy
import importlib
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..exercises import Mistake
from ..verdict import Failure, fail
from ._attn_hypotheses import diagnose_weights
from ._device_probe import probe as probe_device
from ._device_probe import probe_after_cpu_calls
from ._gradients import check_function_gradients
from ._model_common import ProcedureExample, as_tensor, as_values, randomize_
from ._student_code import call, close, expect_callable, expect_tensor, reraise_with
from .engine import Case, FunctionExercise, ScaleFit, at_other_sizes, checker, first_mistake, function_example, judge
from .engine.example import tiny
from .engine.probes import IN_FLOAT64, batch_mixing, called_in_turn, expect_float64, kept_state_message, run_in_float64
from .engine.scale_fit import fitted_scale

__all__ = ["check_split_c_attn", "check_hf_attention"]


_NAMES = ("Wq", "Wk", "Wv")


# ---------------------------------------------------------------- 7.1 split_c_attn

def _hf() -> Any:
    """course_lib.hf, imported on first use: it imports transformers, which takes seconds."""
    return importlib.import_module("course_lib.hf")


def _split_cases(sizes: tuple[int, ...], seed: int, small: bool = False) -> list[Case]:
    generator = torch.Generator().manual_seed(seed)
    weights = [tiny(generator, e, 3 * e) if small else torch.randn(e, 3 * e, generator=generator) for e in sizes]
    return [Case((w,), f"split_c_attn(weight of shape {tuple(w.shape)})") for w in weights]


def _thirds(fn: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The student's (Wq, Wk, Wv) as one (3, E, E) tensor, once they are three matrices of (E, E)."""
    def split(weight: torch.Tensor) -> torch.Tensor:
        what, embed_dim = f"split_c_attn(weight of shape {tuple(weight.shape)})", weight.shape[0]
        result = as_tensor(fn(weight))
        if isinstance(result, torch.Tensor) and result.dim() == 3 and result.shape[0] == 3:
            result = tuple(result.unbind(0))   # a stacked (3, E, E) unpacks just as well
        result = as_values(result, 3)   # so does a generator or a map
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            fail("dtype" if result is not None else "shape",
                 f"{what} should return three tensors (Wq, Wk, Wv), but returned "
                 f"{'nothing (did you forget `return`?)' if result is None else type(result).__name__}"
                 f"{f' of length {len(result)}' if isinstance(result, (tuple, list)) else ''}.")
        parts = [as_tensor(p) for p in result]
        for name, part in zip(_NAMES, parts):
            if isinstance(part, torch.Tensor) and part.dim() == 2 and part.shape[1] == 3 * embed_dim:
                fail("shape", f"{what}: {name} has shape {tuple(part.shape)}. Split along the last dimension "
                              f"(the 3 * embed_dim outputs of c_attn), not the first.")
            expect_tensor(part, (embed_dim, embed_dim), f"{what}: {name}")
        return torch.stack(parts)                                   # (3, E, E)
    return split


def _split_mistake(order: tuple[int, ...], transposed: bool) -> Mistake:
    """The three thirds in another order, or left in Conv1D's (in, out) layout, or both."""
    problems = [] if transposed else [
        "each third is still in Conv1D's (in, out) layout: either it was never transposed, or it was transposed "
        "twice (the whole weight, then each block again), and two transposes cancel. Conv1D stores its weight as "
        "(in, out) and computes x @ W, while nn.Linear stores (out, in) and computes x @ W.T, so each third needs "
        "exactly one .T"]
    if order != (0, 1, 2):
        problems.append(f"the order is wrong: c_attn's output holds the query first, then the key, then the value; "
                        f"you returned them as ({', '.join(_NAMES[j] for j in order)})")
    return Mistake("mismatch" if transposed else "split_transpose", "; and ".join(problems) + ".",
                   output=lambda weight: torch.stack([p if transposed else p.T
                                                      for p in _hf().split_c_attn(weight)])[list(order)])


def _some_transposed(kept: tuple[int, ...]) -> Mistake:
    """The thirds in order, those in ``kept`` left in Conv1D's (in, out) layout, the others transposed."""
    names = " and ".join(_NAMES[j] for j in kept)
    return Mistake("split_transpose", f"{names} {'is' if len(kept) == 1 else 'are'} still in Conv1D's (in, out) "
                                      f"layout: transpose each of the three blocks, not only some.",
                   output=lambda weight: torch.stack([p.T if j in kept else p
                                                      for j, p in enumerate(_hf().split_c_attn(weight))]))


def _every_third(transposed: bool) -> Mistake:
    return Mistake("mismatch", "you took every third column. The query, key and value are three consecutive blocks "
                               "of embed_dim columns each.",
                   output=lambda w: w.view(w.shape[0], w.shape[0], 3).permute(2, 1 if transposed else 0,
                                                                             0 if transposed else 1))


def _reshaped_rows(transposed: bool) -> Mistake:
    """weight.reshape(3, E, E): the (E, 3E) weight's memory cut into three blocks of E rows' worth, not columns."""
    return Mistake("mismatch", "you reshaped the (E, 3E) weight into (3, E, E) (a view or reshape keeps the memory "
                               "order, so each block holds whole rows of c_attn, the query's, key's and value's "
                               "columns mixed). Split the columns into three consecutive blocks instead: "
                               "weight.split(E, dim=1) (or chunk(3, dim=1)), then transpose each.",
                   output=lambda w: w.reshape(3, w.shape[0], w.shape[0]).transpose(1, 2) if transposed
                   else w.reshape(3, w.shape[0], w.shape[0]))


# GPT-2's widths (small, medium, large, XL): a split that fails at the cases' widths but is right at one of these has
# that width written into it
_GPT2_WIDTHS = (768, 1024, 1280, 1600)


def _width_written(failure: Failure, case: Case, out: Any, fn: Any) -> None:
    """A call or shape that fails at this width, where the split is right at one of GPT-2's or at a width of the
    cases before: a size is written into the code."""
    if failure.diagnosis not in ("exception", "shape", "dtype"):
        return
    earlier = [c.args[0].shape[0] for c in SPLIT_C_ATTN.cases()]
    earlier = earlier[:earlier.index(case.args[0].shape[0])] if case.args[0].shape[0] in earlier else []
    for width in _GPT2_WIDTHS:
        weight = torch.randn(width, 3 * width, generator=torch.Generator().manual_seed(width))
        try:
            right = torch.equal(call(fn, weight, what=f"split_c_attn(weight of shape {tuple(weight.shape)})"),
                                torch.stack(_hf().split_c_attn(weight)))
        except Failure:
            continue
        if right:
            reraise_with(failure, "shape", f" Your split is right for a ({width}, {3 * width}) weight, GPT-2's width "
                                           f"{width}, and for no other: a size is written into your code. Take E "
                                           f"from the weight, E = weight.shape[0].")
    if earlier:
        reraise_with(failure, "shape", f" Your split is right for E = {', '.join(map(str, earlier))} but not "
                                       f"{case.args[0].shape[0]}: most likely a size is written into your code. "
                                       f"Take E from the weight, E = weight.shape[0].")


SPLIT_C_ATTN = FunctionExercise(
    "7.1", "split_c_attn", lambda weight: torch.stack(_hf().split_c_attn(weight)),
    lambda: _split_cases((8, 6, 4), 9), ("weight",),
    success="Three (E, E) matrices in nn.Linear layout, in the order query, key, value.",
    mismatch=lambda run: (f"{run.case.what}: the matrices differ from the reference. Split the columns into three "
                          f"consecutive blocks (query, key, value), then transpose each block into nn.Linear's "
                          f"(out, in) layout."),
    mistakes=(*(_split_mistake(order, transposed) for order in itertools.permutations(range(3))
                for transposed in (True, False) if (order, transposed) != ((0, 1, 2), True)),
              *(_some_transposed(kept) for size in (1, 2) for kept in itertools.combinations(range(3), size)),
              _every_third(True), _every_third(False), _reshaped_rows(True), _reshaped_rows(False)),
    each_case=True, dtype=False, exact=True, reword=_width_written,
    # the weights go into a model that may sit on a GPU: new tensors (buffers copied into) on the weight's device
    probes=FunctionExercise.probes + ("device",),
    examples=lambda: _split_cases((1, 2, 3), 0, small=True),
)


@checker("7.1", example=lambda fn, *_, **__: function_example(SPLIT_C_ATTN)(_thirds(fn)))
def check_split_c_attn(fn: Callable[..., Any]) -> str:
    """fn(weight (E, 3E), Conv1D layout) -> (Wq, Wk, Wv), each (E, E) in nn.Linear layout."""
    expect_callable(fn, "split_c_attn")
    return judge(SPLIT_C_ATTN, _thirds(fn))


# ---------------------------------------------------------------- 7.2 attention function for transformers

def _tiny_gpt2(heads: int = 2, head_dim: int = 8) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=heads * head_dim, n_layer=2, n_head=heads,
                        bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    return randomize_(model, torch.Generator().manual_seed(1)).eval()


def _attention(q, k, v, *, scale: float, mask: torch.Tensor | None = None, dim: int = -1,
               additive: bool = False, after: bool = False, reshaped: bool = False,
               masked_after: bool = False) -> torch.Tensor:
    """Attention in the layout transformers wants back, (N, L, heads, d), with a chosen mistake: ``after``
    scales the weights instead of the scores, ``reshaped`` reshapes (N, heads, L, d) where it transposes,
    ``masked_after`` zeroes the hidden weights after the softmax instead of hiding the scores before it."""
    scores = q @ k.transpose(-2, -1) * (1.0 if after else scale)          # (N, heads, Lq, Lk)
    if mask is not None and not masked_after:
        scores = scores + mask.float() if additive else scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim)
    if mask is not None and masked_after:
        weights = weights.masked_fill(~mask, 0.0)                          # rows no longer sum to one
    out = weights * (scale if after else 1.0) @ v                         # (N, heads, Lq, d)
    n, heads, length, d = out.shape
    return out.reshape(n, length, heads, d) if reshaped else out.transpose(1, 2)   # (N, Lq, heads, d)


def _direct(fn: Callable[..., Any], module: nn.Module, q, k, v, mask, scaling: float, what: str) -> torch.Tensor:
    result = call(fn, module, q.clone(), k.clone(), v.clone(), None if mask is None else mask.clone(),
                  scaling=scaling, dropout=0.0, what=what)
    if isinstance(result, torch.Tensor):
        fail("dtype", f"{what} returned a single tensor; an attention-interface function returns a tuple "
                      f"(attn_output, attn_weights), where attn_weights may be None.")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        fail("dtype" if result is not None else "shape",
             f"{what} should return a tuple (attn_output, attn_weights), but returned "
             f"{'nothing (did you forget `return`?)' if result is None else type(result).__name__}.")
    output = as_tensor(result[0])
    n, heads, length, head_dim = q.shape
    if isinstance(output, torch.Tensor) and tuple(output.shape) == (n, heads, length, head_dim) and heads != length:
        fail("shape", f"{what}: attn_output has shape {tuple(output.shape)} = (N, heads, L, head_dim). "
                      f"transformers wants (N, L, heads, head_dim): swap the heads and positions back before "
                      f"returning.")
    if isinstance(output, torch.Tensor) and tuple(output.shape) == (n, length, heads * head_dim):
        fail("shape", f"{what}: attn_output has shape {tuple(output.shape)}: the heads are already merged. "
                      f"Return (N, L, heads, head_dim); the model merges the heads itself.")
    if isinstance(output, torch.Tensor) and output.is_floating_point() and not torch.isfinite(output).all() and \
            close(output, _attention(q, k, v, scale=scaling, mask=_causal(q) if mask is None else mask, dim=1),
                  nan_ok=True):
        fail("softmax_dim", f"{what}: the softmax runs over the heads (dim=1 of the (N, heads, Lq, Lk) scores): "
                            f"a masked position is -inf in every head, so its column is all -inf and gives NaN. "
                            f"Each query's weights sum to one over the keys: softmax over the last axis, dim=-1.")
    if mask is not None and isinstance(output, torch.Tensor) and output.is_floating_point() and \
            not torch.isfinite(output).all():
        fail("causal_mask", f"{what}: NaN in the output with an attention mask: some query had every key "
                            f"blocked, as when the mask is inverted. The mask is bool with True = may attend; "
                            f"block the positions where it is False.")
    return expect_tensor(output, (n, length, heads, head_dim), f"{what}: attn_output")


# A bool mask (the one given, or a causal one made when none is) added to the scores: nothing is hidden.
_ADDED = tuple(Mistake("causal_mask", "you add the mask to the scores, but it is a bool mask (True = may attend): "
                                      "adding it shifts the allowed scores by one instead of blocking the others, so "
                                      "the keys it should hide (the future, padding) still get weight. Fill the "
                                      "blocked positions with -inf (masked_fill(~mask, float('-inf'))).", output=output)
               for output in (lambda q, k, v, s, mask: _attention(q, k, v, scale=s, mask=mask, additive=True),
                              lambda q, k, v, s, mask: _attention(q, k, v, scale=s, mask=_causal(q) & mask,
                                                                  additive=True)))


# Wrong attention on the direct calls: each output is f(q, k, v, scaling, mask), where mask is the causal
# mask (no attention_mask given) or the padding one (attention_mask given).
_CAUSAL_MISTAKES = (
    Mistake("causal_mask", "attention_mask is None, and you then let every query see every key. transformers passes "
                           "no mask when a plain causal mask would do: apply causality yourself (module.is_causal "
                           "tells you), so query i sees keys 0..i only.",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=s)),
    Mistake("causal_mask", "the causal mask points the wrong way: query i should see keys 0..i (on and below the "
                           "diagonal), not the future ones.",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=s, mask=causal.T)),
    Mistake("softmax_dim", "the softmax runs over the queries (dim -2); each query's weights should sum to one over "
                           "the keys, dim -1.",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=s, mask=causal, dim=-2)),
    Mistake("scale", "the scores are not scaled: multiply them by the `scaling` argument.",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=1.0, mask=causal)),
    Mistake("scale", "the scores are scaled by 1/head_dim, the scale twice: multiply them by `scaling` once. (If "
                     "you scale the queries by `scaling` and then call a function that divides by sqrt(head_dim) "
                     "itself, such as the course's scaled_dot_product_attention, scale them by scaling * "
                     "sqrt(head_dim) instead, as step 2 says.)",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=1.0 / q.shape[-1], mask=causal)),
    Mistake("scale", "the scores are divided by `scaling`; `scaling` is the factor itself (head_dim ** -0.5): "
                     "multiply the scores by it.",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=1.0 / s, mask=causal)),
    Mistake("scale", "`scaling` multiplies the weights after the softmax; it belongs to the scores that go into "
                     "the softmax (afterwards it only shrinks the output, every row then sums to `scaling`).",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=s, mask=causal, after=True)),
    Mistake("normalization", "the mask is applied after the softmax: the hidden weights are set to 0 afterwards, "
                             "so each query's weights no longer sum to one. Hide the scores before the softmax "
                             "(masked_fill with -inf), so that it normalises over the visible keys only.",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=s, mask=causal, masked_after=True)),
    Mistake("causal_mask", "your causal mask lets one future key through (the diagonal above the main one): "
                           "query i sees keys 0..i, the lower triangle with its diagonal, tril(diagonal=0).",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=s,
                                                         mask=torch.ones(causal.shape, dtype=torch.bool).tril(1))),
    Mistake("head_split", "attn_output is reshaped from (N, heads, L, head_dim) to (N, L, heads, head_dim): a "
                          "reshape keeps the memory order, so it mixes positions and heads. Move the axes with "
                          "transpose(1, 2).",
            output=lambda q, k, v, s, causal: _attention(q, k, v, scale=s, mask=causal, reshaped=True)),
)
_IGNORED = Mistake("causal_mask", "the attention_mask you were given is ignored, so padding tokens are attended to. "
                                  "When a mask is passed, use it (bool, True = may attend).",
                   output=lambda q, k, v, s, mask: _attention(q, k, v, scale=s, mask=_causal(q)))
# judged before the sequences are run one by one (_each_sequence_alone), the mask ignored after: a mask of one
# sequence used for all is right for each sequence alone, and equals the mask ignored where that one has no padding
_PADDING_MISTAKES = (
    Mistake("causal_mask", "the attention_mask lost its heads axis (squeeze(1), or mask[:, 0]): an (N, Lq, Lk) mask "
                           "lines the batch up with the heads, so a head gets another sequence's padding. Use the "
                           "(N, 1, Lq, Lk) mask as it is given; it broadcasts over the heads.",
            output=lambda q, k, v, s, mask: _attention(q, k, v, scale=s, mask=mask.squeeze(1))),
    *_ADDED,
)


# A factor on the scores that is none of _CAUSAL_MISTAKES': found by a search, and named with its value.
_SCALE = ScaleFit(lambda q, k, v, causal, scaling, factor: _attention(q, k, v, scale=factor, mask=causal),
                  lambda q, k, v, causal, scaling: scaling,
                  "{what}: your scores are multiplied by {factor:.4g}, where the `scaling` argument is {right:.4g}. "
                  "Multiply q @ k^T by `scaling` itself, once, before the softmax: the model chose it.")


def _causal(q: torch.Tensor) -> torch.Tensor:
    return torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()


def _check_direct(fn: Callable[..., Any], module: nn.Module, generator: torch.Generator) -> None:
    reference = _hf().course_attention_forward
    n, heads, length, head_dim = 2, 2, 5, 8
    q, k, v = (torch.randn(n, heads, length, head_dim, generator=generator) for _ in range(3))
    scaling, causal = head_dim ** -0.5, _causal(q)
    what = "your attention function (attention_mask=None)"
    got = _direct(fn, module, q, k, v, None, scaling, what)
    if not close(got, _direct(fn, module, q, k, v, None, scaling, what)):
        fail("dropout", f"{what}: two identical calls gave different outputs with dropout=0.0. Use the `dropout` "
                        f"argument (and module.training) instead of a fixed rate.")
    expected = reference(module, q, k, v, None, scaling=scaling)[0]
    if not close(got, expected):
        first_mistake(_CAUSAL_MISTAKES + _ADDED, lambda m: close(got, m.output(q, k, v, scaling, causal)),
                      f"{what}: ")
        found = fitted_scale(_SCALE, [((q, k, v, causal, scaling), what, got)])
        if found is not None:
            fail("scale", found)
        _read_weights_back(fn, module, q, k, None, scaling, what)
        fail("mismatch", f"{what}: the output differs from causal scaled dot-product attention (largest "
                         f"difference {(got - expected).abs().max():.3g}).")
    what = "your attention function (scaling=0.5)"
    got = _direct(fn, module, q, k, v, None, 0.5, what)
    if not close(got, reference(module, q, k, v, None, scaling=0.5)[0]):
        if close(got, expected):
            fail("scale", f"{what}: you ignore the `scaling` argument and compute your own factor. Models "
                          f"choose their own scale (some divide by the layer index as well): use the one given.")
        fail("scale", f"{what}: with scaling=0.5 the output is wrong: multiply the scores by `scaling` before the "
                      f"softmax.")
    _check_other_heads(fn, generator)
    keep = torch.ones(n, length, dtype=torch.bool)
    keep[1, -2:] = False                                                  # right padding in the second row
    mask = causal[None, None] & keep[:, None, None, :]                    # (N, 1, Lq, Lk)
    what = "your attention function (with a padding attention_mask)"
    got = _direct(fn, module, q, k, v, mask, scaling, what)
    expected = reference(module, q, k, v, mask, scaling=scaling)[0]
    if not close(got, expected):
        _kept_on_layer(fn, module, q, k, v, mask, scaling, what, got)
        first_mistake(_PADDING_MISTAKES, lambda m: close(got, m.output(q, k, v, scaling, mask)), f"{what}: ")
        _each_sequence_alone(fn, module, q, k, v, mask, scaling, what, got)
        first_mistake((_IGNORED,), lambda m: close(got, m.output(q, k, v, scaling, mask)), f"{what}: ")
        _read_weights_back(fn, module, q, k, mask, scaling, what)
        fail("mismatch", f"{what}: with a padding mask the output differs from the reference (largest "
                         f"difference {(got - expected).abs().max():.3g}). The mask is bool, True = may attend.")
    try:
        check_function_gradients(lambda *qkv: _direct(fn, module, *qkv, causal[None, None], scaling, what),
                                 lambda *qkv: reference(module, *qkv, causal[None, None], scaling=scaling)[0],
                                 q, k, v, names=("query", "key", "value"), what="your attention function")
    except Failure as failure:
        if failure.diagnosis == "mismatch":   # right before, on this layer: what did it keep from those calls?
            what = "your attention function (with the causal mask as attention_mask)"
            got = _direct(fn, module, q, k, v, causal[None, None], scaling, what)
            _kept_on_layer(fn, module, q, k, v, causal[None, None], scaling, what, got)
        raise
    _check_fewer_queries(fn, module, k, v, scaling, generator)
    _check_fewer_queries_masked(fn, module, k, v, scaling, generator)


def _kept_on_layer(fn: Callable[..., Any], module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, scaling: float, what: str, got: torch.Tensor) -> None:
    """``kept_state`` where ``got``, wrong on ``module`` after the calls before it, is right on the same inputs given a
    fresh layer of the same sizes: the function kept something on the layer (a mask, a scale, a result) from an
    earlier call, or keyed a cache by the layer."""
    fresh = _tiny_gpt2(heads=module.num_heads, head_dim=module.head_dim).transformer.h[0].attn
    expected = _hf().course_attention_forward(fresh, q, k, v, mask, scaling=scaling)[0]
    if close(got, expected):
        return
    try:
        again = _direct(fn, fresh, q, k, v, mask, scaling, what)
    except Failure:
        return
    if close(again, expected):
        fail("kept_state", kept_state_message(
            what, ", called on the layer after the calls before it,", f"differs from the reference by up to "
            f"{(got - expected).abs().max():.3g}, yet the same call given a fresh layer is right", thing="attention "
            "function") + " transformers calls it on the same layer for every batch, each with its own "
            "attention_mask: never store the mask (or anything worked out from an earlier call) on `module`; use "
            "the arguments of each call.")


def _each_sequence_alone(fn: Callable[..., Any], module: nn.Module, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, mask: torch.Tensor, scaling: float, what: str, got: torch.Tensor) -> None:
    """``batch_mixing`` where the batch's output is wrong and each sequence, run alone with its own rows of the
    attention_mask, is right: one sequence's padding mask (mask[:1], mask[0]) used for every sequence, or the masks
    combined over the batch."""
    alone = []
    for i in range(q.shape[0]):
        one = slice(i, i + 1)
        try:
            out = _direct(fn, module, q[one], k[one], v[one], mask[one], scaling, what)
        except Failure:
            return
        if not close(out, _hf().course_attention_forward(module, q[one], k[one], v[one], mask[one],
                                                         scaling=scaling)[0]):
            return
        alone.append(out)
    batch_mixing(what, got, alone, "the attention_mask holds one padding mask per sequence, (N, 1, Lq, Lk), and "
                                   "each sequence must use its own: use the mask as it is given (it broadcasts over "
                                   "the heads), never one sequence's rows (attention_mask[:1], attention_mask[0]) "
                                   "for all, nor the masks combined over the batch.")


def _read_weights_back(fn: Callable[..., Any], module: nn.Module, q: torch.Tensor, k: torch.Tensor,
                       mask: torch.Tensor | None, scaling: float, what: str) -> None:
    """The attention weights read back, as 3.3 reads them (``diagnose_weights``): with one-hot values (value j is
    e_j, padded to head_dim) query i's output row is its weights. The hidden keys still weighed (a bool mask added to
    the scores, a fill that is not -inf), weights that do not sum to one, a wrong scale are named from them."""
    length = k.shape[-2]
    v = torch.eye(length, k.shape[-1], dtype=k.dtype).expand_as(k)              # (N, heads, Lk, d), Lk <= d
    weights = _direct(fn, module, q, k, v, mask, scaling, what).transpose(1, 2)[..., :length]   # (N, heads, Lq, Lk)
    try:
        diagnose_weights(weights, q @ k.transpose(-2, -1), _causal(q) if mask is None else mask, scaling,
                         hidden="future keys" if mask is None else "future and padding keys", scale_name="`scaling`",
                         inputs="the query and the key you were given")
    except Failure as failure:
        raise Failure(failure.diagnosis, f"{what}: {failure.message}", **failure.details) from None


def _check_other_heads(fn: Callable[..., Any], generator: torch.Generator) -> None:
    """3 heads of 4 and 6 positions: the calls above, and the model, have 2 heads of 8. The layer handed over has
    3 heads of 4 too, as in a real call (a function may read module.head_dim)."""
    module = _tiny_gpt2(heads=3, head_dim=4).transformer.h[0].attn
    q, k, v = (torch.randn(1, 3, 6, 4, generator=generator) for _ in range(3))
    what = f"your attention function on query, key and value of shape {tuple(q.shape)} (scaling=0.5)"
    at_other_sizes(lambda: _direct(fn, module, q, k, v, None, 0.5, what),
                   lambda: _hf().course_attention_forward(module, q, k, v, None, scaling=0.5)[0], what,
                   "with 2 heads of 8", "Take the sizes from query.shape, (N, heads, L, head_dim).",
                   scale=(_SCALE, (q, k, v, _causal(q), 0.5)))


def _check_float64(fn: Callable[..., Any], module: nn.Module) -> None:
    """The dtype probe: q, k, v and the layer in float64, in a float64 notebook; attn_output must follow them.
    No magnitude probe: transformers hands the function scores of a pretrained model, and a correct mask applied
    after the softmax (then renormalised) underflows on large scores, as in 2.2."""
    reference = _hf().course_attention_forward
    n, heads, length, head_dim = 2, 2, 5, 8
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, heads, length, head_dim, generator=generator, dtype=torch.float64) for _ in range(3))
    what = f"your attention function (attention_mask=None) {IN_FLOAT64}"

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        layer = copy.deepcopy(module).double()
        return (_direct(fn, layer, q, k, v, None, head_dim ** -0.5, what),
                reference(layer, q, k, v, None, scaling=head_dim ** -0.5)[0])
    got, expected = run_in_float64(run)
    expect_float64(got, expected, what)


def _check_fewer_queries(fn: Callable[..., Any], module: nn.Module, k: torch.Tensor, v: torch.Tensor,
                         scaling: float, generator: torch.Generator) -> None:
    """Step 1 of the spec with a KV cache: the Lq queries are the LAST Lq of the Lk positions."""
    n, heads, k_len, head_dim = k.shape
    for q_len in (1, 2):
        q = torch.randn(n, heads, q_len, head_dim, generator=generator)        # (N, heads, Lq, d)
        what = f"your attention function ({q_len} quer{'y' if q_len == 1 else 'ies'}, {k_len} keys, no mask)"
        try:
            got = _direct(fn, module, q, k, v, None, scaling, what)
        except Failure as failure:
            if failure.diagnosis != "nan":
                raise
            # with as many queries as keys the function gave no NaN (checked before): a query sees no key here
            reraise_with(failure, "causal_mask", " Here it appears only with fewer queries than keys, so your causal "
                                                 "mask most likely leaves a query with no key. The queries are the "
                                                 "last Lq of the Lk positions: query i may see keys 0..i + (Lk - Lq), "
                                                 "tril(diagonal=Lk - Lq) (a diagonal of Lq - Lk hides every key from "
                                                 "the first queries).")
        bottom_right = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)   # (Lq, Lk)
        if close(got, _attention(q, k, v, scale=scaling, mask=bottom_right)):
            continue
        top_left = torch.ones(q_len, k_len, dtype=torch.bool).tril()
        if close(got, _attention(q, k, v, scale=scaling, mask=top_left)):
            fail("causal_mask", f"{what}: your causal mask is aligned top-left, so query i sees keys 0..i. With a "
                                f"KV cache the queries are the last Lq of the Lk positions: query i may see keys "
                                f"0..i + (Lk - Lq), torch.ones(Lq, Lk, dtype=torch.bool, device=query.device)"
                                f".tril(diagonal=Lk - Lq).")
        fail("mismatch", f"{what}: the output differs from causal attention where the queries are the last "
                         f"{q_len} of the {k_len} positions (query i sees keys 0..i + {k_len - q_len}).")


def _check_fewer_queries_masked(fn: Callable[..., Any], module: nn.Module, k: torch.Tensor, v: torch.Tensor,
                                scaling: float, generator: torch.Generator) -> None:
    """Step 1 with a KV cache and padding: a mask is given and the Lq queries are the last of the Lk positions (as a
    cached step of generate() with left padding calls it). The given mask is the whole answer: it holds causality
    and the padding. Every query keeps a key to see (the text asks nothing of a query that sees none)."""
    n, heads, k_len, head_dim = k.shape
    for q_len in (1, 2):
        q = torch.randn(n, heads, q_len, head_dim, generator=generator)                 # (N, heads, Lq, d)
        causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)   # (Lq, Lk)
        mask = causal.expand(n, 1, q_len, k_len).clone()                                  # (N, 1, Lq, Lk)
        mask[-1, :, :, :2] = False   # the last sequence left-padded by two tokens
        what = (f"your attention function ({q_len} quer{'y' if q_len == 1 else 'ies'}, {k_len} keys, an "
                f"attention_mask with padding: a cached step of generate())")
        said = (" With a mask given, the mask is the whole answer: it already holds causality (for the last Lq "
                "of the Lk positions) and the padding. Use attention_mask as it comes.")
        try:
            got = _direct(fn, module, q, k, v, mask, scaling, what)
        except Failure as failure:
            if failure.diagnosis in ("nan", "causal_mask") and "NaN" in failure.message:
                fail("causal_mask", f"{what}: NaN in the output, though every query here has keys it may see: in "
                                    f"your code a query sees none. A causal mask of your own, aligned top-left and "
                                    f"combined with the one given, does that: it leaves the first query only key 0, "
                                    f"which is padding here." + said)
            raise
        if close(got, _attention(q, k, v, scale=scaling, mask=mask)):
            continue
        top_left = torch.ones(q_len, k_len, dtype=torch.bool).tril()
        for wrong, how in ((causal, "ignores the given attention_mask here (the padded keys get weight)"),
                           (mask & top_left, "combines the given mask with a causal mask of its own aligned "
                                             "top-left (query i sees keys 0..i)")):
            if close(got, _attention(q, k, v, scale=scaling, mask=wrong)):
                fail("causal_mask", f"{what}: your function {how}.{said}")
        fail("mismatch", f"{what}: the output differs from attention with the given mask.{said}")


def _check_on_device(fn: Callable[..., Any], layer: nn.Module) -> None:
    """The text makes the causal mask on the query's device: one made on the CPU cannot meet a GPU's scores. Last,
    so that every other mistake is named first; the meta device stands for the GPU (a tensor made without
    ``device=`` lands on the CPU, and meets the meta scores as it would a GPU's). ``layer`` is the one GPT-2 ran with
    on the CPU: a copy of it moves to meta (as model.to(device) moves it), with whatever the function kept on it."""
    heads, head_dim = layer.num_heads, layer.head_dim
    # 1 query and 3 keys (a step with a cache), then 3 and 3, the sizes GPT-2 just ran on the CPU (in turn, above): a
    # mask kept from those calls and looked up by its size alone is still on the CPU
    sizes = [(queries, f"your attention function ({queries} quer{'y' if queries == 1 else 'ies'}, 3 keys, no mask")
             for queries in (1, 3)]
    moved = copy.deepcopy(layer).to("meta")
    for queries, what in sizes:
        what += f", on another device than the CPU{', after calls of that size on the CPU' if queries == 3 else ''})"
        q, k, v = (torch.empty(1, heads, length, head_dim, device="meta") for length in (queries, 3, 3))
        probe_device(lambda q=q, k=k, v=v, what=what: _direct(fn, moved, q, k, v, None, 0.5, what), what)
    # then the same calls on the CPU first, with another copy of the layer, which then moves to meta: a mask kept on
    # the layer or in a global (an lru_cache too) keyed by its sizes, or by the layer, but not by the device shows
    warm, generator = copy.deepcopy(layer), torch.Generator().manual_seed(8)
    cpu = {queries: [torch.randn(1, heads, length, head_dim, generator=generator) for length in (queries, 3, 3)]
           for queries, _ in sizes}
    probe_after_cpu_calls(
        [(what + ")",
          lambda qkv=cpu[queries], what=what: _direct(fn, warm, *qkv, None, 0.5, what),
          lambda qkv=cpu[queries], what=what: _direct(fn, warm, *(t.to("meta") for t in qkv), None, 0.5, what))
         for queries, what in sizes], move=lambda: warm.to("meta"))


def _attention_cases() -> list[Case]:
    # a layer of one head of 2, the cases' sizes: the function may read them from the layer as from the query
    module, generator = _tiny_gpt2(heads=1, head_dim=2).transformer.h[0].attn, torch.Generator().manual_seed(0)
    cases = []
    for length in (1, 2, 3):
        q, k, v = (tiny(generator, 1, 1, length, 2) for _ in range(3))   # (N, heads, L, head_dim)
        cases.append(Case((module, q, k, v, 0.5), f"your attention function on one head of {length} "
                                                  f"position{'s' if length > 1 else ''} (attention_mask=None, "
                                                  f"scaling=0.5), attn_output"))
    return cases


_ATTENTION_EXAMPLE = ProcedureExample(
    lambda module, q, k, v, scaling: _hf().course_attention_forward(module, q, k, v, None, scaling=scaling)[0],
    _attention_cases, ("module", "query", "key", "value", "scaling"))


@checker("7.2", example=lambda fn, *_, **__: function_example(_ATTENTION_EXAMPLE)(
    lambda module, q, k, v, scaling: _direct(fn, module, q, k, v, None, scaling, "your attention function")))
def check_hf_attention(fn: Callable[..., Any]) -> str:
    """fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs) -> (output, weights)."""
    run_with_attention = _hf().run_with_attention
    if not callable(fn):
        fail("exception", f"Pass your attention function itself, not {type(fn).__name__}.")
    model = _tiny_gpt2()
    generator = torch.Generator().manual_seed(2)
    _check_direct(fn, model.transformer.h[0].attn, generator)
    _check_float64(fn, model.transformer.h[0].attn)
    vocab = model.config.vocab_size
    for batch, length, padded in ((2, 6, False), (1, 1, False), (2, 7, True)):
        ids = torch.randint(0, vocab, (batch, length), generator=generator)
        mask = torch.ones(batch, length, dtype=torch.long)
        if padded:
            mask[1, -3:] = 0
        what = f"GPT-2 with your attention on input_ids of shape {tuple(ids.shape)}" + \
               (" with padding" if padded else "")
        got = call(run_with_attention, model, fn, ids, mask if padded else None, what=what)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask if padded else None).logits
        got = expect_tensor(got, tuple(expected.shape), what)
        real = mask.bool()
        if not close(got[real], expected[real]):
            changed = ids.clone()
            changed[:, -1] = (changed[:, -1] + 1) % vocab
            later = call(run_with_attention, model, fn, changed, None, what=what) if length > 1 and not padded \
                else got
            if not close(later[:, :-1], got[:, :-1]):
                fail("causal_mask", f"{what}: changing the last token changes the logits at earlier positions, "
                                    f"so your attention lets the future leak into the past. Apply the mask (or "
                                    f"causality when attention_mask is None).")
            fail("mismatch", f"{what}: the logits differ from GPT-2's own attention (largest difference "
                             f"{(got[real] - expected[real]).abs().max():.3g}).")
    # the same model, short inputs in turn (two of one batch, two of a batch of one): keys and values kept between
    # calls show here
    shorts = [torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
              for seed, shape in ((1, (2, 3)), (2, (2, 3)), (3, (1, 3)), (4, (1, 3)))]   # a batch of one too

    def logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids).logits
    called_in_turn([(f"GPT-2 with your attention on input_ids {ids.tolist()}",
                     lambda ids=ids: call(run_with_attention, model, fn, ids, None, what=f"GPT-2 with your attention "
                                                                                          f"on input_ids {ids.tolist()}"),
                     lambda ids=ids: logits(ids)) for ids in shorts], thing="attention function")
    _check_on_device(fn, model.transformer.h[0].attn)
    return "GPT-2 gives the same logits with your attention as with its own, padding included."
