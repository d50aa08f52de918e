"""Pictures and ipywidgets explorers for the notebooks.

Every ``plot_*`` function checks its inputs and returns a matplotlib ``Figure``.
The figures are built without pyplot (a ``matplotlib.figure.Figure`` subclass
that renders itself as PNG), so a notebook shows each one exactly once, whatever
the matplotlib backend: put the call (or the returned figure) last in the cell,
or ``display(fig)``. In a script, use ``fig.savefig(path)``. When you pass your
own pyplot ``ax``, the figure is pyplot's: show it as you normally would.

Widgets (``query_explorer``, ``generation_playground``) are thin shells around
plain functions (``query_explorer_state``, ``plot_query_explorer``,
``playground_samples``) that the tests call directly. Each widget has a static
fallback, used when ``static=True`` is passed, when ipywidgets cannot be
imported, or when ``COURSE_STATIC_WIDGETS=1`` is set (the nbval runs set it so
that committed notebook outputs stay stable).
"""
from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib import figure as mpl_figure
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Patch

from . import _validate as check
from .attention import TOY_KEYS, TOY_VALUES, split_heads

__all__ = [
    "Figure",
    "use_static_widgets",
    "plot_attention",
    "plot_attention_heads",
    "plot_causal_mask",
    "plot_positional_encoding",
    "plot_loss_curves",
    "plot_softmax_saturation",
    "plot_attention_cost",
    "plot_architecture_diagram",
    "plot_why_attention",
    "plot_heads_split",
    "plot_ddp_allreduce",
    "query_explorer_state",
    "plot_query_explorer",
    "query_explorer",
    "playground_samples",
    "generation_playground",
    "SampleTable",
]

# One palette for the whole course, colour-blind friendly (Okabe-Ito based).
INK = "#222222"
MUTED = "#8a8a8a"
LIGHT = "#eef0f2"
ACCENT = "#d55e00"      # the query, the thing being predicted
MAY_ATTEND = "#0072b2"
MASKED = "#e6e8eb"
REDUCE = "#6a3d9a"      # what all ranks share after the all-reduce
PALETTE = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#f0e442", "#d55e00", "#999999"]
CMAP = "viridis"
# Values are written into heatmap cells only when they stay readable.
ANNOTATE_MAX_TOKENS = 12
ARCHITECTURES = ("markov", "rnn", "attention")


# --------------------------------------------------------------------------- helpers

class Figure(mpl_figure.Figure):
    """A matplotlib Figure that shows itself in Jupyter even when pyplot was never imported.

    pyplot registers the notebook's PNG display only once it is imported (and
    not at all under MPLBACKEND=Agg), so the figure carries its own.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=100, bbox_inches="tight", facecolor="white")
        return buffer.getvalue()

    def __repr__(self) -> str:
        return f"<Figure size {self.bbox.size[0]:g}x{self.bbox.size[1]:g} with {len(self.axes)} Axes>"


def use_static_widgets() -> bool:
    """True when widgets should fall back to static output (COURSE_STATIC_WIDGETS=1 or no ipywidgets)."""
    if os.environ.get("COURSE_STATIC_WIDGETS", "").strip().lower() in ("1", "true", "yes"):
        return True
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return True
    return False


def _widgets_or_none(static: bool | None) -> Any:
    """The ipywidgets module, or None when the static fallback should be shown instead."""
    if static is None:
        static = use_static_widgets()
    if static:
        return None
    try:
        import ipywidgets
    except ImportError:
        return None
    return ipywidgets


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    return check.describe(value)


def _array(name: str, value: Any, *, ndims: Sequence[int], shape: str, kind: str = "float") -> np.ndarray:
    """``value`` (tensor, array or nested list) as a numpy array with one of ``ndims`` dimensions.

    kind "float": real, finite numbers (returned as float64); kind "bool": a bool mask.
    """
    given = None   # the caller's dtype, for messages (tensors are converted below)
    if isinstance(value, torch.Tensor):
        given = str(value.dtype).replace("torch.", "")
        value = value.detach().cpu()
        if value.is_complex():
            raise TypeError(f"{name}: expected real numbers, got dtype {value.dtype}")
        arr = value.numpy() if value.dtype == torch.bool else value.double().numpy()
    elif isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except ValueError:
            raise ValueError(f"{name}: expected a tensor or array of shape {shape}, got a ragged "
                             f"{type(value).__name__} (rows of different lengths)") from None
    else:
        raise TypeError(f"{name}: expected a tensor or array of shape {shape}, got {_describe(value)}")
    if arr.ndim not in ndims:
        raise ValueError(f"{name}: expected shape {shape}, got shape {tuple(arr.shape)} "
                         f"({arr.ndim} dimensions)")
    if arr.size == 0:
        raise ValueError(f"{name}: expected a non-empty array of shape {shape}, got shape {tuple(arr.shape)}")
    if kind == "bool":
        if arr.dtype != np.bool_:
            raise TypeError(f"{name}: expected a bool mask (True = may attend), got dtype {given or arr.dtype}; "
                            f"build it with causal_mask(n) or compare, e.g. m > 0")
        return arr
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    bad = int((~np.isfinite(arr)).sum())
    if bad:
        raise ValueError(f"{name}: expected finite numbers, got {bad} NaN/inf entries; if these are "
                         f"masked scores, plot the weights after the softmax instead")
    return arr


def _number(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and (minimum is None or value >= minimum) and \
            (maximum is None or value <= maximum)
    if not ok:
        lo = "-inf" if minimum is None else f"{minimum:g}"
        hi = "inf" if maximum is None else f"{maximum:g}"
        raise ValueError(f"{name}: expected a finite number in [{lo}, {hi}], got {_describe(value)}")
    return value


def _tokens(tokens: Any, length: int, name: str = "tokens") -> list[str] | None:
    """Check ``tokens`` (a list of str, or a str read as one token per character) has ``length`` items."""
    if tokens is None:
        return None
    if isinstance(tokens, str):
        tokens = list(tokens)
    elif isinstance(tokens, torch.Tensor) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name}: expected a list of {length} str (one per position), got "
                        f"{_describe(tokens)}; decode ids first, e.g. [tokenizer.decode([i]) for i in ids]")
    tokens = list(tokens)
    if not all(isinstance(t, str) for t in tokens):
        kinds = sorted({type(t).__name__ for t in tokens if not isinstance(t, str)})
        raise TypeError(f"{name}: expected a list of str, got items of type {', '.join(kinds)}")
    if len(tokens) != length:
        raise ValueError(f"{name}: expected {length} tokens (one per position of the matrix), "
                         f"got {len(tokens)}")
    return [_show_token(t) for t in tokens]


def _show_token(token: str) -> str:
    """Make spaces and newlines visible: a tick label ' ' would be invisible."""
    shown = token.replace("\n", "\\n").replace("\t", "\\t")
    return shown.replace(" ", "\u2423") if shown.strip() == "" or shown != shown.strip() else shown


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _tidy(ax, *, grid: bool = False) -> None:
    """The house look for line and bar charts."""
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color(MUTED)
    ax.tick_params(colors=INK, labelsize=9)
    if grid:
        ax.grid(True, color=LIGHT, linewidth=0.8)
        ax.set_axisbelow(True)


def _label_ticks(ax, labels: list[str] | None, n: int, axis: str, fontsize: float) -> None:
    """Tick every position; thin out the labels when there are too many to read."""
    step = max(1, math.ceil(n / 40))
    ticks = list(range(0, n, step))
    texts = [labels[i] for i in ticks] if labels is not None else [str(i) for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks, labels=texts, fontsize=fontsize, rotation=90 if _crowded(labels, n) else 0)
    else:
        ax.set_yticks(ticks, labels=texts, fontsize=fontsize)


def _crowded(labels: list[str] | None, n: int) -> bool:
    """Word-like key labels only fit side by side when there are few of them."""
    return bool(labels) and n > 6 and max(len(t) for t in labels) > 2


def _heatmap(ax, data: np.ndarray, xlabels, ylabels, *, vmin: float, vmax: float, annotate: bool,
             fontsize: float):
    im = ax.imshow(data, cmap=CMAP, vmin=vmin, vmax=vmax, interpolation="nearest", aspect="equal")
    _label_ticks(ax, xlabels, data.shape[1], "x", fontsize)
    _label_ticks(ax, ylabels, data.shape[0], "y", fontsize)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if annotate:
        span = vmax - vmin or 1.0
        for (i, j), v in np.ndenumerate(data):
            # viridis is dark at the low end: white text there, dark text on yellow
            colour = "white" if (v - vmin) / span < 0.6 else INK
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=fontsize - 1, color=colour)
    return im


def _box(ax, x: float, y: float, w: float, h: float, text: str, *, face: str = "white",
         edge: str = INK, color: str = INK, fontsize: float = 10, weight: str = "normal", lw: float = 1.2):
    """A rounded box centred on (x, y)."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.12",
                                facecolor=face, edgecolor=edge, linewidth=lw))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, color=color, fontweight=weight)


