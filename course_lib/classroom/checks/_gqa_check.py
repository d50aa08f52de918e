"""Exercise 9.6: a student's GroupedQueryAttention next to the reference, in a full pass and with a KV cache.

The class is built with the notebook's constructor for multi-head (num_kv_heads = num_heads), grouped-query
and multi-query attention, plus QK-norm and a sliding window when its constructor takes them; the
reference's weights are copied in by name. A wrong output is named by the mistake in ``_gqa_variants``
it matches. The forward uses the notebook's own apply_rotary and repeat_kv: when one of them fails its
own exercise's check, the message says so.
"""
from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ... import modern as ref
from ...attention import KVCache
from ..verdict import Failure, fail
from . import _rope_variants as rope
from ._attn_hypotheses import first_match, shape_str
from ._device_probe import meta, module_on_meta
from ._device_probe import probe as probe_device
from ._gqa_variants import CACHED, FULL_PASS, Setup, simulate
from ._gradients import check_module_gradients
from ._model_common import accepts, copy_weights
from ._student_code import (
    call,
    call_student,
    close,
    construct,
    expect_callable,
    expect_finite,
    expect_tensor,
    max_diff,
    reraise_with,
)

EMBED_DIM, NUM_HEADS, MAX_TOKENS = 32, 4, 10
HEAD_DIM = EMBED_DIM // NUM_HEADS
# (num_kv_heads, rope_theta, constructor extras): multi-head first, so a module that only fails with
# fewer key/value heads is told so; then grouped-query and multi-query attention.
CONFIGS: tuple[tuple[int, float, dict[str, Any]], ...] = (
    (NUM_HEADS, 500.0, {}),
    (2, 10000.0, {}),
    (1, 10000.0, {}),
)
OPTIONAL = (
    (2, 10000.0, {"qk_norm": True}),
    (2, 10000.0, {"sliding_window": 3}),
)
# (batch, length) of the full passes: the full length first, so a failure at a shorter one is told apart
CASES = ((2, MAX_TOKENS), (3, 5), (1, 1))
# the cached run: a prompt of 3, three tokens one at a time, then two at once; it stops short of
# max_tokens, so an offset that runs ahead still finds rows in the tables and its outputs can be named
PLAN = ((0, 3), (3, 1), (4, 1), (5, 1), (6, 2))
PLAN_TOKENS = sum(length for _, length in PLAN)


class RecordingCache(KVCache):
    """A KVCache that keeps a copy of what was appended, to read back what the student's module caches."""

    def __init__(self, max_tokens: int):
        super().__init__(max_tokens)
        self.appended: list[tuple[Any, Any]] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        copy = (lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t)
        self.appended.append((copy(k), copy(v)))
        return super().append(k, v)


@dataclass
class Built:
    kv_heads: int
    extra: dict[str, Any]
    model: nn.Module
    reference: nn.Module
    setup: Setup
    runs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)   # (x, out, expected)

    @property
    def label(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.extra.items())
        return f"num_kv_heads={self.kv_heads}{extra}"


def _describe(kv_heads: int, theta: float, extra: dict[str, Any]) -> str:
    more = "".join(f", {k}={v!r}" for k, v in extra.items())
    return f"GroupedQueryAttention({EMBED_DIM}, {NUM_HEADS}, {kv_heads}, {MAX_TOKENS}, {theta:g}{more})"


def _randomize(reference: nn.Module, generator: torch.Generator) -> None:
    # queries and keys a bit larger than the default: the softmax is neither flat nor one-hot
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.4 * torch.randn(p.shape, generator=generator))
            else:
                gain = 1.5 if name.split(".")[0] in ("query", "key") else 1.0
                p.copy_(torch.randn(p.shape, generator=generator) * gain / math.sqrt(p.shape[1]))


