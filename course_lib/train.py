"""Training a GPT: the loss, one step, evaluation, the schedule and the loop.

Named recipes and runs from the command line build on this file: :mod:`course_lib.runs`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import _validate as validate
from .data import IGNORE_INDEX, Examples, Split, TokenStream
from .distributed import DistributedContext
from .model import GPT, GPTConfig
from .modern_gpt import ModernGPT, ModernGPTConfig
from .optimizers import build_optimizer
from .runtime import device as default_device

__all__ = [
    "lm_loss", "update", "train_step", "evaluate", "count_ngrams", "has_ngram_prior",
    "TrainConfig", "History", "TrainState", "NonFiniteLoss", "learning_rate", "batches", "train",
    "resolve_device", "flops_per_token", "patience_stop_note",
]

# IGNORE_INDEX (data.py): targets with this value (padding) add nothing to the loss.
# train() reads batches from a data.Split: data.TokenStream (one long text) or data.Examples (one row each).


# ---------------------------------------------------------------- loss, step, evaluation

def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of predicting each target token: logits (N, L, V), targets (N, L).

    ``reduction="mean"`` averages over the targets that count (not IGNORE_INDEX); ``"sum"`` adds them.
    """
    validate.tensor("logits", logits, dim=3, floating=True)
    validate.tensor("targets", targets)   # before its device is read below
    # padding (IGNORE_INDEX) is allowed; any other id must be a class of the logits (reading the
    # ids back waits for a GPU, so there only their type is checked)
    checkable = not torch.compiler.is_compiling() and not targets.is_cuda
    validate.token_ids("targets", targets, dim=2, padding=IGNORE_INDEX,
                       vocab_size=logits.shape[-1] if checkable and logits.shape[:2] == targets.shape else None)
    validate.one_of("reduction", reduction, ["mean", "sum"])
    validate.expect(logits.shape[:2] == targets.shape, "targets",
                    f"shape {tuple(logits.shape[:2])} to match logits {tuple(logits.shape)}", tuple(targets.shape))
    # any integer dtype is accepted as token ids; cross-entropy wants long (a no-op when they are)
    return _cross_entropy(logits, targets.long(), reduction)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    # lm_loss without its checks: the loop and evaluate() call it on batches checked once, up front.
    # cross_entropy wants the classes in dimension 1, so flatten positions into the batch; half-precision
    # logits are summed in float32 (float64 ones stay float64: a float64 notebook keeps its precision)
    precision = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.flatten(0, 1).to(precision), targets.flatten(),   # (N*L, V), (N*L,)
                           ignore_index=IGNORE_INDEX, reduction=reduction)


def update(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
           max_grad_norm: float | None = 1.0, *, autocast: Any = None, parameters: Any = None,
           show_targets: bool = False) -> torch.Tensor:
    """The one training step of train_step and of the loop, on a batch already checked.

    It returns the loss as a tensor, so the loop reads it back only now and then (each read waits
    for the device). ``autocast``: a torch.autocast context; ``parameters``: what to clip (the
    model's own, when ``model`` is a wrapper); ``show_targets``: hand the model the targets too (a
    ModernGPT with a counted n-gram model leaves each target out of its counts).
    """
    model.train()
    optimizer.zero_grad(set_to_none=True)
    with autocast if autocast is not None else contextlib.nullcontext():
        logits = model(inputs, targets=targets) if show_targets else model(inputs)
        loss = _cross_entropy(logits, targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(parameters if parameters is not None else model.parameters(),
                                       max_grad_norm)
    optimizer.step()
    return loss.detach()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, max_grad_norm: float | None = 1.0) -> float:
    """One update: forget old gradients, predict, measure the loss, backpropagate, clip, step."""
    validate.instance("model", model, nn.Module, "an nn.Module")
    validate.instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
    if max_grad_norm is not None:
        validate.positive_float("max_grad_norm", max_grad_norm)
    inputs, targets = _check_batch(model, inputs, targets)
    return update(model, optimizer, inputs, targets, max_grad_norm,
                  show_targets=has_ngram_prior(model)).item()


