"""What each change of the CPU recipe bought: ``python -m course_lib bench ablation``.

The recipe went from GPT-2's parts with AdamW to notebook 09's parts with Muon one change at a
time. Each row of the table adds one change to the row above and is measured the way the issue
asks for every change: at the baseline's own wall time, with an interleaved A/B for the time.

1. **Time, interleaved.** Every variant's training step is timed in one process, the variants
   taking turns (a, b, c, a, b, c, ...), so a machine that speeds up or slows down during the
   measurement moves them all alike. The baseline's 2,000 steps take ``2000 * t_baseline``; a
   variant gets the steps it completes in that time, ``2000 * t_baseline / t_variant``.
2. **Loss, deterministic.** Each variant then trains for exactly those steps, its schedule
   ending with them, and is scored on the whole validation split. Same seed, same batches:
   running it again on any machine with the same step counts gives the same losses.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import _validate as validate
from .._rng import leaves_rng_alone
from ..model import GPT2_INIT_STD
from .presets import PRESETS, Preset, prepare_preset

__all__ = ["Variant", "ABLATION", "ablation_benchmark", "print_ablation"]


@dataclass(frozen=True)
class Variant:
    """One row: a label and the preset it trains (a change applied to the row above)."""

    label: str
    preset: Preset
    side: bool = False   # a side row (tried and dropped, a control): compared with the last main row
    against: str | None = None   # the label of an earlier row to compare with instead of the last main row


def _variant(label: str, base: Preset, *, architecture: str | None = None, model: dict[str, Any] | None = None,
             side: bool = False, against: str | None = None, **train: Any) -> Variant:
    return Variant(label, replace(base, architecture=architecture or base.architecture,
                                  model=model if model is not None else base.model,
                                  train=replace(base.train, **train)), side, against)


def _ablation() -> list[Variant]:
    baseline, notebook05 = PRESETS["baseline_cpu"], PRESETS["shakespeare_char_cpu"]
    course = PRESETS["shakespeare_char_modern_cpu"]
    # The path was walked at width 192 with 6 heads (ReLU² hidden 3E = 576); its last main rows narrow it to the
    # recipe's width, then trade ReLU² for SwiGLU of the same weights. It starts from GPT-2's parts at that width
    # (notebook 05's recipe until it became narrower), so that each row changes one thing.
    wide = dict(course.model, embed_dim=192, num_heads=6, mlp="relu2", hidden_dim=576)
    before = replace(notebook05, model=dict(notebook05.model, embed_dim=wide["embed_dim"], num_heads=wide["num_heads"],
                                            activation="gelu", input_init_std=GPT2_INIT_STD),
                     train=replace(notebook05.train, learning_rate=course.train.learning_rate, weight_decay=0.1))

    # The rows before the longer context read 64 characters, 32 windows a step, as the recipe did then.
    short = replace(course, model=dict(wide, max_tokens=64), train=replace(course.train, batch_size=32))
    long = replace(course, model=wide)

    def modern(**model: Any) -> dict[str, Any]:   # the recipe at 64 characters
        return dict(short.model, **model)
    first = dict(muon_momentum=0.95)   # the momentum before its own row
    hashed = dict(hashed_ngrams=4, ngram_buckets=8192)   # the hashed n-gram embeddings of 2026-11-26
    no_qk_norm = "Muon momentum 0.9 instead of 0.95"   # the control's changes, on notebook 09's parts
    return [
        Variant("baseline_cpu (4 layers of 128, AdamW)", baseline),
        Variant("GPT-2 parts, 2 layers of 192, AdamW", before),
        Variant("notebook 05's shakespeare_char_cpu: 2 layers of 96, GELU-tanh, lr 1e-2, weight decay 0.2, "
                "input init 0.05 (side)", notebook05, side=True),
        _variant("+ Muon for the blocks' matrices", before, optimizer="muon"),
        _variant("+ RoPE, RMSNorm, SwiGLU (notebook 09's parts)", short,
                 model=modern(mlp="swiglu", hidden_dim=None, tie_weights=True, qk_norm=False), **first),
        _variant("ReLU² (hidden 4E) instead of SwiGLU", short,
                 model=modern(hidden_dim=4 * wide["embed_dim"], tie_weights=True, qk_norm=False), **first),
        _variant("ReLU² hidden 3E instead of 4E", short, model=modern(tie_weights=True, qk_norm=False), **first),
        _variant("untied output head", short, model=modern(qk_norm=False), **first),
        _variant(no_qk_norm, short, model=modern(qk_norm=False)),
        _variant("+ QK-norm", short, model=modern()),
        _variant("hashed 2- to 4-gram embeddings (the recipe on 2026-11-26, side)", short, model=modern(**hashed),
                 side=True),
        _variant("+ context 256, 8 windows a step", long),
        # Not a transformer: counts under the network (the recipe from 2026-11-26 to 2026-11-28)
        _variant("a counted 7-gram model under the logits, its probabilities read too (side, not a transformer)",
                 long, model=dict(wide, ngram_prior=7, prior_features=True), side=True),
        _variant("+ width 128, 4 heads, ReLU² hidden 384", course, model=dict(course.model, mlp="relu2", hidden_dim=384)),
        _variant("+ SwiGLU of hidden 256 instead of ReLU² of 384, the same weights (shakespeare_char_modern_cpu)",
                 course),
        _variant("warmup 30 steps instead of 100 (tried, not kept)", course, warmup_steps=30, side=True),
        # The control: every change but notebook 09's parts and the n-grams, on GPT-2's (GELU feed-forward of 3E).
        # It is compared with the row that has the same changes on notebook 09's parts, so that its difference is
        # what those parts buy, not what QK-norm and the context buy as well.
        _variant("control: GPT-2 parts, every other change but QK-norm and the n-grams", short, architecture="gpt",
                 model=dict(before.model, mlp_ratio=3, tie_weights=False), side=True, against=no_qk_norm),
    ]


ABLATION: list[Variant] = _ablation()


def _build(preset: Preset, corpus: str | None, steps: int | None = None):
    torch.manual_seed(preset.train.seed)   # the initial weights run_preset gives this preset
    return prepare_preset(preset, corpus, "cpu", steps=steps)


def _stepper(preset: Preset, corpus: str | None) -> tuple[Any, float]:
    """A function that takes one training step of ``preset``, and the seconds training spends before its first
    step (counting the n-grams of a counted n-gram model; 0 without one)."""
    from ..optimizers import build_optimizer
    from ..train import count_ngrams, has_ngram_prior, update
    model, _, train_split, _, config = _build(preset, corpus)
    optimizer = build_optimizer(model, config, "cpu")
    generator = torch.Generator().manual_seed(0)
    show_targets = has_ngram_prior(model)
    setup = count_ngrams(model, train_split)

    def step() -> None:
        x, y = train_split.sample(config.batch_size, model.config.max_tokens, generator)
        update(model, optimizer, x, y, config.max_grad_norm, show_targets=show_targets)
    return step, setup


def _time_steps(variants: Sequence[Variant], corpus: str | None, rounds: int,
                steps_per_round: int) -> tuple[list[float], list[float]]:
    """Median seconds per training step of each variant, timed in turns, and each one's set-up seconds."""
    steppers, setups = zip(*(_stepper(v.preset, corpus) for v in variants))
    for step in steppers:            # warm up: first calls allocate and pick kernels
        for _ in range(3):
            step()
    times: list[list[float]] = [[] for _ in steppers]
    for _ in range(rounds):
        for step, spent in zip(steppers, times):
            started = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            spent.append((time.perf_counter() - started) / steps_per_round)
    return [statistics.median(spent) for spent in times], list(setups)