def _check_tables(model: nn.Module, reference: nn.Module, theta: float, shown: str,
                  tables: Callable[..., None]) -> None:
    """The constructor builds self.rope_cos / self.rope_sin, with the notebook's rope_tables (exercise 9.1)."""
    cos, sin = getattr(model, "rope_cos", None), getattr(model, "rope_sin", None)
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return
    if cos.shape == reference.rope_cos.shape and close(cos, reference.rope_cos) and close(sin, reference.rope_sin):
        return
    try:
        if cos.shape != reference.rope_cos.shape or sin.shape != cos.shape:
            fail("shape", f"they have shapes {shape_str(cos.shape)} and {shape_str(sin.shape)}, expected "
                          f"{shape_str(reference.rope_cos.shape)} (max_tokens, head_dim).")
        tables(cos, sin, HEAD_DIM, MAX_TOKENS, theta, f"rope_tables({HEAD_DIM}, {MAX_TOKENS}, theta={theta:g})",
               False)
    except Failure as failure:
        raise Failure(failure.diagnosis, f"The RoPE tables your constructor builds for {shown} (self.rope_cos, "
                                         f"self.rope_sin, from your rope_tables of exercise 9.1) are wrong: "
                                         f"{failure.message} Fix rope_tables first "
                                         f"(checks.check_rope_tables(rope_tables)).") from None


def _build(cls: Any, kv_heads: int, theta: float, extra: dict[str, Any], generator: torch.Generator,
           tables: Callable[..., None]) -> Built:
    shown = _describe(kv_heads, theta, extra)
    reference = ref.GroupedQueryAttention(EMBED_DIM, NUM_HEADS, kv_heads, MAX_TOKENS, theta, **extra)
    _randomize(reference, generator)
    model = construct(cls, EMBED_DIM, NUM_HEADS, kv_heads, MAX_TOKENS, theta, what="GroupedQueryAttention",
                      shown=shown, **extra)
    copy_weights(reference, model, "your GroupedQueryAttention")
    call(model.eval, what="GroupedQueryAttention.eval()")
    _check_tables(model, reference, theta, shown, tables)
    cos, sin = rope.tables(HEAD_DIM, MAX_TOKENS, theta)
    params = {name: p.detach().double() for name, p in reference.named_parameters()}
    setup = Setup(EMBED_DIM, NUM_HEADS, kv_heads, MAX_TOKENS, theta, params, cos, sin,
                  qk_norm=bool(extra.get("qk_norm")), window=extra.get("sliding_window"),
                  eps=reference.q_norm.eps if reference.q_norm is not None else 1e-6)
    return Built(kv_heads, extra, model, reference.eval(), setup)


def _rope_frame(failure: BaseException) -> dict[str, Any] | None:
    """The locals of apply_rotary (or rotate_half) where the student's code raised, if it raised there."""
    exc: BaseException | None = failure
    while exc is not None and isinstance(exc, Failure):
        exc = exc.__context__
    tb = exc.__traceback__ if exc is not None else None
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in ("apply_rotary", "rotate_half") and code.co_argcount:
            # the tensor it turns is its first argument, whatever the student named it
            found = dict(tb.tb_frame.f_locals, x=tb.tb_frame.f_locals.get(code.co_varnames[0]))
        tb = tb.tb_next
    return found


def _forward(built: Built, x: torch.Tensor, what: str, *, start: int | None = None, **kwargs: Any) -> torch.Tensor:
    """The student's module on x (``start``: the tokens already in the cache passed in kwargs)."""
    with torch.no_grad():
        try:
            out = call_student(built.model, x.clone(), what=what, **kwargs)
        except Failure as failure:
            _explain_rope_error(failure, built, x.shape[1], start)
            raise
    return expect_tensor(out, (x.shape[0], x.shape[1], EMBED_DIM), what, dtype=x.dtype, finite=False)


