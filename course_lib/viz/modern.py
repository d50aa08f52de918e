"""Pictures of notebook 09 (today's attention): RoPE's rotation, scores against the offset,
KV-cache memory per token, and attention masks side by side."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.patches import Circle, Patch

from .. import _validate as validate
from .style import INK, MASKED, MAY_ATTEND, MUTED, PALETTE, Figure, as_array, label_ticks, new_figure, tidy

__all__ = ["plot_rope_rotation", "plot_rope_scores", "plot_kv_cache_per_token", "plot_masks"]


def _labelled(name: str, value: Any, what: str) -> dict[str, Any]:
    """A non-empty mapping of str labels, in the caller's order."""
    if not isinstance(value, Mapping) or not value:
        raise TypeError(f"{name}: expected a non-empty dict of label -> {what}, got {validate.describe(value)}")
    for label in value:
        if not isinstance(label, str):
            raise TypeError(f"{name}: expected str labels, got the label {validate.describe(label)}")
    return dict(value)


def plot_rope_rotation(rotated, pairs: Sequence[int] | None = None) -> Figure:
    """One vector rotated to positions 0, 1, ..., P-1, drawn pair by pair (half-split layout).

    ``rotated`` (P, head_dim) holds the vector at each position (row p = position p), as
    ``apply_rotary`` returns it. Pair ``i`` is dimensions ``(i, i + head_dim/2)``: one panel per pair
    in ``pairs`` (default: the two fastest, one in the middle and the slowest), with an arrow per
    position. The angle each pair turns per token is measured from the rows and put in the title;
    ``fig.course_data`` holds the points and the measured steps.
    """
    r = as_array("rotated", rotated, ndims=(2,), shape="(positions, head_dim)")
    positions, head_dim = r.shape
    if head_dim % 2:
        raise ValueError(f"rotated: expected an even head_dim (RoPE turns pairs of dimensions), got shape {r.shape}")
    if positions < 2:
        raise ValueError(f"rotated: expected at least 2 positions (rows) to show a turn, got shape {r.shape}")
    half = head_dim // 2
    if pairs is None:
        pairs = sorted({0, min(1, half - 1), half // 2, half - 1})
    else:
        pairs = validate.int_list("pairs", pairs, minimum=0, below=half)
    points = np.stack([np.stack([r[:, i], r[:, i + half]], axis=-1) for i in pairs])   # (pairs, P, 2)
    angles = np.arctan2(points[..., 1], points[..., 0])                                # (pairs, P)
    # the turn from one position to the next, wrapped to (-pi, pi], averaged over the steps
    steps = np.angle(np.exp(1j * np.diff(angles, axis=1))).mean(axis=1)               # (pairs,)

    fig = new_figure(2.9 * len(pairs) + 0.6, 3.8)
    axes = fig.subplots(1, len(pairs), squeeze=False).ravel()
    colours = colormaps["viridis"](np.linspace(0.0, 0.9, positions))
    labels: list[list[str]] = []
    for ax, i, pts, step in zip(axes, pairs, points, steps):
        radius = float(np.linalg.norm(pts, axis=-1).max()) or 1.0
        ax.add_patch(Circle((0, 0), radius, fill=False, color=MUTED, linestyle=":", linewidth=1.0))
        for p, (x, y) in enumerate(pts):
            ax.annotate("", xy=(x, y), xytext=(0, 0),
                        arrowprops=dict(arrowstyle="-|>", color=colours[p], linewidth=1.4, shrinkA=0, shrinkB=0))
        panel_labels = []
        for first, last in _label_runs(1.16 * pts, 0.3 * radius):
            x, y = 1.16 * pts[first:last + 1].mean(axis=0)
            text = str(first) if first == last else f"{first}-{last}"
            ax.text(x, y, text, ha="center", va="center", fontsize=8, color=colours[last])
            panel_labels.append(text)
        labels.append(panel_labels)
        limit = 1.35 * radius
        ax.set_xlim(-limit, limit)
        ax.set_ylim(-limit, limit)
        ax.set_aspect("equal")
        ax.axhline(0, color=MUTED, linewidth=0.5)
        ax.axvline(0, color=MUTED, linewidth=0.5)
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(f"pair {i}: dims {i} and {i + half}\n{step:.3g} rad per token", fontsize=10)
        ax.set_xlabel(f"dim {i}", fontsize=9, color=MUTED)
        ax.set_ylabel(f"dim {i + half}", fontsize=9, color=MUTED)
    fig.suptitle(f"one vector at positions 0-{positions - 1} (numbers: the position)", fontsize=11)
    fig.course_data = {"pairs": list(pairs), "points": points, "step": steps.tolist(), "labels": labels}
    return fig


def _label_runs(anchors: np.ndarray, gap: float) -> list[tuple[int, int]]:
    """Runs of consecutive positions whose labels would sit on top of each other (closer than ``gap``
    to the run's first): a slow pair gets one label "0-7" instead of eight numbers in one blob."""
    runs: list[tuple[int, int]] = []
    first = 0
    for p in range(1, len(anchors) + 1):
        if p == len(anchors) or np.linalg.norm(anchors[p] - anchors[first]) >= gap:
            runs.append((first, p - 1))
            first = p
    return runs


def plot_rope_scores(scores, curves: Mapping[str, Any] | None = None, title: str | None = None) -> Figure:
    """Left: ``scores`` (M, N), the score of a query at position m and a key at position n, as a heat map.
    Right (with ``curves``, a dict label -> 1-D values): each curve against the offset 0, 1, 2, ...

    With RoPE the heat map is constant along every diagonal: the score depends only on m - n.
    """
    s = as_array("scores", scores, ndims=(2,), shape="(query positions, key positions)", attention=True)
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a str or None, got {validate.describe(title)}")
    lines = {}
    if curves is not None:
        for label, values in _labelled("curves", curves, "1-D values, one per offset").items():
            lines[label] = as_array(f"curves[{label!r}]", values, ndims=(1,), shape="(offsets,)")

    fig = new_figure(10.5 if lines else 5.2, 4.2)
    axes = fig.subplots(1, 2 if lines else 1, squeeze=False, width_ratios=[1, 1.2] if lines else None).ravel()
    ax = axes[0]
    limit = max(float(np.abs(s).max()), 1e-12)
    im = ax.imshow(s, cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
    # a tick every few positions: a label on each of 24 columns would run together
    ax.set_xticks(range(0, s.shape[1], max(1, math.ceil(s.shape[1] / 12))))
    ax.set_yticks(range(0, s.shape[0], max(1, math.ceil(s.shape[0] / 12))))
    ax.tick_params(length=0, labelsize=8)
    ax.set_xlabel("key position n", fontsize=10)
    ax.set_ylabel("query position m", fontsize=10)
    ax.set_title(title or "score of the query at m and the key at n", fontsize=11)
    cbar = fig.colorbar(im, ax=ax, shrink=0.8)
    cbar.outline.set_visible(False)
    cbar.ax.tick_params(labelsize=8)
    if lines:
        ax_lines = axes[1]
        for k, (label, values) in enumerate(lines.items()):
            ax_lines.plot(np.arange(len(values)), values, color=PALETTE[k % len(PALETTE)], linewidth=1.6,
                          label=label)
        ax_lines.axhline(0, color=MUTED, linewidth=0.6)
        tidy(ax_lines, grid=True)
        ax_lines.set_xlabel("offset m - n (tokens)", fontsize=10)
        ax_lines.set_ylabel("score", fontsize=10)
        ax_lines.set_title("the score against the offset", fontsize=11)
        # under the axes: inside, the legend would cover the curves that cross the whole panel
        ax_lines.legend(frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.course_data = {"scores": s, "curves": lines}
    return fig


def _bytes(n: float) -> str:
    for unit, size in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:,.0f} B"


def plot_kv_cache_per_token(measured: Mapping[str, float], formula: Mapping[str, float] | None = None,
                            title: str | None = None) -> Figure:
    """Bars: KV-cache bytes per token, one per attention kind (``measured``, label -> bytes).

    ``formula`` (the same labels) adds a marker per bar for the value the formula predicts.
    """
    bars = _labelled("measured", measured, "bytes per token (a number)")
    for label, value in bars.items():
        bars[label] = validate.finite_number(f"measured[{label!r}]", value, minimum=0)
    marks = None
    if formula is not None:
        marks = _labelled("formula", formula, "bytes per token (a number)")
        if set(marks) != set(bars):
            raise ValueError(f"formula: expected the same labels as measured, {list(bars)}, got {list(marks)}")
        marks = {label: validate.finite_number(f"formula[{label!r}]", marks[label], minimum=0) for label in bars}
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a str or None, got {validate.describe(title)}")

    fig = new_figure(1.6 * len(bars) + 3.2, 3.8)
    ax = fig.add_subplot()
    x = np.arange(len(bars))
    heights = list(bars.values())
    drawn = ax.bar(x, heights, color=[PALETTE[k % len(PALETTE)] for k in range(len(bars))], width=0.6,
                   label="measured in the cache")
    ax.bar_label(drawn, labels=[_bytes(h) for h in heights], padding=6, fontsize=9, color=INK)
    if marks is not None:
        ax.plot(x, list(marks.values()), linestyle="none", marker="_", markersize=30, markeredgewidth=2,
                color=INK, label="formula")
        ax.legend(frameon=False, fontsize=9, loc="upper right")
    ax.set_xticks(x, labels=list(bars), fontsize=9)
    ax.set_ylabel("KV-cache bytes per token", fontsize=10)
    ax.set_ylim(0, 1.2 * max(max(heights), max(marks.values()) if marks else 0, 1))
    ax.set_title(title or "KV-cache memory per token", fontsize=11)
    tidy(ax, grid=True)
    ax.grid(axis="x", visible=False)
    fig.course_data = {"measured": bars, "formula": marks}
    return fig


def plot_masks(masks: Mapping[str, Any]) -> Figure:
    """Bool attention masks (True = may attend), side by side, one panel per label.

    Queries in rows, keys in columns, as in ``plot_causal_mask``.
    """
    shown = {label: as_array(f"masks[{label!r}]", m, ndims=(2,), shape="(Lq, Lk)", kind="bool")
             for label, m in _labelled("masks", masks, "a bool (Lq, Lk) mask").items()}
    size = max(max(m.shape) for m in shown.values())
    side = min(4.5, 1.4 + 0.22 * size)
    fig = new_figure(side * len(shown) + 0.4, side + 0.9)
    axes = fig.subplots(1, len(shown), squeeze=False).ravel()
    for ax, (label, m) in zip(axes, shown.items()):
        lq, lk = m.shape
        ax.imshow(m.astype(int), cmap=ListedColormap([MASKED, MAY_ATTEND]), vmin=0, vmax=1,
                  interpolation="nearest")
        label_ticks(ax, None, lk, "x", 8)
        label_ticks(ax, None, lq, "y", 8)
        ax.xaxis.tick_top()
        ax.xaxis.set_label_position("top")
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_xticks(np.arange(-0.5, lk, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, lq, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=1.2 if size <= 24 else 0.4)
        ax.tick_params(which="minor", length=0)
        ax.set_xlabel("key position", fontsize=9)
        ax.set_ylabel("query position", fontsize=9)
        ax.set_title(f"{label}\n{int(m.sum(axis=1).max())} keys at most per query", fontsize=10)
    fig.legend(handles=[Patch(facecolor=MAY_ATTEND, label="may attend (True)"),
                        Patch(facecolor=MASKED, edgecolor=MUTED, label="masked")],
               loc="lower center", ncol=2, frameon=False, fontsize=9)
    fig.get_layout_engine().set(rect=(0, 0.07, 1, 0.93))
    fig.course_data = {"masks": shown, "keys_per_query": {k: m.sum(axis=1).tolist() for k, m in shown.items()}}
    return fig