def _model_limits(model: nn.Module) -> tuple[int | None, int | None]:
    """(vocab_size, max_tokens) from ``model.config``, each None where the model does not say."""
    config = getattr(model, "config", None)
    sizes = (getattr(config, "vocab_size", None), getattr(config, "max_tokens", None))
    return tuple(size if validate.is_int(size) and size > 0 else None for size in sizes)


def _check_length(inputs: torch.Tensor, max_tokens: int | None) -> None:
    if max_tokens is not None and inputs.shape[1] > max_tokens:
        raise ValueError(f"inputs: sequence of {inputs.shape[1]} tokens is longer than the model's "
                         f"max_tokens={max_tokens}; crop the windows to {max_tokens} tokens "
                         f"(inputs[:, -{max_tokens}:], and targets alike)")


def _check_batch(model: nn.Module, inputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """train_step's ``inputs`` and ``targets``, checked against the model under the names the
    student passed (the model's own forward would name them ``idx``), as long token ids."""
    vocab_size, max_tokens = _model_limits(model)
    # reading the ids back waits for a GPU, so there only their type is checked
    validate.tensor("inputs", inputs)     # before its device is read
    validate.token_ids("inputs", inputs, dim=2, vocab_size=None if inputs.is_cuda else vocab_size)
    validate.tensor("targets", targets)
    validate.token_ids("targets", targets, dim=2, padding=IGNORE_INDEX,
                       vocab_size=None if targets.is_cuda else vocab_size)
    validate.expect(inputs.shape == targets.shape, "targets", f"the shape of inputs {tuple(inputs.shape)}",
                    tuple(targets.shape))
    _check_length(inputs, max_tokens)
    return inputs.long(), targets.long()   # any integer dtype is accepted: a no-op for long ids


def has_ngram_prior(model: nn.Module) -> bool:
    """Whether ``model`` (unwrapped) has a counted n-gram model, and so wants the targets in training steps."""
    return getattr(model, "ngram_prior", None) is not None


def count_ngrams(model: nn.Module, train_split: Split) -> float:
    """Count a ModernGPT's n-gram model (``ngram_prior``) from ``train_split``, unless it is counted already.

    Returns the seconds it took (0.0 with nothing to count): training time, which :func:`train` and the
    benchmarks spend out of their budgets.
    """
    validate.instance("model", model, nn.Module, "an nn.Module (a course_lib GPT or ModernGPT)")
    if not has_ngram_prior(model) or model.ngram_prior.counted:
        return 0.0
    started = time.perf_counter()
    model.ngram_prior.count(_one_text(train_split).to(model.ngram_prior.discounts.device))
    return time.perf_counter() - started


def _one_text(split: Split) -> torch.Tensor:
    """The token ids of a split as one run (T,), for counting n-grams: names' rows one after the other."""
    if isinstance(split, TokenStream):
        return split.ids
    if isinstance(split, Examples):
        rows = torch.cat([split.inputs[:, :1], split.targets], dim=1)   # each row's whole sequence
        return rows[rows != IGNORE_INDEX]
    raise TypeError(f"train_split: a model with a counted n-gram model (ngram_prior) counts a TokenStream or "
                    f"Examples, got {type(split).__name__}")


@torch.no_grad()
def evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 64) -> float:
    """Mean loss per predicted token over every window given (no sampling, no dropout)."""
    validate.instance("model", model, nn.Module, "an nn.Module (a course_lib GPT or ModernGPT)")
    vocab_size, max_tokens = _model_limits(model)   # the ids are checked here, under the names given
    validate.token_ids("inputs", inputs, dim=2, vocab_size=vocab_size)
    validate.token_ids("targets", targets, dim=2, vocab_size=vocab_size, padding=IGNORE_INDEX)
    validate.positive_int("batch_size", batch_size)
    validate.expect(inputs.shape == targets.shape and inputs.shape[0] > 0, "targets",
                    f"the shape of inputs {tuple(inputs.shape)} (at least one window)", tuple(targets.shape))
    _check_length(inputs, max_tokens)
    inputs, targets = inputs.long(), targets.long()   # any integer dtype is accepted: a no-op for long ids
    if not bool((targets != IGNORE_INDEX).any()):
        # the mean over no targets is not a loss of 0 (a perfect model): there is nothing to measure
        raise ValueError(f"targets: expected at least one target that is not padding ({IGNORE_INDEX}), got "
                         f"{targets.numel()} targets that are all {IGNORE_INDEX}; evaluate on windows with text")
    return _evaluate(model, inputs, targets, batch_size)


