"""Notebook 08: your parts, trained beside the course's, judged, and blamed when they lag.

``train_parts`` trains a GPT put together from a ``Collection`` (``course_lib.classroom.collect``):
the student's ``GPT``, blocks, attention, mask, loss and training step where they wrote them,
the course's elsewhere. Every run of one ``TrainingSetup`` starts from the same weights and
sees the same batches in the same order, so two runs differ only by the parts they use.

``judge`` (from ``training_runs``) says whether the student's GPT trains like the reference
(exercise 8.1), and ``find_blame`` adds the student's parts one at a time, in the order they compose, and names
the first after which the loss turns NaN, diverges, falls far below the reference's or stalls.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import _validate as validate
from .._rng import leaves_rng_alone
from .._validate import describe
from ..data import char_corpus, load_names, names_dataset, names_tokenizer, random_batch, split_names
from ..model import GPT, GPTConfig
from ..train import evaluate
from .collect import GPT_EXERCISES, STATUS_TEXT, Collection
from .training_runs import TOLERANCE, TrainingRun, how_it_fails
from .verdict import CheckResult

__all__ = ["TrainingSetup", "TrainingRun", "Blame", "names_setup", "shakespeare_setup", "train_parts",
           "find_blame", "sample_text", "sample_names", "plot_side_by_side", "CHECKERS", "TOLERANCE"]

# The checker of each part (by exercise id), to say what it missed when a part it passed breaks training.
CHECKERS = {"2.1": "check_causal_mask", "3.1": "check_split_heads", "3.2": "check_merge_heads",
            "3.3": "check_multi_head_attention", "4.2": "check_transformer_block", "4.3": "check_gpt",
            "5.2": "check_lm_loss", "5.3": "check_train_step", "5.4": "check_sampling"}

@dataclass(frozen=True)
class TrainingSetup:
    """One corpus and model for side-by-side runs: data, config, steps and the batches' seed."""

    name: str
    config: GPTConfig
    batches: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    val_inputs: torch.Tensor
    val_targets: torch.Tensor
    steps: int
    learning_rate: float = 3e-3
    eval_every: int = 50
    seed: int = 0
    decode: Callable[[list[int]], str] | None = None
    start_token: int = 0


@dataclass(frozen=True)
class Blame:
    """The part after which training breaks, how it breaks, and what its own checker said."""

    exercise: str
    name: str
    verdict: str            # "nan", "diverges", "below", "stalls" or "raises"
    run: TrainingRun
    checker: CheckResult | None
    notebook: str = ""      # where the part is written, to say where to fix it
    whose: str = "your"     # "your", or e.g. "the planted" for a demonstration
    alone: bool | None = None   # whether this part alone (the others the course's) breaks training too
    earlier: tuple[str, ...] = ()   # the student's parts added before it

    def __str__(self) -> str:
        steps = len(self.run.step)
        how = {"nan": f"the loss becomes NaN at step {steps}",
               "diverges": "the loss ends well above the reference's",
               "below": "the loss ends far below the reference's, as a model that sees the future does",
               "stalls": "the loss stops going down",
               "raises": f"training fails ({self.run.failure})"}[self.verdict]
        text = f"Exercise {self.exercise} ({self.name}): with {self.whose} {self.name}, {how}."
        if self.verdict == "nan":
            text += (" Look for what acts only in training mode or on the -inf of the mask: dropout applied "
                     "before the softmax turns 0 x (-inf) into NaN.")
        if self.alone is True and self.earlier:
            text += " This part alone (the others the course's) does it too: the lag is its own."
        elif self.alone is False:
            text += (f" On its own this part trains like the reference: the lag needs it together with the "
                     f"parts added before it ({', '.join(self.earlier)}).")
        if self.checker is not None and self.checker.passed:
            text += " Its checker passed: this mistake shows only when the parts train together."
        elif self.checker is not None:
            text += f" Its checker says: {self.checker.message}"
        if self.whose == "your" and self.notebook:
            text += f" Fix it in {self.notebook}, save it, and run this notebook again from section 1."
        return text