@leaves_rng_alone   # a benchmark seeds its own inputs
def ablation_benchmark(variants: Sequence[Variant] | None = None, *, corpus: str | None = None,
                       baseline_steps: int | None = None, rounds: int = 7, steps_per_round: int = 10,
                       verbose: bool = False) -> list[dict[str, Any]]:
    """Time every variant (interleaved), then train each for the steps it takes in the first's time.

    The first variant is the baseline: it trains its own preset's steps (or ``baseline_steps``).
    Returns one dict per variant: label, seconds per step, steps, val_loss.
    """
    from ..train import evaluate, train
    variants = list(ABLATION if variants is None else variants)
    if not variants or not all(isinstance(v, Variant) for v in variants):
        raise TypeError(f"variants: expected a non-empty list of Variant, got {validate.describe(variants)}")
    for i, variant in enumerate(variants):
        if variant.against is not None and variant.against not in [v.label for v in variants[1:i]]:
            raise ValueError(f"variants[{i}].against: expected the label of an earlier row after the baseline, "
                             f"got {variant.against!r}")
    if baseline_steps is not None:
        validate.positive_int("baseline_steps", baseline_steps)
    validate.positive_int("rounds", rounds)
    validate.positive_int("steps_per_round", steps_per_round)
    if verbose:
        print(f"timing {len(variants)} variants in turns ({rounds} rounds of {steps_per_round} steps) ...", flush=True)
    per_step, setups = _time_steps(variants, corpus, rounds, steps_per_round)
    budget_steps = baseline_steps or variants[0].preset.train.steps
    budget = budget_steps * per_step[0]
    rows = []
    for variant, seconds, setup in zip(variants, per_step, setups):
        # counting n-grams is part of the training time: it leaves fewer seconds for steps
        steps = budget_steps if not rows else max(1, round((budget - setup) / seconds))
        model, _, train_split, val_split, config = _build(variant.preset, corpus, steps)
        config = replace(config, eval_interval=steps + 1, log_interval=max(1, min(config.log_interval, steps)))
        if verbose:
            print(f"training {variant.label}: {steps} steps ...", flush=True)
        train(model, train_split, None, config, device="cpu", progress=False)
        val_loss = evaluate(model, *val_split.eval_windows(model.config.max_tokens))
        # a longer context lowers the loss by itself, so a row with a longer one is also scored on the baseline's
        # windows (a shorter context cannot read them: its own score stands)
        first_windows = variants[0].preset.model["max_tokens"]
        on_first_windows = val_loss if model.config.max_tokens <= first_windows else \
            evaluate(model, *val_split.eval_windows(first_windows))
        rows.append(dict(label=variant.label, seconds_per_step=seconds, steps=steps, val_loss=val_loss,
                         val_loss_on_first_windows=on_first_windows, first_windows=first_windows,
                         budget_seconds=budget, setup_seconds=setup, side=variant.side, against=variant.against))
    return rows