@torch.no_grad()
def _evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 64) -> float:
    # evaluate() without its checks: train() checked its validation split once, up front.
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, inputs.shape[0], batch_size):
        x = inputs[i:i + batch_size].to(device)
        y = targets[i:i + batch_size].to(device)
        total += _cross_entropy(model(x), y, reduction="sum").item()
        count += int((y != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / count


# ---------------------------------------------------------------- configuration and schedule

@dataclass
class TrainConfig:
    """How to train: budget, batch, optimiser, schedule, evaluation, checkpoints, speed switches."""

    steps: int = 2000
    seconds: float | None = None        # stop on wall-clock too; whichever comes first
    batch_size: int = 12
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    max_grad_norm: float | None = 1.0
    optimizer: str = "adamw"            # "adamw", or "muon": Muon for the blocks' matrices, AdamW for the rest
    muon_learning_rate: float = 0.02    # Muon's peak learning rate (its scale differs from AdamW's)
    muon_momentum: float = 0.95
    eval_interval: int = 250            # steps between validation estimates (and checkpoints)
    eval_windows: int = 200             # windows per estimate during training (the final one uses all)
    patience: int | None = None         # stop once this many estimates in a row beat no earlier one, and
                                        # go back to the best weights (None: train the whole budget)
    log_interval: int = 10              # steps between reading the loss back from the device
    seed: int = 1337
    checkpoint_seconds: float = 180.0   # checkpoint at least this often, evaluations or not
    amp: bool = False                   # bf16 autocast (CUDA)
    compile: bool = False               # torch.compile the model
    pin_memory: bool = False            # page-locked batches for faster host-to-GPU copies

    def __post_init__(self) -> None:
        self.steps = validate.positive_int("steps", self.steps)
        if self.seconds is not None:
            validate.positive_float("seconds", self.seconds, finite=True)
        self.batch_size = validate.positive_int("batch_size", self.batch_size)
        validate.positive_float("learning_rate", self.learning_rate, finite=True)
        # a negative floor turns the end of the cosine into gradient ascent
        validate.number_in("min_learning_rate", self.min_learning_rate, low=0, high=self.learning_rate)
        validate.non_negative_int("warmup_steps", self.warmup_steps)
        validate.number_in("weight_decay", self.weight_decay, low=0, high=math.inf, high_open=True)
        for name in ("beta1", "beta2", "muon_momentum"):
            validate.number_in(name, getattr(self, name), low=0, high=1, high_open=True)
        if self.max_grad_norm is not None:   # a negative norm flips the clipped gradient: ascent
            validate.positive_float("max_grad_norm", self.max_grad_norm, finite=True)
        validate.one_of("optimizer", self.optimizer, ("adamw", "muon"))
        validate.positive_float("muon_learning_rate", self.muon_learning_rate, finite=True)
        self.eval_interval = validate.positive_int("eval_interval", self.eval_interval)
        self.eval_windows = validate.positive_int("eval_windows", self.eval_windows)
        validate.positive_int_or_none("patience", self.patience)
        self.log_interval = validate.positive_int("log_interval", self.log_interval)
        validate.non_negative_int("seed", self.seed)
        validate.positive_float("checkpoint_seconds", self.checkpoint_seconds, finite=True)
        for name in ("amp", "compile", "pin_memory"):
            validate.boolean(name, getattr(self, name))


def learning_rate(config: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup for ``warmup_steps``, then cosine decay to ``min_learning_rate``.

    ``progress`` (0 to 1) is how much of the budget after warmup is used: steps or seconds,
    whichever binds, so a wall-clock budget still ends on the small learning rate.
    """
    validate.instance("config", config, TrainConfig, "a TrainConfig", brief=True)
    validate.non_negative_int("step", step)
    validate.finite_number("progress", progress)   # NaN is refused; outside [0, 1] counts as its nearest end
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / (config.warmup_steps + 1)
    progress = min(max(progress, 0.0), 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_learning_rate + cosine * (config.learning_rate - config.min_learning_rate)


def flops_per_token(config: GPTConfig | ModernGPTConfig, num_parameters: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12·n·H·Q·T for attention (PaLM, appendix B).

    N = ``num_parameters``; L layers, H heads of size Q, context T, all from ``config``. With a
    sliding window, each query attends to at most ``sliding_window`` keys, so T is the smaller of the two.
    """
    validate.instance("config", config, (GPTConfig, ModernGPTConfig), "a GPTConfig or ModernGPTConfig", brief=True)
    validate.positive_int("num_parameters", num_parameters)
    context = min(config.max_tokens, getattr(config, "sliding_window", None) or config.max_tokens)
    return 6 * num_parameters + 12 * config.num_layers * config.num_heads * config.head_dim * context


@dataclass
class History:
    """What happened during training, ready for ``viz.plot_loss_curves``."""

    step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    learning_rate: list[float] = field(default_factory=list)
    val_step: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    steps_taken: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    checkpoint_seconds: float = 0.0     # spent writing checkpoints (not counted in train_seconds)
    first_step_seconds: float = 0.0     # the first step of a fresh run, torch.compile's compiling included
    stop_reason: str = ""               # "steps", "seconds", "patience" or "stopped" (a signal asked)
    best_step: int | None = None        # the step of the lowest validation estimate so far
    best_val_loss: float | None = None

    def estimates_since_best(self) -> int:
        """How many validation estimates came after the best one (0 when the latest is the best)."""
        return sum(1 for s in self.val_step if self.best_step is not None and s > self.best_step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> History:
        if not isinstance(d, dict):
            raise TypeError(f"d: expected a dict from History.to_dict(), got {validate.describe(d)}")
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def patience_stop_note(patience: int, best_step: int | None) -> str:
    """Why a run stopped early under ``TrainConfig.patience``, in words, for the command line."""
    latest = "the latest validation estimate" if patience == 1 else f"the latest {patience} validation estimates"
    return f"{latest} beat no earlier one, so the run kept the weights of step {best_step}, its best"


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss; nothing after the last good checkpoint is kept."""

    def __init__(self, step: int, what: str, config: TrainConfig):
        self.step = step
        super().__init__(
            f"training stopped at step {step}: the {what} became NaN or infinite. Likely causes: a learning "
            f"rate too high (learning_rate={config.learning_rate:g}; try a third of it), bad data (token ids "
            f"or targets that are all padding), or dropout applied after the causal mask (a row of -inf "
            f"becomes NaN)")


@dataclass
class TrainState:
    """Everything the loop needs to continue exactly where it stopped (saved in checkpoints)."""

    step: int
    history: History
    optimizer: dict[str, Any]
    batch_rng: torch.Tensor             # the batcher's generator: which windows come next
    torch_rng: torch.Tensor             # the global CPU generator: dropout on a CPU
    cuda_rng: list[torch.Tensor]        # one per GPU: dropout on a GPU
    running_loss: torch.Tensor          # sum of the losses since the last logged mean
    running_count: int
    best_weights: dict[str, torch.Tensor] | None = None   # kept only under TrainConfig.patience

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["history"] = self.history.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        # best_weights came later: a checkpoint written before it still resumes
        required = {k for k, f in cls.__dataclass_fields__.items() if f.default is dataclasses.MISSING}
        if not isinstance(d, dict) or not required <= set(d):
            raise ValueError(f"state: expected a dict from TrainState.to_dict() (a resumable checkpoint), "
                             f"got {validate.describe(d)}")
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        fields["history"] = History.from_dict(d["history"])
        return cls(**fields)


def batches(split: Split, config: TrainConfig, max_tokens: int, ctx: DistributedContext,
            device: torch.device, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """train()'s endless batches from ``split``, on ``device``: under torchrun, this rank's slice.

    Every rank draws the same global batch and keeps its own slice, so N processes see exactly
    what one process with an N-times larger batch would see.
    """
    rows = slice(ctx.rank * config.batch_size, (ctx.rank + 1) * config.batch_size)
    while True:
        x, y = split.sample(config.batch_size * ctx.world_size, max_tokens, generator)
        x, y = x[rows], y[rows]
        if config.pin_memory and device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm
    # At most one redraw a second: a notebook bar redrawn thousands of times floods the
    # kernel's message queue (and nbval, which reads it only after the cell ends).
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True,
                leave=True, mininterval=1.0)


def _check_split(name: str, split: Any, vocab_size: int, max_tokens: int) -> None:
    if not isinstance(split, Split):
        raise TypeError(f"{name}: expected a split with sample() and eval_windows() (TokenStream or "
                        f"Examples), got {type(split).__name__}")
    inputs, targets = split.eval_windows(max_tokens)
    validate.token_ids(f"{name} inputs", inputs, vocab_size=vocab_size)
    validate.token_ids(f"{name} targets", targets, vocab_size=vocab_size, padding=IGNORE_INDEX)


def _all_finite(tensors: Iterator[torch.Tensor]) -> bool:
    return bool(torch.stack([t.isfinite().all() for t in tensors]).all())


def _agree(flags: list[bool], ctx: DistributedContext, device: torch.device) -> list[bool]:
    """Under torchrun every rank acts on the same decisions: any rank's yes is everyone's yes."""
    if not ctx.enabled:
        return flags
    tensor = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def train(model: GPT | ModernGPT, train_split: Split, val_split: Split | None, config: TrainConfig, *,
          device: torch.device | str | None = None, progress: bool = True,
          ctx: DistributedContext | None = None, state: TrainState | None = None,
          on_checkpoint: Callable[[TrainState], None] | None = None,
          should_stop: Callable[[], bool] | None = None) -> History:
    """Train ``model`` in place and return its :class:`History`.

    Stops after ``config.steps`` steps or ``config.seconds`` seconds, whichever comes first, or
    after the current step once ``should_stop()`` says so. With ``config.patience`` it also stops once
    that many validation estimates in a row beat no earlier one, and goes back to the weights of the
    best (``history.best_step``); a run whose budget ends first keeps its last weights, so that a
    resume with a larger budget continues exactly. ``state`` (from a checkpoint) continues
    an earlier run exactly. ``on_checkpoint(state)`` is called at every evaluation, at least every
    ``config.checkpoint_seconds``, and at the end, only with finite weights and losses; a NaN or
    infinite loss raises :class:`NonFiniteLoss` instead. Under torchrun (``ctx.enabled``) the model
    is wrapped in DistributedDataParallel, only rank 0 evaluates and checkpoints, and all ranks stop
    together.
    """
    validate.instance("model", model, (GPT, ModernGPT), "a course_lib GPT or ModernGPT", brief=True)
    validate.instance("config", config, TrainConfig, "a TrainConfig", brief=True)
    max_tokens, vocab_size = model.config.max_tokens, model.config.vocab_size
    _check_split("train_split", train_split, vocab_size, max_tokens)
    if val_split is not None:
        _check_split("val_split", val_split, vocab_size, max_tokens)
    validate.boolean("progress", progress)
    validate.instance("state", state, TrainState, "a TrainState or None", or_none=True, brief=True)
    for name, fn in (("on_checkpoint", on_checkpoint), ("should_stop", should_stop)):
        validate.expect(fn is None or callable(fn), name, "a function or None", validate.describe(fn), TypeError)
    ctx = ctx or DistributedContext()
    device = resolve_device(device)
    model.to(device)
    raw_model = model
    # Counting a counted n-gram model is part of training, so its seconds count as training time. It comes
    # before any wrapper, so DistributedDataParallel and compile see the counted tables.
    show_targets = has_ngram_prior(raw_model)
    counting_seconds = count_ngrams(raw_model, train_split)
    if ctx.enabled:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[ctx.local_rank] if device.type == "cuda" else None)
    if config.compile:
        model = torch.compile(model)
    optimizer = build_optimizer(raw_model, config, device.type)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.amp)

    estimate_inputs = estimate_targets = None
    if val_split is not None and ctx.is_main:
        val_inputs, val_targets = val_split.eval_windows(max_tokens)
        # evenly spaced windows: a cheap estimate during training, always the same ones
        picks = torch.linspace(0, val_inputs.shape[0] - 1, min(config.eval_windows, val_inputs.shape[0])).long()
        estimate_inputs, estimate_targets = val_inputs[picks], val_targets[picks]

    generator = torch.Generator().manual_seed(config.seed)
    history = History()
    step = 0
    running = torch.zeros((), device=device)
    running_count = 0
    best_weights: dict[str, torch.Tensor] | None = None   # a CPU copy, only under config.patience
    if state is not None:
        step, history = state.step, History.from_dict(state.history.to_dict())
        optimizer.load_state_dict(state.optimizer)
        generator.set_state(state.batch_rng)
        torch.set_rng_state(state.torch_rng)
        if device.type == "cuda" and state.cuda_rng:
            torch.cuda.set_rng_state_all(state.cuda_rng)
        running = state.running_loss.to(device)
        running_count = state.running_count
        best_weights = state.best_weights
    stream = batches(train_split, config, max_tokens, ctx, device, generator)
    bar = _progress_bar(config.steps, step, progress and ctx.is_main)
    prior = (history.train_seconds + counting_seconds, history.eval_seconds, history.checkpoint_seconds)
    started = last_save = time.perf_counter()
    eval_seconds = checkpoint_seconds = 0.0   # this session's
    saved_step = step if state is not None else -1

    def checkpoint() -> None:
        nonlocal checkpoint_seconds, saved_step
        # Only finite weights and losses are ever saved, so the last checkpoint is always a good one.
        if not (_all_finite(raw_model.parameters()) and bool(torch.isfinite(running))):
            raise NonFiniteLoss(step, "loss" if not torch.isfinite(running) else "weights", config)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        history.train_seconds = prior[0] + t0 - started - eval_seconds - checkpoint_seconds
        history.eval_seconds = prior[1] + eval_seconds
        history.steps_taken = step
        if on_checkpoint is not None and ctx.is_main:
            on_checkpoint(TrainState(
                step, history, optimizer.state_dict(), generator.get_state(), torch.get_rng_state(),
                torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
                running.detach().cpu().clone(), running_count, best_weights))
        checkpoint_seconds += time.perf_counter() - t0
        history.checkpoint_seconds = prior[2] + checkpoint_seconds
        saved_step = step

    try:
        while step < config.steps:
            now = time.perf_counter()
            elapsed = prior[0] + now - started - eval_seconds - checkpoint_seconds
            time_up, stop_asked, save_due, out_of_patience = _agree(
                [config.seconds is not None and elapsed >= config.seconds,
                 should_stop is not None and should_stop(),
                 on_checkpoint is not None and now - last_save >= config.checkpoint_seconds,
                 # only the main rank evaluates, so only its history can say so
                 config.patience is not None and history.estimates_since_best() >= config.patience], ctx, device)
            if time_up or stop_asked or out_of_patience:
                history.stop_reason = "seconds" if time_up else "stopped" if stop_asked else "patience"
                break
            if save_due:
                checkpoint()
                last_save = time.perf_counter()
            progress_done = max((step - config.warmup_steps) / max(1, config.steps - config.warmup_steps),
                                elapsed / config.seconds if config.seconds else 0.0)
            lr = learning_rate(config, step, progress_done)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)   # Muon's groups run at their own scale

            x, y = next(stream)
            running += update(model, optimizer, x, y, config.max_grad_norm, autocast=autocast,
                              parameters=raw_model.parameters(), show_targets=show_targets)
            running_count += 1
            step += 1
            history.tokens_seen += x.numel() * ctx.world_size
            history.steps_taken = step

            if step % config.log_interval == 0 or step == 1:
                # reading the loss waits for the device, so do it only every log_interval steps
                mean_loss = running / running_count
                if ctx.enabled:
                    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
                if not math.isfinite(mean_loss.item()):
                    raise NonFiniteLoss(step, "training loss", config)
                if step == 1:   # .item() above waited for the device: the first step is done
                    history.first_step_seconds = time.perf_counter() - started
                history.step.append(step)
                history.train_loss.append(mean_loss.item())
                history.learning_rate.append(lr)
                running.zero_()
                running_count = 0
                bar.set_postfix(loss=f"{history.train_loss[-1]:.3f}", refresh=False)
            if step % config.eval_interval == 0:
                if estimate_inputs is not None:
                    t0 = time.perf_counter()
                    val_loss = _evaluate(raw_model, estimate_inputs, estimate_targets)
                    eval_seconds += time.perf_counter() - t0
                    if not math.isfinite(val_loss):
                        raise NonFiniteLoss(step, "validation loss", config)
                    history.val_step.append(step)
                    history.val_loss.append(val_loss)
                    if history.best_val_loss is None or val_loss < history.best_val_loss:
                        history.best_step, history.best_val_loss = step, val_loss
                        if config.patience is not None:
                            best_weights = {name: t.detach().to("cpu", copy=True)
                                            for name, t in raw_model.state_dict().items()}
                    bar.set_postfix(loss=f"{history.train_loss[-1]:.3f}", val=f"{val_loss:.3f}", refresh=False)
                checkpoint()
                last_save = time.perf_counter()
            bar.update(1)
        else:
            history.stop_reason = "steps"
        went_back = history.stop_reason == "patience" and best_weights is not None
        if went_back:
            # the estimates stopped improving: the run ends with the weights of its best one
            raw_model.load_state_dict(best_weights)
            best_weights = None   # the model holds them now; the checkpoint need not keep them twice
        if step != saved_step or went_back:
            checkpoint()
        else:   # saved at this very step (an evaluation): only the clocks move on
            history.train_seconds = prior[0] + time.perf_counter() - started - eval_seconds - checkpoint_seconds
    finally:
        bar.close()
        if ctx.enabled:
            # Let the DDP wrapper and whatever it left behind (autograd hooks, gloo work objects
            # that hold tensors) go now, while Python is fully alive. Left to interpreter shutdown,
            # gloo's threads can abort the process: "terminate called without an active exception",
            # 3 runs in 20-30 on a loaded 2-core machine, none in 30 with this collection.
            del model
            gc.collect()
    return history


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` checked like COURSE_DEVICE (None: the fastest here); raises ValueError naming it."""
    if device is None:
        return default_device()
    return validate.device("device", device)
