"""What every exercise gets besides the comparison of its outputs: the shared probes.

Each exercise lists the probes it gets (``FunctionExercise.probes``); ``tests/test_engine_probes.py`` holds every
function exercise to them by behaviour (a correct attempt with the probe's mistake planted must get its verdict).
Where a probe lives:

- ``gradient``: one backward pass beside the reference's, gradient by gradient (``_gradients``).
- ``mutation``: an input changed in place is a verdict (``_student_code.call``, on every call), and so is a
  module's parameter that its own forward changed (a clamp_, a weight decay, ``.data = ...``).
- ``reference_guard``: the exercise's own reference doing the work is a verdict (``reference_guard``,
  entered by ``engine.run`` around every check).
- ``counterexample``: the smallest input on which the student and the reference differ (``example``).
- ``device``: the output on the inputs' device (``_student_code.expect_cpu``); where the text asks for the
  input's device, a case again on the meta device, where a tensor made on the CPU or a result copied there shows
  (``_device_probe``: ``engine.function`` runs it for the function exercises that list it, and module checks; a
  module's, ``probe_module``, also after the same calls on the CPU, then moved to meta, ``probe_after_cpu_calls``,
  so that a cache keyed by shape or dtype but not by device meets meta inputs).
- ``magnitude``: the exercise's cases again at the magnitudes a softmax or a norm must survive: scores in
  the hundreds, rows far below zero, rows of very different scales (``magnitude_rows``, ``magnitude_scores``
  make them from a case's inputs; ``FunctionExercise.magnitude`` lists them).
- ``dtype``: the cases again with float64 inputs, first in the notebook's own default dtype (a new tensor made
  without dtype= shows), then in a float64 notebook (``torch.set_default_dtype(torch.float64)``): a dtype written
  into the code shows (``in_float64``, judged by ``engine.function``). An exercise that
  is a module or a procedure builds and runs its work inside ``float64_notebook`` through ``run_in_float64``
  (an exception that float32 did not raise is ``dtype``), then ``expect_float64`` judges a floating output and
  ``expect_dtype_kept`` the model the student's procedure was given (``model.float()`` inside it is ``dtype``);
  ``module_in_float64`` is all of it for a module beside its reference (2.2, 3.3, 4.2, 4.3, 9.3, 9.4, 9.6), run on a
  fresh module and again on one called first in the default dtype, then converted with model.double() (what its
  first call kept, a dtype or a cast weight, shows).
- ``bfloat16``: the inputs in bfloat16 (``in_bfloat16``), where a tensor made in float32 is not promoted away as it
  is in float64: the result's dtype is judged (``expect_dtype_in_bfloat16``; a raise of two dtypes meeting is
  ``dtype``: ``called_in_bfloat16``), not its values. ``engine.function`` runs it for the function exercises that
  list it (1.3, 3.1, 3.2, 9.2, 9.5: their text asks for the inputs' dtype); 9.3, 10.1, 10.2, 10.3, 11.3, 12.2 and
  12.3 call it themselves.
- ``global_state``: torch's and the course's functions as the check found them at import; one replaced
  (``torch.equal = ...``) is the verdict ``patched`` (``checks._pinned``). The default dtype or grad mode left
  changed by a call is ``global_setting`` (``_student_code.call``; a with-block's own ``__enter__`` and
  ``__exit__`` may change them, ``with_block_step``).
- ``saved_tensors``: an autograd.Function's forward and backward run by ``engine.saved_tensors.forward_backward``:
  an input, ``grad_out`` or a tensor saved for backward changed in place is ``mutation``, the tensor named (10.3).
- ``batch``: each item of a batch alone right, the batch together wrong: the items leak into each other
  (``batch_mixing``: modules compare their own outputs with it; ``engine.function`` slices a function
  exercise's cases along their leading axes for the exercises that list it).
- ``kept_state`` of a module or a procedure (the function exercises: ``engine.function``): the same object called
  several times in a row (short inputs of one batch, another input of the same shape, a change of mode, a change of
  its weights as an optimizer's step makes: ``weight_step``), each call beside what a fresh one gives
  (``called_in_turn``); what is drawn at random must be new at every call of a few in a row (``repeated_draw``), and
  a result that changes from call to call with torch's random state seeded alike comes from an earlier call, not
  from a draw (``random_or_kept``); generations with a new cache each, the last one freed before the next is made
  (``generations_with_fresh_caches``: 9.6, 12.2).
- ``model_state``: everything a context manager or hook can change on a module tree, snapshotted before the
  student's code and compared after, each difference named (``engine.model_state``; 11.3).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from ...verdict import Failure, fail
from .._gradients import check_function_gradients
from .._student_code import call, close, close_in_float64, expect_tensor, max_diff

# Every probe an exercise may list, written or not yet: a declaration naming another is a typo.
PROBES = ("gradient", "mutation", "reference_guard", "counterexample", "device",
          "magnitude", "dtype", "bfloat16", "saved_tensors", "model_state", "global_state", "batch")


def gradient_probe(fn: Callable[..., Any], reference: Callable[..., Any], args: Sequence[Any],
                   names: Sequence[str], what: str) -> None:
    """Backpropagate the same loss through the student's function and the reference on ``args``; the
    floating-point tensors among them are compared by their names in ``names`` (the others are skipped)."""
    floats = [name for name, a in zip(names, args) if getattr(a, "is_floating_point", lambda: False)()]
    check_function_gradients(fn, reference, *args, names=floats, what=what)


# ---------------------------------------------------------------- magnitude

# exp overflows float32 past 88 and float64 past 709, and underflows to 0 below about -104 (float32) and
# -745 (float64): these inputs pass those bounds in both dtypes.
_LARGE = 300.0      # a unit-spread row scaled to scores of several hundred
_FAR = 1000.0       # how far below zero (or apart) whole rows are moved


def _unit_spread(x: torch.Tensor) -> torch.Tensor:
    """``x`` divided by the spread of its finite entries (a masked -inf stays -inf)."""
    finite = x[x.isfinite()]
    return x / finite.std().clamp_min(1e-6) if finite.numel() > 1 else x


def magnitude_rows(x: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """``x`` (..., L), read as rows of scores along its last axis, at three magnitudes a stable softmax (or
    log-sum-exp) survives and a naive one does not, each with the words a message shows:

    - every score scaled to several hundred: ``exp`` overflows unless the row's maximum is subtracted;
    - every row far below zero: ``exp`` underflows to 0 (0/0) unless the maximum is, a maximum starting at 0 too;
    - rows of very different scales and offsets: one maximum shared by all rows leaves some rows at 0/0.
    """
    unit = _unit_spread(x)
    rows = unit.reshape(-1, x.shape[-1]) if x.dim() else unit.reshape(1, 1)        # (rows, L)
    pattern = torch.tensor([(1.0, _FAR), (40.0, 0.0), (1.0, -_FAR), (0.05, 0.0)], dtype=x.dtype)
    scale, offset = pattern[torch.arange(rows.shape[0]) % len(pattern)].unbind(-1)      # (rows,) each
    mixed = (rows * scale[:, None] + offset[:, None]).reshape(x.shape)
    negative = unit - _FAR
    return [(unit * _LARGE, f"scores scaled to about \u00b1{_LARGE:.0f}"),
            (negative, f"every score below {float(negative[negative.isfinite()].max()):.0f}"),
            (mixed, f"rows {2 * _FAR:.0f} apart and of scales from 0.05 to 40")]


def magnitude_scores(q: torch.Tensor, k: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """Queries and keys (..., L, d) (a single query (d,) too) whose scores q k^T / sqrt(d) have the magnitudes
    of ``magnitude_rows``, each with the words a message shows:

    - both scaled: scores of several hundred;
    - one direction added to every key and, with alternating signs, to the queries: every score of one query
      row near +S and of the next near -S (S of several hundred): a maximum shared by all rows fails;
    - the same direction subtracted from every query: every score near -S, so exp underflows to 0/0 unless
      each row's maximum is subtracted (a maximum that starts at 0 fails too).
    """
    d = q.shape[-1]
    # a score is a sum of d products over sqrt(d): its spread is about std(q) * std(k); make it _LARGE / 3
    spread = float(q.std()) * float(k.std()) if q.numel() > 1 and k.numel() > 1 else 1.0
    grow = (_LARGE / 3 / max(spread, 1e-6)) ** 0.5
    push = (2 * _LARGE * d ** 0.5) ** 0.5   # push**2 / sqrt(d) = 2 * _LARGE: a score of several hundred
    direction = torch.zeros(d, dtype=q.dtype)
    direction[0] = push
    signs = torch.ones(q.shape[-2] if q.dim() > 1 else 1, dtype=q.dtype)
    signs[1::2] = -1.0                                                          # (L,): +, -, +, ...
    alternating = signs[:, None] * direction if q.dim() > 1 else direction      # (L, d), or (d,) for one query
    return [(q * grow, k * grow, f"scores scaled to about \u00b1{_LARGE:.0f}"),
            (q + alternating, k + direction, f"every score of one query near +{2 * _LARGE:.0f}, of the next near "
                                             f"-{2 * _LARGE:.0f}"),
            (q - direction, k + direction, f"every score near -{2 * _LARGE:.0f}")]


# ---------------------------------------------------------------- dtype

def in_float64(args: Sequence[Any]) -> tuple[Any, ...]:
    """The arguments with every floating-point tensor in float64 (the others as they are)."""
    return tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


T = TypeVar("T")

IN_FLOAT64 = "in a float64 notebook (torch.set_default_dtype(torch.float64))"
DTYPE_ADVICE = ("A dtype is written into your code (torch.float32, .float(), a fixed dtype=...): make new tensors "
                "like the input (torch.zeros_like(x), x.new_ones(...), dtype=x.dtype).")


@contextlib.contextmanager
def float64_notebook() -> Iterator[None]:
    """A notebook whose default dtype is float64 while the block runs; the caller's default is put back after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def run_in_float64(run: Callable[[], T]) -> T:
    """``run()`` (which calls the student's code through ``_student_code.call``) in a float64 notebook. The same
    work ran in float32 without an exception, so one raised now comes from a dtype written into the code
    (a float32 tensor meeting float64 ones in a matmul, searchsorted, a KVCache): the verdict ``dtype``."""
    with float64_notebook():
        try:
            return run()
        except Failure as failure:
            if failure.diagnosis != "exception":
                raise
            raise Failure("dtype", f"{failure.message.rstrip().rstrip('.')}. The same code runs in float32, so the "
                                   f"float64 inputs meet a float32 tensor somewhere. {DTYPE_ADVICE}",
                          **failure.details) from None


