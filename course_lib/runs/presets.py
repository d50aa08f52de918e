"""Named training recipes and running one: ``python -m course_lib train --preset NAME``.

``PRESETS`` holds the recipes (which text, which model, how to train); ``prepare_preset`` builds
everything one needs. A run is asked for as one value, a :class:`RunRequest`, checked whole when it
is made; :func:`run_request` trains it with checkpoints, clean stops and ``--resume``, and writes
``metrics.json`` beside ``checkpoint.pt``. ``run_preset(name, out_dir, **options)`` is the same in
one call. The command line makes the same request: ``python -m course_lib train``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import KW_ONLY, asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import _validate as validate
from .. import train as training
from ..checkpoints import CheckpointError, load_checkpoint, write_atomically
from ..data import CORPORA, IGNORE_INDEX, CorpusError, Examples, Split, TokenStream, corpus_splits
from ..distributed import DistributedContext, setup_distributed, teardown_distributed
from ..model import GPT
from ..modern_gpt import ARCHITECTURES, ModernGPT
from ..train import (
    History,
    NonFiniteLoss,
    TrainConfig,
    TrainState,
    evaluate,
    flops_per_token,
    resolve_device,
)
from .run_folder import METRICS, RunFolder, RunRefused, SaveFailed, command
from .stopping import StopRequest

__all__ = ["Preset", "PRESETS", "prepare_preset", "RunRequest", "run_request", "run_preset", "RunFinished"]

@dataclass(frozen=True)
class Preset:
    """A named recipe: which text, which model, how to train."""

    name: str
    description: str
    corpus: str                      # "tinyshakespeare", "names", or a path to a UTF-8 text file
    model: dict[str, Any]            # the config's fields except vocab_size
    train: TrainConfig
    architecture: str = "gpt"        # "gpt" (GPTConfig, notebook 04) or "modern" (ModernGPTConfig, notebook 09)

    def __post_init__(self) -> None:
        # Checked here, when the recipe is written, rather than at the first save of a run that trained it.
        for field_name in ("name", "corpus"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value.strip():
                raise TypeError(f"Preset.{field_name}: expected a non-empty str, got {validate.describe(value)}")
        if not isinstance(self.description, str):
            raise TypeError(f"Preset.description: expected a str, got {validate.describe(self.description)}")
        validate.one_of("architecture", self.architecture, sorted(ARCHITECTURES))
        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"Preset.train: expected a TrainConfig, got {validate.describe(self.train)}")
        config_class = ARCHITECTURES[self.architecture][1]
        known = {f.name for f in fields(config_class)} - {"vocab_size"}
        if not isinstance(self.model, dict) or not all(isinstance(k, str) for k in self.model):
            raise TypeError(f"Preset.model: expected a dict of {config_class.__name__}'s fields (all but "
                            f"vocab_size), got {validate.describe(self.model)}")
        unknown = sorted(set(self.model) - known)
        if unknown:
            raise ValueError(f"Preset.model: {config_class.__name__} has no field {unknown[0]!r}; expected some "
                             f"of {sorted(known)}")


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
        # Notebook 05's recipe, GPT-2's parts with AdamW. In a budget of a minute or two a small model
        # learns most: 2 layers of width 96 take about a third of the time per step of 2 layers of 192
        # and, at a learning rate of 1e-2 (a model this small takes it), end below the wider model in
        # its training time, and about the same loss (0.005 lower) in half that time (five seeds; PERFORMANCE.md).
        # Few layers, since depth costs time per step without paying for it this early. The GELU is
        # GPT-2's own tanh approximation, which a CPU also runs 2.7 times faster than the exact erf.
        # Weight decay 0.2 beat 0.1 in each of five seeds; 3 heads beat 2, 4 and 6, and batch 32 beat 16
        # and 24, in the same time (one seed each), and equalled 64 (five seeds). The blocks' input
        # matrices start at a spread of 0.05, not GPT-2's 0.02 (chosen for widths of 768 and more):
        # that won in each of five seeds, by 0.014 on average.
        Preset("shakespeare_char_cpu", "the course's CPU recipe for tinyshakespeare (notebook 05)",
               "tinyshakespeare",
               dict(max_tokens=64, embed_dim=96, num_heads=3, num_layers=2, dropout_rate=0.0,
                    tie_weights=True, activation="gelu_tanh", input_init_std=0.05),
               TrainConfig(steps=5000, batch_size=32, learning_rate=1e-2, min_learning_rate=1e-4,
                           warmup_steps=100, beta2=0.99, weight_decay=0.2, eval_interval=500)),
        # Notebook 09's parts and Muon, at the baseline's own wall time (PERFORMANCE.md: "what each change bought",
        # `bench ablation`): Muon for the blocks' matrices reaches a given loss in far fewer steps than
        # AdamW, which more than pays for its extra cost per step; RoPE and RMSNorm replace learned
        # positions and LayerNorm; an untied head, Muon momentum 0.9 and QK-norm add the rest (QK-norm won in
        # each of three seeds, by 0.002 to 0.014). It reads 256 characters (8 windows a step, the same
        # characters as 32 of 64). Width 128 with 4 heads, not 192 with 6: a step takes half the time, and in
        # a budget of 90 to 140 seconds more steps of a smaller model learn more (with ReLU², 1.513 against
        # 1.547 in 140 s; widths 96 and 160, 3 layers and 2 heads all did worse). SwiGLU of hidden 256, not
        # ReLU² of 384 (the same weights, the same time a step): 0.002 to 0.016 lower on each of three seeds
        # at 1,200 steps.
        # A pure transformer, so it exports to transformers (as Qwen 3: SwiGLU and QK-norm). A counted n-gram
        # model under the logits (ngram_prior) scores lower still, but is not a transformer; `bench ablation`
        # has it as a side row.
        Preset("shakespeare_char_modern_cpu",
               "the fastest CPU recipe: notebook 09's parts (RoPE, RMSNorm, SwiGLU, QK-norm) and Muon, 2 layers "
               "of 128",
               "tinyshakespeare",
               dict(max_tokens=256, embed_dim=128, num_heads=4, num_layers=2, mlp="swiglu", hidden_dim=256,
                    qk_norm=True, dropout_rate=0.0, tie_weights=False),
               TrainConfig(steps=5000, batch_size=8, learning_rate=3e-3, min_learning_rate=1e-4,
                           warmup_steps=100, beta2=0.99, weight_decay=0.1, eval_interval=500,
                           optimizer="muon", muon_learning_rate=0.02, muon_momentum=0.9),
               architecture="modern"),
        # nanoGPT's Shakespeare recipe with patience. It overfits tinyshakespeare (on an H200, nanoGPT's own
        # estimate was lowest at step 1,750 of 5,000 and rose to 1.70 by the end; PERFORMANCE.md), so
        # validation picks where it stops: an estimate every 250 steps, and once 3 in a row beat no earlier
        # one it stops and goes back to the best weights.
        Preset("shakespeare_char_gpu", "the larger GPU recipe: bf16, fused AdamW, compile", "tinyshakespeare",
               dict(max_tokens=256, embed_dim=384, num_heads=6, num_layers=6, dropout_rate=0.2),
               TrainConfig(steps=5000, batch_size=64, learning_rate=1e-3, min_learning_rate=1e-4,
                           warmup_steps=100, beta2=0.99, eval_interval=250, patience=3, log_interval=100,
                           amp=True, compile=True, pin_memory=True)),
        # The GPU recipe's size (6 layers of 384, 6 heads, dropout 0.2, 256 characters, 64 windows a step)
        # with the CPU modern recipe's parts: RoPE, RMSNorm, SwiGLU (hidden 1024: the weights of GELU's 1536),
        # QK-norm, an untied head and Muon for the blocks' matrices. On an H200 (PERFORMANCE.md) it ends at
        # 1.44 in 27 s, under a third of nanoGPT's 98 s for 1.47. Muon learns far more per step, so 800
        # steps do: with the cosine over 1,200 the estimate was lowest at step 900 (1.440) and the end
        # 0.02 worse. Not compiled: compiling took 15 s and then ran twice the tokens a second (12 ms a step
        # against 24), which pays only past about 1,250 steps. Patience (an estimate every 100 steps) guards
        # a longer --steps.
        Preset("shakespeare_char_modern_gpu",
               "the fastest GPU recipe: the GPU recipe's size with notebook 09's parts and Muon, bf16",
               "tinyshakespeare",
               dict(max_tokens=256, embed_dim=384, num_heads=6, num_layers=6, mlp="swiglu", hidden_dim=1024,
                    qk_norm=True, dropout_rate=0.2, tie_weights=False),
               TrainConfig(steps=800, batch_size=64, learning_rate=2e-3, min_learning_rate=1e-4,
                           warmup_steps=50, beta2=0.99, weight_decay=0.1, eval_interval=100, patience=3,
                           log_interval=100, optimizer="muon", muon_learning_rate=0.02, muon_momentum=0.95,
                           amp=True, compile=False, pin_memory=True),
               architecture="modern"),
    ]
}


@dataclass(frozen=True)
class RunRequest:
    """One training run, as asked for: the one value the command line and :func:`run_preset` hand down.

    Checked whole when it is made, before any folder, device or corpus is touched: a wrong field is
    a :class:`RunRefused` naming the field, what was expected and what was given. ``None`` keeps the
    preset's own value (or, with ``resume``, the saved run's). After the checks ``preset`` is a name
    (a registered Preset stands for its name) and ``device`` a torch.device.
    """

    preset: str | Preset | None            # a name in PRESETS; None only with resume (the saved run's)
    out: str | os.PathLike                 # the run's folder: checkpoint.pt and metrics.json
    _: KW_ONLY
    seconds: float | None = None           # the training-time budget
    steps: int | None = None               # the total steps (resumed: the new total)
    corpus: str | None = None              # a corpus name or the path of any UTF-8 text file
    device: torch.device | str | None = None   # None: the fastest here
    progress: bool = True                  # show a progress bar
    compile: bool | None = None            # torch.compile the model (None: as the preset says)
    batch_size: int | None = None          # sequences per step and per process
    seed: int | None = None                # initial weights, batches and dropout (None: the preset's)
    resume: bool = False                   # continue the run saved in ``out``
    overwrite: bool = False                # replace the run that ``out`` holds

    def __post_init__(self) -> None:
        settle = partial(object.__setattr__, self)   # frozen: checked values replace the given ones, once, here
        try:
            RunFolder.check_arguments(self.out, resume=self.resume, overwrite=self.overwrite)
            settle("preset", _registered_name(self.preset))
            if self.preset is None and not self.resume:
                raise RunRefused("preset: expected a preset name (or --resume DIR), got none")
            if self.corpus is not None and (not isinstance(self.corpus, str) or not self.corpus.strip()):
                raise RunRefused(f"corpus: expected a corpus name or a file path, got {self.corpus!r}")
            for field_name, check in (("seconds", _positive_seconds), ("steps", validate.steps),
                                      ("batch_size", validate.positive_int), ("seed", validate.seed),
                                      ("compile", validate.boolean)):
                if getattr(self, field_name) is not None:
                    check(field_name, getattr(self, field_name))
            validate.boolean("progress", self.progress)
            settle("device", resolve_device(self.device))   # None: the fastest here
        except RunRefused:
            raise
        except (TypeError, ValueError) as exc:
            raise RunRefused(str(exc)) from None
        # taken as truth values, as they always were (RunFolder reads them so too)
        settle("resume", bool(self.resume))
        settle("overwrite", bool(self.overwrite))


def _positive_seconds(name: str, value: Any) -> float:
    return validate.positive_float(name, value, finite=True)


def _preset(name: str | Preset) -> Preset:
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]


def prepare_preset(name: str | Preset, corpus: str | None = None, device: torch.device | str | None = None,
                   **train_overrides: Any) -> tuple[GPT | ModernGPT, Any, Split, Split, TrainConfig]:
    """Build (model, tokenizer, train_split, val_split, train_config) for a named preset (or a Preset).

    ``corpus`` replaces the preset's text: a corpus name or the path of any UTF-8 text file.
    """
    preset = _preset(name)
    tokenizer, train_split, val_split = corpus_splits(corpus or preset.corpus, preset.model["max_tokens"])
    model_class, config_class = ARCHITECTURES[preset.architecture]
    config = config_class(vocab_size=tokenizer.vocab_size, **preset.model)
    train_config = replace(preset.train, **{k: v for k, v in train_overrides.items() if v is not None})
    if device is not None and torch.device(device).type != "cuda":
        # bf16 autocast, compile and pinned memory are the GPU recipe's; on a CPU they only cost
        # (an explicit compile=True is kept: the CPU test of the GPU code path needs it)
        train_config = replace(train_config, amp=False, pin_memory=False,
                               compile=bool(train_overrides.get("compile")))
    return model_class(config), tokenizer, train_split, val_split, train_config


@dataclass
class _Plan:
    """A run ready for its first step: checked, built, resumed where asked; it saves itself."""

    name: str
    corpus: str | None
    folder: RunFolder
    model: GPT | ModernGPT
    tokenizer: Any
    train_split: Split
    val_split: Split
    config: TrainConfig
    state: TrainState | None
    corpus_checksum: str
    device: torch.device
    ctx: DistributedContext

    def __post_init__(self) -> None:
        self.saved_step = self.state.step if self.state is not None else None   # the last checkpoint's step

    def metrics(self, status: str, history: History, val_loss: float | None = None, val_tokens: int | None = None,
                final_eval_seconds: float | None = None) -> dict[str, Any]:
        model = self.model
        non_embedding = model.num_parameters(include_embeddings=False)
        per_token = flops_per_token(model.config, non_embedding)
        tokens_per_second = history.tokens_seen / max(history.train_seconds, 1e-9)
        if val_loss is None and history.val_loss:
            val_loss = history.val_loss[-1]   # the latest estimate until the final evaluation
        return {
            "preset": self.name,
            "status": status,                 # running | stopped | finished
            "val_loss": val_loss,
            "val_tokens": val_tokens,
            "final_eval_seconds": final_eval_seconds,
            "train_seconds": history.train_seconds,
            "steps": history.steps_taken,
            "tokens_per_second": tokens_per_second,
            "parameters": model.num_parameters(),
            "flops_per_token": per_token,
            "achieved_flops": per_token * tokens_per_second,
            "world_size": self.ctx.world_size,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "corpus": self.corpus,
            "model": model.config.to_dict(),
            "train": asdict(self.config),
            "history": history.to_dict(),
        }

    def save(self, state: TrainState) -> None:
        """The loop's ``on_checkpoint``: the checkpoint and metrics.json of ``state``, as one unit."""
        training = {**state.to_dict(), "preset": self.name, "corpus": self.corpus,
                    "corpus_checksum": self.corpus_checksum,
                    "train_config": asdict(self.config), "world_size": self.ctx.world_size}
        with self._saving(state.step):
            self.folder.save(self.model, self.tokenizer, training, self.metrics("running", state.history))
        self.saved_step = state.step

    def finish(self, history: History, stop: StopRequest) -> dict[str, Any]:
        """The final evaluation (when training ran to its end), then metrics.json: the run's last save.

        The checkpoint of the last step is already on disk. A signal now stops the evaluation at once
        and the metrics say so ("pending": "final evaluation"), so ``--resume`` knows to finish it.
        """
        model, folder = self.model, self.folder
        status = "stopped" if history.stop_reason == "stopped" else "finished"
        extra: dict[str, Any] = {}
        pending = None
        if status == "finished":
            # the final, exact evaluation: every validation window, not the running estimate
            stop.immediate = True
            try:
                if stop():   # a signal came after the last step: do not start it
                    raise KeyboardInterrupt
                val_inputs, val_targets = self.val_split.eval_windows(model.config.max_tokens)
                started = time.perf_counter()
                extra = dict(val_loss=evaluate(model, val_inputs, val_targets),
                             val_tokens=int((val_targets != IGNORE_INDEX).sum()))
                extra["final_eval_seconds"] = time.perf_counter() - started
            except KeyboardInterrupt:
                if stop.signum is None:   # not one of ours (a KeyboardInterrupt raised some other way)
                    raise
                status, pending, extra = "stopped", "final evaluation", {}
            finally:
                stop.immediate = False
        # the same run id and step as the checkpoint saved when the loop ended
        metrics = {**self.metrics(status, history, **extra), "run_id": folder.run_id, "step": history.steps_taken}
        if pending:
            metrics["pending"] = pending
        if stop.signum is not None:
            metrics["signal"] = stop.name
        with self._saving(history.steps_taken, what="the final metrics"):
            write_atomically(folder.metrics, json.dumps(metrics, indent=2).encode("utf-8"))
        return metrics

    @contextlib.contextmanager
    def _saving(self, step: int, what: str = "the checkpoint") -> Iterator[None]:
        """A write that fails (a full disk, a folder made read-only) ends the run in one line, naming what is kept."""
        folder, last_saved = self.folder, self.saved_step
        try:
            yield
        except (OSError, ValueError) as exc:   # ValueError: a file there that is no longer one this run may replace
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            resume = f"resume with: {command('--resume', folder.path)}"
            if what == "the checkpoint" and folder.checkpoint_step == step:   # the checkpoint went, metrics.json not
                what, kept = (f"{METRICS}", f"the checkpoint of step {step} in {folder.checkpoint} was written and "
                              f"is what a resume reads: make room, then {resume}")
            else:
                kept = (f"the checkpoint of step {last_saved} in {folder.checkpoint} is intact: make room, then "
                        f"{resume}" if last_saved is not None else
                        "no checkpoint was written yet: make room, then start again")
            raise SaveFailed(f"out: could not write {what} of step {step} to {folder.path} ({why}); {kept}") from None