def _explain_rope_error(failure: Failure, built: Built, length: int, start: int | None) -> None:
    """When the student's code raised inside apply_rotary, say what it was given that it cannot take."""
    names = _rope_frame(failure) if failure.diagnosis == "exception" else None
    turned, offset = (names.get("x"), names.get("offset")) if names else (None, None)
    if not isinstance(turned, torch.Tensor):
        return
    if turned.dim() == 4 and turned.shape[-1] != HEAD_DIM and turned.shape[-2] == length:
        features = turned.shape[1] * turned.shape[-1]
        which = {NUM_HEADS * HEAD_DIM: "queries", built.kv_heads * HEAD_DIM: "keys or values"}.get(features)
        if which is not None:
            right = NUM_HEADS if which == "queries" else built.kv_heads
            code = "kv_grouping" if which != "queries" else "head_split"
            reraise_with(failure, code, f" apply_rotary was given {which} split into {turned.shape[1]} heads of "
                         f"{turned.shape[-1]} features, shape {shape_str(turned.shape)}: the {which} have "
                         f"{features} features, {right} heads of head_dim={HEAD_DIM} "
                         f"({'self.num_heads' if which == 'queries' else 'self.num_kv_heads'} heads). Split them "
                         f"into that many heads; head_dim is embed_dim // num_heads for all three.")
    if turned.dim() != 4 or turned.shape[-1] != HEAD_DIM:
        reraise_with(failure, "rope_axes", f" apply_rotary was given a tensor of shape {shape_str(turned.shape)}: "
                     f"it takes queries or keys split into heads, (N, heads, L, head_dim) with head_dim={HEAD_DIM}. "
                     f"Rotate after the head split and the transpose, not the (N, L, features) projections.")
    if start is None or not isinstance(offset, int):
        return
    if turned.shape[-2] > length:
        reraise_with(failure, "kv_cache", f" apply_rotary was given {turned.shape[-2]} positions from offset "
                     f"{offset} although only {length} token(s) are new: you rotate the keys after appending "
                     f"them to the cache, so the cached keys are turned again, to the wrong positions (and past "
                     f"the tables). Rotate the new keys first (offset=cache.length), then append them rotated.")
    if offset != start:
        reraise_with(failure, "rope_positions", f" apply_rotary was given offset={offset} for {length} new "
                     f"token(s) after {start} cached ones: the offset is the number of tokens already cached, "
                     f"cache.length read BEFORE cache.append(...).")


def _full_passes(built: Built, generator: torch.Generator, mha_right: bool) -> None:
    for n, length in CASES:
        x = torch.randn(n, length, EMBED_DIM, generator=generator)
        what = f"GroupedQueryAttention({built.label}).forward(x) with x of shape {(n, length, EMBED_DIM)}"
        try:
            out = _forward(built, x, what)
        except Failure as failure:
            if failure.diagnosis in ("exception", "shape") and built.kv_heads < NUM_HEADS and mha_right:
                reraise_with(failure, "kv_grouping", f" Your module works with num_kv_heads = num_heads but not "
                             f"with num_kv_heads={built.kv_heads} < num_heads={NUM_HEADS}: split k and v into "
                             f"num_kv_heads heads (self.num_kv_heads) and repeat each for its group of query "
                             f"heads (repeat_kv) before the scores.")
            full = built.runs[0] if built.runs else None
            if full is not None and failure.diagnosis in ("exception", "shape") and close(full[1], full[2]):
                reraise_with(failure, "causal_mask", f" Your module works for {MAX_TOKENS} tokens but not for "
                             f"{length}: cut the causal mask to the current length.")
            raise
        with torch.no_grad():
            built.runs.append((x, out, built.reference(x)))


