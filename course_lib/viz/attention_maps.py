"""Attention pictures: weight heatmaps (one head or a grid of heads), the causal mask,
position tables, and why the scores are divided by sqrt(d)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from .. import _validate as validate
from .style import (
    ACCENT,
    ANNOTATE_MAX_TOKENS,
    MASK_HATCH,
    MASKED,
    MAY_ATTEND,
    MUTED,
    PALETTE,
    Figure,
    as_array,
    heatmap,
    label_ticks,
    new_figure,
    tidy,
    token_labels,
)

__all__ = ["plot_attention", "plot_attention_heads", "plot_causal_mask", "plot_positional_encoding",
           "plot_softmax_saturation"]


def _masked_cells(w: np.ndarray, mask) -> np.ndarray | None:
    """Cells (..., Lq, Lk) that may not be attended to, or None.

    ``mask`` (Lq, Lk), True = may attend, says so explicitly. Without it, a causal pattern is recognised:
    when every weight above the (bottom-aligned) diagonal is exactly 0, as a softmax over -inf gives,
    those cells are masked. Weights that merely happen to be small are never taken for masked.
    """
    lq, lk = w.shape[-2:]
    if mask is not None:
        allowed = as_array("mask", mask, ndims=(2,), shape="(Lq, Lk)", kind="bool")
        if allowed.shape != (lq, lk):
            raise ValueError(f"mask: expected shape {(lq, lk)} like the weights, got {allowed.shape}")
        return np.broadcast_to(~allowed, w.shape)
    future = np.triu(np.ones((lq, lk), dtype=bool), k=lk - lq + 1)
    if not future.any() or np.any(w[..., future] != 0):
        return None
    return np.broadcast_to(future, w.shape)


def _masked_legend(fig_or_ax, **where) -> None:
    fig_or_ax.legend(handles=[Patch(facecolor=MASKED, edgecolor=MUTED, hatch=MASK_HATCH,
                                    label="masked: weight exactly 0 (hatched, not coloured)")],
                     fontsize=8, frameon=False, **where)


def plot_attention(weights, tokens=None, title: str | None = None, ax=None, mask=None) -> Figure:
    """Heatmap of one attention matrix (Lq, Lk): queries are rows, keys are columns.

    Masked cells (future positions) are drawn grey and hatched, not in the colour of a 0 weight: give
    ``mask`` (Lq, Lk, True = may attend), or let a causal pattern of exact zeros be recognised.

    ``tokens`` labels the keys (a list of Lk str; a str is read one character per
    token). When Lq < Lk (queries of the newest tokens only, as with a KV cache)
    the rows get the last Lq tokens. Values are written in the cells for up to
    12 tokens. Draws into ``ax`` when given; returns the Figure.
    """
    w = as_array("weights", weights, ndims=(2,), shape="(Lq, Lk)", attention=True)
    lq, lk = w.shape
    if lq > lk:
        raise ValueError(f"weights: expected at most as many queries as keys (Lq <= Lk), got shape {w.shape}")
    labels = token_labels(tokens, lk)
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a str or None, got {validate.describe(title)}")
    if ax is None:
        side = min(9.0, 2.2 + 0.45 * max(lq, lk))
        fig = new_figure(side + 1.2, side)
        ax = fig.add_subplot()
    elif not hasattr(ax, "imshow") or ax.figure is None:
        raise TypeError(f"ax: expected a matplotlib Axes or None, got {validate.describe(ax)}")
    fig = ax.figure
    fontsize = 10 if max(lq, lk) <= 16 else 8
    vmin, vmax = min(0.0, float(w.min())), max(float(w.max()), 1e-12)
    masked = _masked_cells(w, mask)
    im = heatmap(ax, w, labels, labels[lk - lq:] if labels else None, vmin=vmin, vmax=vmax,
                  annotate=max(lq, lk) <= ANNOTATE_MAX_TOKENS, fontsize=fontsize, masked=masked)
    if masked is not None:
        _masked_legend(ax, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncols=1)
    ax.set_xlabel("key (attended to)", fontsize=10)
    ax.set_ylabel("query (attending)", fontsize=10)
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    ax.set_title(title or "attention weights (each row sums to 1)", fontsize=11, pad=8)
    cbar = fig.colorbar(im, ax=ax, shrink=0.8)
    cbar.ax.tick_params(labelsize=8)
    cbar.outline.set_visible(False)
    return fig


def plot_attention_heads(weights, tokens=None, layer: int | None = None, mask=None) -> Figure:
    """One heatmap per head: weights (heads, L, L) or (layers, heads, L, L).

    Masked cells are drawn grey and hatched, as in ``plot_attention`` (``mask``: (L, L), True = may attend).

    For 4-D weights ``layer=None`` draws every layer (one row each) and ``layer=i``
    only row i. For 3-D weights ``layer`` only names the layer in the titles.
    Panels share one colour scale, so heads can be compared by colour.
    """
    if isinstance(weights, torch.Tensor) and weights.dim() == 5:
        raise ValueError(f"weights: expected (heads, L, L) or (layers, heads, L, L), got shape "
                         f"{tuple(weights.shape)}; for GPT.attention_maps output (layers, N, heads, L, L) "
                         f"pick one sequence, e.g. maps[:, 0]")
    w = as_array("weights", weights, ndims=(3, 4), shape="(heads, L, L) or (layers, heads, L, L)",
                 attention=True)
    if layer is not None:
        validate.non_negative_int("layer", layer)
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
    labels = token_labels(tokens, lk)

    panels = [(i, h) for i in range(layers) for h in range(heads)]
    # one row per layer; with one head per layer, the layers side by side
    cols = heads if layers > 1 and heads > 1 else min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    size = 2.6 if max(lq, lk) <= 16 else 3.2
    fig = new_figure(size * cols + 1.0, size * rows + 0.4)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    vmax = max(float(w.max()), 1e-12)
    vmin = min(0.0, float(w.min()))
    fontsize = 8 if max(lq, lk) <= 16 else 6
    masked = _masked_cells(w, mask)
    im = None
    for k, ax in enumerate(axes):
        if k >= len(panels):
            ax.remove()
            continue
        i, h = panels[k]
        im = heatmap(ax, w[i, h], labels, labels[lk - lq:] if labels else None, vmin=vmin, vmax=vmax,
                      annotate=False, fontsize=fontsize, masked=None if masked is None else masked[i, h])
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
    if masked is not None:
        _masked_legend(fig, loc="lower right")
    return fig


def plot_causal_mask(mask, tokens=None) -> Figure:
    """The bool mask (True = may attend) as a two-colour grid with a legend."""
    m = as_array("mask", mask, ndims=(2,), shape="(Lq, Lk)", kind="bool")
    lq, lk = m.shape
    labels = token_labels(tokens, lk)
    side = min(8.0, 2.0 + 0.4 * max(lq, lk))
    fig = new_figure(side + 0.6, side + 0.6)
    ax = fig.add_subplot()
    ax.imshow(m.astype(int), cmap=ListedColormap([MASKED, MAY_ATTEND]), vmin=0, vmax=1,
              interpolation="nearest")
    fontsize = 10 if max(lq, lk) <= 16 else 8
    label_ticks(ax, labels, lk, "x", fontsize)
    label_ticks(ax, labels[lk - lq:] if labels else None, lq, "y", fontsize)
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
    t = as_array("table", table, ndims=(2,), shape="(max_tokens, embed_dim)")
    positions, embed_dim = t.shape
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a str or None, got {validate.describe(title)}")
    if dims is None:
        dims = sorted({0, min(1, embed_dim - 1), 2 * (embed_dim // 8), 2 * (embed_dim // 4)} & set(range(embed_dim)))
    else:
        dims = validate.int_list("dims", dims, minimum=0, below=embed_dim)
    fig = new_figure(10, 6)
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
    tidy(ax_lines, grid=True)
    ax_lines.set_xlabel("position in the sequence", fontsize=10)
    ax_lines.set_ylabel("value", fontsize=10)
    ax_lines.legend(fontsize=8, frameon=False, ncol=len(dims), loc="upper left", bbox_to_anchor=(0, 1.25))
    ax_lines.set_xlim(-0.5, positions - 0.5)
    return fig


def plot_softmax_saturation(dims: Sequence[int] = (4, 16, 64, 256, 1024), samples: int = 2000,
                            seed: int = 0, num_keys: int = 16) -> Figure:
    """Why attention divides by sqrt(d): q.k of random unit-variance vectors has variance d.

    Left: the variance of the scores with and without the 1/sqrt(d) scale.
    Right: the mean largest softmax weight over ``num_keys`` keys; without the
    scale it creeps to 1 (the softmax saturates to one-hot and its gradients
    vanish). The numbers are in ``fig.course_data``.
    """
    validate.int_list("dims", dims)
    validate.positive_int("samples", samples)
    validate.positive_int("num_keys", num_keys)
    if num_keys < 2:
        raise ValueError(f"num_keys: expected at least 2 keys to share the weight, got {num_keys}")
    validate.non_negative_int("seed", seed)   # numpy's generators take no negative seeds
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

    fig = new_figure(10, 4)
    ax_var, ax_max = fig.subplots(1, 2)
    ax_var.plot(dims, data["variance_unscaled"], "o-", color=ACCENT, label="q·k (no scaling)")
    ax_var.plot(dims, data["variance_scaled"], "o-", color=PALETTE[0], label="q·k / sqrt(d)")
    ax_var.plot(dims, dims, ":", color=MUTED, label="d")
    ax_var.set_xscale("log", base=2)
    ax_var.set_yscale("log")
    ax_var.set_xlabel("dimension d of q and k", fontsize=10)
    ax_var.set_ylabel("variance of the scores", fontsize=10)
    ax_var.set_title("score variance grows like d", fontsize=11)
    ax_max.plot(dims, data["max_weight_unscaled"], "o-", color=ACCENT, label="no scaling")
    ax_max.plot(dims, data["max_weight_scaled"], "o-", color=PALETTE[0], label="scaled by 1/sqrt(d)")
    ax_max.axhline(1 / num_keys, linestyle=":", color=MUTED, label=f"uniform (1/{num_keys})")
    ax_max.set_xscale("log", base=2)
    ax_max.set_ylim(0, 1.05)
    ax_max.set_xlabel("dimension d of q and k", fontsize=10)
    ax_max.set_ylabel(f"largest softmax weight (of {num_keys})", fontsize=10)
    ax_max.set_title("without scaling the softmax saturates", fontsize=11)
    for ax in (ax_var, ax_max):
        tidy(ax, grid=True)
        ax.legend(frameon=False, fontsize=9)
    fig.course_data = data
    return fig