def expect_float64(out: Any, expected: torch.Tensor, what: str) -> torch.Tensor:
    """The verdict of the dtype probe on one floating output: the reference's shape, its dtype (``dtype``), then its
    values (``precision``: the dtype is right but a part of the work ran in a lower precision)."""
    out = expect_tensor(out, tuple(expected.shape), what, finite=False)
    lower = out.is_floating_point() and torch.finfo(out.dtype).eps > torch.finfo(expected.dtype).eps
    if out.dtype != expected.dtype or lower:
        fail("dtype", f"{what}: your output is {out.dtype}, expected {expected.dtype}. {DTYPE_ADVICE}")
    if not close_in_float64(out, expected):
        fail("precision", f"{what}: your output differs from the reference's by up to {max_diff(out, expected):.3g}, "
                          f"which float64 does not explain: part of your computation runs in a lower precision "
                          f"(.half(), torch.bfloat16, an autocast, a float16 tensor). Keep the input's dtype "
                          f"throughout.")
    return out


def expect_dtype_kept(model: nn.Module, dtype: torch.dtype, what: str) -> None:
    """A procedure given a model leaves its dtype alone: ``model.float()`` inside it changes the caller's model."""
    changed = next(((name, p.dtype) for name, p in model.named_parameters() if p.dtype != dtype), None)
    if changed is not None:
        fail("dtype", f"{what}: afterwards the model's parameter {changed[0]} is {changed[1]}, it was {dtype}: your "
                      f"code changes the dtype of the model it is given (model.float(), model.to(torch.float32)). "
                      f"Use the model as it comes; {DTYPE_ADVICE}")