def _arrow(ax, start, end, *, color: str = INK, lw: float = 1.3, rad: float = 0.0, style: str = "-|>"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color,
                                 linewidth=lw, shrinkA=2, shrinkB=2,
                                 connectionstyle=f"arc3,rad={rad}"))


def _canvas(ax, width: float, height: float) -> None:
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")


def _lighten(colour: str, amount: float = 0.6) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


# --------------------------------------------------------------------------- attention maps

def plot_attention(weights, tokens=None, title: str | None = None, ax=None) -> Figure:
    """Heatmap of one attention matrix (Lq, Lk): queries are rows, keys are columns.

    ``tokens`` labels the keys (a list of Lk str; a str is read one character per
    token). When Lq < Lk (queries of the newest tokens only, as with a KV cache)
    the rows get the last Lq tokens. Values are written in the cells for up to
    12 tokens. Draws into ``ax`` when given; returns the Figure.
    """
    w = _array("weights", weights, ndims=(2,), shape="(Lq, Lk)")
    lq, lk = w.shape
    if lq > lk:
        raise ValueError(f"weights: expected at most as many queries as keys (Lq <= Lk), got shape {w.shape}")
    labels = _tokens(tokens, lk)
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a str or None, got {_describe(title)}")
    if ax is None:
        side = min(9.0, 2.2 + 0.45 * max(lq, lk))
        fig = _figure(side + 1.2, side)
        ax = fig.add_subplot()
    elif not hasattr(ax, "imshow") or ax.figure is None:
        raise TypeError(f"ax: expected a matplotlib Axes or None, got {_describe(ax)}")
    fig = ax.figure
    fontsize = 10 if max(lq, lk) <= 16 else 8
    vmin, vmax = min(0.0, float(w.min())), max(float(w.max()), 1e-12)
    im = _heatmap(ax, w, labels, labels[lk - lq:] if labels else None, vmin=vmin, vmax=vmax,
                  annotate=max(lq, lk) <= ANNOTATE_MAX_TOKENS, fontsize=fontsize)
    ax.set_xlabel("key (attended to)", fontsize=10)
    ax.set_ylabel("query (attending)", fontsize=10)
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    ax.set_title(title or "attention weights (each row sums to 1)", fontsize=11, pad=8)
    cbar = fig.colorbar(im, ax=ax, shrink=0.8)
    cbar.ax.tick_params(labelsize=8)
    cbar.outline.set_visible(False)
    return fig


def plot_attention_heads(weights, tokens=None, layer: int | None = None) -> Figure:
    """One heatmap per head: weights (heads, L, L) or (layers, heads, L, L).

    For 4-D weights ``layer=None`` draws every layer (one row each) and ``layer=i``
    only row i. For 3-D weights ``layer`` only names the layer in the titles.
    Panels share one colour scale, so heads can be compared by colour.
    """
    if isinstance(weights, torch.Tensor) and weights.dim() == 5:
        raise ValueError(f"weights: expected (heads, L, L) or (layers, heads, L, L), got shape "
                         f"{tuple(weights.shape)}; for GPT.attention_maps output (layers, N, heads, L, L) "
                         f"pick one sequence, e.g. maps[:, 0]")
    w = _array("weights", weights, ndims=(3, 4), shape="(heads, L, L) or (layers, heads, L, L)")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise ValueError(f"layer: expected None or an int >= 0, got {_describe(layer)}")
    if w.ndim == 4:
        if layer is not None:
            if layer >= w.shape[0]:
                raise ValueError(f"layer: expected an index below the {w.shape[0]} layers of weights, got {layer}")
            layer_ids, w = [layer], w[layer:layer + 1]
        else:
            layer_ids = list(range(w.shape[0]))
    else:
        layer_ids, w = [layer], w[None]
    layers, heads, lq, lk = w.shape
    if lq > lk:
        raise ValueError(f"weights: expected at most as many queries as keys, got L_q={lq} > L_k={lk}")
    labels = _tokens(tokens, lk)

    panels = [(i, h) for i in range(layers) for h in range(heads)]
    cols = heads if layers > 1 else min(heads, 4)
    rows = math.ceil(len(panels) / cols)
    size = 2.6 if max(lq, lk) <= 16 else 3.2
    fig = _figure(size * cols + 1.0, size * rows + 0.4)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    vmax = max(float(w.max()), 1e-12)
    vmin = min(0.0, float(w.min()))
    fontsize = 8 if max(lq, lk) <= 16 else 6
    im = None
    for k, ax in enumerate(axes):
        if k >= len(panels):
            ax.remove()
            continue
        i, h = panels[k]
        im = _heatmap(ax, w[i, h], labels, labels[lk - lq:] if labels else None, vmin=vmin, vmax=vmax,
                      annotate=False, fontsize=fontsize)
        name = f"head {h}" if layer_ids[i] is None else f"layer {layer_ids[i]}, head {h}"
        ax.set_title(name, fontsize=10)
        # labels only on the outer edge: inner ones repeat and crowd the grid
        if k % cols:
            ax.set_yticklabels([])
        if k + cols < len(panels):
            ax.set_xticklabels([])
    cbar = fig.colorbar(im, ax=list(fig.axes), shrink=0.8)   # the panels left after removing spares
    cbar.outline.set_visible(False)
    cbar.ax.tick_params(labelsize=8)
    fig.supxlabel("key (attended to)", fontsize=10)
    fig.supylabel("query (attending)", fontsize=10)
    return fig


