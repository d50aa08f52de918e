"""Training pictures: loss curves, and the measured cost of attention against sequence length."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .. import _validate as validate
from .style import ACCENT, MUTED, PALETTE, Figure, as_array, new_figure, tidy

__all__ = ["plot_loss_curves", "plot_attention_cost"]


def _history_field(history: Any, name: str, required: bool) -> list[float] | None:
    if isinstance(history, Mapping):
        value = history.get(name)
    else:
        value = getattr(history, name, None)
    if value is None:
        if required:
            raise ValueError(f"history: expected a mapping with key '{name}' or an object with attribute "
                             f"'{name}' (a list of numbers), got {type(history).__name__} without it")
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"history: expected '{name}' to be a list of numbers, got {validate.describe(value)}")
    values = list(value)
    for v in values:
        if not validate.is_number(v):   # NaN is a number here: a diverged run leaves gaps, not an error
            raise TypeError(f"history: expected '{name}' to hold numbers, got an item {validate.describe(v)}")
    return [float(v) for v in values]


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """ys at x, read off the line through (xs, ys) (NaN points skipped); None outside its range."""
    pairs = [(a, b) for a, b in zip(xs, ys) if math.isfinite(b)]
    if not pairs or not pairs[0][0] <= x <= pairs[-1][0]:
        return None
    return float(np.interp(x, [a for a, _ in pairs], [b for _, b in pairs]))


def plot_loss_curves(history) -> Figure:
    """Training and validation loss against the step, on linear axes.

    ``history`` is a mapping with keys, or an object with attributes (a
    ``train.History``): ``step`` and ``train_loss`` (same length), optionally
    ``val_loss`` with ``val_step`` (when ``val_step`` is missing, ``val_loss``
    must have one entry per ``step``). NaN losses (a diverged run) leave gaps.
    """
    if history is None:
        raise TypeError("history: expected a mapping or an object with step and train_loss lists, got None")
    steps = _history_field(history, "step", required=True)
    train = _history_field(history, "train_loss", required=True)
    if len(steps) != len(train):
        raise ValueError(f"history: expected 'step' and 'train_loss' of the same length, got "
                         f"{len(steps)} and {len(train)}")
    val = _history_field(history, "val_loss", required=False)
    val_steps = _history_field(history, "val_step", required=False)
    if val is not None and val_steps is None:
        if len(val) != len(steps):
            raise ValueError(f"history: 'val_loss' has {len(val)} entries but 'step' has {len(steps)}; "
                             f"add 'val_step' (the step of each validation loss)")
        val_steps = steps
    if val is not None and len(val) != len(val_steps):
        raise ValueError(f"history: expected 'val_step' and 'val_loss' of the same length, got "
                         f"{len(val_steps)} and {len(val)}")
    if not steps and not val:
        raise ValueError("history: expected at least one recorded step, got empty lists")

    fig = new_figure(7.5, 4.2)
    ax = fig.add_subplot()
    ax.plot(steps, train, color=PALETTE[0], linewidth=1.4, label="train", marker="o" if len(steps) < 30 else None,
            markersize=3)
    if val:
        ax.plot(val_steps, val, color=PALETTE[6], linewidth=1.8, marker="o", markersize=4, label="validation")
        finite = [(s, v) for s, v in zip(val_steps, val) if math.isfinite(v)]
        if finite:
            best_step, best = min(finite, key=lambda p: p[1])
            # anchored on the right when the best point is the last one, so the label stays inside
            at_end = best_step == val_steps[-1]
            # on the side away from the training line: validation usually sits above it, so below the
            # point the label would land on the training curve
            train_here = _interpolate(steps, train, best_step)
            above = train_here is None or train_here <= best
            ax.annotate(f"best {best:.3f}", (best_step, best), xytext=(0, 7 if above else -7),
                        textcoords="offset points", ha="right" if at_end else "center",
                        va="bottom" if above else "top", fontsize=8, color=PALETTE[6])
    tidy(ax, grid=True)
    ax.set_xlabel("step", fontsize=10)
    ax.set_ylabel("loss (cross-entropy, nats per token)", fontsize=10)
    ax.set_title("training progress", fontsize=11)
    ax.legend(frameon=False, fontsize=9)
    return fig


def plot_attention_cost(lengths, seconds, flops=None) -> Figure:
    """Measured attention time against sequence length L, with the best c·L² fit.

    ``flops`` (optional, one per length) adds a panel of the achieved GFLOP/s.
    The fit is in ``fig.course_data`` (``c`` in seconds per token²).
    """
    lengths_ = as_array("lengths", lengths, ndims=(1,), shape="(n,) of sequence lengths")
    seconds_ = as_array("seconds", seconds, ndims=(1,), shape=f"({len(lengths_)},), one time per length")
    if (lengths_ <= 0).any():
        raise ValueError(f"lengths: expected positive sequence lengths, got {lengths_.tolist()}")
    if seconds_.shape != lengths_.shape:
        raise ValueError(f"seconds: expected one time per length ({len(lengths_)} values), got {len(seconds_)}")
    if (seconds_ <= 0).any():
        raise ValueError(f"seconds: expected times > 0, got {seconds_.tolist()}")
    flops_ = None
    if flops is not None:
        flops_ = as_array("flops", flops, ndims=(1,), shape=f"({len(lengths_)},), one count per length")
        if flops_.shape != lengths_.shape or (flops_ <= 0).any():
            raise ValueError(f"flops: expected {len(lengths_)} positive counts (one per length), "
                             f"got {flops_.tolist()}")
    order = np.argsort(lengths_)
    lengths_, seconds_ = lengths_[order], seconds_[order]
    # least squares through the origin: minimise sum (t - c L^2)^2
    c = float((seconds_ * lengths_ ** 2).sum() / (lengths_ ** 4).sum())
    top = float(seconds_.max())
    scale, unit = (1e6, "µs") if top < 1e-3 else (1e3, "ms") if top < 1 else (1.0, "s")

    fig = new_figure(10 if flops_ is not None else 6.5, 4)
    axes = fig.subplots(1, 2 if flops_ is not None else 1, squeeze=False).ravel()
    ax = axes[0]
    smooth = np.linspace(0, lengths_.max() * 1.05, 200)
    ax.plot(smooth, c * smooth ** 2 * scale, color=MUTED, linestyle="--",
            label=f"fit: c·L², c = {c:.2e} s")
    ax.plot(lengths_, seconds_ * scale, "o", color=ACCENT, markersize=6, label="measured")
    ax.set_xlabel("sequence length L (tokens)", fontsize=10)
    ax.set_ylabel(f"time per call ({unit})", fontsize=10)
    ax.set_title("attention cost against the sequence length L", fontsize=11)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    data: dict[str, Any] = {"c": c, "lengths": lengths_.tolist(), "seconds": seconds_.tolist(),
                            "fit_seconds": (c * lengths_ ** 2).tolist()}
    if flops_ is not None:
        gflops = flops_[order] / seconds_ / 1e9
        axes[1].plot(lengths_, gflops, "o-", color=PALETTE[0])
        axes[1].set_xlabel("sequence length L (tokens)", fontsize=10)
        axes[1].set_ylabel("achieved GFLOP/s", fontsize=10)
        axes[1].set_title("how busy the hardware was", fontsize=11)
        axes[1].set_ylim(bottom=0)
        data["gflops_per_s"] = gflops.tolist()
    for a in axes:
        tidy(a, grid=True)
    ax.legend(frameon=False, fontsize=9)
    fig.course_data = data
    return fig