def print_ablation(rows: Sequence[dict[str, Any]]) -> None:
    print(f"At the baseline's time ({rows[0]['budget_seconds']:.1f} s of training by the interleaved timing, "
          f"{torch.get_num_threads()} threads):")
    width = max(58, 2 + max(len(row["label"]) for row in rows))
    windows = f"at {rows[0]['first_windows']}" if "first_windows" in rows[0] else ""
    header = f"{'change':<{width}}{'ms/step':>9}{'steps':>7}{'val_loss':>10}{'bought':>9}{windows:>10}"
    print(header)
    print("-" * len(header))
    previous = None
    losses: dict[str, float] = {}
    for i, row in enumerate(rows):
        # rows 0 and 1 are the two starting points; each later row is measured against the main row above, or
        # against the row it names
        against = losses[row["against"]] if row.get("against") in losses else previous
        bought = "" if against is None or i < 2 else f"{against - row['val_loss']:+.3f}"
        on_first = f"{row['val_loss_on_first_windows']:.4f}" if windows else ""
        print(f"{row['label']:<{width}}{1000 * row['seconds_per_step']:>9.1f}{row['steps']:>7d}"
              f"{row['val_loss']:>10.4f}{bought:>9}{on_first:>10}")
        if i > 0:
            losses[row["label"]] = row["val_loss"]
            if not row.get("side"):
                previous = row["val_loss"]
    # the recipe is the last main row; a side row (a counted model, say) may end lower, and is named then
    main = [row for row in rows[1:] if not row.get("side")]
    best = min(rows[1:], key=lambda row: row["val_loss"], default=None)
    leads = f"; the last main row is {rows[0]['val_loss'] - main[-1]['val_loss']:.3f} below the baseline" if main else ""
    if best is not None and (not main or best is not main[-1]):
        leads += f"; the lowest row, {best['label']!r}, is {rows[0]['val_loss'] - best['val_loss']:.3f} below it"
    named = "".join(f", {row['label']!r} with {row['against']!r}" for row in rows if row.get("against"))
    print(f"(bought: the main row above minus this row; side rows are compared with the main row above them{named}"
          f"{leads}; {windows or 'at'}: the same model scored on the baseline's windows, since a longer context "
          f"lowers the loss by itself)")