def plot_causal_mask(mask, tokens=None) -> Figure:
    """The bool mask (True = may attend) as a two-colour grid with a legend."""
    m = _array("mask", mask, ndims=(2,), shape="(Lq, Lk)", kind="bool")
    lq, lk = m.shape
    labels = _tokens(tokens, lk)
    side = min(8.0, 2.0 + 0.4 * max(lq, lk))
    fig = _figure(side + 0.6, side + 0.6)
    ax = fig.add_subplot()
    ax.imshow(m.astype(int), cmap=ListedColormap([MASKED, MAY_ATTEND]), vmin=0, vmax=1,
              interpolation="nearest")
    fontsize = 10 if max(lq, lk) <= 16 else 8
    _label_ticks(ax, labels, lk, "x", fontsize)
    _label_ticks(ax, labels[lk - lq:] if labels else None, lq, "y", fontsize)
    ax.xaxis.tick_top()
    ax.xaxis.set_label_position("top")
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    # thin white lines between cells make the staircase easy to count
    ax.set_xticks(np.arange(-0.5, lk, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, lq, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5 if max(lq, lk) <= 24 else 0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position", fontsize=10)
    ax.set_ylabel("query position", fontsize=10)
    ax.set_title("causal mask: each token sees itself and the past", fontsize=11, pad=8)
    ax.legend(handles=[Patch(facecolor=MAY_ATTEND, label="may attend (True)"),
                       Patch(facecolor=MASKED, edgecolor=MUTED, label="masked (future)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, frameon=False, fontsize=9)
    return fig


def plot_positional_encoding(table, title: str | None = None, dims: Sequence[int] | None = None) -> Figure:
    """Heatmap of a (max_tokens, embed_dim) position table, plus a few dimensions as lines.

    Positions run along the x axis of both panels; ``dims`` picks the lines
    (default: 0, 1 and two slower ones).
    """
    t = _array("table", table, ndims=(2,), shape="(max_tokens, embed_dim)")
    positions, embed_dim = t.shape
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a str or None, got {_describe(title)}")
    if dims is None:
        dims = sorted({0, min(1, embed_dim - 1), 2 * (embed_dim // 8), 2 * (embed_dim // 4)} & set(range(embed_dim)))
    else:
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < embed_dim for d in dims):
            raise ValueError(f"dims: expected a non-empty list of ints in [0, {embed_dim}), got {_describe(dims)}")
        dims = list(dims)
    fig = _figure(10, 6)
    ax_map, ax_lines = fig.subplots(2, 1, sharex=True, height_ratios=[2.2, 1])
    limit = max(float(np.abs(t).max()), 1e-12)
    im = ax_map.imshow(t.T, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest",
                       origin="lower")
    ax_map.set_ylabel("embedding dimension", fontsize=10)
    ax_map.set_title(title or f"positional encoding table ({positions} positions x {embed_dim} dimensions)",
                     fontsize=11)
    ax_map.tick_params(labelsize=9)
    cbar = fig.colorbar(im, ax=[ax_map, ax_lines], shrink=0.6, anchor=(0.0, 1.0), pad=0.02)
    cbar.outline.set_visible(False)
    cbar.ax.tick_params(labelsize=8)
    for k, d in enumerate(dims):
        colour = PALETTE[k % len(PALETTE)]
        # markers on both edges: a line across the stripes would be lost in them
        for x, marker in ((-0.5, ">"), (positions - 0.5, "<")):
            ax_map.plot([x], [d], marker=marker, markersize=8, color=colour, clip_on=False,
                        markeredgecolor="white", markeredgewidth=0.6)
        ax_lines.plot(np.arange(positions), t[:, d], color=colour, linewidth=1.6, label=f"dim {d}")
    _tidy(ax_lines, grid=True)
    ax_lines.set_xlabel("position in the sequence", fontsize=10)
    ax_lines.set_ylabel("value", fontsize=10)
    ax_lines.legend(fontsize=8, frameon=False, ncol=len(dims), loc="upper left", bbox_to_anchor=(0, 1.25))
    ax_lines.set_xlim(-0.5, positions - 0.5)
    return fig


# --------------------------------------------------------------------------- training and cost

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
        raise TypeError(f"history: expected '{name}' to be a list of numbers, got {_describe(value)}")
    values = list(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"history: expected '{name}' to hold numbers, got an item {_describe(v)}")
    return [float(v) for v in values]


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

    fig = _figure(7.5, 4.2)
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
            ax.annotate(f"best {best:.3f}", (best_step, best), xytext=(0, -16), textcoords="offset points",
                        ha="right" if at_end else "center", fontsize=8, color=PALETTE[6])
    _tidy(ax, grid=True)
    ax.set_xlabel("step", fontsize=10)
    ax.set_ylabel("loss (cross-entropy, nats per token)", fontsize=10)
    ax.set_title("training progress", fontsize=11)
    ax.legend(frameon=False, fontsize=9)
    return fig


def plot_softmax_saturation(dims: Sequence[int] = (4, 16, 64, 256, 1024), samples: int = 2000,
                            seed: int = 0, num_keys: int = 16) -> Figure:
    """Why attention divides by sqrt(d): q.k of random unit-variance vectors has variance d.

    Left: the variance of the logits with and without the 1/sqrt(d) scale.
    Right: the mean largest softmax weight over ``num_keys`` keys; without the
    scale it creeps to 1 (the softmax saturates to one-hot and its gradients
    vanish). The numbers are in ``fig.course_data``.
    """
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
        raise ValueError(f"dims: expected a non-empty list of positive ints, got {_describe(dims)}")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise ValueError(f"dims: expected a non-empty list of positive ints, got an item {_describe(d)}")
    check.positive_int("samples", samples)
    check.positive_int("num_keys", num_keys)
    if num_keys < 2:
        raise ValueError(f"num_keys: expected at least 2 keys to share the weight, got {num_keys}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {_describe(seed)}")
    dims = sorted(set(dims))
    rng = np.random.default_rng(seed)
    data: dict[str, Any] = {"dims": dims, "samples": samples, "num_keys": num_keys, "seed": seed,
                            "variance_unscaled": [], "variance_scaled": [],
                            "max_weight_unscaled": [], "max_weight_scaled": []}
    for d in dims:
        logits = np.empty((samples, num_keys))
        # in chunks: samples x num_keys x d floats at d = 1024 would be ~260 MB at once
        chunk = max(1, 2_000_000 // (num_keys * d))
        for start in range(0, samples, chunk):
            n = min(chunk, samples - start)
            q = rng.standard_normal((n, 1, d))
            k = rng.standard_normal((n, num_keys, d))
            logits[start:start + n] = (q * k).sum(-1)                            # (n, num_keys)
        for tag, z in (("unscaled", logits), ("scaled", logits / math.sqrt(d))):
            p = np.exp(z - z.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)                                    # softmax over the keys
            data[f"variance_{tag}"].append(float(z.var()))
            data[f"max_weight_{tag}"].append(float(p.max(axis=1).mean()))

    fig = _figure(10, 4)
    ax_var, ax_max = fig.subplots(1, 2)
    ax_var.plot(dims, data["variance_unscaled"], "o-", color=ACCENT, label="q·k (no scaling)")
    ax_var.plot(dims, data["variance_scaled"], "o-", color=PALETTE[0], label="q·k / sqrt(d)")
    ax_var.plot(dims, dims, ":", color=MUTED, label="d")
    ax_var.set_xscale("log", base=2)
    ax_var.set_yscale("log")
    ax_var.set_xlabel("dimension d of q and k", fontsize=10)
    ax_var.set_ylabel("variance of the logits", fontsize=10)
    ax_var.set_title("logit variance grows like d", fontsize=11)
    ax_max.plot(dims, data["max_weight_unscaled"], "o-", color=ACCENT, label="no scaling")
    ax_max.plot(dims, data["max_weight_scaled"], "o-", color=PALETTE[0], label="scaled by 1/sqrt(d)")
    ax_max.axhline(1 / num_keys, linestyle=":", color=MUTED, label=f"uniform (1/{num_keys})")
    ax_max.set_xscale("log", base=2)
    ax_max.set_ylim(0, 1.05)
    ax_max.set_xlabel("dimension d of q and k", fontsize=10)
    ax_max.set_ylabel(f"largest softmax weight (of {num_keys})", fontsize=10)
    ax_max.set_title("without scaling the softmax saturates", fontsize=11)
    for ax in (ax_var, ax_max):
        _tidy(ax, grid=True)
        ax.legend(frameon=False, fontsize=9)
    fig.course_data = data
    return fig


def plot_attention_cost(lengths, seconds, flops=None) -> Figure:
    """Measured attention time against sequence length L, with the best c·L² fit.

    ``flops`` (optional, one per length) adds a panel of the achieved GFLOP/s.
    The fit is in ``fig.course_data`` (``c`` in seconds per token²).
    """
    lengths_ = _array("lengths", lengths, ndims=(1,), shape="(n,) of sequence lengths")
    seconds_ = _array("seconds", seconds, ndims=(1,), shape=f"({len(lengths_)},), one time per length")
    if (lengths_ <= 0).any():
        raise ValueError(f"lengths: expected positive sequence lengths, got {lengths_.tolist()}")
    if seconds_.shape != lengths_.shape:
        raise ValueError(f"seconds: expected one time per length ({len(lengths_)} values), got {len(seconds_)}")
    if (seconds_ <= 0).any():
        raise ValueError(f"seconds: expected times > 0, got {seconds_.tolist()}")
    flops_ = None
    if flops is not None:
        flops_ = _array("flops", flops, ndims=(1,), shape=f"({len(lengths_)},), one count per length")
        if flops_.shape != lengths_.shape or (flops_ <= 0).any():
            raise ValueError(f"flops: expected {len(lengths_)} positive counts (one per length), "
                             f"got {flops_.tolist()}")
    order = np.argsort(lengths_)
    lengths_, seconds_ = lengths_[order], seconds_[order]
    # least squares through the origin: minimise sum (t - c L^2)^2
    c = float((seconds_ * lengths_ ** 2).sum() / (lengths_ ** 4).sum())
    top = float(seconds_.max())
    scale, unit = (1e6, "µs") if top < 1e-3 else (1e3, "ms") if top < 1 else (1.0, "s")

    fig = _figure(10 if flops_ is not None else 6.5, 4)
    axes = fig.subplots(1, 2 if flops_ is not None else 1, squeeze=False).ravel()
    ax = axes[0]
    smooth = np.linspace(0, lengths_.max() * 1.05, 200)
    ax.plot(smooth, c * smooth ** 2 * scale, color=MUTED, linestyle="--",
            label=f"fit: c·L², c = {c:.2e} s")
    ax.plot(lengths_, seconds_ * scale, "o", color=ACCENT, markersize=6, label="measured")
    ax.set_xlabel("sequence length L (tokens)", fontsize=10)
    ax.set_ylabel(f"time per call ({unit})", fontsize=10)
    ax.set_title("attention cost grows like L²", fontsize=11)
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
        _tidy(a, grid=True)
    ax.legend(frameon=False, fontsize=9)
    fig.course_data = data
    return fig


# --------------------------------------------------------------------------- diagrams

_SENTENCE = ["the", "cat", "sat", "on", "the"]
_ATTENTION_EXAMPLE = [0.08, 0.42, 0.12, 0.30, 0.08]


def _draw_architecture(ax, kind: str) -> None:
    _canvas(ax, 10.6, 6.0)
    xs = [1.0 + 2.0 * i for i in range(len(_SENTENCE))]
    y_tok, y_mid, y_out = 1.2, 3.3, 5.3
    last = xs[-1]
    faded = kind == "markov"
    for i, (x, word) in enumerate(zip(xs, _SENTENCE)):
        old = faded and i < len(xs) - 1
        _box(ax, x, y_tok, 1.5, 0.75, word, face=LIGHT if old else "white",
             edge=MUTED if old else INK, color=MUTED if old else INK)
    _box(ax, last, y_out, 2.0, 0.75, "next: mat?", face=_lighten(ACCENT, 0.75), edge=ACCENT, color=INK,
         weight="bold")
    if kind == "markov":
        _box(ax, last, y_mid, 2.6, 0.95, "P(next | 'the')\nlook-up table", face=_lighten(PALETTE[0], 0.8),
             edge=PALETTE[0], fontsize=9)
        _arrow(ax, (last, y_tok + 0.4), (last, y_mid - 0.5))
        _arrow(ax, (last, y_mid + 0.5), (last, y_out - 0.4))
        ax.text((xs[0] + xs[-2]) / 2, y_tok + 0.7, "forgotten: only the last token counts",
                ha="center", fontsize=9, color=MUTED, style="italic")
        caption = "Markov chain: the next token depends\non the last one (or last n) only"
    elif kind == "rnn":
        for i, x in enumerate(xs):
            _box(ax, x, y_mid, 1.1, 0.75, f"h{i + 1}", face=_lighten(PALETTE[2], 0.75), edge=PALETTE[2])
            _arrow(ax, (x, y_tok + 0.4), (x, y_mid - 0.4))
            if i:
                _arrow(ax, (xs[i - 1] + 0.55, y_mid), (x - 0.55, y_mid), color=PALETTE[2], lw=1.6)
        _arrow(ax, (last, y_mid + 0.4), (last, y_out - 0.4))
        caption = "RNN: the past is squeezed into one hidden\nstate, passed along one step at a time"
    else:
        _box(ax, last - 0.3, y_mid, 2.6, 0.95, "weighted sum\nof the values", face=_lighten(PALETTE[0], 0.8),
             edge=PALETTE[0], fontsize=9)
        for i, (x, weight) in enumerate(zip(xs, _ATTENTION_EXAMPLE)):
            # arrows land spread along the bottom of the box, so each stays visible
            end = (last - 1.3 + 2.0 * i / (len(xs) - 1), y_mid - 0.5)
            _arrow(ax, (x, y_tok + 0.4), end, color=PALETTE[0], lw=0.8 + 9 * weight)
            ax.text(x, y_tok - 0.6, f"w = {weight:.2f}", ha="center", va="center", fontsize=8.5,
                    color=PALETTE[0])
        _arrow(ax, (last, y_mid + 0.5), (last, y_out - 0.4))
        caption = "Attention: every earlier token is one step\naway, weighted by how well it matches"
    ax.text(5.3, -0.1, caption, ha="center", va="top", fontsize=9.5, color=INK)
    ax.set_ylim(-1.1, 5.9)


def plot_architecture_diagram(kind: str) -> Figure:
    """How a Markov chain, an RNN or attention ("markov", "rnn", "attention") looks back at earlier tokens."""
    check.one_of("kind", kind, ARCHITECTURES)
    fig = _figure(5.2, 4.2)
    ax = fig.add_subplot()
    _draw_architecture(ax, kind)
    ax.set_title({"markov": "Markov chain", "rnn": "Recurrent network (RNN)", "attention": "Attention"}[kind],
                 fontsize=12, fontweight="bold")
    return fig


def plot_why_attention() -> Figure:
    """The three ways of looking back, side by side (notebook 01)."""
    fig = _figure(15, 4.4)
    for ax, kind, title in zip(fig.subplots(1, 3), ARCHITECTURES,
                               ("Markov chain", "Recurrent network (RNN)", "Attention")):
        _draw_architecture(ax, kind)
        ax.set_title(title, fontsize=12, fontweight="bold")
    return fig


def plot_heads_split(embed_dim: int = 8, num_heads: int = 2, length: int = 4) -> Figure:
    """How (N, L, E) becomes (N, heads, L, head_dim): view, then transpose (N = 1 drawn).

    Cells show the feature index and are coloured by the head that gets them. The
    right-hand stage is drawn from ``split_heads`` itself; its layout is in
    ``fig.course_data["split"]`` (heads, L, head_dim) of feature indices.
    """
    check.positive_int("embed_dim", embed_dim)
    check.positive_int("num_heads", num_heads)
    check.positive_int("length", length)
    if embed_dim % num_heads:
        raise ValueError(f"num_heads: embed_dim={embed_dim} must be divisible by num_heads, got {num_heads}")
    if embed_dim > 24 or length > 12:
        raise ValueError(f"embed_dim, length: expected embed_dim <= 24 and length <= 12 so the cells stay "
                         f"readable, got embed_dim={embed_dim}, length={length}")
    head_dim = embed_dim // num_heads
    cell, gap = 0.5, 0.35
    colours = [_lighten(PALETTE[h % len(PALETTE)], 0.55) for h in range(num_heads)]

    def grid(x0: float, y0: float, features: list[int], heads_of: list[int], row_labels: bool = True):
        """Rows = positions (top row = position 0); x0, y0 = lower-left corner."""
        for t in range(length):
            y = y0 + (length - 1 - t) * cell
            if row_labels:
                ax.text(x0 - 0.12, y + cell / 2, f"t{t}", ha="right", va="center", fontsize=8, color=MUTED)
            for c, (f, h) in enumerate(zip(features, heads_of)):
                ax.add_patch(FancyBboxPatch((x0 + c * cell, y), cell, cell, boxstyle="square,pad=0",
                                            facecolor=colours[h], edgecolor="white", linewidth=1.2))
                ax.text(x0 + (c + 0.5) * cell, y + cell / 2, str(f), ha="center", va="center", fontsize=7,
                        color=INK)

    block_h = length * cell
    stage3_h = num_heads * block_h + (num_heads - 1) * gap
    height = max(block_h, stage3_h)
    stage1_w = embed_dim * cell
    stage2_w = embed_dim * cell + (num_heads - 1) * gap
    arrow_w = 2.4
    x1 = 0.6
    x2 = x1 + stage1_w + arrow_w
    x3 = x2 + stage2_w + arrow_w
    width = x3 + head_dim * cell + 1.1
    canvas_h = height + 2.5
    fig_w = min(16.0, 0.9 * width)
    fig = _figure(fig_w, fig_w * canvas_h / width + 0.3)
    ax = fig.add_subplot()
    _canvas(ax, width, canvas_h)
    base = 0.4 + (height - block_h) / 2
    top = base + block_h
    y3 = 0.4 + (height - stage3_h) / 2
    title_y = max(top, y3 + stage3_h) + 0.55   # one line of titles across the three stages

    feats = list(range(embed_dim))
    heads_of = [f // head_dim for f in feats]
    grid(x1, base, feats, heads_of)
    ax.text(x1 + stage1_w / 2, title_y, f"x  (N, L, E) = (1, {length}, {embed_dim})", ha="center",
            fontsize=9.5, fontweight="bold")
    ax.text(x1 + stage1_w / 2, top + 0.2, "features of every position", ha="center", fontsize=8, color=MUTED)

    for h in range(num_heads):
        xh = x2 + h * (head_dim * cell + gap)
        grid(xh, base, feats[h * head_dim:(h + 1) * head_dim], [h] * head_dim, row_labels=h == 0)
        ax.text(xh + head_dim * cell / 2, top + 0.2, f"head {h}", ha="center", fontsize=8,
                color=PALETTE[h % len(PALETTE)], fontweight="bold")
    ax.text(x2 + stage2_w / 2, title_y, f"(N, L, heads, head_dim) = (1, {length}, {num_heads}, {head_dim})",
            ha="center", fontsize=9.5, fontweight="bold")

    features = torch.arange(embed_dim).expand(1, length, embed_dim)   # (1, L, E): feature index per cell
    split = split_heads(features, num_heads)[0]                        # (heads, L, head_dim)
    for h in range(num_heads):
        yh = y3 + (num_heads - 1 - h) * (block_h + gap)
        grid(x3, yh, split[h, 0].tolist(), [h] * head_dim)
        ax.text(x3 + head_dim * cell + 0.12, yh + block_h / 2, f"head {h}", ha="left", va="center",
                fontsize=8, color=PALETTE[h % len(PALETTE)], fontweight="bold")
    ax.text(x3 + head_dim * cell / 2, title_y,
            f"(N, heads, L, head_dim) = (1, {num_heads}, {length}, {head_dim})", ha="center", fontsize=9.5,
            fontweight="bold")

    mid = base + block_h / 2
    for xa, label in ((x1 + stage1_w, f".view(N, L, {num_heads}, {head_dim})"), (x2 + stage2_w, ".transpose(1, 2)")):
        _arrow(ax, (xa + 0.25, mid), (xa + arrow_w - 0.45, mid), lw=1.6)
        ax.text(xa + arrow_w / 2 - 0.1, mid + 0.18, label, ha="center", va="bottom", fontsize=8, family="monospace")
    ax.text(width / 2, 0.0, f"each head sees every position, but only its own {head_dim} of the "
            f"{embed_dim} features", ha="center", va="top", fontsize=9, color=INK)
    ax.set_ylim(-0.5, canvas_h - 0.5)
    fig.course_data = {"split": split}
    return fig


def plot_ddp_allreduce(num_ranks: int = 2) -> Figure:
    """Data-parallel training: own batch per rank -> own gradients -> all-reduce average -> same step."""
    check.positive_int("num_ranks", num_ranks)
    if num_ranks > 8:
        raise ValueError(f"num_ranks: expected at most 8 ranks for a readable drawing, got {num_ranks}")
    row = 1.3
    height = num_ranks * row
    xs = {"batch": 1.0, "model": 3.3, "grad": 5.6, "reduce": 8.0, "step": 10.4, "weights": 12.7}
    fig = _figure(13, 1.0 + 1.0 * height + 0.9)
    ax = fig.add_subplot()
    _canvas(ax, 13.8, height + 1.6)
    reduce_colour = REDUCE
    for r in range(num_ranks):
        y = 0.6 + (num_ranks - 1 - r + 0.5) * row
        colour = PALETTE[r % len(PALETTE)]
        ax.text(0.05, y, f"rank {r}", ha="left", va="center", fontsize=9, color=colour, fontweight="bold",
                rotation=90)
        _box(ax, xs["batch"], y, 1.5, 0.8, f"batch {r}", face=_lighten(colour, 0.7), edge=colour, fontsize=9)
        _box(ax, xs["model"], y, 1.8, 0.8, "model copy\nforward+backward", fontsize=8)
        _box(ax, xs["grad"], y, 1.3, 0.8, f"grads g{r}", face=_lighten(colour, 0.7), edge=colour, fontsize=9)
        _box(ax, xs["step"], y, 1.7, 0.8, "optimizer.step()\nwith the mean g", fontsize=8)
        _box(ax, xs["weights"], y, 1.4, 0.8, "same new\nweights", face=_lighten(reduce_colour, 0.75),
             edge=reduce_colour, fontsize=8)
        _arrow(ax, (xs["batch"] + 0.75, y), (xs["model"] - 0.9, y))
        _arrow(ax, (xs["model"] + 0.9, y), (xs["grad"] - 0.65, y))
        _arrow(ax, (xs["grad"] + 0.65, y), (xs["reduce"] - 0.95, y), color=colour)
        _arrow(ax, (xs["reduce"] + 0.95, y), (xs["step"] - 0.85, y), color=reduce_colour)
        _arrow(ax, (xs["step"] + 0.85, y), (xs["weights"] - 0.7, y))
    reduce_h = height - 0.3
    _box(ax, xs["reduce"], 0.6 + height / 2, 1.9, reduce_h,
         "all-reduce\n\ng = mean of\n" + (", ".join(f"g{r}" for r in range(num_ranks)) if num_ranks <= 3
                                            else f"g0, ..., g{num_ranks - 1}"),
         face=_lighten(reduce_colour, 0.8), edge=reduce_colour, fontsize=8.5)
    ax.text(6.9, height + 1.1, f"data-parallel training: one step on {num_ranks} "
            f"{'rank' if num_ranks == 1 else 'ranks'}", ha="center", fontsize=11, fontweight="bold")
    ax.text(6.9, 0.2, "different data on each rank, averaged gradients, so every copy of the model stays identical",
            ha="center", fontsize=9, color=INK)
    return fig


# --------------------------------------------------------------------------- query explorer

def _toy_inputs(keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    keys = TOY_KEYS if keys is None else keys
    values = TOY_VALUES if values is None else values
    k = torch.as_tensor(_array("keys", keys, ndims=(2,), shape="(n, 2): one 2-D key per row"))
    if k.shape[1] != 2:
        raise ValueError(f"keys: expected shape (n, 2) (the explorer's query is 2-D), got {tuple(k.shape)}")
    v = torch.as_tensor(_array("values", values, ndims=(1, 2), shape=f"({k.shape[0]},) or ({k.shape[0]}, dv)"))
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"values: expected one value per key ({k.shape[0]} rows), got shape {tuple(v.shape)}")
    return k.float(), v.float()


def query_explorer_state(angle_degrees: float, keys=None, values=None) -> dict[str, torch.Tensor]:
    """Toy attention for the unit query at ``angle_degrees``: dict(query, scores, weights, result).

    Same computation as ``toy_attention`` (plain dot product, no scaling);
    keys default to TOY_KEYS and values to TOY_VALUES.
    """
    angle = _number("angle_degrees", angle_degrees)
    k, v = _toy_inputs(keys, values)
    radians = math.radians(angle)
    query = torch.tensor([math.cos(radians), math.sin(radians)])   # (2,)  unit length
    scores = k @ query                                             # (n,)
    weights = torch.softmax(scores, dim=0)                         # (n,)
    return {"query": query, "scores": scores, "weights": weights, "result": weights @ v}


def _format_result(result: torch.Tensor) -> str:
    if result.dim() == 0:
        return f"{result.item():.2f}"
    return "[" + ", ".join(f"{x:.2f}" for x in result.tolist()) + "]"


def _value_label(v: torch.Tensor) -> str:
    return f"{v.item():g}" if v.dim() == 0 else _format_result(v)


def _outward_label(ax, point: torch.Tensor, text: str, colour: str, fontsize: float) -> None:
    """A label just past the tip of an arrow from the origin, aligned away from it."""
    x, y = point.tolist()
    norm = math.hypot(x, y) or 1.0
    ha = "left" if x / norm > 0.3 else "right" if x / norm < -0.3 else "center"
    va = "bottom" if y / norm > 0.3 else "top" if y / norm < -0.3 else "center"
    ax.text(x + 0.08 * x / norm, y + 0.08 * y / norm, text, ha=ha, va=va, fontsize=fontsize, color=colour)


def _draw_query(ax_circle, ax_bars, angle: float, keys: torch.Tensor, values: torch.Tensor,
                compact: bool = False) -> dict[str, torch.Tensor]:
    state = query_explorer_state(angle, keys, values)
    reach = max(1.0, float(keys.norm(dim=1).max())) * (1.45 if compact else 1.75)
    ax_circle.add_patch(Circle((0, 0), 1.0, fill=False, linestyle=":", color=MUTED))
    ax_circle.axhline(0, color=LIGHT, linewidth=0.8, zorder=0)
    ax_circle.axvline(0, color=LIGHT, linewidth=0.8, zorder=0)
    for i, key in enumerate(keys):
        colour = PALETTE[i % len(PALETTE)]
        _arrow(ax_circle, (0, 0), tuple(key.tolist()), color=colour, lw=1.8)
        label = f"k{i}" if compact else f"k{i} (v={_value_label(values[i])})"
        _outward_label(ax_circle, key, label, colour, 8 if compact else 9)
    q = state["query"]
    _arrow(ax_circle, (0, 0), tuple(q.tolist()), color=ACCENT, lw=2.6)
    # beside the arrow head rather than beyond it, where a key's label may sit
    side = torch.stack([-q[1], q[0]]) * 0.14
    ax_circle.text(*(q * 0.8 + side).tolist(), "q", ha="center", va="center", fontsize=11, color=ACCENT,
                   fontweight="bold")
    ax_circle.set_xlim(-reach, reach)
    ax_circle.set_ylim(-reach, reach)
    ax_circle.set_aspect("equal")
    ax_circle.set_xticks([])
    ax_circle.set_yticks([])
    for spine in ax_circle.spines.values():
        spine.set_visible(False)
    ax_circle.set_title(f"query at {angle:g}°" + ("" if compact else f" = [{q[0]:.2f}, {q[1]:.2f}]"),
                        fontsize=10)

    weights = state["weights"].tolist()
    positions = range(len(weights))
    bars = ax_bars.bar(positions, weights, color=[PALETTE[i % len(PALETTE)] for i in positions])
    ax_bars.bar_label(bars, labels=[f"{w:.2f}" for w in weights], fontsize=8, padding=2)
    ax_bars.set_xticks(list(positions), labels=[f"k{i}" if compact else f"k{i}\nv={_value_label(values[i])}"
                                                for i in positions])
    ax_bars.set_ylim(0, 1.12)
    ax_bars.set_ylabel("weight", fontsize=9)
    _tidy(ax_bars)
    ax_bars.set_title(f"result = {_format_result(state['result'])}", fontsize=10)
    return state


def plot_query_explorer(angle_degrees: float, keys=None, values=None) -> Figure:
    """Left: keys and the query on the unit circle; right: the attention weights and the result."""
    angle = _number("angle_degrees", angle_degrees)
    k, v = _toy_inputs(keys, values)
    fig = _figure(8.5, 3.8)
    ax_circle, ax_bars = fig.subplots(1, 2, width_ratios=[1, 1.1])
    state = _draw_query(ax_circle, ax_bars, angle, k, v)
    ax_bars.set_title(f"weights = softmax(K q);  result = Σ wᵢ vᵢ = {_format_result(state['result'])}",
                      fontsize=10)
    fig.course_data = state
    return fig


def _static_query_figure(keys: torch.Tensor, values: torch.Tensor, angles: Sequence[float]) -> Figure:
    fig = _figure(2.6 * len(angles) + 0.4, 5.2)
    axes = fig.subplots(2, len(angles), squeeze=False, height_ratios=[1.15, 1])
    fig.course_data = [_draw_query(axes[0, i], axes[1, i], a, keys, values, compact=True)
                       for i, a in enumerate(angles)]
    fig.suptitle("the query at a few angles: weights = softmax(K q), result = Σ wᵢ vᵢ", fontsize=11)
    return fig


def query_explorer(keys=None, values=None, *, static: bool | None = None,
                   angles: Sequence[float] = (0, 90, 135, 225)):
    """A slider for the query angle (0-360°) that redraws ``plot_query_explorer``.

    Static (``static=True``, COURSE_STATIC_WIDGETS=1, or no ipywidgets): returns a
    Figure with the query at each of ``angles``. Otherwise returns an ipywidgets
    VBox with attributes ``slider``, ``output`` and ``state`` (the latest
    ``query_explorer_state``, updated on every slider change).
    """
    k, v = _toy_inputs(keys, values)
    if isinstance(angles, (str, bytes)) or not isinstance(angles, Sequence) or not angles:
        raise ValueError(f"angles: expected a non-empty list of angles in degrees, got {_describe(angles)}")
    angles = [_number("angles", a) for a in angles]
    widgets = _widgets_or_none(static)
    if widgets is None:
        return _static_query_figure(k, v, angles)

    from IPython.display import display

    slider = widgets.FloatSlider(value=float(angles[0]), min=0.0, max=360.0, step=5.0,
                                 description="query angle (°)", continuous_update=True,
                                 style={"description_width": "initial"},
                                 layout=widgets.Layout(width="420px"))
    output = widgets.Output()
    box = widgets.VBox([slider, output])
    box.slider, box.output, box.state = slider, output, {}

    def redraw(change=None) -> None:
        fig = plot_query_explorer(slider.value, k, v)
        box.state.clear()
        box.state.update(fig.course_data)
        with output:
            output.clear_output(wait=True)
            display(fig)

    slider.observe(redraw, names="value")
    redraw()
    return box


# --------------------------------------------------------------------------- generation playground

class SampleTable(str):
    """Samples as readable text (shown without quotes in a notebook); ``.rows`` holds the tuples."""

    rows: list[tuple[float, int | None, str]]

    def __repr__(self) -> str:
        return str(self)


def _top_k(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected None (off) or a positive int, got {_describe(value)}")
    return int(value)


def playground_samples(generate_fn: Callable[..., str], prompt: str, settings,
                       max_new_tokens: int = 80) -> list[tuple[float, int | None, str]]:
    """Call ``generate_fn(prompt, temperature, top_k, max_new_tokens)`` once per (temperature, top_k).

    ``settings`` is a list of (temperature, top_k) pairs, top_k None meaning off.
    Returns [(temperature, top_k, text), ...] in the same order.
    """
    if not callable(generate_fn):
        raise TypeError(f"generate_fn: expected a function (prompt, temperature, top_k, max_new_tokens) -> str, "
                        f"got {_describe(generate_fn)}")
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a str, got {_describe(prompt)}")
    check.positive_int("max_new_tokens", max_new_tokens)
    if isinstance(settings, (str, bytes)) or not isinstance(settings, Sequence) or not settings:
        raise ValueError(f"settings: expected a non-empty list of (temperature, top_k) pairs, "
                         f"got {_describe(settings)}")
    checked = []
    for item in settings:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"settings: expected (temperature, top_k) pairs, got an item {_describe(item)}")
        checked.append((_number("settings (temperature)", item[0], minimum=0.0),
                        _top_k("settings (top_k)", item[1])))
    rows = []
    for temperature, top_k in checked:
        text = generate_fn(prompt, temperature, top_k, max_new_tokens)
        if not isinstance(text, str):
            raise TypeError(f"generate_fn: expected it to return a str, got {_describe(text)}")
        rows.append((temperature, top_k, text))
    return rows


def _format_samples(prompt: str, rows: list[tuple[float, int | None, str]]) -> SampleTable:
    lines = [f"prompt: {prompt!r}"]
    for temperature, top_k, text in rows:
        lines.append("")
        lines.append(f"temperature {temperature:g}, top_k {'off' if top_k is None else top_k}"
                     + ("  (greedy)" if temperature == 0 else ""))
        lines.extend("    " + line for line in text.splitlines() or [""])
    table = SampleTable("\n".join(lines))
    table.rows = rows
    return table


def generation_playground(generate_fn: Callable[..., str], prompt: str = "",
                          temperatures: Sequence[float] = (0.0, 0.5, 1.0, 1.5), top_k: int | None = None,
                          max_new_tokens: int = 80, *, static: bool | None = None, max_top_k: int = 100):
    """Prompt box, temperature and top-k sliders and a Generate button around ``generate_fn``.

    ``generate_fn(prompt: str, temperature: float, top_k: int | None, max_new_tokens: int) -> str``.
    Static (``static=True``, COURSE_STATIC_WIDGETS=1, or no ipywidgets): returns a
    ``SampleTable`` (a str) with one sample per temperature in ``temperatures``.
    Otherwise an ipywidgets VBox with attributes ``prompt``, ``temperature``,
    ``top_k`` (0 = off), ``button``, ``output``, ``samples`` (list of
    (temperature, top_k, text)) and ``error`` (the last exception, or None).
    """
    if not callable(generate_fn):
        raise TypeError(f"generate_fn: expected a function (prompt, temperature, top_k, max_new_tokens) -> str, "
                        f"got {_describe(generate_fn)}")
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a str, got {_describe(prompt)}")
    if isinstance(temperatures, (str, bytes)) or not isinstance(temperatures, Sequence) or not temperatures:
        raise ValueError(f"temperatures: expected a non-empty list of numbers >= 0, got {_describe(temperatures)}")
    temperatures = [_number("temperatures", t, minimum=0.0) for t in temperatures]
    top_k = _top_k("top_k", top_k)
    check.positive_int("max_new_tokens", max_new_tokens)
    check.positive_int("max_top_k", max_top_k)
    widgets = _widgets_or_none(static)
    if widgets is None:
        rows = playground_samples(generate_fn, prompt, [(t, top_k) for t in temperatures], max_new_tokens)
        return _format_samples(prompt, rows)

    text = widgets.Text(value=prompt, description="prompt", placeholder="type a prompt",
                        layout=widgets.Layout(width="420px"))
    temperature = widgets.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.05, description="temperature",
                                      style={"description_width": "initial"})
    k_slider = widgets.IntSlider(value=min(top_k or 0, max_top_k), min=0, max=max_top_k,
                                 description="top_k (0 = off)", style={"description_width": "initial"})
    button = widgets.Button(description="Generate", button_style="primary", icon="play")
    output = widgets.Output(layout=widgets.Layout(border=f"1px solid {LIGHT}", padding="4px"))
    box = widgets.VBox([text, widgets.HBox([temperature, k_slider]), button, output])
    box.prompt, box.temperature, box.top_k, box.button, box.output = text, temperature, k_slider, button, output
    box.samples, box.error = [], None

    def on_click(_button=None) -> None:
        button.disabled = True
        try:
            rows = playground_samples(generate_fn, text.value, [(temperature.value, k_slider.value or None)],
                                      max_new_tokens)
            box.samples.extend(rows)
            box.error = None
            with output:
                print(_format_samples(text.value, rows))
                print()
        except Exception as error:   # a widget callback's exception would vanish into the kernel log
            box.error = error
            with output:
                print(f"generate_fn raised {type(error).__name__}: {error}")
        finally:
            button.disabled = False

    button.on_click(on_click)
    return box
