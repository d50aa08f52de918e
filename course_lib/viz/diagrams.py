"""Diagrams: how a Markov chain, an RNN and attention look back; how heads split the features;
how data-parallel ranks share their gradients."""
from __future__ import annotations

import torch
from matplotlib.patches import FancyBboxPatch

from .. import _validate as validate
from ..attention import split_heads
from .style import (
    ACCENT,
    INK,
    LIGHT,
    MUTED,
    PALETTE,
    REDUCE,
    Figure,
    blank_canvas,
    draw_arrow,
    draw_box,
    lighten,
    new_figure,
)

__all__ = ["ARCHITECTURES", "plot_architecture_diagram", "plot_why_attention", "plot_heads_split",
           "plot_ddp_allreduce"]

ARCHITECTURES = ("markov", "rnn", "attention")

# The sentence each architecture reads, and the attention weights drawn on its arrows.
_SENTENCE = ["the", "cat", "sat", "on", "the"]
_ATTENTION_EXAMPLE = [0.08, 0.42, 0.12, 0.30, 0.08]
_TITLES = {"markov": "Markov chain", "rnn": "Recurrent network (RNN)", "attention": "Attention"}
_CAPTIONS = {
    "markov": "Markov chain: the next token depends\non the last one (or last n) only",
    "rnn": "RNN: the past is squeezed into one hidden\nstate, passed along one step at a time",
    "attention": "Attention: every earlier token is one step\naway, weighted by how well it matches",
}
# Three rows, bottom to top: the tokens, what the model keeps of them, the prediction.
_XS = [1.0 + 2.0 * i for i in range(len(_SENTENCE))]
_Y_TOKENS, _Y_MIDDLE, _Y_NEXT = 1.2, 3.3, 5.3


def _markov_middle(ax) -> None:
    last = _XS[-1]
    draw_box(ax, last, _Y_MIDDLE, 2.6, 0.95, "P(next | 'the')\nlook-up table", face=lighten(PALETTE[0], 0.8),
             edge=PALETTE[0], fontsize=9)
    draw_arrow(ax, (last, _Y_TOKENS + 0.4), (last, _Y_MIDDLE - 0.5))
    draw_arrow(ax, (last, _Y_MIDDLE + 0.5), (last, _Y_NEXT - 0.4))
    ax.text((_XS[0] + _XS[-2]) / 2, _Y_TOKENS + 0.7, "forgotten: only the last token counts",
            ha="center", fontsize=9, color=MUTED, style="italic")


def _rnn_middle(ax) -> None:
    for i, x in enumerate(_XS):
        draw_box(ax, x, _Y_MIDDLE, 1.1, 0.75, f"h{i + 1}", face=lighten(PALETTE[2], 0.75), edge=PALETTE[2])
        draw_arrow(ax, (x, _Y_TOKENS + 0.4), (x, _Y_MIDDLE - 0.4))
        if i:   # the hidden state passed along
            draw_arrow(ax, (_XS[i - 1] + 0.55, _Y_MIDDLE), (x - 0.55, _Y_MIDDLE), color=PALETTE[2], lw=1.6)
    draw_arrow(ax, (_XS[-1], _Y_MIDDLE + 0.4), (_XS[-1], _Y_NEXT - 0.4))


def _attention_middle(ax) -> None:
    last = _XS[-1]
    draw_box(ax, last - 0.3, _Y_MIDDLE, 2.6, 0.95, "weighted sum\nof the values", face=lighten(PALETTE[0], 0.8),
             edge=PALETTE[0], fontsize=9)
    for i, (x, weight) in enumerate(zip(_XS, _ATTENTION_EXAMPLE)):
        # arrows land spread along the bottom of the box, so each stays visible; thicker = more weight
        end = (last - 1.3 + 2.0 * i / (len(_XS) - 1), _Y_MIDDLE - 0.5)
        draw_arrow(ax, (x, _Y_TOKENS + 0.4), end, color=PALETTE[0], lw=0.8 + 9 * weight)
        ax.text(x, _Y_TOKENS - 0.6, f"w = {weight:.2f}", ha="center", va="center", fontsize=8.5,
                color=PALETTE[0])
    draw_arrow(ax, (last, _Y_MIDDLE + 0.5), (last, _Y_NEXT - 0.4))


_MIDDLES = {"markov": _markov_middle, "rnn": _rnn_middle, "attention": _attention_middle}


def _draw_architecture(ax, kind: str) -> None:
    blank_canvas(ax, 10.6, 6.0)
    for i, (x, word) in enumerate(zip(_XS, _SENTENCE)):
        forgotten = kind == "markov" and i < len(_XS) - 1
        draw_box(ax, x, _Y_TOKENS, 1.5, 0.75, word, face=LIGHT if forgotten else "white",
                 edge=MUTED if forgotten else INK, color=MUTED if forgotten else INK)
    draw_box(ax, _XS[-1], _Y_NEXT, 2.0, 0.75, "next: mat?", face=lighten(ACCENT, 0.75), edge=ACCENT, color=INK,
             weight="bold")
    _MIDDLES[kind](ax)
    ax.text(5.3, -0.1, _CAPTIONS[kind], ha="center", va="top", fontsize=9.5, color=INK)
    ax.set_ylim(-1.1, 5.9)


def plot_architecture_diagram(kind: str) -> Figure:
    """How a Markov chain, an RNN or attention ("markov", "rnn", "attention") looks back at earlier tokens."""
    validate.one_of("kind", kind, ARCHITECTURES)
    fig = new_figure(5.2, 4.2)
    ax = fig.add_subplot()
    _draw_architecture(ax, kind)
    ax.set_title(_TITLES[kind], fontsize=12, fontweight="bold")
    return fig


