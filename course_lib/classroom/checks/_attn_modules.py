"""Running a student's attention module next to the reference: build, copy weights by name, probe."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..verdict import Failure, fail
from ._attn_hypotheses import (
    MODULE_HYPOTHESES,
    SPLIT_SIZE,
    diagnose_weights,
    module_variant,
    shape_str,
    split_into,
)
from ._device_probe import probe_kept_on_device, probe_module
from ._gradients import check_module_gradients
from ._model_common import copy_weights, same_when_called_twice
from ._student_code import (
    HALF_PRECISION,
    call,
    close,
    coarse_precision,
    construct,
    expect_finite,
    expect_parameters,
    load_parameters,
    matches,
    max_diff,
    module_output,
    reraise_with,
)
from .engine import ScaleFit, at_other_sizes, first_mistake
from .engine.function import Afresh, kept_from_start
from .engine.probes import IN_TURN, batch_mixing, called_in_turn, module_in_float64, repeated_draw

EMBED_DIM, MAX_TOKENS, DROPOUT = 16, 8, 0.2
# (batch, length): full length first, so a failure at a shorter length can be told apart
CASES = ((2, MAX_TOKENS), (3, 5), (1, 1), (2, 3))
PARAMETERS = ("query.weight", "key.weight", "value.weight", "proj.weight")


@dataclass
class Run:
    heads: int
    params: dict[str, torch.Tensor]
    x: torch.Tensor
    out: torch.Tensor
    expected: torch.Tensor
    what: str   # how messages name this call, e.g. "MaskedAttention.forward(x) with x of shape (2, 8, 16)"


# What the parameter check tells a student whose module is built differently.
PARAMETER_ADVICE = ("The constructor should create exactly four nn.Linear(embed_dim, embed_dim, bias=False) "
                    "layers named query, key, value and proj (the names are how the checker copies the "
                    "reference weights into your module).")


def random_params(generator: torch.Generator) -> dict[str, torch.Tensor]:
    # Queries and keys a bit larger than the default init: the softmax is then neither flat nor
    # one-hot, and every mistake moves the output well past the tolerance.
    scale = {"query.weight": 1.2, "key.weight": 1.2, "value.weight": 1.0, "proj.weight": 1.0}
    return {name: torch.randn(EMBED_DIM, EMBED_DIM, generator=generator) * scale[name] * EMBED_DIM ** -0.5
            for name in PARAMETERS}


def one_sequence_only(thing: str) -> str:
    """The words added to a failure where the student's code is right on x[:1] alone (3.1, 3.2, 2.2, 3.3)."""
    return (f" Your {thing} is right for a batch of one sequence (x[:1]) only: it assumes a batch of one (x[0], "
            f".squeeze(0), a 1 written as the batch size). Keep the batch axis: take N from x.shape and reshape with "
            f"it.")


