"""The house style and the input checks every picture shares.

One palette, one Figure class that shows itself in Jupyter, the heatmap and
tick-label helpers, rounded boxes and arrows for diagrams, and ``as_array`` /
``token_labels``, which turn what a student passes (tensor, array, nested list,
str) into numpy with a message naming the argument when it cannot.
"""
from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib import figure as mpl_figure
from matplotlib.colors import to_rgb
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from .. import _validate as validate

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


MASKED_SCORES_HINT = "if these are masked scores, plot the weights after the softmax instead"


def as_array(name: str, value: Any, *, ndims: Sequence[int], shape: str, kind: str = "float",
             attention: bool = False) -> np.ndarray:
    """``value`` (tensor, array or nested list) as a numpy array with one of ``ndims`` dimensions.

    kind "float": real, finite numbers (returned as float64); kind "bool": a bool mask. ``attention``: the
    value is attention weights or scores, so a NaN/inf message may say that masked scores hold -inf.
    """
    given = None   # the caller's dtype, for messages (tensors are converted below)
    if isinstance(value, torch.Tensor):
        given = str(value.dtype).replace("torch.", "")
        # no numbers to draw (meta), or a layout numpy cannot take (sparse): named here, not by torch
        if value.is_meta:
            raise ValueError(f"{name}: expected a tensor holding numbers, got a tensor on the meta device "
                             f"(a shape with no data); compute it on 'cpu' or 'cuda'")
        if value.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense tensor, got a {value.layout} tensor; convert it with "
                            f".to_dense()")
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
        raise TypeError(f"{name}: expected a tensor or array of shape {shape}, got {validate.describe(value)}")
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
        raise ValueError(f"{name}: expected finite numbers, got {bad} NaN/inf entries"
                         + (f"; {MASKED_SCORES_HINT}" if attention else ""))
    return arr


def token_labels(tokens: Any, length: int, name: str = "tokens") -> list[str] | None:
    """Check ``tokens`` (a list of str, or a str read as one token per character) has ``length`` items."""
    if tokens is None:
        return None
    if isinstance(tokens, str):
        tokens = list(tokens)
    elif isinstance(tokens, torch.Tensor) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name}: expected a list of {length} str (one per position), got "
                        f"{validate.describe(tokens)}; decode ids first, e.g. [tokenizer.decode([i]) for i in ids]")
    tokens = list(tokens)
    if not all(isinstance(t, str) for t in tokens):
        kinds = sorted({type(t).__name__ for t in tokens if not isinstance(t, str)})
        raise TypeError(f"{name}: expected a list of str, got items of type {', '.join(kinds)}")
    if len(tokens) != length:
        raise ValueError(f"{name}: expected {length} tokens (one per position of the matrix), "
                         f"got {len(tokens)}")
    return [show_token(t) for t in tokens]


def show_token(token: str) -> str:
    """Make spaces and newlines visible: a tick label ' ' would be invisible."""
    shown = token.replace("\n", "\\n").replace("\t", "\\t")
    return shown.replace(" ", "\u2423") if shown.strip() == "" or shown != shown.strip() else shown


def new_figure(width: float, height: float) -> Figure:
    """A course Figure with constrained layout, so labels never overlap."""
    return Figure(figsize=(width, height), layout="constrained")


def tidy(ax, *, grid: bool = False) -> None:
    """The house look for line and bar charts."""
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color(MUTED)
    ax.tick_params(colors=INK, labelsize=9)
    if grid:
        ax.grid(True, color=LIGHT, linewidth=0.8)
        ax.set_axisbelow(True)


def label_ticks(ax, labels: list[str] | None, n: int, axis: str, fontsize: float) -> None:
    """Tick every position; thin out the labels when there are too many to read."""
    step = max(1, math.ceil(n / 40))
    ticks = list(range(0, n, step))
    texts = [labels[i] for i in ticks] if labels is not None else [str(i) for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks, labels=texts, fontsize=fontsize, rotation=90 if crowded(labels, n) else 0)
    else:
        ax.set_yticks(ticks, labels=texts, fontsize=fontsize)


def crowded(labels: list[str] | None, n: int) -> bool:
    """Word-like key labels only fit side by side when there are few of them."""
    return bool(labels) and n > 6 and max(len(t) for t in labels) > 2


MASK_HATCH = "////"   # masked cells: light grey, hatched, and no number: not a weight of 0 but no weight at all


def heatmap(ax, data: np.ndarray, xlabels, ylabels, *, vmin: float, vmax: float, annotate: bool,
             fontsize: float, masked: np.ndarray | None = None):
    """Draw ``data`` as a heatmap; cells where ``masked`` is True are drawn grey and hatched, without a number."""
    if masked is not None and masked.any():
        shown = np.ma.masked_array(data, mask=masked)
        im = ax.imshow(shown, cmap=colormaps[CMAP].with_extremes(bad=MASKED), vmin=vmin, vmax=vmax,
                       interpolation="nearest", aspect="equal")
        for i, j in zip(*np.nonzero(masked)):
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="none", edgecolor=MUTED,
                                   hatch=MASK_HATCH, linewidth=0.0))
    else:
        masked = None
        im = ax.imshow(data, cmap=CMAP, vmin=vmin, vmax=vmax, interpolation="nearest", aspect="equal")
    label_ticks(ax, xlabels, data.shape[1], "x", fontsize)
    label_ticks(ax, ylabels, data.shape[0], "y", fontsize)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if annotate:
        span = vmax - vmin or 1.0
        for (i, j), v in np.ndenumerate(data):
            if masked is not None and masked[i, j]:
                continue
            # viridis is dark at the low end: white text there, dark text on yellow
            colour = "white" if (v - vmin) / span < 0.6 else INK
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=fontsize - 1, color=colour)
    return im


def draw_box(ax, x: float, y: float, w: float, h: float, text: str, *, face: str = "white",
         edge: str = INK, color: str = INK, fontsize: float = 10, weight: str = "normal", lw: float = 1.2):
    """A rounded box centred on (x, y)."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.12",
                                facecolor=face, edgecolor=edge, linewidth=lw))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, color=color, fontweight=weight)


def draw_arrow(ax, start, end, *, color: str = INK, lw: float = 1.3, rad: float = 0.0, style: str = "-|>"):
    """An arrow from ``start`` to ``end`` (curved by ``rad``), stopping just short of both."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color,
                                 linewidth=lw, shrinkA=2, shrinkB=2,
                                 connectionstyle=f"arc3,rad={rad}"))


def blank_canvas(ax, width: float, height: float) -> None:
    """An axes without axes: a width x height drawing area in data units, one unit the same both ways."""
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")


def lighten(colour: str, amount: float = 0.6) -> tuple[float, float, float]:
    """``colour`` mixed with white: 0 leaves it, 1 gives white."""
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)