def plot_why_attention() -> Figure:
    """The three ways of looking back, side by side (notebook 01)."""
    fig = new_figure(15, 4.4)
    for ax, kind in zip(fig.subplots(1, 3), ARCHITECTURES):
        _draw_architecture(ax, kind)
        ax.set_title(_TITLES[kind], fontsize=12, fontweight="bold")
    return fig


def plot_heads_split(embed_dim: int = 8, num_heads: int = 2, length: int = 4) -> Figure:
    """How (N, L, E) becomes (N, heads, L, head_dim): view, then transpose (N = 1 drawn).

    Cells show the feature index and are coloured by the head that gets them. The
    right-hand stage is drawn from ``split_heads`` itself; its layout is in
    ``fig.course_data["split"]`` (heads, L, head_dim) of feature indices.
    """
    validate.positive_int("embed_dim", embed_dim)
    validate.positive_int("num_heads", num_heads)
    validate.positive_int("length", length)
    if embed_dim % num_heads:
        raise ValueError(f"num_heads: embed_dim={embed_dim} must be divisible by num_heads, got {num_heads}")
    if embed_dim > 24 or length > 12:
        raise ValueError(f"embed_dim, length: expected embed_dim <= 24 and length <= 12 so the cells stay "
                         f"readable, got embed_dim={embed_dim}, length={length}")
    head_dim = embed_dim // num_heads
    cell, gap = 0.5, 0.35
    colours = [lighten(PALETTE[h % len(PALETTE)], 0.55) for h in range(num_heads)]

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
    fig = new_figure(fig_w, fig_w * canvas_h / width + 0.3)
    ax = fig.add_subplot()
    blank_canvas(ax, width, canvas_h)
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
        draw_arrow(ax, (xa + 0.25, mid), (xa + arrow_w - 0.45, mid), lw=1.6)
        ax.text(xa + arrow_w / 2 - 0.1, mid + 0.18, label, ha="center", va="bottom", fontsize=8, family="monospace")
    ax.text(width / 2, 0.0, f"each head sees every position, but only its own {head_dim} of the "
            f"{embed_dim} features", ha="center", va="top", fontsize=9, color=INK)
    ax.set_ylim(-0.5, canvas_h - 0.5)
    fig.course_data = {"split": split}
    return fig


def plot_ddp_allreduce(num_ranks: int = 2) -> Figure:
    """Data-parallel training: own batch per rank -> own gradients -> all-reduce average -> same step."""
    validate.positive_int("num_ranks", num_ranks)
    if num_ranks > 8:
        raise ValueError(f"num_ranks: expected at most 8 ranks for a readable drawing, got {num_ranks}")
    row = 1.3
    height = num_ranks * row
    reduce_x, reduce_w = 8.0, 1.9
    fig = new_figure(13, 1.0 + 1.0 * height + 0.9)
    ax = fig.add_subplot()
    blank_canvas(ax, 13.8, height + 1.6)
    for r in range(num_ranks):
        y = 0.6 + (num_ranks - 1 - r + 0.5) * row
        colour = PALETTE[r % len(PALETTE)]
        own, shared = dict(face=lighten(colour, 0.7), edge=colour), dict(face=lighten(REDUCE, 0.75), edge=REDUCE)
        ax.text(0.05, y, f"rank {r}", ha="left", va="center", fontsize=9, color=colour, fontweight="bold",
                rotation=90)
        # One row of boxes, left to right: (centre x, width, text, fontsize, colours). The all-reduce
        # box (text None) spans every row, so it is drawn once, after the rows.
        boxes = [(1.0, 1.5, f"batch {r}", 9, own), (3.3, 1.8, "model copy\nforward+backward", 8, {}),
                 (5.6, 1.3, f"grads g{r}", 9, own), (reduce_x, reduce_w, None, 0, {}),
                 (10.4, 1.7, "optimizer.step()\nwith the mean g", 8, {}), (12.7, 1.4, "same new\nweights", 8, shared)]
        for x, w, text, fontsize, colours in boxes:
            if text is not None:
                draw_box(ax, x, y, w, 0.8, text, fontsize=fontsize, **colours)
        # arrows join neighbouring boxes edge to edge; gradients go in in the rank's colour, come out shared
        for (x0, w0, *_), (x1, w1, *_), arrow_colour in zip(boxes, boxes[1:], (INK, INK, colour, REDUCE, INK)):
            draw_arrow(ax, (x0 + w0 / 2, y), (x1 - w1 / 2, y), color=arrow_colour)
    grads = ", ".join(f"g{r}" for r in range(num_ranks)) if num_ranks <= 3 else f"g0, ..., g{num_ranks - 1}"
    draw_box(ax, reduce_x, 0.6 + height / 2, reduce_w, height - 0.3, "all-reduce\n\ng = mean of\n" + grads,
             face=lighten(REDUCE, 0.8), edge=REDUCE, fontsize=8.5)
    ax.text(6.9, height + 1.1, f"data-parallel training: one step on {num_ranks} "
            f"{'rank' if num_ranks == 1 else 'ranks'}", ha="center", fontsize=11, fontweight="bold")
    ax.text(6.9, 0.2, "different data on each rank, averaged gradients, so every copy of the model stays identical",
            ha="center", fontsize=9, color=INK)
    return fig