def module_in_float64(build: Callable[[], tuple[nn.Module, nn.Module]], x: torch.Tensor, what: str,
                      output: Callable[[Any], Any] = lambda out: out) -> None:
    """The dtype probe of a module: ``build()`` makes (the student's module, the reference) with the same weights, in
    eval mode, inside a float64 notebook; both run on ``x`` (float64 where it is floating); the student's output
    (``output`` picks it from what forward returns) must be float64 and agree with the reference's. Then once more
    on a module built and called in the default dtype first, then converted with model.double()
    (``_float64_after_a_call``): what its first call kept shows."""
    what = f"{what} {IN_FLOAT64}"
    given, x = x, (x.double() if x.is_floating_point() else x)

    def run() -> tuple[Any, torch.Tensor]:
        candidate, reference = build()
        with torch.no_grad():
            out = call(candidate, x.clone(), what=what)
            return output(out), reference(x)
    out, expected = run_in_float64(run)
    expect_float64(out, expected, what)
    _float64_after_a_call(build, given, x, what, output)


AFTER_A_CALL = "after a first call in the notebook's default dtype and model.double()"


def _float64_after_a_call(build: Callable[[], tuple[nn.Module, nn.Module]], given: torch.Tensor, x: torch.Tensor,
                          what: str, output: Callable[[Any], Any]) -> None:
    """The dtype probe once more, on a module built and called once in the notebook's default dtype (on ``given``),
    then converted with model.double() (the reference too) and run on ``x`` (float64): something the student's code
    made in its first call and kept (a dtype, a cast weight, a table or a mask cached by length but not by dtype)
    was made in float32, and model.double() does not convert it. Inconclusive where that first call or the
    conversion fails (the fresh float64 run above judged the code)."""
    try:
        candidate, reference = build()
        with torch.no_grad():
            call(candidate, given.clone(), what=what)
        candidate.double()
        reference.double()
    except Exception:  # noqa: BLE001 - Failure included: the first call is judged by the exercise's other runs
        return
    what = f"{what}, {AFTER_A_CALL}"

    def run() -> tuple[Any, torch.Tensor]:
        with torch.no_grad():
            return output(call(candidate, x.clone(), what=what)), reference(x)
    try:
        out, expected = run_in_float64(run)
        expect_float64(out, expected, what)
    except Failure as failure:
        if failure.diagnosis not in ("dtype", "precision"):
            raise
        said = failure.message.replace(DTYPE_ADVICE, "").rstrip()   # no dtype is written in: a fresh one is right
        raise Failure(failure.diagnosis, f"{said} A fresh module built in float64 is right, so "
                                         f"your module keeps something from its first call, made in float32 then (a "
                                         f"dtype it remembers, a weight it cast, a table or a mask it cached on "
                                         f"itself, in a global or with functools.lru_cache, keyed by its length but "
                                         f"not by its dtype), which model.double() does not convert. Key such a "
                                         f"cache by x.dtype too, make the tensor in x.dtype at every call "
                                         f"(self.weight.to(x.dtype)), or register it with self.register_buffer(...) "
                                         f"so that model.to(dtype) converts it.", **failure.details) from None


