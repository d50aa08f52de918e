"""Widgets with their static fallbacks: the query explorer (notebook 01) and the generation
playground (notebook 05).

Each widget is a thin shell around plain functions (``query_explorer_state``,
``plot_query_explorer``, ``playground_samples``) that the tests call directly. The
static fallback is used when ``static=True`` is passed, when ipywidgets cannot be
imported, or when ``COURSE_STATIC_WIDGETS=1`` is set (the nbval runs set it so that
committed notebook outputs stay stable).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from matplotlib.patches import Circle

from .. import _validate as validate
from ..attention import TOY_KEYS, TOY_VALUES, toy_attention
from .style import ACCENT, LIGHT, MUTED, PALETTE, Figure, as_array, draw_arrow, new_figure, tidy

__all__ = ["use_static_widgets", "query_explorer_state", "plot_query_explorer", "query_explorer",
           "playground_samples", "generation_playground", "SampleTable"]


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
    else:   # "yes" or 1 are truthy stand-ins, never meant as the choice
        validate.boolean("static", static)
    if static:
        return None
    try:
        import ipywidgets
    except ImportError:
        return None
    return ipywidgets


# ---------------------------------------------------------------------- query explorer

LARGEST_TOY_NUMBER = 1e6


def _toy_inputs(keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    keys = TOY_KEYS if keys is None else keys
    values = TOY_VALUES if values is None else values
    k = torch.as_tensor(as_array("keys", keys, ndims=(2,), shape="(n, 2): one 2-D key per row"))
    if k.shape[1] != 2:
        raise ValueError(f"keys: expected shape (n, 2) (the explorer's query is 2-D), got {tuple(k.shape)}")
    v = torch.as_tensor(as_array("values", values, ndims=(1, 2), shape=f"({k.shape[0]},) or ({k.shape[0]}, dv)"))
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"values: expected one value per key ({k.shape[0]} rows), got shape {tuple(v.shape)}")
    for name, given in (("keys", k), ("values", v)):   # drawn in float32: 1e30 squared is inf, and no axis fits it
        largest = float(given.abs().max())
        validate.expect(largest <= LARGEST_TOY_NUMBER, name, f"numbers of size at most {LARGEST_TOY_NUMBER:g} "
                        f"(the explorer draws them to scale)", f"one of size {largest:g}")
    return k.float(), v.float()


def query_explorer_state(angle_degrees: float, keys=None, values=None) -> dict[str, torch.Tensor]:
    """Toy attention for the unit query at ``angle_degrees``: dict(query, scores, weights, result).

    Computed by ``toy_attention`` (plain dot product, no scaling);
    keys default to TOY_KEYS and values to TOY_VALUES.
    """
    angle = validate.finite_number("angle_degrees", angle_degrees)
    k, v = _toy_inputs(keys, values)
    radians = math.radians(angle)
    query = torch.tensor([math.cos(radians), math.sin(radians)])   # (2,)  unit length
    # With one-hot values (the rows of the identity) toy_attention returns the weights themselves.
    weights = toy_attention(query, k, torch.eye(len(k)))           # (n,)
    return {"query": query, "scores": k @ query, "weights": weights, "result": toy_attention(query, k, v)}


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
        draw_arrow(ax_circle, (0, 0), tuple(key.tolist()), color=colour, lw=1.8)
        label = f"k{i}" if compact else f"k{i} (v={_value_label(values[i])})"
        _outward_label(ax_circle, key, label, colour, 8 if compact else 9)
    q = state["query"]
    draw_arrow(ax_circle, (0, 0), tuple(q.tolist()), color=ACCENT, lw=2.6)
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
    tidy(ax_bars)
    ax_bars.set_title(f"result = {_format_result(state['result'])}", fontsize=10)
    return state


def plot_query_explorer(angle_degrees: float, keys=None, values=None) -> Figure:
    """Left: keys and the query on the unit circle; right: the attention weights and the result."""
    angle = validate.finite_number("angle_degrees", angle_degrees)
    k, v = _toy_inputs(keys, values)
    fig = new_figure(8.5, 3.8)
    ax_circle, ax_bars = fig.subplots(1, 2, width_ratios=[1, 1.1])
    state = _draw_query(ax_circle, ax_bars, angle, k, v)
    ax_bars.set_title(f"weights = softmax(K q);  result = Σ wᵢ vᵢ = {_format_result(state['result'])}",
                      fontsize=10)
    fig.course_data = state
    return fig


def _static_query_figure(keys: torch.Tensor, values: torch.Tensor, angles: Sequence[float]) -> Figure:
    fig = new_figure(2.6 * len(angles) + 0.4, 5.2)
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
        raise ValueError(f"angles: expected a non-empty list of angles in degrees, got {validate.describe(angles)}")
    angles = [validate.finite_number("angles", a) for a in angles]
    widgets = _widgets_or_none(static)
    if widgets is None:
        return _static_query_figure(k, v, angles)

    from IPython.display import display

    # whole degrees in the readout ("190", not "190.00"): the slider moves in steps of 5°
    slider = widgets.FloatSlider(value=float(angles[0]), min=0.0, max=360.0, step=5.0, readout_format=".0f",
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
    # A saved notebook keeps this line but not the slider (a widget lives in the kernel): reopened,
    # JupyterLab shows "Error displaying widget: model not found" in its place.
    display(widgets_note())
    return box


def widgets_note():
    """The one line printed above a live widget: what to do when the notebook is reopened."""
    from IPython.display import Markdown
    return Markdown(f"*{REOPENED_NOTE}*")


REOPENED_NOTE = ("A live widget below: if this notebook was reopened and it shows \"Error displaying widget\" "
                 "instead, run this cell again (a widget lives in the running kernel, not in the saved file).")


# ---------------------------------------------------------------------- generation playground

class SampleTable(str):
    """Samples as readable text (shown without quotes in a notebook); ``.rows`` holds the tuples."""

    rows: list[tuple[float, int | None, str]]

    def __repr__(self) -> str:
        return str(self)


GENERATE_FN_SIGNATURE = "(prompt, temperature, top_k, max_new_tokens) -> str"


def playground_samples(generate_fn: Callable[..., str], prompt: str, settings,
                       max_new_tokens: int = 80) -> list[tuple[float, int | None, str]]:
    """Call ``generate_fn(prompt, temperature, top_k, max_new_tokens)`` once per (temperature, top_k).

    ``settings`` is a list of (temperature, top_k) pairs, top_k None meaning off.
    Returns [(temperature, top_k, text), ...] in the same order.
    """
    validate.callable_taking("generate_fn", generate_fn, 4, GENERATE_FN_SIGNATURE)
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a str, got {validate.describe(prompt)}")
    validate.positive_int("max_new_tokens", max_new_tokens)
    if isinstance(settings, (str, bytes)) or not isinstance(settings, Sequence) or not settings:
        raise ValueError(f"settings: expected a non-empty list of (temperature, top_k) pairs, "
                         f"got {validate.describe(settings)}")
    checked = []
    for item in settings:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"settings: expected (temperature, top_k) pairs, got an item {validate.describe(item)}")
        checked.append((validate.finite_number("settings (temperature)", item[0], minimum=0.0),
                        validate.positive_int_or_none("settings (top_k)", item[1])))
    rows = []
    for temperature, top_k in checked:
        text = generate_fn(prompt, temperature, top_k, max_new_tokens)
        if not isinstance(text, str):
            raise TypeError(f"generate_fn: expected it to return a str, got {validate.describe(text)}")
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
    validate.callable_taking("generate_fn", generate_fn, 4, GENERATE_FN_SIGNATURE)
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a str, got {validate.describe(prompt)}")
    if isinstance(temperatures, (str, bytes)) or not isinstance(temperatures, Sequence) or not temperatures:
        raise ValueError(f"temperatures: expected a non-empty list of numbers >= 0, got {validate.describe(temperatures)}")
    temperatures = [validate.finite_number("temperatures", t, minimum=0.0) for t in temperatures]
    top_k = validate.positive_int_or_none("top_k", top_k)
    validate.positive_int("max_new_tokens", max_new_tokens)
    validate.positive_int("max_top_k", max_top_k)
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
    from IPython.display import display
    display(widgets_note())
    return box