@dataclass
class ModuleCheck:
    """Everything one exercise (2.2 or 3.3) does with the student's class."""

    name: str
    make_candidate: Callable[[int, float], Any]
    make_reference: Callable[[int, float], nn.Module]
    heads: tuple[int, ...]
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1234))
    models: dict[int, nn.Module] = field(default_factory=dict)
    references: dict[int, nn.Module] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    start: Afresh | None = None   # the student's code before the first module was built

    def what(self, shape: tuple[int, ...], heads: int) -> str:
        extra = f", num_heads={heads}" if len(self.heads) > 1 else ""
        return f"{self.name}.forward(x) with x of shape {shape}{extra}"

    # -------------------------------------------------------------------- running

    def _runs(self, model: nn.Module, n: int, what: str) -> bool:
        """Whether the student's module runs on a batch of n at the full length, with the right shape."""
        x = torch.randn(n, MAX_TOKENS, EMBED_DIM, generator=self.generator)
        try:
            return tuple(module_output(model, x, what).shape) == tuple(x.shape)
        except Failure:
            return False

    def run_all(self) -> None:
        """Every case through the student's module in eval mode, next to the reference with the same weights."""
        torch.manual_seed(0)   # dropout draws; the @checker decorator restores the caller's RNG state
        self.start = Afresh(self.make_candidate)
        for heads in self.heads:
            params = random_params(self.generator)
            label = self.name + (f"(embed_dim={EMBED_DIM}, num_heads={heads}, max_tokens={MAX_TOKENS}, "
                                 if len(self.heads) > 1 else f"(embed_dim={EMBED_DIM}, max_tokens={MAX_TOKENS}, ")
            model = construct(self.make_candidate, heads, DROPOUT, what=self.name,
                              shown=label + f"dropout_rate={DROPOUT})")
            expect_parameters(model, {name: (EMBED_DIM, EMBED_DIM) for name in PARAMETERS}, self.name,
                              PARAMETER_ADVICE)
            reference = self.make_reference(heads, DROPOUT).eval()
            load_parameters(model, params)
            load_parameters(reference, params)
            call(model.eval, what=f"{self.name}.eval()")
            self.models[heads] = model
            self.references[heads] = reference
            for index, (n, length) in enumerate(CASES):
                x = torch.randn(n, length, EMBED_DIM, generator=self.generator)
                what = self.what(tuple(x.shape), heads)
                try:
                    out = module_output(model, x, what)
                except Failure as failure:
                    if index == 0 and failure.diagnosis in ("exception", "shape"):
                        self._first_call_failed(failure, model, reference, x, what)
                    full = self.runs[-index] if index else None
                    if (full is not None and failure.diagnosis in ("exception", "shape")
                            and close(full.out, full.expected)):
                        if n != full.x.shape[0] and not self._runs(model, n, what):   # the batch, not the length
                            reraise_with(failure, "shape", f" Your module works for a batch of {full.x.shape[0]} "
                                         f"but not for a batch of {n}, even at max_tokens={MAX_TOKENS} tokens: "
                                         f"take N from x.shape, and mind that .squeeze() without a dimension also "
                                         f"drops a batch (or a length) of 1.")
                        reraise_with(failure, "shape", f" Your module works for sequences of max_tokens="
                                     f"{MAX_TOKENS} tokens but not for {length}: the causal mask must be "
                                     f"cut to the current sequence length, not used at its full max_tokens "
                                     f"size.")
                    raise
                # eval mode is deterministic: the same input twice gives the same output
                if index == 0 and not close(module_output(model, x, what), out, nan_ok=True):
                    fail("dropout", f"In eval mode your module gives different outputs for the same input: "
                                    f"something random is still active (dropout_rate={DROPOUT}: dropout that does "
                                    f"not follow the module's mode, or other random numbers). Use the nn.Dropout "
                                    f"layers (or training=self.training), so model.eval() switches it off, and "
                                    f"nothing else random.")
                with torch.no_grad():
                    expected = reference(x)
                self.runs += [Run(heads, params, x, out, expected, what)]

    def _right_on(self, model: nn.Module, reference: nn.Module, x: torch.Tensor, what: str) -> bool:
        try:
            out = module_output(model, x, what)
        except Failure:
            return False
        with torch.no_grad():
            return close(out, reference(x))

    def _first_call_failed(self, failure: Failure, model: nn.Module, reference: nn.Module, x: torch.Tensor,
                           what: str) -> None:
        """The first call failed: where the module is right on a batch of one (x[:1]), or on a batch as large as
        the sequence is long, name the size it assumes."""
        n, length, _ = x.shape
        if n > 1 and self._right_on(model, reference, x[:1], what):
            reraise_with(failure, "shape", one_sequence_only("module"))
        square = torch.randn(length, length, EMBED_DIM, generator=torch.Generator().manual_seed(length))
        if n != length and self._right_on(model, reference, square, what):
            reraise_with(failure, "causal_mask", f" Your module is right on x of shape {(length, length, EMBED_DIM)}, "
                                                 f"where the batch is as large as the sequence is long, but not on a "
                                                 f"batch of {n}: it reads the length L from the batch axis (len(x), "
                                                 f"x.shape[0], x.size(0) are N), so the causal mask is cut to N x N. "
                                                 f"L is x.shape[1]: self.mask[:L, :L].")

    # -------------------------------------------------------------------- diagnosing

    def _kept_since_start(self, run: Run) -> None:
        """``kept_state`` where a wrong run is right on a module built and called as the first one was, with the
        student's code as it was before the check (``Afresh``): a scale or a size kept on the class, in a global or
        a default from the module built first."""
        if self.start is None or not self.start.places:
            return
        with self.start.restored():
            try:
                model = construct(self.make_candidate, run.heads, DROPOUT, what=self.name)
                load_parameters(model, run.params)
                call(model.eval, what=f"{self.name}.eval()")
                out = module_output(model, run.x, run.what)
            except Failure:
                return
        if close(out, run.expected):
            fail("kept_state", kept_from_start(run.what, f"differs from the reference by up to "
                                                         f"{max_diff(run.out, run.expected):.3g}"))

    def diagnose(self, bad: list[Run]) -> None:
        """Called with the runs whose outputs differ from the reference: raise the most specific Failure we can.

        The probes' answers are read from the student's module first (in eval mode), then every judgement runs
        in turn, from a known mistake that reproduces the output exactly to "something after the softmax". A probe
        that raises is reported at once, before any judgement: the cases before already ran batch sizes 1 to 3
        and lengths 1 to 8, so it has found a bug of its own."""
        self._kept_since_start(bad[0])   # before any mistake its symptom looks like
        heads = max(self.heads)
        weights_heads = bad[0].heads   # the weights read back where the output is wrong (a scale right elsewhere)
        model = self.models[heads]
        what = lambda x, h=heads: self.what(tuple(x.shape), h)
        batch_x = torch.randn(3, MAX_TOKENS, EMBED_DIM, generator=self.generator)    # (3, L, E)
        together = module_output(model, batch_x, what(batch_x))
        alone = [module_output(model, batch_x[i:i + 1], what(batch_x[i:i + 1])) for i in range(3)]   # (1, L, E)
        head_before = head_after = None
        if heads > 1:   # with proj = identity; then with head 1's query weights changed
            params = dict(self.runs[0].params, **{"proj.weight": torch.eye(EMBED_DIM)})
            x = torch.randn(2, MAX_TOKENS, EMBED_DIM, generator=self.generator)
            head_before = module_output(model, x, what(x), params=params)
            head_dim = EMBED_DIM // heads
            query = params["query.weight"].clone()
            query[head_dim:2 * head_dim] = torch.randn(head_dim, EMBED_DIM, generator=self.generator)
            head_after = module_output(model, x, what(x), params=dict(params, **{"query.weight": query}))
        eye = torch.eye(EMBED_DIM)   # with value = proj = identity the output is the weights times x, L <= head_dim
        weights_x = torch.randn(1, min(6, EMBED_DIM // weights_heads), EMBED_DIM, generator=self.generator)
        weights_out = module_output(self.models[weights_heads], weights_x, what(weights_x, weights_heads),
                                    params=dict(self.runs[0].params, **{"value.weight": eye, "proj.weight": eye}))
        future_x = torch.randn(2, MAX_TOKENS, EMBED_DIM, generator=self.generator)
        future_out = module_output(model, future_x, what(future_x))
        future_changed = []   # (t, the output with the tokens after t changed)
        for t in (0, MAX_TOKENS // 2, MAX_TOKENS - 2):
            changed = future_x.clone()
            changed[:, t + 1:] = torch.randn(2, MAX_TOKENS - t - 1, EMBED_DIM, generator=self.generator)
            future_changed.append((t, module_output(model, changed, what(changed))))

        several = any(h > 1 for h in self.heads)
        hypotheses = [h for h in MODULE_HYPOTHESES
                      if several or not ({"split", "merge"} & set(h.spec) or h.spec.get("scale") == "embed_dim")]
        reproduces = lambda mistake: all(matches(run.out, module_variant(run.x, run.params, run.heads, mistake.spec))
                                         for run in self.runs)
        first_mistake(hypotheses, reproduces, d="head_dim" if several else "embed_dim")
        self._weights_untransposed()
        # scaled for the heads it computes, or for the heads it was asked for (self.head_dim)
        computes = lambda count: any(all(matches(run.out, module_variant(run.x, run.params, count(run), spec(run)))
                                         for run in bad)
                                     for spec in (lambda run: {}, lambda run: {"scale": (EMBED_DIM // run.heads) ** -0.5}))
        for count in (h for h in range(1, EMBED_DIM + 1) if EMBED_DIM % h == 0) if several else ():
            if computes(lambda run, count=count: count):
                fail("head_split", f"{bad[0].what}: your module computes {count} heads, whatever num_heads is "
                                   f"({bad[0].heads} here): a head count is written into your code. Split into "
                                   f"self.num_heads heads of embed_dim // num_heads features.")
        if several and computes(lambda run: EMBED_DIM // run.heads):   # heads of num_heads features
            run = bad[0]
            fail("head_split", f"{run.what}: your module makes embed_dim // num_heads heads of num_heads features: "
                               + split_into("queries, keys and values", EMBED_DIM // run.heads, run.heads, EMBED_DIM,
                                            run.heads, EMBED_DIM // run.heads, "self.num_heads") + " " + SPLIT_SIZE)
        if all(run.x.shape[1] < MAX_TOKENS for run in bad):
            fail("causal_mask", f"Your output is right for sequences of max_tokens={MAX_TOKENS} tokens but wrong "
                                f"for shorter ones (e.g. x of shape {shape_str(bad[0].x.shape)}): the causal "
                                f"mask must be cut to the current sequence length, its top-left L x L corner.")
        for run in self.runs:
            expect_finite(run.out, run.what)
        # Right to a rounding's size everywhere: a lower precision, before any probe compares two roundings.
        if all(coarse_precision(run.out, run.expected) for run in bad):
            fail("precision", f"{bad[0].what}: {HALF_PRECISION} (Off by up to {max_diff(bad[0].out, bad[0].expected):.3g}.)")

        # Rows never mix: each sequence of a batch gives what it gives alone. This comes before the future,
        # since a reshape that mixes rows also "leaks" positions.
        reshape = " view (N, L, E) as (N, L, heads, head_dim) with N and L from x.shape, then transpose(1, 2)."
        batch_mixing(what(batch_x), together, alone, "your code mixes the sequences of the batch, or uses the batch "
                                                     "size N = x.shape[0] as if it were another size. Keep the batch "
                                                     "axis first and untouched, and compute each sequence on its own"
                                                     + (f":{reshape}" if several else "."))

        # Heads stay apart: with proj = identity, changing the query weights of head 1 may only change head 1's
        # block of output features.
        if head_before is not None and head_after is not None:
            head_dim = EMBED_DIM // heads
            block = slice(head_dim, 2 * head_dim)
            others = torch.ones(EMBED_DIM, dtype=torch.bool)
            others[block] = False
            if not close(head_after[..., others], head_before[..., others]):
                fail("head_split", "Heads are mixed: changing only the query weights of head 1 (features "
                                   f"{head_dim}..{2 * head_dim - 1}) changed the output of other heads. Each head "
                                   "must work on its own contiguous block of head_dim features, from the split to "
                                   "the merge.")
            if close(head_after[..., block], head_before[..., block]):
                fail("head_split", "Head 1 ignores its own query features: changing the query weights of head 1 "
                                   "did not change its output. Each head must use its own block of head_dim "
                                   "features.")

        # The weights, read back: with value = proj = identity the output is the weights times x. Reading them
        # assumes heads are kept apart (judged above); it comes before the future because a softmax over the
        # wrong axis also leaks the future.
        x, w_heads = weights_x, weights_heads
        length, head_dim = x.shape[1], EMBED_DIM // w_heads
        split = lambda t: t.double().reshape(length, w_heads, head_dim).transpose(0, 1)   # (heads, L, head_dim)
        weights = split(weights_out) @ torch.linalg.pinv(split(x))                 # (heads, L, L)
        params = self.runs[0].params
        q = split(x.double() @ params["query.weight"].double().T)                         # (heads, L, head_dim)
        k = split(x.double() @ params["key.weight"].double().T)
        diagnose_weights(weights, q @ k.transpose(-2, -1), torch.ones(length, length, dtype=torch.bool).tril(),
                         head_dim ** -0.5, key_axis="the keys (the last axis of the scores)",
                         hidden="future positions",
                         scale_name="1/sqrt(head_dim)" if len(self.heads) > 1 else "1/sqrt(embed_dim)",
                         inputs="the queries and the keys themselves (which layer makes each, what it is applied to"
                                + (", which slice each head takes)" if len(self.heads) > 1 else ")"))

        # The future never leaks: changing the tokens after position t leaves the outputs up to t as they were.
        for t, changed in future_changed:
            if not close(changed[:, :t + 1], future_out[:, :t + 1]):
                fail("causal_mask", f"The future leaks: changing the tokens after position {t} changes your "
                                    f"output at position {t} or before. Each query may only attend to keys at "
                                    f"its own position or earlier; mask the scores before the softmax.")
        run = bad[0]
        off = max_diff(run.out, run.expected)
        small = off <= 1e-2 * max(1.0, float(run.expected.abs().max()))
        fail("mismatch", f"For x of shape {shape_str(run.x.shape)} your output differs from the reference by up "
                         f"to {off:.3g}, although the attention weights look right"
                         + (" to that rounding: differences this small come from a lower precision on the way (a "
                            ".half(), float16 or bfloat16 in the softmax or after it). Keep x's dtype throughout."
                            if small else
                            ": check what happens after the softmax (the values, "
                            + ("merging the heads, " if len(self.heads) > 1 else "") + "the output projection `proj`)."))

    def _weights_untransposed(self) -> None:
        """x @ layer.weight (a flax or numpy habit) where nn.Linear computes x @ weight.T: the reference with those
        layers' weights transposed gives the student's output in every run."""
        subsets = [PARAMETERS, PARAMETERS[:3], *((name,) for name in PARAMETERS)]

        def transposed(run: Run, subset: tuple[str, ...]) -> torch.Tensor:
            params = {name: (w.T if name in subset else w) for name, w in run.params.items()}
            with torch.no_grad():
                return torch.func.functional_call(self.references[run.heads], params, (run.x,))
        for subset in subsets:
            try:
                if all(matches(run.out, transposed(run, subset)) for run in self.runs):
                    layers = ", ".join(f"self.{name.split('.')[0]}" for name in subset)
                    fail("mismatch", f"{self.runs[0].what}: your output is the reference's with the weights of "
                                     f"{layers} transposed: x @ layer.weight uses the weight the other way round "
                                     f"(nn.Linear computes x @ weight.T, F.linear too). Call the layers themselves, "
                                     f"self.query(x), or write x @ layer.weight.T.")
            except (RuntimeError, ValueError, IndexError):
                continue

    # -------------------------------------------------------------------- training mode

    def check_train_dropout(self) -> None:
        """Training mode, by behaviour: outputs stay finite, attn_dropout drops single attention weights
        after the softmax, proj_dropout drops single output features after proj, both rescale by 1/(1-p).

        Every answer is read from the student's module first, each with the same dropout draws (seed 7),
        then judged, the plainest mistake first."""
        heads, run = self.heads[0], self.runs[0]
        head_dim = EMBED_DIM // heads
        eye = torch.eye(EMBED_DIM)
        identity = dict(run.params, **{"value.weight": eye, "proj.weight": eye})   # the output is weights @ x
        rotation, _ = torch.linalg.qr(torch.randn(EMBED_DIM, EMBED_DIM, generator=self.generator))
        # Many copies of one sequence: each copy gets its own dropout draws.
        dense = run.x[:1].expand(64, -1, -1).clone()                                 # (64, L, E)
        one_hot = eye[:MAX_TOKENS].expand(64, -1, -1).clone()                        # (64, L, E), L <= E
        inputs = {"plain": (run.params, run.x), "dense": (identity, dense), "one_hot": (identity, one_hot),
                  "many": (identity, run.x[:1].expand(256, -1, -1).clone()),         # (256, L, E)
                  "rotated": (dict(identity, **{"proj.weight": rotation}), dense)}
        labels = {name: self.what(tuple(x.shape), heads) + " in training mode" for name, (_, x) in inputs.items()}
        model, what = self.models[heads], labels["plain"]
        eval_one_hot = module_output(model, one_hot, labels["one_hot"], params=identity)   # eval: w_ij
        got = {name: module_output(model, x, labels[name], params=params, train_seed=7)
               for name, (params, x) in inputs.items()}

        if close(got["plain"], run.expected):
            fail("dropout", f"In training mode (model.train()) with dropout_rate={DROPOUT} your output is exactly "
                            f"the eval-mode output: dropout is missing. Apply the module's dropout to the "
                            f"attention weights (and after the output projection).")
        if not torch.isfinite(got["dense"]).all():
            fail("dropout", f"{what}: NaN appears in training mode. Dropout reaches the scores after they were "
                            f"set to -inf (0 * -inf = NaN): apply dropout to the attention weights AFTER the "
                            f"softmax (self.attn_dropout(weights)).")
        # Dropout draws anew at every call: a seed set inside forward, or a mask kept from an earlier call, drops
        # the same weights every time (every draw above was seeded alike, so only two unseeded calls show it).
        call(model.train, what=f"model.train() before {what}")
        try:
            with torch.no_grad():
                repeats = same_when_called_twice(lambda: call(model, run.x.clone(), what=what))
        finally:
            model.eval()
        if repeats:
            fail("dropout", f"{what}: your module gives the same output twice on the same input, so it drops the "
                            f"same attention weights at every call (a torch.manual_seed inside forward resets the "
                            f"notebook's random numbers too; a dropout mask kept from an earlier call does the "
                            f"same). Dropout draws new weights to drop at every call: apply self.attn_dropout to "
                            f"the weights each time, and leave the seed to the notebook.")

        # One-hot tokens and value = proj = identity: output feature j of query i is the weight w_ij, so the
        # training-mode output over the eval output reads each weight's dropout factor directly.
        visible = eval_one_hot.abs() > 1e-3
        ratio = (got["one_hot"][visible] / eval_one_hot[visible]).double()          # (entries,)
        s = 1 / (1 - DROPOUT)
        near = lambda value: (ratio - value).abs() <= 1e-3 * max(value, 1.0)
        kinds = {0.0: near(0.0), s: near(s), s * s: near(s * s)}
        if float((~(kinds[0.0] | kinds[s] | kinds[s * s])).double().mean()) > 0.01:
            _rate_written_in(what, ratio, got, heads, head_dim)
            fail("dropout", f"{what}: in training mode your attention weights are changed, not just dropped: "
                            f"dropout acts before the softmax (on the scores), or rescales wrongly. Drop the "
                            f"weights AFTER the softmax: self.attn_dropout(weights), which also scales the kept "
                            f"ones by 1/(1 - p).")
        if float(kinds[s * s].double().mean()) < 0.3:
            fail("dropout", f"{what}: each attention weight should pass two dropouts (self.attn_dropout on the "
                            f"weights after the softmax, then self.proj_dropout after self.proj), but yours passes "
                            f"only one: the dropout on the attention weights is missing or sits elsewhere.")

        # The 64 one-hot sequences are copies of one: each draws its own dropout, so an attention weight dropped in
        # every copy (a chance of about 0.36**64) is one mask for the whole batch, broadcast over N.
        if bool(((got["one_hot"] == 0).all(0) & visible.all(0)).any()):
            shape, shared = (("(N, L, L)", "(L, L)") if len(self.heads) == 1 else
                             ("(N, heads, L, L)", "(heads, L, L) or (L, L)"))
            fail("dropout", f"{what}: every sequence of the batch gets the same dropout mask: 64 copies of one "
                            f"sequence drop exactly the same attention weights. Dropout draws for every weight of "
                            f"every sequence: apply self.attn_dropout to the weights {shape} (or draw the mask with "
                            f"torch.rand_like(weights)), not a mask of shape {shared} broadcast over the batch.")

        # Dense values, value = proj = identity: position 0 sees only itself, with weight 1, so its output is
        # x_0 times that one weight's dropout factor, per head. Dropping the weight zeroes a head's whole block
        # of features; dropout on v or on the merged heads zeroes single features, which one-hot values cannot
        # tell from dropping a weight.
        blocks = got["many"][:, 0].reshape(-1, heads, head_dim)                     # (256, heads, head_dim)
        whole = float((blocks == 0).all(-1).double().mean())
        if whole < 0.4 * DROPOUT:
            fail("dropout", f"{what}: with dense values, your dropout zeroes single features, never a whole "
                            f"attention weight: at position 0 (which sees only itself, with weight 1) a dropped "
                            f"weight would zero all {head_dim} features it carries, but only "
                            f"{whole:.0%} of the heads' blocks there are zero (expected about {DROPOUT:.0%}). "
                            f"Dropout acts on v or on the attention output before self.proj: apply "
                            f"self.attn_dropout to the attention WEIGHTS, right after the softmax.")

        # Each head draws its own: position 0's weight dropped in every head of each sequence or in none (a chance
        # of about 0.68 per sequence with two heads) is one mask for all heads, broadcast over them.
        dropped_heads = (blocks == 0).all(-1)                                       # (256, heads)
        if heads > 1 and float((dropped_heads == dropped_heads[:, :1]).all(-1).double().mean()) > 0.97:
            fail("dropout", f"{what}: every head gets the same dropout mask: at position 0 (weight 1 in each head) "
                            f"a sequence's heads are dropped all together or not at all. Dropout draws for every "
                            f"weight of every head: apply self.attn_dropout to the weights (N, heads, L, L), not a "
                            f"mask of shape (N, 1, L, L) broadcast over the heads.")

        # With value = proj = identity and a dense x, only dropout on the output features makes exact zeros;
        # with a dense proj, only dropout after proj does.
        zeros_identity = float((got["dense"] == 0).double().mean())
        zeros_after_proj = float((got["rotated"] == 0).double().mean())
        if zeros_after_proj < DROPOUT / 2:
            where = ("on the attention output before self.proj" if zeros_identity > DROPOUT / 2 else "nowhere")
            fail("dropout", f"{what}: the output projection's dropout is missing (your feature dropout acts "
                            f"{where}). The spec puts it last: self.proj_dropout(self.proj(out)).")
        if zeros_after_proj > 1 - (1 - DROPOUT) ** 2 + 0.1:
            fail("dropout", f"{what}: {zeros_after_proj:.0%} of the output features are dropped, expected about "
                            f"{DROPOUT:.0%}: apply self.proj_dropout once, after self.proj.")
        # Dropout draws anew at every call, seeded alike or not: with other seeds, position 0's dropped weights
        # (whole blocks of a head's features, above) fall elsewhere; a mask kept from an earlier call drops the same.
        # Several calls in a row of one shape: a mask redrawn only now and then (once per shape, every other or
        # every fourth call) is reused by some two of them.
        dropped = lambda out: (out[:, 0].reshape(-1, heads, head_dim) == 0).all(-1)    # (256, heads)
        draws = [dropped(got["many"])] + [dropped(module_output(model, inputs["many"][1], labels["many"],
                                                                params=identity, train_seed=8 + i)) for i in range(5)]
        pair = repeated_draw(draws, lambda a, b: float((a == b).double().mean()) > 0.97)
        if pair is not None:
            calls = "two calls" if pair == (0, 1) else f"calls {pair[0] + 1} and {pair[1] + 1} of {len(draws)} in a row"
            fail("kept_state", f"{what}: {calls} in training mode drop exactly the same attention weights: your "
                               f"module keeps a dropout mask from an earlier call (drawn once or only now and then, "
                               f"stored on the module or in a global). Each call must depend only on its inputs: "
                               f"apply self.attn_dropout to the weights at every call, so that it draws a new mask "
                               f"each time.")
        self.check_train_backward(model, run.x, what)

    @staticmethod
    def check_train_backward(model: nn.Module, x: torch.Tensor, what: str) -> None:
        """Learning happens in training mode: a backward pass there must run too (the gradient probe runs in eval
        mode, where an in-place dropout on the weights the softmax saved does nothing)."""
        def forward_backward() -> None:
            model.train()
            try:
                model(x.clone().requires_grad_(True)).sum().backward()
            finally:
                model.eval()
        try:
            call(forward_backward, what=f"{what}, then backward")
        except Failure as failure:
            if "inplace" not in failure.message:
                raise
            fail("mutation", f"{failure.message} In training mode your module changes in place a tensor that "
                             f"autograd saved for the backward pass (for example F.dropout(..., inplace=True) on "
                             f"the attention weights, which the softmax's gradient needs): write a new tensor "
                             f"instead (weights = self.attn_dropout(weights)).")


def _rate_written_in(what: str, ratio: torch.Tensor, got: dict[str, torch.Tensor], heads: int, head_dim: int
                     ) -> None:
    """Dropout that only drops and rescales, but at a rate other than the constructor's: every kept weight scaled by
    one factor c = 1/((1 - p_attn)(1 - p_proj)). The shares dropped (whole heads' blocks at position 0, which sees
    only itself; single features after a dense proj) say which rate is off (the hypothesis nearest them); c gives
    its exact value."""
    kept = ratio[ratio.abs() > 1e-3]
    if kept.numel() == 0 or not bool(((kept - kept[0]).abs() <= 1e-3 * kept[0].abs()).all()) or kept[0] <= 1:
        return
    c = float(kept.mean())
    rotated = got["rotated"][(got["rotated"] != 0).any(-1)]   # positions whose every weight was dropped left out
    measured = (float((got["many"][:, 0].reshape(-1, heads, head_dim) == 0).all(-1).double().mean()),
                float((rotated == 0).double().mean()))
    one = 1 - 1 / (c * (1 - DROPOUT))   # the rate of one dropout where the other one is right
    rates = [(1 - c ** -0.5,) * 2, (one, DROPOUT), (DROPOUT, one)]
    rates = [r for r in rates if all(0 <= p < 1 and abs(p - m) < 0.06 for p, m in zip(r, measured))
             and any(abs(p - DROPOUT) > 0.02 for p in r)]
    if not rates:
        return
    closest = min(rates, key=lambda r: sum((p - m) ** 2 for p, m in zip(r, measured)))
    said = [f"{p:.0%} of the {where}" for p, where in zip(closest, ("attention weights", "output features"))
            if abs(p - DROPOUT) > 0.02]
    fail("dropout", f"{what}: your dropout drops about {' and '.join(said)}, expected {DROPOUT:.0%} "
                    f"(dropout_rate={DROPOUT}): a rate is written into your code. Use the constructor's dropout_rate: "
                    f"self.attn_dropout on the weights and self.proj_dropout after self.proj (or F.dropout(..., "
                    f"p=dropout_rate, training=self.training)).")


def check_float64(check: ModuleCheck) -> None:
    """The dtype probe of a module: built, loaded and run in a float64 notebook (torch.set_default_dtype(
    torch.float64)); its output must be float64 and agree with the reference's (``engine.probes``)."""
    heads = check.heads[0]
    run = next(run for run in check.runs if run.heads == heads)

    def build() -> tuple[nn.Module, nn.Module]:
        model = construct(check.make_candidate, heads, DROPOUT, what=check.name)
        reference = check.make_reference(heads, DROPOUT).eval()
        params = {name: p.double() for name, p in run.params.items()}
        load_parameters(model, params)
        load_parameters(reference, params)
        call(model.eval, what=f"{check.name}.eval()")
        return model, reference
    module_in_float64(build, run.x, run.what)


def module_check(check: ModuleCheck, heads_text: str) -> str:
    """Run a ModuleCheck through: outputs, the known mistakes, gradients, then dropout; the success message."""
    check.run_all()
    bad = [run for run in check.runs if not close(run.out, run.expected)]
    if bad:
        check.diagnose(bad)
    # Learning: one backward pass per head count, on its first (full-length) case, in eval mode with the
    # run's weights. Every projection and the input must get the reference's gradient.
    for heads in check.heads:
        run = next(run for run in check.runs if run.heads == heads)
        check_module_gradients(check.models[heads], check.references[heads], run.x, what=run.what)
    check.check_train_dropout()
    # One module, called in turn in eval mode right after a training call of the first input's shape (a dropout mask
    # kept for eval shows), on short inputs of one batch (keys, values or a cache kept "while they fit" are used
    # then), another input of the same shape, and a batch of one twice: each as a fresh module gives it.
    for heads in check.heads:
        xs = [torch.randn(batch, length, EMBED_DIM, generator=torch.Generator().manual_seed(seed))
              for seed, (batch, length) in enumerate(IN_TURN)]
        module_output(check.models[heads], xs[0], check.what(tuple(xs[0].shape), heads) + " in training mode",
                      train_seed=11)
        called_in_turn([(what, lambda x=x, what=what, model=check.models[heads]: module_output(model, x, what),
                         lambda x=x, reference=check.references[heads]: reference(x).detach())
                        for x in xs for what in (check.what(tuple(x.shape), heads),)],
                       step=(check.models[heads], check.references[heads]))
        # moved to another device after those calls: a tensor it kept from them (a mask cached by length) stays behind
        unseen = torch.randn(2, 6, EMBED_DIM, generator=torch.Generator().manual_seed(6))   # a length not run before
        probe_kept_on_device(check.models[heads], xs[0], unseen, f"{check.name} after model.to(device)")
    # No magnitude probe here: the scores come from the module's weights, and masking after the softmax then
    # renormalising (right, and in the bank) underflows on large scores like a softmax without its maximum.
    check_float64(check)
    lengths = sorted({length for _, length in CASES})
    return (f"Matches the reference for batch sizes 1-3 and lengths {lengths}{heads_text}; the future never "
            f"leaks and dropout only acts in training mode.")


def check_on_device(check: ModuleCheck) -> None:
    """Last (after the other sizes too): the modules on another device (meta), in eval and training mode; a mask or
    bias made on the CPU inside forward (no device=x.device, the buffer not read) shows."""
    for heads in check.heads:
        x = torch.randn(2, 5, EMBED_DIM, generator=torch.Generator().manual_seed(7))
        probe_module(check.models[heads], x, check.what(tuple(x.shape), heads))


def check_other_shape(name: str, make_candidate: Callable[[], Any], make_reference: Callable[[], nn.Module],
                      shown: str, heads: int, sizes: str) -> None:
    """The module at other sizes (embed_dim, heads, max_tokens), beside the reference with the same weights: every
    case above had embed_dim 16 and max_tokens 8 (``engine.at_other_sizes``). ``shown`` names the call, ``sizes``
    where the module was right ("embed_dim=16 with 1, 2 and 4 heads")."""
    reference = make_reference().eval()
    model = construct(make_candidate, what=name, shown=shown)
    copy_weights(reference, model, f"your {name}")
    call(model.eval, what=f"{name}.eval()")
    max_tokens, embed_dim = reference.mask.shape[0], reference.query.in_features
    x = torch.randn(2, max_tokens, embed_dim, generator=torch.Generator().manual_seed(16))
    what = f"{shown}.forward(x) with x of shape {shape_str(x.shape)}"
    params = {key: p.detach().double() for key, p in reference.named_parameters()}
    head_dim = embed_dim // heads
    fit = ScaleFit(lambda t, factor: module_variant(t.double(), params, heads, {"scale": factor}),
                   lambda t: head_dim ** -0.5,
                   "{what}: your scores are multiplied by {factor:.4g}, where 1/sqrt(" +
                   ("head_dim" if heads > 1 else "embed_dim") + f") = {{right:.4g}} for {head_dim} features.")
    with torch.no_grad():
        at_other_sizes(lambda: module_output(model, x, what), lambda: reference(x), what,
                       f"at {sizes} and max_tokens={MAX_TOKENS}",
                       "Take every size from the module (self.mask, the layers) or from x.shape.", scale=(fit, (x,)))