# --------------------------------------------------------------------------- the two setups

def names_setup(steps: int = 300, seed: int = 0) -> TrainingSetup:
    """Character-level names: a small GPT that learns in a few seconds."""
    validate.positive_int("steps", steps)
    validate.seed("seed", seed)
    names = load_names()
    tokenizer = names_tokenizer(names)
    train_names, val_names = split_names(names)
    max_tokens = 16
    config = GPTConfig(vocab_size=tokenizer.vocab_size, embed_dim=64, num_heads=4, num_layers=2,
                       max_tokens=max_tokens, dropout_rate=0.1)
    inputs, targets = names_dataset(train_names, tokenizer, max_tokens)        # (names, max_tokens) each
    val_inputs, val_targets = names_dataset(val_names[:1000], tokenizer, max_tokens)

    def batches(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(inputs.shape[0], (64,), generator=generator)      # (64,)
        return inputs[rows], targets[rows]                                     # (64, max_tokens) each

    return TrainingSetup("names", config, batches, val_inputs, val_targets, steps, learning_rate=3e-3,
                         eval_every=max(1, steps // 6), seed=seed, decode=tokenizer.decode, start_token=0)


def shakespeare_setup(steps: int = 300, seed: int = 0) -> TrainingSetup:
    """Character-level Shakespeare, the corpus of notebook 05, with a model small enough for a CPU."""
    validate.positive_int("steps", steps)
    validate.seed("seed", seed)
    corpus = char_corpus("tinyshakespeare")
    max_tokens = 64
    config = GPTConfig(vocab_size=corpus.vocab_size, embed_dim=96, num_heads=4, num_layers=2,
                       max_tokens=max_tokens, dropout_rate=0.1)
    val_generator = torch.Generator().manual_seed(1234)
    val_inputs, val_targets = random_batch(corpus.val_ids, 64, max_tokens, generator=val_generator)

    def batches(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(corpus.train_ids, 32, max_tokens, generator=generator)

    return TrainingSetup("tinyshakespeare", config, batches, val_inputs, val_targets, steps, learning_rate=3e-3,
                         eval_every=max(1, steps // 6), seed=seed, decode=corpus.tokenizer.decode,
                         start_token=corpus.tokenizer.encode("\n")[0])


# --------------------------------------------------------------------------- training

def _build(namespace: dict, setup: TrainingSetup) -> torch.nn.Module:
    torch.manual_seed(setup.seed)
    model = namespace["GPT"](setup.config)
    # Every run starts from the reference's initial weights (copied by name where they fit), so a
    # part that only creates its layers in another order does not change where training starts.
    torch.manual_seed(setup.seed)
    start = GPT(setup.config).state_dict()
    own = model.state_dict()
    fitting = {k: v for k, v in start.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fitting, strict=False)
    return model


@leaves_rng_alone   # it trains with the setup's own seed: the notebook's next torch.randn is untouched
def train_parts(collection: Collection, yours: Sequence[str] | None, setup: TrainingSetup, *,
                steps: int | None = None, label: str = "") -> TrainingRun:
    """Train the GPT made of the student's parts ``yours`` (None: every usable one) and the course's others."""
    if not isinstance(collection, Collection):
        raise TypeError(f"collection: expected the result of collect_student_parts(...), got {describe(collection)}")
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"setup: expected names_setup() or shakespeare_setup(), got {describe(setup)}")
    steps = setup.steps if steps is None else steps
    validate.positive_int("steps", steps)
    if yours is not None:
        if isinstance(yours, str) or not isinstance(yours, Sequence):
            raise TypeError(f"yours: expected a list of exercise ids such as ['2.1', '3.3'] (or None for every "
                            f"part of yours), got {describe(yours)}")
        unknown = [ex for ex in yours if ex not in collection.parts]
        if unknown:
            raise ValueError(f"yours: expected ids among {sorted(collection.parts)}, got {unknown}")
    run = TrainingRun(label or ("yours" if yours is None else f"yours: {', '.join(yours) or 'none'}"))
    run.yours_asked = None if yours is None else tuple(yours)
    run.trained_on = (setup.name, setup.seed, setup.learning_rate)
    if yours is None:
        run.not_yours = tuple(f"{ex} ({STATUS_TEXT[part.status]})" for ex, part in collection.parts.items()
                              if ex in GPT_EXERCISES and not part.is_yours)
    try:
        namespace = collection.namespace(yours)
        model = _build(namespace, setup)
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=0.01)
        generator = torch.Generator().manual_seed(setup.seed)
        for step in range(1, steps + 1):
            inputs, targets = setup.batches(generator)
            loss = float(namespace["train_step"](model, optimizer, inputs, targets, 1.0))
            run.step.append(step)
            run.train_loss.append(loss)
            if not math.isfinite(loss):
                run.failure = "nan"
                break
            if step % setup.eval_every == 0 or step == steps:
                run.val_step.append(step)
                run.val_loss.append(evaluate(model, setup.val_inputs, setup.val_targets))
                if not math.isfinite(run.val_loss[-1]):
                    run.failure = "nan"
                    break
    except Exception as err:  # the student's parts: any error ends this run with a verdict
        run.failure = f"exception: {type(err).__name__}: {err}"
        return run
    run.model, run.namespace = model, namespace
    return run


# --------------------------------------------------------------------------- judging and blaming

def _checker_result(collection: Collection, exercise: str, namespace: dict) -> CheckResult | None:
    from . import checks
    checker = getattr(checks, CHECKERS.get(exercise, ""), None)
    if checker is None:
        return None
    # not a test of the student's work here (it explains a blame), so never a failed cell under nbgrader
    return checker(namespace[collection.parts[exercise].exercise.name], graded=False)


@leaves_rng_alone
def find_blame(collection: Collection, setup: TrainingSetup, *, steps: int | None = None,
               tolerance: float = TOLERANCE, only: Sequence[str] | None = None, whose: str = "your") -> Blame | None:
    """Add the student's parts one at a time, in the order they compose; name the first that breaks training.

    Every trial is a run on the same batches; the search stops at the first part to blame. It first
    tries short runs (``steps``, default 120), and when none of them lags, runs as long as check 8.1
    does (``setup.steps``): a slow lag shows only there. A blamed part that came after others is tried
    once more alone, and the blame says whether it breaks training on its own. A part whose code is
    the solution's (up to comments and layout) needs no trial; ``only`` limits the search to some
    exercises. None when no part breaks training even at 8.1's length.
    """
    if not isinstance(collection, Collection):
        raise TypeError(f"collection: expected the result of collect_student_parts(...), got {describe(collection)}")
    if steps is not None:
        validate.positive_int("steps", steps)
    candidates = collection.yours() if only is None else [ex for ex in collection.yours() if ex in set(only)]
    first = min(120, setup.steps) if steps is None else steps
    for length in (first, setup.steps) if setup.steps > first else (first,):
        blame = _blame_at(collection, setup, candidates, length, tolerance, whose)
        if blame is not None:
            return blame
    return None


def _blame_at(collection: Collection, setup: TrainingSetup, candidates: Sequence[str], steps: int,
              tolerance: float, whose: str) -> Blame | None:
    reference = train_parts(collection, [], setup, steps=steps, label="reference")
    added: list[str] = []
    for exercise in candidates:
        added.append(exercise)
        if collection.parts[exercise].is_the_solution:
            continue
        trial = train_parts(collection, list(added), setup, steps=steps)
        verdict = how_it_fails(trial, reference, tolerance)
        if verdict is None:
            continue
        part = collection.parts[exercise]
        earlier = tuple(ex for ex in added[:-1] if not collection.parts[ex].is_the_solution)
        alone = None
        if earlier:   # does it lag without the student's earlier parts? Then never "only together"
            alone = how_it_fails(train_parts(collection, [exercise], setup, steps=steps), reference, tolerance) is not None
        return Blame(exercise, part.exercise.name, verdict, trial,
                     _checker_result(collection, exercise, collection.namespace(added)),
                     notebook=part.exercise.notebook, whose=whose, alone=alone, earlier=earlier)
    return None


def plot_side_by_side(yours: TrainingRun, reference: TrainingRun, title: str = ""):
    """Both runs' training loss (thin) and validation loss (dots) against the step, on one figure."""
    from ..viz.style import PALETTE, Figure
    for name, run in (("yours", yours), ("reference", reference)):
        if not isinstance(run, TrainingRun):
            raise TypeError(f"{name}: expected a TrainingRun from train_parts(...), got {describe(run)}")
    fig = Figure(figsize=(7.5, 4.0))
    ax = fig.add_subplot()
    for run, colour, style in ((reference, PALETTE[0], "-"), (yours, PALETTE[6], "--")):
        if run.failure is not None:   # a NaN is not drawn: say so where the curve would be
            ax.plot([], [], color=colour, linestyle=style,
                    label=f"{run.label}: stopped at step {len(run.step)} ({run.failure}), not drawn")
            continue
        ax.plot(run.step, run.train_loss, color=colour, linewidth=1.0, alpha=0.6, linestyle=style,
                label=f"{run.label}, training batches")
        ax.plot(run.val_step, run.val_loss, color=colour, marker="o", markersize=4, linewidth=1.8,
                linestyle=style, label=f"{run.label}, validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or "your GPT and the reference, same start and same batches", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    return fig


def sample_names(run: TrainingRun, setup: TrainingSetup, count: int = 12, seed: int = 0,
                 temperature: float = 0.8) -> list[str]:
    """``count`` names, each drawn from its own boundary token ``.`` until the next one (as in notebook 05)."""
    if not isinstance(run, TrainingRun) or run.model is None:
        raise ValueError(f"run: expected a finished TrainingRun with its model, got {describe(run)}")
    validate.positive_int("count", count)
    model, sample = run.model.eval(), run.namespace["sample_next_token"]
    generator = torch.Generator().manual_seed(seed)
    names = []
    with torch.no_grad():
        for _ in range(count):
            ids = torch.tensor([[setup.start_token]])                             # (1, 1): the boundary "."
            while ids.shape[1] < setup.config.max_tokens:
                logits = model(ids)[:, -1, :]                                      # (1, vocab)
                next_id = sample(logits, temperature=temperature, generator=generator).reshape(1, 1)
                if int(next_id) == setup.start_token:
                    break                                                          # the name is complete
                ids = torch.cat([ids, next_id], dim=1)                             # (1, T + 1)
            names.append(setup.decode(ids[0, 1:].tolist()) if setup.decode else str(ids[0, 1:].tolist()))
    return names


def sample_text(run: TrainingRun, setup: TrainingSetup, length: int = 200, seed: int = 0,
                temperature: float = 0.8) -> str:
    """Text from a trained run's model, drawn with the run's own ``sample_next_token``."""
    if not isinstance(run, TrainingRun) or run.model is None:
        raise ValueError(f"run: expected a finished TrainingRun with its model, got {describe(run)}")
    model, sample = run.model.eval(), run.namespace["sample_next_token"]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[setup.start_token]])                                   # (1, 1)
    with torch.no_grad():
        for _ in range(length):
            logits = model(ids[:, -setup.config.max_tokens:])[:, -1, :]          # (1, vocab)
            next_id = sample(logits, temperature=temperature, generator=generator)
            ids = torch.cat([ids, next_id.reshape(1, 1)], dim=1)                # (1, T + 1)
    return setup.decode(ids[0].tolist()) if setup.decode else str(ids[0].tolist())