def _corpus_checksum(*splits: Split) -> str:
    """SHA-256 of the token ids a run trains and evaluates on: the same text gives the same ids."""
    digest = hashlib.sha256()
    for split in splits:
        for tensor in ((split.ids,) if isinstance(split, TokenStream) else
                       (split.inputs, split.targets) if isinstance(split, Examples) else ()):
            digest.update(tensor.long().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _check_long_enough(name: str, corpus: str | None, model: GPT | ModernGPT, *splits: tuple[str, Split]) -> None:
    # Before the first step, not at the first evaluation: each split must give at least one window.
    max_tokens = model.config.max_tokens
    for label, split in splits:
        try:
            split.eval_windows(max_tokens)
            split.sample(1, max_tokens, torch.Generator().manual_seed(0))
        except ValueError as exc:
            raise RunRefused(f"corpus: {corpus or _preset(name).corpus!r} is too short for preset {name!r} "
                             f"(max_tokens={max_tokens}): its {label} part gives no window ({exc}); use a "
                             f"longer text") from None


def _registered_name(name: Any) -> str | None:
    """The name a run saves (and ``--resume`` looks up again): a registered Preset stands for its name."""
    if isinstance(name, Preset):
        if PRESETS.get(name.name) != name:
            raise RunRefused(f"preset: a run saves its preset by name, so that --resume finds the recipe again; "
                             f"got Preset {name.name!r}, which is not in PRESETS: register it first "
                             f"(PRESETS[{name.name!r}] = preset), or pass one of {sorted(PRESETS)}")
        return name.name
    if name is not None and (not isinstance(name, str) or name not in PRESETS):
        raise RunRefused(f"preset: expected one of {sorted(PRESETS)}, got {validate.describe(name)}")
    return name


def _final_evaluation_done(folder: RunFolder, step: int) -> bool:
    """Whether metrics.json records this run's final evaluation at ``step``."""
    try:
        saved = json.loads(folder.metrics.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(saved, dict) and saved.get("status") == "finished" and saved.get("step") == step
            and saved.get("run_id") == folder.run_id and saved.get("val_loss") is not None)


def _plan(request: RunRequest, folder: RunFolder, device: torch.device, ctx: DistributedContext) -> _Plan:
    # Everything a run needs beyond its checked arguments and its prepared folder (a saved run, the
    # corpus, the model), checked before the first step: any failure here is a RunRefused.
    name, corpus, seed = request.preset, request.corpus, request.seed
    saved: dict[str, Any] | None = None
    checkpoint = None
    if request.resume:
        try:
            checkpoint = load_checkpoint(folder.checkpoint)
        except (CheckpointError, FileNotFoundError) as exc:
            raise RunRefused(f"resume: {exc}") from None
        saved = checkpoint.training
        if not saved:
            raise RunRefused(f"resume: {folder.checkpoint} holds weights but no training state (a final or "
                             f"hand-saved checkpoint); start a new run with --overwrite")
        missing = [key for key in ("preset", "train_config", "run_id") if key not in saved]
        if missing or not isinstance(saved.get("train_config"), dict):
            raise RunRefused(f"resume: {folder.checkpoint} holds a training state that no run of `train` wrote (it "
                             f"lacks {', '.join(repr(k) for k in missing) or 'a train_config dict'}); start a new run "
                             f"with --overwrite")
        # a resumed run keeps its recipe, batch and seed: asking for others is refused, not ignored
        if name is not None and name != saved["preset"]:
            raise RunRefused(f"preset: the run in {folder.path} is preset {saved['preset']!r}, got {name!r}; "
                             f"leave --preset out when resuming")
        for field_name, word in (("batch_size", ""), ("seed", "seed ")):
            asked, kept = getattr(request, field_name), saved["train_config"][field_name]
            if asked is not None and asked != kept:
                raise RunRefused(f"{field_name}: the run in {folder.path} uses {word}{kept}; a resumed run "
                                 f"keeps it, got {asked}")
        name = saved["preset"]
        corpus = corpus or saved["corpus"]
        folder.run_id = saved["run_id"]
    if corpus is not None and corpus not in CORPORA and Path(corpus).expanduser().exists():
        corpus = str(Path(corpus).expanduser().resolve())   # the resume may start in another folder
    seed = _preset(name).train.seed if seed is None else seed
    torch.manual_seed(seed)   # same initial weights on every rank and every run
    model, tokenizer, train_split, val_split, config = prepare_preset(
        name, corpus, device, compile=request.compile, batch_size=request.batch_size, seed=seed)
    _check_long_enough(name, corpus, model, ("training", train_split), ("validation", val_split))
    checksum = _corpus_checksum(train_split, val_split)
    budget = {k: v for k, v in dict(steps=request.steps, seconds=request.seconds).items() if v is not None}
    state = None
    if saved is not None:
        try:
            config = replace(TrainConfig(**saved["train_config"]), **budget,
                             **({} if request.compile is None else {"compile": request.compile}))
        except TypeError as exc:   # fields another version of course_lib wrote
            raise RunRefused(f"resume: the training settings saved in {folder.checkpoint} are not this course_lib's "
                             f"({exc}); resume with the version that wrote them, or start again with --overwrite") \
                from None
        if device.type != "cuda":   # a GPU run continued on a CPU: as prepare_preset does
            config = replace(config, amp=False, pin_memory=False, compile=bool(request.compile))
        trained_on = saved.get("corpus") or _preset(name).corpus
        if checkpoint.tokenizer != tokenizer or saved.get("corpus_checksum", checksum) != checksum:
            raise RunRefused(f"corpus: the run in {folder.path} was trained on {trained_on!r} (checksum "
                             f"{saved.get('corpus_checksum', 'not recorded')[:12]}), got {corpus or trained_on!r} "
                             f"(checksum {checksum[:12]}), a different text; resume with the run's own corpus")
        model.load_state_dict(checkpoint.model.state_dict())
        state = TrainState.from_dict(saved)
        if state.history.stop_reason == "patience":
            # its validation estimates had stopped improving: it ended on its best weights, for good
            if _final_evaluation_done(folder, state.step):
                raise RunFinished(f"the run in {folder.path} already finished at step {state.step}: "
                                  f"{training.patience_stop_note(config.patience, state.history.best_step)}; a "
                                  f"larger --steps would not change that")
            print(f"the run in {folder.path} stopped at step {state.step} on its best weights (step "
                  f"{state.history.best_step}), but its final evaluation did not finish; doing it now")
        elif state.step >= config.steps:
            if _final_evaluation_done(folder, state.step):
                raise RunFinished(f"the run in {folder.path} already finished at step {state.step} (steps="
                                  f"{config.steps}); give a larger --steps to train it further")
            if config.steps < state.step:
                # --steps is the run's new total: below the steps already trained it cannot be met
                raise RunRefused(f"steps: the run in {folder.path} has trained {state.step} steps already, got "
                                 f"--steps {config.steps} (the new total); give {state.step} to end it there, or "
                                 f"more to train it further")
            print(f"the run in {folder.path} trained all {state.step} steps, but its final evaluation did not "
                  f"finish; doing it now")
    else:
        config = replace(config, **budget)
    if ctx.is_main:
        folder.clear_replaced_run()
    return _Plan(name, corpus, folder, model, tokenizer, train_split, val_split, config, state, checksum,
                 device, ctx)


class RunFinished(Exception):
    """A resumed run had nothing left to do."""


def run_preset(name: str | Preset | None, out_dir: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Train a preset into ``out_dir`` (checkpoint.pt and metrics.json, kept up to date); return the metrics.

    ``options`` are :class:`RunRequest`'s other fields: ``seconds``, ``steps``, ``corpus``, ``device``,
    ``progress``, ``compile``, ``batch_size``, ``seed``, ``resume``, ``overwrite``. The same as
    ``run_request(RunRequest(name, out_dir, **options))``: see :func:`run_request`.
    """
    return run_request(RunRequest(name, out_dir, **options))


def run_request(request: RunRequest) -> dict[str, Any]:
    """Train what ``request`` asks for; return the metrics (also in ``request.out``/metrics.json).

    Everything is checked before the first step (a :class:`RunRefused` names the problem).
    ``resume=True`` continues the run saved in ``out`` (``preset`` may be None), with
    ``steps``/``seconds`` as the run's new total budget; ``overwrite=True`` replaces it; a folder
    holding a run is otherwise refused. ``seed`` replaces the preset's (initial weights, batches,
    dropout): a benchmark over several seeds tells a real difference from luck. SIGINT and SIGTERM
    stop the run cleanly after the current step, saved: the metrics then say ``"status": "stopped"``
    and ``"signal"``. A NaN loss raises :class:`NonFiniteLoss` and keeps the last good checkpoint.
    A run with nothing left to do (resumed after it finished) prints so and returns ``{}``, as
    does every rank but the first under torchrun.
    """
    if not isinstance(request, RunRequest):
        raise TypeError(f"request: expected a RunRequest, got {validate.describe(request)}")
    # The run seeds and draws from the global generators (initial weights, dropout); fork them so
    # the caller's random numbers are the same after the call as before it.
    # (only the current GPU's: touching every GPU would make each torchrun rank a context on all of them)
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        return _run(request)


def _run(request: RunRequest) -> dict[str, Any]:
    finished = False
    ctx = DistributedContext()
    folder: RunFolder | None = None
    try:
        try:
            device = request.device
            ctx = setup_distributed(device.type)
            if ctx.enabled and device.type == "cuda":
                device = torch.device("cuda", ctx.local_rank)
            folder = RunFolder(request.out, resume=request.resume, overwrite=request.overwrite)
            if ctx.is_main:
                folder.prepare()   # created, writable, locked, free of a killed run's leftovers
            plan = _plan(request, folder, device, ctx)
        except RunFinished as done:
            print(done)
            finished = True
            return {}
        except RunRefused:
            raise
        except (ValueError, TypeError, OSError, RuntimeError) as exc:   # CorpusError is a RuntimeError
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if isinstance(exc, CorpusError):   # its full text lists the folders searched and the fix
                first_line = (f"corpus: {first_line} `python -m course_lib data --no-download` shows where "
                              f"to put it (or set COURSE_DATA_DIR)")
            raise RunRefused(first_line) from None
        with StopRequest() as stop:
            try:
                history = training.train(plan.model, plan.train_split, plan.val_split, plan.config, device=device,
                                         progress=request.progress, ctx=ctx, state=plan.state,
                                         on_checkpoint=plan.save, should_stop=stop)
            except NonFiniteLoss as exc:
                saved = "no checkpoint was written yet" if not folder.checkpoint.exists() else \
                    f"the last good checkpoint is kept in {folder.checkpoint}"
                if ctx.is_main:
                    _mark_failed(folder, str(exc))
                raise _with_checkpoint_note(exc, saved) from None
            metrics = plan.finish(history, stop) if ctx.is_main else {}
        finished = True
        return metrics
    finally:
        if folder is not None:
            folder.release()
        # After a failure the other ranks may never arrive: wait for them only on success.
        teardown_distributed(wait_for_all=finished)


def _mark_failed(folder: RunFolder, why: str) -> None:
    """metrics.json of the last save says "running"; a run that ended on a NaN says "failed", and why, so that a
    script (a requeue, a dashboard) tells it from a live run. Best effort: the checkpoint is what counts."""
    try:
        metrics = json.loads(folder.metrics.read_text(encoding="utf-8"))
        if isinstance(metrics, dict):
            metrics.update(status="failed", failure=why.splitlines()[0])
            write_atomically(folder.metrics, json.dumps(metrics, indent=2).encode("utf-8"))
    except (OSError, ValueError):
        pass


def _with_checkpoint_note(exc: NonFiniteLoss, note: str) -> NonFiniteLoss:
    again = NonFiniteLoss.__new__(NonFiniteLoss)
    again.step = exc.step
    RuntimeError.__init__(again, f"{exc}; {note}")
    return again