def _diagnose_full(built_all: list[Built], generator: torch.Generator) -> None:
    """Some full pass differs from the reference: raise the most specific Failure we can. The probes'
    answers are read from the student's module first (an exception there is reported at once: the
    full passes before already used these batch sizes and this length); then every judgement runs in turn."""
    built = built_all[0]
    x = torch.randn(3, MAX_TOKENS, EMBED_DIM, generator=generator)
    batch_what = f"GroupedQueryAttention({built.label}) on x of shape {shape_str(x.shape)}"
    together = _forward(built, x, batch_what)                                    # (3, L, E)
    alone = [_forward(built, x[i:i + 1], batch_what.replace("(3,", "(1,")) for i in range(3)]   # 3 x (1, L, E)
    x = torch.randn(2, MAX_TOKENS, EMBED_DIM, generator=generator)
    future_what = f"GroupedQueryAttention({built.label}) on x of shape {shape_str(x.shape)}"
    changed = x.clone()
    changed[:, MAX_TOKENS // 2:] += torch.randn(2, MAX_TOKENS - MAX_TOKENS // 2, EMBED_DIM, generator=generator)
    before, after = _forward(built, x, future_what), _forward(built, changed, future_what)   # (2, L, E)

    runs = [(b, x, out) for b in built_all for x, out, _ in b.runs]
    qk = any(b.setup.qk_norm for b in built_all)
    window = any(b.setup.window for b in built_all)
    hypotheses = [m for m in FULL_PASS if (qk or "qk_norm" not in m.spec) and (window or "window" not in m.spec)]
    found = first_match(hypotheses, [out for _, _, out in runs],
                        lambda i, spec: simulate(runs[i][0].setup, runs[i][1], [(0, runs[i][1].shape[1])], spec))
    if found is not None:
        fail(found.code, found.message)
    for b, x, out in runs:
        expect_finite(out, f"GroupedQueryAttention({b.label}) on x of shape {shape_str(x.shape)}")
    # Rows never mix (before the future: a reshape that mixes rows also "leaks" positions).
    for i in range(3):
        if not close(alone[i][0], together[i], nan_ok=True):
            fail("batch_mixing", f"{batch_what}: sequence {i} gives a different output in a batch of 3 than alone: "
                                 f"your reshapes mix the sequences. Keep the batch axis first and take N and L from "
                                 f"x.shape.")
    # The future never leaks: changing the second half leaves the first half's outputs as they were.
    if not close(after[:, :MAX_TOKENS // 2], before[:, :MAX_TOKENS // 2]):
        fail("causal_mask", f"{future_what}: the future leaks: changing the tokens after position "
                            f"{MAX_TOKENS // 2 - 1} changes the outputs before. Each query may see only keys at its "
                            f"position or earlier.")
    b, x, out, expected = next((b, x, out, e) for b in built_all for x, out, e in b.runs if not close(out, e))
    fail("mismatch", f"GroupedQueryAttention({b.label}) on x of shape {shape_str(x.shape)} differs from the "
                     f"reference by up to {max_diff(out, expected):.3g}, and like none of the mistakes we know. The "
                     f"steps: project, split into heads (num_heads for q, num_kv_heads for k and v), rotate q and k, "
                     f"repeat k and v per group, causal attention scaled by 1/sqrt(head_dim), merge, self.proj.")


# ---------------------------------------------------------------- the KV cache

def _cached(built: Built) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RecordingCache]:
    """Prompt, then one token at a time, then two: (x, the student's outputs, the reference full pass, cache).
    The tokens are those of the first full pass (already right), so its reference outputs serve again."""
    full, _, reference = built.runs[0]
    x, expected = full[:, :PLAN_TOKENS], reference[:, :PLAN_TOKENS]    # causal: the first tokens' outputs
    cache = RecordingCache(MAX_TOKENS)
    outs = []
    for start, length in PLAN:
        what = (f"GroupedQueryAttention({built.label}).forward(x, cache) with {length} new token(s) and "
                f"{start} cached")
        out = _forward(built, x[:, start:start + length], what, start=start, cache=cache)
        if start == 0 and not cache.appended:
            fail("kv_cache", f"{what}: your forward never appends to the cache it is given, so the next tokens "
                             f"cannot see the earlier ones. With a cache: read start = cache.length, rotate the new "
                             f"keys, then k, v = cache.append(k, v) and attend over what it returns.")
        outs.append(out)
    return x, torch.cat(outs, dim=1), expected, cache


def _fill_context(built: Built, cache: RecordingCache) -> None:
    """After the plan, token by token to the last position: a position that runs ahead of cache.length
    (say the keys placed one late) is invisible to RoPE's offsets until the tables run out."""
    full, _, reference = built.runs[0]
    for start in range(PLAN_TOKENS, MAX_TOKENS):
        what = (f"GroupedQueryAttention({built.label}).forward(x, cache) with 1 new token and {start} cached "
                f"(the context fills at {MAX_TOKENS})")
        try:
            out = _forward(built, full[:, start:start + 1], what, start=start, cache=cache)
        except Failure as failure:
            if failure.diagnosis in ("exception", "shape"):
                reraise_with(failure, "rope_positions", f" Your module is right for the first {start} tokens and "
                             f"fails only as the context fills: your positions run ahead of the cache (a new "
                             f"token at cache.length + 1, or the keys placed one position late), which RoPE's "
                             f"relative angles hide until the tables run out. Rotate the new tokens with "
                             f"offset=cache.length, read before cache.append(...).")
            raise
        if not close(out, reference[:, start:start + 1]):
            fail("rope_positions", f"{what}: your output differs from the full pass only now that the context "
                                   f"fills ({max_diff(out, reference[:, start:start + 1]):.3g}): your positions run "
                                   f"ahead of the cache (a new token at cache.length + 1, or the keys placed one "
                                   f"position late), which RoPE's relative angles hide until the tables run out. "
                                   f"Rotate with offset=cache.length, read before cache.append(...).")


def _check_cache_contents(built: Built, x: torch.Tensor, cache: RecordingCache) -> None:
    """The cache must hold num_kv_heads heads of rotated keys (so GQA's cache is smaller, and never re-rotated)."""
    k, v = cache.appended[0]
    length = PLAN[0][1]
    what = f"GroupedQueryAttention({built.label}) with a cache"
    if isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[1] != built.kv_heads:
        fail("kv_cache", f"{what}: your cache receives keys of shape {shape_str(k.shape)}, {k.shape[1]} heads. It "
                         f"should hold the num_kv_heads={built.kv_heads} heads: append k and v BEFORE repeat_kv, "
                         f"and repeat what the cache returns. That is the point of GQA: the cache is "
                         f"num_heads / num_kv_heads times smaller.")
    s = built.setup
    raw = (x[:, :length].double() @ s.params["key.weight"].T).reshape(2, length, built.kv_heads, HEAD_DIM)
    raw = raw.transpose(1, 2)                                                   # (N, kv_heads, L, head_dim)
    if s.qk_norm:
        raw = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + s.eps) * s.params["k_norm.weight"]
    turned = rope.rotate(raw, s.cos, s.sin, 0)
    if isinstance(k, torch.Tensor) and close(k, raw) and not close(k, turned):
        fail("kv_cache", f"{what}: your outputs are right, but your cache holds the keys before RoPE, so every "
                         f"step turns all the cached keys again. Rotate the new keys (offset = cache.length) and append them rotated: each key is "
                         f"turned once, to its own position, and never again.")


def _diagnose_cached(built_all: list[Built], cached: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    found = first_match(CACHED, [got for _, got, _ in cached],
                        lambda i, spec: simulate(built_all[i].setup, cached[i][0], list(PLAN), spec, cached=True))
    if found is not None:
        fail(found.code, found.message)
    index = next(i for i, (_, got, expected) in enumerate(cached) if not close(got, expected))
    built, (_, got, expected) = built_all[index], cached[index]
    wrong = [t for t in range(PLAN_TOKENS) if not close(got[:, t], expected[:, t])]
    prompt = PLAN[0][1]
    if wrong and wrong[0] < prompt:
        where = (f"already for the prompt ({prompt} tokens into an empty cache): with an empty cache the "
                 f"forward must give what it gives without one")
    elif wrong and wrong[0] >= PLAN[-1][0]:
        where = ("only when two new tokens come at once: the second may see the first, not the reverse. Mask the "
                 "new queries with the rows start .. total-1 of a (total, total) causal mask")
    else:
        where = (f"from position {wrong[0]} on: a new token must get position cache.length (its RoPE offset) and "
                 f"attend to every cached key")
    fail("kv_cache", f"GroupedQueryAttention({built.label}) with a KV cache differs from the full pass {where} "
                     f"(largest difference {max_diff(got, expected):.3g}).")


# ---------------------------------------------------------------- which part is at fault

def _calls(cls: Any) -> tuple[set[str], dict[str, Any]]:
    """The global names the class's methods use, and the namespace they are looked up in."""
    names: set[str] = set()
    namespace: dict[str, Any] = {}
    for value in vars(cls).values() if isinstance(cls, type) else ():
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if isinstance(fn, types.FunctionType):
            names |= set(fn.__code__.co_names)
            namespace = namespace or fn.__globals__
    return names, namespace


def _parts_note(cls: Any, parts: dict[str, tuple[str, Callable[[Any], Any]]]) -> str:
    """A sentence per helper of an earlier exercise that the class calls and that fails its own check."""
    names, namespace = _calls(cls)
    notes = []
    for name, (exercise, judge) in parts.items():
        fn = namespace.get(name)
        if name not in names or not callable(fn):
            continue
        try:
            judge(fn)
        except Failure as failure:
            notes.append(f" Your class calls your {name} (exercise {exercise}), which fails its own check "
                         f"({failure.diagnosis}): fix it first, checks.check_{name}({name}).")
    return "".join(notes)


# ---------------------------------------------------------------- the check

def check_class(cls: Any, *, parts: dict[str, tuple[str, Callable[[Any], Any]]],
                tables: Callable[..., None]) -> str:
    expect_callable(cls, "GroupedQueryAttention", "class")
    try:
        return _check(cls, tables)
    except Failure as failure:
        if failure.diagnosis in ("not_implemented", "timeout"):
            raise
        note = _parts_note(cls, parts)
        if not note:
            raise
        raise Failure(failure.diagnosis, failure.message.rstrip() + note, **failure.details) from None


def _check(cls: Any, tables: Callable[..., None]) -> str:
    torch.manual_seed(0)   # any dropout draws; the @checker decorator restores the caller's RNG state
    generator = torch.Generator().manual_seed(96)
    # The optional features (QK-norm, a sliding window) are judged after the plain module is right, so that
    # a mistake in the common path is named from the plain configurations alone.
    optional = [c for c in OPTIONAL if all(accepts(cls, key) for key in c[2])]
    built = [_check_configs(cls, configs, generator, tables) for configs in (CONFIGS, optional) if configs]
    _learns_and_stays_on_device(built[0][1], generator)   # grouped-query: 2 key/value heads
    extras = [key for _, _, extra in optional for key in extra]
    also = f", and with {' and '.join(extras)}" if extras else ""
    return (f"Matches the reference for multi-head ({NUM_HEADS} kv heads), grouped-query (2) and multi-query (1) "
            f"attention{also}, in a full pass and token by token with a KV cache that holds num_kv_heads heads of "
            f"rotated keys.")


def _check_configs(cls: Any, configs: Any, generator: torch.Generator, tables: Callable[..., None]) -> list[Built]:
    built_all: list[Built] = []
    for kv_heads, theta, extra in configs:
        built = _build(cls, kv_heads, theta, extra, generator, tables)
        mha_right = (bool(built_all) and built_all[0].kv_heads == NUM_HEADS
                     and all(close(out, e) for _, out, e in built_all[0].runs))
        _full_passes(built, generator, mha_right)
        built_all.append(built)
    if not all(close(out, e) for b in built_all for _, out, e in b.runs):
        _diagnose_full(built_all, generator)
    cached = []
    caches = []
    for built in built_all:
        x, got, expected, cache = _cached(built)
        cached.append((x, got, expected))
        caches.append(cache)
        if close(got, expected):
            _check_cache_contents(built, x, cache)
    if not all(close(got, expected) for _, got, expected in cached):
        _diagnose_cached(built_all, cached)
    for built, cache in zip(built_all, caches):
        _fill_context(built, cache)
    return built_all


def _learns_and_stays_on_device(built: Built, generator: torch.Generator) -> None:
    """One backward pass (every projection must learn), then the module on the meta device."""
    x = torch.randn(2, 5, EMBED_DIM, generator=generator)
    what = f"GroupedQueryAttention({built.label}) on x of shape {shape_str(x.shape)}"
    check_module_gradients(built.model, built.reference, x, what=what)
    moved = module_on_meta(built.model)
    if moved is not None:
        probe_device(lambda: moved(meta(x)), what)
