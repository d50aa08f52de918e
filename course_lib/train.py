"""Training a GPT: the loss, one step, evaluation, the schedule, the loop, and named presets."""
from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import _validate as check
from .checkpoints import save_checkpoint, unwrap_model
from .distributed import DistributedContext, setup_distributed, teardown_distributed
from .model import GPT, GPTConfig
from .runtime import device as default_device

__all__ = [
    "IGNORE_INDEX", "lm_loss", "train_step", "evaluate", "TokenStream", "Examples", "TrainConfig",
    "History", "learning_rate", "train", "flops_per_token", "PRESETS", "Preset", "prepare_preset",
    "run_preset",
]

from .data import IGNORE_INDEX  # noqa: E402  targets with this value (padding) add nothing to the loss


# ---------------------------------------------------------------- loss, step, evaluation

def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each target token: logits (N, L, V), targets (N, L)."""
    check.tensor("logits", logits, dim=3, floating=True)
    check.token_ids("targets", targets, dim=2)
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:2])} to match logits "
                         f"{tuple(logits.shape)}, got {tuple(targets.shape)}")
    # cross_entropy wants the classes in dimension 1, so flatten positions into the batch
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),   # (N*L, V), (N*L,)
                           ignore_index=IGNORE_INDEX)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, max_grad_norm: float | None = 1.0) -> float:
    """One update: forget old gradients, predict, measure the loss, backpropagate, clip, step."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 64) -> float:
    """Mean loss per predicted token over every window given (no sampling, no dropout)."""
    check.token_ids("inputs", inputs, dim=2)
    check.token_ids("targets", targets, dim=2)
    check.positive_int("batch_size", batch_size)
    if inputs.shape != targets.shape or inputs.shape[0] == 0:
        raise ValueError(f"targets: expected the shape of inputs {tuple(inputs.shape)} (at least one "
                         f"window), got {tuple(targets.shape)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, inputs.shape[0], batch_size):
        x = inputs[i:i + batch_size].to(device)
        y = targets[i:i + batch_size].to(device)
        logits = model(x).float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum").item()
        count += int((y != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / max(count, 1)


# ---------------------------------------------------------------- what a split looks like

class TokenStream:
    """One long run of token ids: random windows to train on, consecutive windows to evaluate."""

    def __init__(self, ids: torch.Tensor):
        self.ids = check.token_ids("ids", ids, dim=1).long()

    def sample(self, batch_size: int, max_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ids.numel() <= max_tokens:
            raise ValueError(f"ids: a split of {self.ids.numel()} tokens is too short for windows of "
                             f"max_tokens={max_tokens} (+1 for the target)")
        starts = torch.randint(self.ids.numel() - max_tokens, (batch_size,), generator=generator)
        offsets = starts[:, None] + torch.arange(max_tokens + 1)     # (B, max_tokens + 1)
        window = self.ids[offsets]
        return window[:, :-1], window[:, 1:]                         # (B, max_tokens) each

    def eval_windows(self, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        from .data import lm_windows
        return lm_windows(self.ids, max_tokens)


class Examples:
    """Fixed, padded examples (one name per row): random rows to train on, all rows to evaluate."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs = check.token_ids("inputs", inputs, dim=2).long()
        self.targets = check.token_ids("targets", targets, dim=2).long()
        if inputs.shape != targets.shape:
            raise ValueError(f"targets: expected shape {tuple(inputs.shape)}, got {tuple(targets.shape)}")

    def sample(self, batch_size: int, max_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(self.inputs.shape[0], (batch_size,), generator=generator)
        return self.inputs[rows], self.targets[rows]

    def eval_windows(self, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets


# ---------------------------------------------------------------- configuration and schedule

@dataclass
class TrainConfig:
    """How to train: budget, batch, optimiser, schedule, evaluation, speed switches."""

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
    eval_interval: int = 250            # steps between validation estimates
    eval_windows: int = 200             # windows per estimate during training (the final one uses all)
    log_interval: int = 10              # steps between reading the loss back from the device
    seed: int = 1337
    amp: bool = False                   # bf16 autocast (CUDA)
    compile: bool = False               # torch.compile the model
    pin_memory: bool = False            # page-locked batches for faster host-to-GPU copies

    def __post_init__(self) -> None:
        check.positive_int("steps", self.steps)
        if self.seconds is not None:
            check.positive_float("seconds", self.seconds)
        check.positive_int("batch_size", self.batch_size)
        check.positive_float("learning_rate", self.learning_rate)
        check.non_negative_int("warmup_steps", self.warmup_steps)
        check.positive_int("eval_interval", self.eval_interval)
        check.positive_int("eval_windows", self.eval_windows)
        check.positive_int("log_interval", self.log_interval)


def learning_rate(config: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup for ``warmup_steps``, then cosine decay to ``min_learning_rate``.

    ``progress`` (0 to 1) is how much of the budget after warmup is used: steps or seconds,
    whichever binds, so a wall-clock budget still ends on the small learning rate.
    """
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / (config.warmup_steps + 1)
    progress = min(max(progress, 0.0), 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_learning_rate + cosine * (config.learning_rate - config.min_learning_rate)


def flops_per_token(config: GPTConfig, num_parameters: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12·L·H·Q·T for attention (PaLM, appendix B).

    N = ``num_parameters``; L layers, H heads of size Q, context T, all from ``config``.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config: expected a GPTConfig, got {type(config).__name__}")
    check.positive_int("num_parameters", num_parameters)
    return 6 * num_parameters + 12 * config.num_layers * config.num_heads * config.head_dim * config.max_tokens


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _optimizer(model: nn.Module, config: TrainConfig, device_type: str) -> torch.optim.AdamW:
    # Decay matrices and embeddings, not biases and LayerNorm gains (as GPT-2 and nanoGPT do).
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel updates every weight in one pass instead of one small op per tensor and
    # step: a few percent of a CPU step for the course's small models, more on a GPU.
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2),
                             fused=device_type in ("cuda", "cpu"))


def _batches(split: Any, config: TrainConfig, max_tokens: int, ctx: DistributedContext,
             device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    # Every rank draws the same global batch and keeps its own slice, so N processes
    # see exactly what one process with an N-times larger batch would see.
    generator = torch.Generator().manual_seed(config.seed)
    rows = slice(ctx.rank * config.batch_size, (ctx.rank + 1) * config.batch_size)
    while True:
        x, y = split.sample(config.batch_size * ctx.world_size, max_tokens, generator)
        x, y = x[rows], y[rows]
        if config.pin_memory and device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm
    # At most one redraw a second: a notebook bar redrawn thousands of times floods the
    # kernel's message queue (and nbval, which reads it only after the cell ends).
    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True, leave=True, mininterval=1.0)


def train(model: GPT, train_split: Any, val_split: Any | None, config: TrainConfig, *,
          device: torch.device | str | None = None, progress: bool = True,
          ctx: DistributedContext | None = None) -> History:
    """Train ``model`` in place and return its :class:`History`.

    Stops after ``config.steps`` steps or ``config.seconds`` seconds, whichever comes first.
    Under torchrun (``ctx.enabled``) the model is wrapped in DistributedDataParallel and only
    rank 0 evaluates and reports.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model: expected a course_lib GPT, got {type(model).__name__}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config: expected a TrainConfig, got {type(config).__name__}")
    for name, split in (("train_split", train_split), ("val_split", val_split)):
        if split is not None and not hasattr(split, "sample"):
            raise TypeError(f"{name}: expected a TokenStream or Examples, got {type(split).__name__}")
    ctx = ctx or DistributedContext()
    device = torch.device(device) if device is not None else default_device()
    max_tokens = model.config.max_tokens
    model.to(device)
    raw_model = model
    if ctx.enabled:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[ctx.local_rank] if device.type == "cuda" else None)
    if config.compile:
        model = torch.compile(model)
    optimizer = _optimizer(raw_model, config, device.type)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.amp)

    val_inputs = val_targets = None
    if val_split is not None and ctx.is_main:
        val_inputs, val_targets = val_split.eval_windows(max_tokens)
        # evenly spaced windows: a cheap estimate during training, always the same ones
        picks = torch.linspace(0, val_inputs.shape[0] - 1, min(config.eval_windows, val_inputs.shape[0])).long()
        estimate_inputs, estimate_targets = val_inputs[picks], val_targets[picks]

    history = History()
    batches = _batches(train_split, config, max_tokens, ctx, device)
    bar = _progress_bar(config.steps, progress and ctx.is_main)
    running = torch.zeros((), device=device)
    started = time.perf_counter()
    eval_seconds = 0.0
    step = 0
    for step in range(config.steps):
        elapsed = time.perf_counter() - started - eval_seconds
        if config.seconds is not None and _stop_now(elapsed >= config.seconds, ctx, device):
            break
        progress_done = max((step - config.warmup_steps) / max(1, config.steps - config.warmup_steps),
                            elapsed / config.seconds if config.seconds else 0.0)
        lr = learning_rate(config, step, progress_done)
        for group in optimizer.param_groups:
            group["lr"] = lr

        x, y = next(batches)
        with autocast:
            loss = lm_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), config.max_grad_norm)
        optimizer.step()
        running += loss.detach()
        history.tokens_seen += x.numel() * ctx.world_size

        if (step + 1) % config.log_interval == 0 or step == 0:
            # reading the loss waits for the device, so do it only every log_interval steps
            mean_loss = running / (1 if step == 0 else config.log_interval)
            if ctx.enabled:
                dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
            history.step.append(step + 1)
            history.train_loss.append(mean_loss.item())
            history.learning_rate.append(lr)
            running.zero_()
            bar.set_postfix(loss=f"{history.train_loss[-1]:.3f}", refresh=False)
        if val_inputs is not None and (step + 1) % config.eval_interval == 0:
            t0 = time.perf_counter()
            history.val_step.append(step + 1)
            history.val_loss.append(evaluate(raw_model, estimate_inputs, estimate_targets))
            eval_seconds += time.perf_counter() - t0
            bar.set_postfix(loss=f"{history.train_loss[-1]:.3f}", val=f"{history.val_loss[-1]:.3f}",
                            refresh=False)
        bar.update(1)
        history.steps_taken = step + 1
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    history.train_seconds = time.perf_counter() - started - eval_seconds
    history.eval_seconds = eval_seconds
    if ctx.enabled:
        # Let the DDP wrapper and whatever it left behind (autograd hooks, gloo work objects
        # that hold tensors) go now, while Python is fully alive. Left to interpreter shutdown,
        # gloo's threads can abort the process: "terminate called without an active exception",
        # 3 runs in 20-30 on a loaded 2-core machine, none in 30 with this collection.
        del model
        gc.collect()
    return history


def _stop_now(local_decision: bool, ctx: DistributedContext, device: torch.device) -> bool:
    """All ranks stop together: rank 0's clock decides."""
    if not ctx.enabled:
        return local_decision
    flag = torch.tensor([1.0 if local_decision else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


# ---------------------------------------------------------------- presets

@dataclass(frozen=True)
class Preset:
    """A named recipe: which text, which model, how to train."""

    name: str
    description: str
    corpus: str                      # "tinyshakespeare", "names", or a path to a UTF-8 text file
    model: dict[str, Any]            # GPTConfig fields except vocab_size
    train: TrainConfig


PRESETS: dict[str, Preset] = {
    p.name: p for p in [
        Preset("tiny", "a few seconds on any CPU: for tests and smoke runs", "tinyshakespeare",
               dict(max_tokens=32, embed_dim=32, num_heads=2, num_layers=2),
               TrainConfig(steps=150, batch_size=16, learning_rate=3e-3, min_learning_rate=3e-4,
                           warmup_steps=10, eval_interval=50, eval_windows=50)),
        Preset("names_char", "character-level names, seconds on a laptop CPU", "names",
               dict(max_tokens=16, embed_dim=64, num_heads=4, num_layers=3),
               TrainConfig(steps=1500, batch_size=64, learning_rate=3e-3, min_learning_rate=3e-4,
                           warmup_steps=50, eval_interval=250, eval_windows=2000)),
        Preset("baseline_cpu", "the well-known small-CPU tinyshakespeare recipe, for comparison",
               "tinyshakespeare",
               dict(max_tokens=64, embed_dim=128, num_heads=4, num_layers=4, dropout_rate=0.0,
                    tie_weights=False),
               TrainConfig(steps=2000, batch_size=12, learning_rate=1e-3, min_learning_rate=1e-4,
                           warmup_steps=100, beta2=0.99, weight_decay=0.1, eval_interval=250)),
        # On a CPU budget, width in few layers buys more than depth: 2 layers of width 192 run
        # larger matrix multiplies than the baseline's 4 of 128, which keeps the cores near half
        # their matmul peak; batches of 32 windows, a higher learning rate and a schedule that
        # ends with the wall-clock budget do the rest (measured runs: README, performance).
        Preset("shakespeare_char_cpu", "the course's CPU recipe for tinyshakespeare (notebook 05)",
               "tinyshakespeare",
               dict(max_tokens=64, embed_dim=192, num_heads=6, num_layers=2, dropout_rate=0.0,
                    tie_weights=True),
               TrainConfig(steps=5000, batch_size=32, learning_rate=3e-3, min_learning_rate=1e-4,
                           warmup_steps=100, beta2=0.99, weight_decay=0.1, eval_interval=500)),
        Preset("shakespeare_char_gpu", "the larger GPU recipe: bf16, fused AdamW, compile", "tinyshakespeare",
               dict(max_tokens=256, embed_dim=384, num_heads=6, num_layers=6, dropout_rate=0.2),
               TrainConfig(steps=5000, batch_size=64, learning_rate=1e-3, min_learning_rate=1e-4,
                           warmup_steps=100, beta2=0.99, eval_interval=500, log_interval=100,
                           amp=True, compile=True, pin_memory=True)),
    ]
}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


def prepare_preset(name: str, corpus: str | None = None, device: torch.device | str | None = None,
                   **train_overrides: Any) -> tuple[GPT, Any, Any, Any, TrainConfig]:
    """Build (model, tokenizer, train_split, val_split, train_config) for a named preset.

    ``corpus`` replaces the preset's text: a corpus name or the path of any UTF-8 text file.
    """
    from . import data
    preset = _preset(name)
    source = corpus or preset.corpus
    if source == "names":
        names = data.load_names()
        tokenizer = data.names_tokenizer(names)
        train_names, val_names = data.split_names(names)
        max_tokens = preset.model["max_tokens"]
        train_split = Examples(*data.names_dataset(train_names, tokenizer, max_tokens))
        val_split = Examples(*data.names_dataset(val_names, tokenizer, max_tokens))
    else:
        text = data.load_corpus(source) if source in data.CORPORA else data.load_text(source)
        prepared = data.char_corpus(text)
        tokenizer = prepared.tokenizer
        train_split, val_split = TokenStream(prepared.train_ids), TokenStream(prepared.val_ids)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, **preset.model)
    train_config = replace(preset.train, **{k: v for k, v in train_overrides.items() if v is not None})
    if device is not None and torch.device(device).type != "cuda":
        # bf16 autocast, compile and pinned memory are the GPU recipe's; on a CPU they only cost
        train_config = replace(train_config, amp=False, compile=False, pin_memory=False)
    return GPT(config), tokenizer, train_split, val_split, train_config


def run_preset(name: str, out_dir: str | Path, *, seconds: float | None = None, steps: int | None = None,
               corpus: str | None = None, device: torch.device | str | None = None,
               progress: bool = True, compile: bool | None = None,
               batch_size: int | None = None) -> dict[str, Any]:
    """Train a preset and write ``out_dir/metrics.json`` and ``out_dir/checkpoint.pt``; return the metrics."""
    out_dir = Path(out_dir)
    device = torch.device(device) if device is not None else default_device()
    ctx = setup_distributed(device.type)
    finished = False
    try:
        if ctx.enabled and device.type == "cuda":
            device = torch.device("cuda", ctx.local_rank)
        torch.manual_seed(_preset(name).train.seed)   # same initial weights on every rank and every run
        model, tokenizer, train_split, val_split, config = prepare_preset(
            name, corpus, device, seconds=seconds, steps=steps, compile=compile, batch_size=batch_size)
        history = train(model, train_split, val_split, config, device=device, progress=progress, ctx=ctx)
        metrics: dict[str, Any] = {}
        if ctx.is_main:
            val_inputs, val_targets = val_split.eval_windows(model.config.max_tokens)
            started = time.perf_counter()
            val_loss = evaluate(model, val_inputs, val_targets)
            parameters = model.num_parameters()
            per_token = flops_per_token(model.config, model.num_parameters(include_embeddings=False))
            tokens_per_second = history.tokens_seen / max(history.train_seconds, 1e-9)
            metrics = {
                "preset": name,
                "val_loss": val_loss,
                "val_tokens": int((val_targets != IGNORE_INDEX).sum()),
                "final_eval_seconds": time.perf_counter() - started,
                "train_seconds": history.train_seconds,
                "steps": history.steps_taken,
                "tokens_per_second": tokens_per_second,
                "parameters": parameters,
                "flops_per_token": per_token,
                "achieved_flops": per_token * tokens_per_second,
                "world_size": ctx.world_size,
                "device": str(device),
                "threads": torch.get_num_threads(),
                "model": model.config.to_dict(),
                "train": {k: v for k, v in asdict(config).items()},
                "history": history.to_dict(),
            }
            out_dir.mkdir(parents=True, exist_ok=True)
            save_checkpoint(out_dir / "checkpoint.pt", unwrap_model(model), tokenizer,
                            extra={"preset": name, "val_loss": val_loss, "steps": history.steps_taken})
            tmp = out_dir / ".metrics.json.tmp"
            tmp.write_text(json.dumps(metrics, indent=2))
            tmp.replace(out_dir / "metrics.json")
        finished = True
        return metrics
    finally:
        # After a failure the other ranks may never arrive: wait for them only on success.
        teardown_distributed(wait_for_all=finished)