# ---------------------------------------------------------------- bfloat16

BFLOAT16_ADVICE = ("Make new tensors like the input (torch.zeros_like(x), dtype=x.dtype); a tensor kept in float32 on "
                   "purpose (statistics, as FlashAttention's kernels keep them) is fine if you cast the results back "
                   "at the end: .to(x.dtype).")


def in_bfloat16(args: Sequence[Any]) -> tuple[Any, ...]:
    """The arguments with every floating-point tensor in bfloat16 (the others as they are). Where the float64 probe
    is blind: a tensor made in float32 (torch.full without dtype=, dtype=torch.float32, .float()) meets float64
    inputs and is promoted to float64, but meets bfloat16 ones and promotes them to float32, so the result comes
    back float32 (or a matmul of the two raises)."""
    return tuple(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


FLOAT32_MADE = ("A tensor of your code is made in float32 whatever the inputs' dtype (torch.full or torch.zeros "
                "without dtype=, which take the default, dtype=torch.float32, .float()): float64 inputs hide it, "
                "since float32 with float64 gives float64, but float32 with bfloat16 gives float32.")


def expect_dtype_in_bfloat16(out: Any, what: str, made: str = FLOAT32_MADE) -> None:
    """The verdict ``dtype`` when ``out`` (a floating tensor the student returned for bfloat16 inputs) is not
    bfloat16; ``made``: what in the student's code is likely float32, in words. Its values are not judged."""
    if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.bfloat16:
        fail("dtype", f"{what}: your result is {out.dtype}, expected torch.bfloat16, the inputs' dtype. {made} "
                      f"{BFLOAT16_ADVICE}")


# words of torch's errors where two dtypes meet: a matmul ("expected m1 and m2 to have the same dtype"), einsum and
# bmm ("expected scalar type Float but found BFloat16"), an index_put ("the source and destination dtypes match");
# and of those where one operation has no kernel for a dtype ("view_as_complex is only supported for half, float and
# double tensors, but got a tensor of scalar type: BFloat16"), which is no tensor of the code in another dtype
_DTYPES_MEET = ("dtype", "scalar type")
_NO_KERNEL = ("not implemented for", "only supported for", "not supported", "unsupported", "does not support")


def dtypes_met(failure: Failure, what: str) -> str | None:
    """The error of a failed call (``failure``, ``exception``) where two dtypes meet (a float32 tensor of the code and
    an input of another dtype in a matmul, an index_put), as call() shows it; None for any other error, such as an
    operation torch has no kernel for in that dtype ("not implemented for 'BFloat16'") or numpy, which has no
    bfloat16."""
    said = failure.message.removeprefix(what).strip().removeprefix("raised").strip()   # the error, as call() shows it
    if any(word in said.lower() for word in _NO_KERNEL) or not any(word in said for word in _DTYPES_MEET):
        return None
    return said[:200].rstrip(" .")


def raised_in_bfloat16(failure: Failure, what: str, made: str = FLOAT32_MADE) -> None:
    """After the student's code raised (``failure``, ``exception``) on bfloat16 inputs where it ran on float32 and
    float64 ones: ``dtype`` when the error is two dtypes meeting (``dtypes_met``); returns (inconclusive) for any
    other error. ``made``: what in the student's code is likely float32, in words."""
    said = dtypes_met(failure, what)
    if said is None:
        return
    raise Failure("dtype", f"{what}: your code raised {said}, though it runs on float32 and float64 inputs: a float32 "
                           f"tensor of your code meets the bfloat16 inputs. {made} {BFLOAT16_ADVICE}",
                  **failure.details) from None


def called_in_bfloat16(run: Callable[[], Any], what: str, made: str = FLOAT32_MADE) -> Any:
    """``run()``, the student's code on bfloat16 inputs (after it was judged right in float32 and float64): its
    result, or None where it raised an error other than two dtypes meeting (inconclusive); ``dtype`` where it did."""
    try:
        return run()
    except Failure as failure:
        if failure.diagnosis != "exception":
            raise
        raised_in_bfloat16(failure, what, made)
        return None


def batch_mixing(what: str, together: torch.Tensor, alone: Sequence[torch.Tensor], advice: str,
                 item: Callable[[int], str] = lambda i: f"sequence {i}") -> None:
    """``batch_mixing`` where item i of a batch (``alone[i]``, its output run on its own, with a batch axis of one)
    gives another output in the batch (``together[i]``)."""
    for i, one in enumerate(alone):
        if not close(one[0], together[i], nan_ok=True):
            fail("batch_mixing", f"{what}: {item(i)} gives a different output in a batch of {len(alone)} than alone: "
                                 f"{advice}")


# ---------------------------------------------------------------- kept state

# (batch, length) of the inputs a module is called with in turn (within a context of 8): short ones that fit
# together, another of the same shape, then a batch of one twice (state kept only for a batch of one)
IN_TURN = ((2, 3), (2, 3), (2, 4), (1, 3), (1, 3))


def kept_state_message(what: str, after: str, how: str, thing: str = "module", cache: bool = False) -> str:
    """The words of ``kept_state`` for a call that differs from what a fresh object gives: ``what`` the call, ``after``
    what came before it (", called right after ...,"), ``how`` the difference."""
    return (f"{what}{after} {how}: your {thing} keeps something from one call to the next (keys and values of earlier "
            f"calls, a cache, a dropout mask, a running statistic, stored on it or in a global). Each call must depend "
            f"only on its inputs{' and the cache the caller passes' if cache else ''}: keep what a call computes in "
            f"local variables.")


# What an optimizer's step does to a module between two calls, in words
AFTER_A_STEP = "after its weights changed in place (as an optimizer step changes them)"


def weight_step(*modules: nn.Module) -> Callable[[], None]:
    """The same in-place change to every floating parameter that all ``modules`` have (by name), as an optimizer's
    step makes between two calls; a parameter is changed once however many names it has. Returns the undo.
    Something a module (or code given it) computed from its weights and kept shows afterwards: it still has the
    old values."""
    named = [dict(module.named_parameters()) for module in modules]
    shared = [name for name in named[0] if all(name in other for other in named[1:])]
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for name in shared:
            for params in named:
                p = params[name]
                if id(p) in saved or not p.is_floating_point():
                    continue
                saved[id(p)] = (p, p.detach().clone())
                pattern = torch.cos(torch.arange(p.numel(), dtype=torch.float64)).reshape(p.shape)
                p.mul_(1.25).add_((0.05 * pattern).to(p.dtype))

    def undo() -> None:
        with torch.no_grad():
            for p, before in saved.values():
                p.copy_(before)
    return undo


FRESH_CACHE = ("Your code carries a position (or keys) from one generation into the next: something kept outside the "
               "cache, keyed by id(cache) or stored on self, outlives the cache it was about, and a new cache can get "
               "a freed one's id. Read the start position from the cache itself, start = cache.length.")


def generations_with_fresh_caches(new_cache: Callable[[], Any], step: Callable[[Any, int, int], None],
                                  prompt: int, turns: int = 3) -> None:
    """Generations as a loop over prompts runs them, each with a cache of its own: ``step(cache, start, length)``
    feeds tokens start .. start + length - 1 of one sequence with ``cache`` and fails on a wrong output. First a few
    generations (a prompt of ``prompt`` tokens, then one token) in a row, each cache dropped before the next is made:
    CPython gives a new cache the id of a freed one (freed at once, with no gc.collect() between, which allocates),
    so a position kept by id(cache) carries into the next. Then two caches in turn (prompts of ``prompt`` and
    ``prompt - 1`` tokens, then a token for each): a position kept anywhere but in the cache, even one reset when a
    cache comes empty, is the other cache's. Run once the exercise's cached calls were judged right: any failure
    here is ``kept_state`` (the first generation's too: its cache may get the id of one the check freed before)."""
    def kept(run: Callable[[], None], how: str) -> None:
        try:
            run()
        except Failure as failure:
            if failure.diagnosis == "kept_state":
                raise
            said = failure.message.splitlines()[0].rstrip(" .")
            raise Failure("kept_state", f"{said[:300]}: {how}, though the same calls were right before. "
                                        f"{FRESH_CACHE}") from None

    def generation(cache: Any) -> None:
        step(cache, 0, prompt)
        step(cache, prompt, 1)
    for turn in range(turns):
        cache = new_cache()
        kept(lambda cache=cache: generation(cache), f"in generation {turn + 1} of a loop that makes a new cache for "
                                                   f"each")
        del cache   # its memory, and its id, go to the next one
    first, second = new_cache(), new_cache()
    for cache, start, length in ((first, 0, prompt), (second, 0, prompt - 1), (first, prompt, 1),
                                 (second, prompt - 1, 1)):
        kept(lambda cache=cache, start=start, length=length: step(cache, start, length),
             f"with two caches used in turn (a prompt of {prompt} tokens in one, of {prompt - 1} in the other, then "
             f"a token for each)")


def called_in_turn(calls: Sequence[tuple[str, Callable[[], Any], Callable[[], Any]]], *, thing: str = "module",
                   cache: bool = False, same: Callable[[Any, Any], bool] = close,
                   step: Sequence[nn.Module] = ()) -> None:
    """``kept_state`` where the same module (or a procedure on the same model) called several times in a row does
    not give what a fresh one gives. ``calls`` are (what, the student's call, the reference's result), run in
    order: short inputs of one batch, so that keys, values or a cache carried "while they fit" are used, another
    input of the same shape, a mode switched. Every case was right on a fresh object, so a call that differs now
    depends on an earlier one. ``cache``: the exercise passes a cache, the one state a call may depend on.
    ``step``: the student's module and the reference; the first call runs once more after the same change to both
    one's weights (``weight_step``; undone after), so that a weight (a cast, a copy) kept from an earlier call shows."""
    done: list[str] = []

    def differs(what: str, out: Any, expected: Any) -> str | None:
        if same(out, expected):
            done.append(what)
            return None
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape == expected.shape:
            return f"differs from what a fresh {thing} gives by up to {max_diff(out, expected):.3g}"
        shown = lambda t: (t.tolist() if t.numel() <= 40 else f"a tensor of shape {tuple(t.shape)}") \
            if isinstance(t, torch.Tensor) else repr(t)
        return f"returned {shown(out)} where a fresh {thing} gives {shown(expected)}"

    for what, run, reference in calls:
        how = differs(what, run(), reference())
        if how is None:
            continue
        after = (", called after the checker's earlier calls," if not done else ", called again on other numbers "
                 "right after the same shape," if done[-1] == what else f", called right after {done[-1]},")
        fail("kept_state", kept_state_message(what, after, how, thing, cache))
    if not step or not calls:
        return
    what, run, reference = calls[0]
    undo = weight_step(*step)
    try:
        how = differs(what, run(), reference())
    finally:
        undo()
    if how is not None:
        fail("kept_state", f"{what}, called again {AFTER_A_STEP}, {how}: your {thing} keeps something it made from "
                           f"its weights in an earlier call (a cast or a copy of a weight, stored on it or in a "
                           f"global), so it does not see their new values. Read the weights (self.weight, "
                           f"self.query.weight, ...) at every call.")


def repeated_draw(draws: Sequence[Any], same: Callable[[Any, Any], bool]) -> tuple[int, int] | None:
    """The first two of ``draws`` (what calls in a row drew at random: a dropout mask, sampled tokens) that are the
    same, as (earlier, later); None when every one is new. A mask kept and redrawn only now and then (every other
    call, every fourth, once per shape) shows among a few calls in a row whatever its period."""
    for later in range(1, len(draws)):
        for earlier in range(later):
            if same(draws[earlier], draws[later]):
                return earlier, later
    return None


def random_or_kept(run: Callable[[], Any], same: Callable[[Any, Any], bool], seeds: Sequence[int] = (0, 1, 2)
                   ) -> str | None:
    """Why the same call gives other results from one call to the next: ``run()`` twice for each seed of torch's
    random state (the caller's state kept). "kept" when the same seed gives two results (something kept from an
    earlier call: the random state does not explain it), "random" when only other seeds do (a random draw), None
    when every result is the same."""
    results = []
    with torch.random.fork_rng():
        for seed in seeds:
            for _ in range(2):
                torch.manual_seed(seed)
                results.append(run())
    if any(not same(results[i], results[i + 1]) for i in range(0, len(results), 2)):
        return "kept"
    if any(not same(results[0], other) for other in results[1:]):
        return "random"
    return None


def copy_of(module: nn.Module) -> nn.Module | None:
    """A copy of the student's module as it is now (before the calls of ``in_turn_beside_a_new_copy``); None when it
    cannot be copied (that probe is then skipped)."""
    try:
        return copy.deepcopy(module)
    except Exception:  # noqa: BLE001 - a module that cannot be copied: the probe is inconclusive
        return None


def in_turn_beside_a_new_copy(module: nn.Module, pristine: nn.Module | None,
                              inputs: Sequence[tuple[str, torch.Tensor]],
                              run: Callable[[nn.Module, torch.Tensor, str], Any], *, thing: str = "module") -> None:
    """``called_in_turn`` where the fresh object is the student's own: a new copy of ``pristine`` (``copy_of`` the
    module before any of these calls) for every call, so that the student's code is held only to itself where the
    reference's roundings may differ from a right answer's (a weight and an input of two dtypes). ``inputs``:
    (what, x) in order; the weight step changes the module and ``pristine`` alike."""
    if pristine is None:
        return
    called_in_turn([(what, lambda x=x, what=what: run(module, x, what),
                     lambda x=x, what=what: run(copy.deepcopy(pristine), x, f"{what} (a new copy of your {thing})"))
                    for what, x in inputs], thing=thing, step=(module, pristine))
