"""Pictures and ipywidgets explorers for the notebooks, one module per concern.

- :mod:`.style`: the palette, the self-displaying ``Figure`` and the input checks every picture shares;
- :mod:`.attention_maps`: attention weights, heads, the causal mask, position tables, softmax saturation;
- :mod:`.training`: loss curves and the measured cost of attention;
- :mod:`.diagrams`: Markov chain / RNN / attention, splitting heads, data-parallel training;
- :mod:`.modern`: RoPE's rotation, scores against the offset, KV-cache bytes per token, masks side by side;
- :mod:`.widgets`: the query explorer and the generation playground, each with a static fallback.

Every ``plot_*`` function checks its inputs and returns a matplotlib ``Figure``.
The figures are built without pyplot (a ``matplotlib.figure.Figure`` subclass
that renders itself as PNG), so a notebook shows each one exactly once, whatever
the matplotlib backend: put the call (or the returned figure) last in the cell,
or ``display(fig)``. In a script, use ``fig.savefig(path)``. When you pass your
own pyplot ``ax``, the figure is pyplot's: show it as you normally would.
"""
from __future__ import annotations

from .attention_maps import (
    plot_attention,
    plot_attention_heads,
    plot_causal_mask,
    plot_positional_encoding,
    plot_softmax_saturation,
)
from .diagrams import plot_architecture_diagram, plot_ddp_allreduce, plot_heads_split, plot_why_attention
from .modern import plot_kv_cache_per_token, plot_masks, plot_rope_rotation, plot_rope_scores
from .style import Figure
from .training import plot_attention_cost, plot_loss_curves
from .widgets import (
    SampleTable,
    generation_playground,
    playground_samples,
    plot_query_explorer,
    query_explorer,
    query_explorer_state,
    use_static_widgets,
)

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
    "plot_rope_rotation",
    "plot_rope_scores",
    "plot_kv_cache_per_token",
    "plot_masks",
    "query_explorer_state",
    "plot_query_explorer",
    "query_explorer",
    "playground_samples",
    "generation_playground",
    "SampleTable",
]
