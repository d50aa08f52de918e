"""Tests for course_lib.viz: the pictures show the data they were given, and the widgets work."""
import matplotlib

matplotlib.use("Agg")

import math
import sys
from types import SimpleNamespace

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from course_lib import viz
from course_lib.attention import TOY_KEYS, TOY_VALUES, attention_weights, causal_mask, split_heads, toy_attention
from course_lib.model import sinusoidal_table

TOKENS = ["the", "cat", "sat", "down"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def causal_weights(*batch, length=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, length, 8, generator=g)
    k = torch.randn(*batch, length, 8, generator=g)
    return attention_weights(q, k, causal_mask(length))


def assert_close(actual, expected):
    # torch.testing.assert_close costs ~2 s of imports on its first call
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6)


def image_axes(fig):
    return [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]


def texts(fig):
    found = [t.get_text() for ax in fig.axes for t in ax.texts]
    found += [ax.get_title() for ax in fig.axes]
    return found + [t.get_text() for t in fig.texts]


# --------------------------------------------------------------------------- attention maps

def test_plot_attention_shows_the_weights_with_token_labels():
    w = causal_weights()
    fig = viz.plot_attention(w, TOKENS, title="one head")
    assert isinstance(fig, Figure)
    [ax] = image_axes(fig)
    assert len(fig.axes) == 2                      # heatmap and colourbar
    np.testing.assert_allclose(ax.images[0].get_array(), w.numpy(), rtol=1e-6)
    assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    assert ax.get_title() == "one head"
    # small matrices get every allowed value written in its cell; the 6 masked (future) cells get none
    cell_texts = [t.get_text() for t in ax.texts]
    assert len(cell_texts) == 10 and cell_texts[1] == f"{w[1, 0].item():.2f}"


def _hatched_cells(ax):
    return sorted((round(p.get_x() + 0.5), round(p.get_y() + 0.5)) for p in ax.patches if p.get_hatch())


def test_plot_attention_draws_masked_cells_apart_from_zero_weights():
    w = causal_weights()
    fig = viz.plot_attention(w, TOKENS)
    [ax] = image_axes(fig)
    shown = ax.images[0].get_array()
    future = np.triu(np.ones((4, 4), dtype=bool), k=1)
    # masked cells are "bad" pixels (drawn in the grey of the causal-mask picture), hatched, and named in a legend
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), future)
    assert _hatched_cells(ax) == sorted((j, i) for i, j in zip(*np.nonzero(future)))
    grey = ax.images[0].cmap.get_bad()
    assert tuple(np.round(grey[:3], 3)) != tuple(np.round(ax.images[0].cmap(0.0)[:3], 3))
    [legend] = [a.get_legend() for a in fig.axes if a.get_legend()]
    assert "masked" in legend.get_texts()[0].get_text()
    # a real weight of exactly 0 outside the causal pattern is not called masked
    zero_somewhere = torch.full((3, 3), 1 / 3)
    zero_somewhere[2] = torch.tensor([0.0, 0.5, 0.5])
    [ax] = image_axes(viz.plot_attention(zero_somewhere))
    assert not np.ma.getmaskarray(ax.images[0].get_array()).any() and not _hatched_cells(ax)


def test_plot_attention_takes_an_explicit_mask_and_checks_its_shape():
    w = torch.full((3, 3), 1 / 3)
    allowed = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    [ax] = image_axes(viz.plot_attention(w, mask=allowed))
    np.testing.assert_array_equal(np.ma.getmaskarray(ax.images[0].get_array()), ~allowed.numpy())
    with pytest.raises(ValueError, match="mask"):
        viz.plot_attention(w, mask=torch.ones(2, 3, dtype=torch.bool))


def test_plot_attention_heads_marks_masked_cells_in_every_panel():
    w = causal_weights(2, length=5)                       # (heads, L, L)
    fig = viz.plot_attention_heads(w)
    future = np.triu(np.ones((5, 5), dtype=bool), k=1)
    for ax in image_axes(fig):
        np.testing.assert_array_equal(np.ma.getmaskarray(ax.images[0].get_array()), future)
        assert len(_hatched_cells(ax)) == future.sum()
    assert fig.legends and "masked" in fig.legends[0].get_texts()[0].get_text()


def test_figures_show_once_in_a_notebook():
    # not registered with pyplot (no second copy from the inline backend), and renders itself
    fig = viz.plot_attention(causal_weights(length=2))
    assert plt.get_fignums() == []
    assert fig._repr_png_().startswith(b"\x89PNG")
    assert repr(fig).startswith("<Figure size ")


def test_plot_attention_large_matrix_has_no_cell_text_and_accepts_a_string_of_chars():
    w = causal_weights(length=13)
    fig = viz.plot_attention(w, "hello, world!")
    [ax] = image_axes(fig)
    assert len(ax.texts) == 0
    assert [t.get_text() for t in ax.get_xticklabels()][:5] == list("hello")


def test_plot_attention_with_fewer_queries_labels_rows_with_the_last_tokens():
    w = torch.softmax(torch.randn(2, 4), dim=-1)     # the two newest queries, as with a KV cache
    fig = viz.plot_attention(w, TOKENS)
    [ax] = image_axes(fig)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["sat", "down"]


def test_plot_attention_draws_into_a_given_axes():
    fig, (left, right) = plt.subplots(1, 2)
    assert viz.plot_attention(causal_weights(), ax=right) is fig
    assert right.images and not left.images


def test_plot_attention_makes_spaces_visible():
    fig = viz.plot_attention(causal_weights(length=2), [" ", "a\n"])
    [ax] = image_axes(fig)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["\u2423", "a\\n"]


@pytest.mark.parametrize("weights, tokens, error, match", [
    (torch.ones(2, 3, 3, 3), None, ValueError, r"weights: expected shape \(Lq, Lk\), got shape \(2, 3, 3, 3\)"),
    ("weights", None, TypeError, "weights: expected a tensor or array"),
    (torch.full((3, 3), float("nan")), None, ValueError, "weights: expected finite numbers, got 9 NaN"),
    (torch.ones(3, 3), ["a", "b"], ValueError, "tokens: expected 3 tokens .* got 2"),
    (torch.ones(3, 3), [1, 2, 3], TypeError, "tokens: expected a list of str, got items of type int"),
    (torch.ones(4, 3), None, ValueError, r"weights: expected at most as many queries as keys"),
])
def test_plot_attention_rejects_bad_inputs(weights, tokens, error, match):
    with pytest.raises(error, match=match):
        viz.plot_attention(weights, tokens)


def test_plot_attention_heads_one_layer_grid_with_titles():
    w = causal_weights(6)                               # (heads, L, L)
    fig = viz.plot_attention_heads(w, TOKENS, layer=2)
    panels = image_axes(fig)
    assert len(panels) == 6
    assert [ax.get_title() for ax in panels] == [f"layer 2, head {h}" for h in range(6)]
    for h, ax in enumerate(panels):
        np.testing.assert_allclose(ax.images[0].get_array(), w[h].numpy(), rtol=1e-6)
    # one shared colour scale, so colours compare across heads
    assert len({ax.images[0].get_clim() for ax in panels}) == 1
    assert [ax.get_title() for ax in image_axes(viz.plot_attention_heads(w))][:2] == ["head 0", "head 1"]


def test_plot_attention_heads_layers_by_heads_and_one_layer():
    w = causal_weights(2, 3)                            # (layers, heads, L, L)
    panels = image_axes(viz.plot_attention_heads(w, TOKENS))
    assert [ax.get_title() for ax in panels] == [f"layer {i}, head {h}" for i in range(2) for h in range(3)]
    np.testing.assert_allclose(panels[4].images[0].get_array(), w[1, 1].numpy(), rtol=1e-6)
    only = image_axes(viz.plot_attention_heads(w, TOKENS, layer=1))
    assert [ax.get_title() for ax in only] == [f"layer 1, head {h}" for h in range(3)]
    np.testing.assert_allclose(only[2].images[0].get_array(), w[1, 2].numpy(), rtol=1e-6)


def test_plot_attention_heads_puts_single_head_layers_side_by_side():
    w = causal_weights(2, 1)                            # (layers, 1 head, L, L): notebook 11's toy model
    panels = image_axes(viz.plot_attention_heads(w, TOKENS))
    assert [ax.get_title() for ax in panels] == ["layer 0, head 0", "layer 1, head 0"]
    rows = {round(ax.get_position().y0, 3) for ax in panels}
    assert len(rows) == 1, "one row, not a column of two"


def test_plot_attention_heads_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"weights: .* maps\[:, 0\]"):
        viz.plot_attention_heads(torch.ones(2, 1, 3, 4, 4))   # GPT.attention_maps output, unsliced
    with pytest.raises(ValueError, match="weights: expected shape"):
        viz.plot_attention_heads(torch.ones(4, 4))
    with pytest.raises(ValueError, match="layer: expected an index below the 2 layers"):
        viz.plot_attention_heads(torch.ones(2, 3, 4, 4), layer=2)
    with pytest.raises(ValueError, match="layer: expected an int >= 0"):
        viz.plot_attention_heads(torch.ones(3, 4, 4), layer="last")


def test_plot_causal_mask_two_colours_and_legend():
    mask = causal_mask(5)
    fig = viz.plot_causal_mask(mask, list("abcde"))
    [ax] = image_axes(fig)
    np.testing.assert_array_equal(ax.images[0].get_array(), mask.int().numpy())
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcde")
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["may attend (True)", "masked (future)"]
    with pytest.raises(TypeError, match="mask: expected a bool mask .* got dtype float32"):
        viz.plot_causal_mask(mask.float())


def test_plot_positional_encoding_heatmap_and_lines():
    table = sinusoidal_table(32, 16)
    fig = viz.plot_positional_encoding(table, title="sinusoidal")
    [heat] = image_axes(fig)
    np.testing.assert_allclose(heat.images[0].get_array(), table.numpy().T, rtol=1e-6)  # positions along x
    assert heat.get_title() == "sinusoidal"
    lines = [ax for ax in fig.axes if ax.get_xlabel() == "position in the sequence"][0].get_lines()
    assert [line.get_label() for line in lines] == ["dim 0", "dim 1", "dim 4", "dim 8"]
    np.testing.assert_allclose(lines[2].get_ydata(), table[:, 4].numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match=r"table: expected shape \(max_tokens, embed_dim\)"):
        viz.plot_positional_encoding(torch.ones(8))
    with pytest.raises(ValueError, match=r"dims: expected a non-empty list of ints in \[0, 16\)"):
        viz.plot_positional_encoding(table, dims=[99])


# --------------------------------------------------------------------------- training and cost

def test_plot_loss_curves_from_mapping_and_object():
    history = {"step": [0, 10, 20], "train_loss": [3.0, 2.0, 1.5], "val_step": [0, 20], "val_loss": [3.1, 1.8]}
    for source in (history, SimpleNamespace(**history)):
        fig = viz.plot_loss_curves(source)
        [ax] = fig.axes
        train, val = ax.get_lines()
        assert (train.get_label(), val.get_label()) == ("train", "validation")
        np.testing.assert_allclose(train.get_xydata(), [[0, 3.0], [10, 2.0], [20, 1.5]])
        np.testing.assert_allclose(val.get_xydata(), [[0, 3.1], [20, 1.8]])
        assert ax.get_xscale() == ax.get_yscale() == "linear"
        assert ax.get_xlabel() == "step" and "loss" in ax.get_ylabel()


def test_plot_loss_curves_val_loss_without_val_step_and_train_only():
    fig = viz.plot_loss_curves({"step": [1, 2], "train_loss": [2.0, 1.0], "val_loss": [2.5, 1.5]})
    np.testing.assert_allclose(fig.axes[0].get_lines()[1].get_xdata(), [1, 2])
    assert len(viz.plot_loss_curves({"step": [1, 2], "train_loss": [2.0, 1.0]}).axes[0].get_lines()) == 1


@pytest.mark.parametrize("history, match", [
    ({"train_loss": [1.0]}, "history: expected a mapping with key 'step'"),
    ({"step": [1, 2], "train_loss": [1.0]},
     "history: expected 'step' and 'train_loss' of the same length, got 2 and 1"),
    ({"step": [1, 2], "train_loss": [1.0, 2.0], "val_loss": [1.0]},
     "history: 'val_loss' has 1 entries .* add 'val_step'"),
    ({"step": [1], "train_loss": ["low"]}, "history: expected 'train_loss' to hold numbers"),
])
def test_plot_loss_curves_rejects_bad_history(history, match):
    with pytest.raises((ValueError, TypeError), match=match):
        viz.plot_loss_curves(history)


def test_plot_softmax_saturation_numbers():
    fig = viz.plot_softmax_saturation(dims=(4, 64, 1024), samples=300, seed=1)
    assert len(fig.axes) == 2
    data = fig.course_data
    assert data["dims"] == [4, 64, 1024]
    var, var_scaled = data["variance_unscaled"], data["variance_scaled"]
    assert var[0] < var[1] < var[2]
    np.testing.assert_allclose(np.array(var) / np.array(data["dims"]), 1.0, atol=0.2)   # variance ~ d
    np.testing.assert_allclose(var_scaled, 1.0, atol=0.2)                                # ~1 with the scale
    top, top_scaled = data["max_weight_unscaled"], data["max_weight_scaled"]
    assert top[0] < top[1] < top[2] and top[2] > 0.9          # saturates to one-hot
    assert max(top_scaled) - min(top_scaled) < 0.1 and max(top_scaled) < 0.5
    again = viz.plot_softmax_saturation(dims=(4, 64, 1024), samples=300, seed=1).course_data
    assert again == data                                      # seeded: same numbers every run


def test_plot_softmax_saturation_rejects_bad_inputs():
    with pytest.raises(ValueError, match="dims: expected a non-empty list of positive ints, got an item 0"):
        viz.plot_softmax_saturation(dims=(0, 4))
    with pytest.raises(ValueError, match="samples: expected a positive int"):
        viz.plot_softmax_saturation(samples=-1)


def test_plot_attention_cost_fits_c_l_squared():
    lengths = [32, 64, 128, 256]
    seconds = [3e-9 * n ** 2 for n in lengths]
    fig = viz.plot_attention_cost(lengths, seconds)
    assert len(fig.axes) == 1
    assert fig.course_data["c"] == pytest.approx(3e-9, rel=1e-9)
    measured = [line for line in fig.axes[0].get_lines() if line.get_label() == "measured"][0]
    np.testing.assert_allclose(measured.get_xdata(), lengths)
    with_flops = viz.plot_attention_cost(lengths, seconds, flops=[4 * n * n * 64 for n in lengths])
    assert len(with_flops.axes) == 2
    np.testing.assert_allclose(with_flops.course_data["gflops_per_s"], 4 * 64 / 3e-9 / 1e9)


@pytest.mark.parametrize("lengths, seconds, flops, match", [
    ([1, 2], [1.0], None, r"seconds: expected one time per length \(2 values\), got 1"),
    ([0, 2], [1.0, 1.0], None, "lengths: expected positive sequence lengths"),
    ([1, 2], [1.0, -1.0], None, "seconds: expected times > 0"),
    ([1, 2], [1.0, 1.0], [5.0], "flops: expected 2 positive counts"),
])
def test_plot_attention_cost_rejects_bad_inputs(lengths, seconds, flops, match):
    with pytest.raises(ValueError, match=match):
        viz.plot_attention_cost(lengths, seconds, flops)


# --------------------------------------------------------------------------- diagrams

@pytest.mark.parametrize("kind, marker", [("markov", "look-up table"), ("rnn", "h5"), ("attention", "w = 0.42")])
def test_architecture_diagrams(kind, marker):
    fig = viz.plot_architecture_diagram(kind)
    [ax] = fig.axes
    assert len(ax.patches) >= 6 and any(marker in t for t in texts(fig))


def test_why_attention_draws_all_three_and_bad_kind_fails():
    fig = viz.plot_why_attention()
    assert [ax.get_title() for ax in fig.axes] == ["Markov chain", "Recurrent network (RNN)", "Attention"]
    with pytest.raises(ValueError, match=r"kind: expected one of \['markov', 'rnn', 'attention'\], got 'cnn'"):
        viz.plot_architecture_diagram("cnn")


def test_plot_heads_split_follows_split_heads():
    fig = viz.plot_heads_split(embed_dim=6, num_heads=3, length=2)
    expected = split_heads(torch.arange(6).expand(1, 2, 6), 3)[0]
    assert torch.equal(fig.course_data["split"], expected)
    shown = texts(fig)
    assert "(N, heads, L, head_dim) = (1, 3, 2, 2)" in shown and "x  (N, L, E) = (1, 2, 6)" in shown
    cells = [t for t in shown if t.isdigit()]
    assert len(cells) == 3 * 2 * 6                        # three stages of L x E cells
    with pytest.raises(ValueError, match="num_heads: embed_dim=8 must be divisible by num_heads, got 3"):
        viz.plot_heads_split(8, 3)
    with pytest.raises(ValueError, match="length: expected a positive int"):
        viz.plot_heads_split(8, 2, 0)


def test_plot_ddp_allreduce():
    shown = "\n".join(texts(viz.plot_ddp_allreduce(3)))
    for r in range(3):
        assert f"batch {r}" in shown and f"grads g{r}" in shown
    assert "all-reduce" in shown and "g0, g1, g2" in shown
    with pytest.raises(ValueError, match="num_ranks: expected at most 8"):
        viz.plot_ddp_allreduce(9)
    with pytest.raises(ValueError, match="num_ranks: expected a positive int"):
        viz.plot_ddp_allreduce(0)


# --------------------------------------------------------------------------- notebook 09: modern attention

def rotated_rows(angles_per_token, positions=6, start=(0.3, 0.5)):
    """One vector at positions 0..P-1: pair i turned by p * angles_per_token[i] (half-split layout)."""
    half = len(angles_per_token)
    rows = np.zeros((positions, 2 * half))
    for i, omega in enumerate(angles_per_token):
        radius, phase = (i + 1.0), np.arctan2(start[1], start[0])
        for p in range(positions):
            rows[p, i], rows[p, i + half] = radius * np.cos(phase + p * omega), radius * np.sin(phase + p * omega)
    return rows


def test_plot_rope_rotation_draws_each_pair_and_measures_its_turn():
    rows = rotated_rows([1.0, 0.25, 0.01])
    fig = viz.plot_rope_rotation(torch.tensor(rows), pairs=[0, 2])
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 2
    np.testing.assert_allclose(fig.course_data["step"], [1.0, 0.01], rtol=1e-9)
    np.testing.assert_allclose(fig.course_data["points"][1], rows[:, [2, 5]])   # pair 2 = dims 2 and 2 + 3
    assert "pair 2: dims 2 and 5" in panels[1].get_title() and "0.01 rad per token" in panels[1].get_title()
    assert [t.get_text() for t in panels[0].texts if t.get_text()] == [str(p) for p in range(6)]   # per row
    default = viz.plot_rope_rotation(rows)
    assert default.course_data["pairs"] == [0, 1, 2]


def test_plot_rope_rotation_measures_a_turn_past_pi_wrapped():
    fig = viz.plot_rope_rotation(rotated_rows([-2.5]), pairs=[0])
    assert fig.course_data["step"] == pytest.approx([-2.5])


@pytest.mark.parametrize("rotated, pairs, match", [
    (np.zeros((4, 5)), None, "rotated: expected an even head_dim"),
    (np.zeros((1, 4)), None, "rotated: expected at least 2 positions"),
    (np.zeros((4, 4)), [2], r"pairs: expected a non-empty list of ints in \[0, 2\)"),
    (np.zeros(4), None, r"rotated: expected shape \(positions, head_dim\)"),
])
def test_plot_rope_rotation_rejects_bad_inputs(rotated, pairs, match):
    with pytest.raises(ValueError, match=match):
        viz.plot_rope_rotation(rotated, pairs)


def test_plot_rope_scores_shows_the_scores_and_the_curves():
    scores = np.add.outer(np.arange(5.0), -np.arange(5.0))                      # m - n: constant diagonals
    fig = viz.plot_rope_scores(scores, {"a": [1.0, 0.5, 0.0], "b": torch.tensor([0.0, 1.0, 2.0])})
    [heat] = image_axes(fig)
    np.testing.assert_allclose(heat.images[0].get_array(), scores)
    lines = {line.get_label(): line.get_ydata() for line in fig.axes[1].get_lines() if not line.get_label().startswith("_")}
    assert list(lines) == ["a", "b"]
    np.testing.assert_allclose(lines["b"], [0.0, 1.0, 2.0])
    assert len(viz.plot_rope_scores(scores).axes) == 2                           # heat map and colour bar


@pytest.mark.parametrize("scores, curves, error, match", [
    (np.zeros(3), None, ValueError, r"scores: expected shape \(query positions, key positions\)"),
    (np.zeros((3, 3)), [1.0, 2.0], TypeError, "curves: expected a non-empty dict of label"),
    (np.zeros((3, 3)), {1: [1.0]}, TypeError, "curves: expected str labels"),
    (np.zeros((3, 3)), {"a": np.zeros((2, 2))}, ValueError, r"curves\['a'\]: expected shape \(offsets,\)"),
])
def test_plot_rope_scores_rejects_bad_inputs(scores, curves, error, match):
    with pytest.raises(error, match=match):
        viz.plot_rope_scores(scores, curves)


def test_plot_kv_cache_per_token_bars_are_the_measurements():
    measured = {"MHA": 4096, "GQA": 1024.0, "MQA": 512}
    fig = viz.plot_kv_cache_per_token(measured, formula=dict(measured))
    [ax] = fig.axes
    assert [p.get_height() for p in ax.patches] == [4096, 1024, 512]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["MHA", "GQA", "MQA"]
    assert [t.get_text() for t in ax.texts] == ["4 KiB", "1 KiB", "512 B"]
    [marks] = [line for line in ax.get_lines() if line.get_label() == "formula"]
    np.testing.assert_allclose(marks.get_ydata(), [4096, 1024, 512])
    assert fig.course_data["formula"] == {"MHA": 4096.0, "GQA": 1024.0, "MQA": 512.0}


@pytest.mark.parametrize("measured, formula, error, match", [
    ({}, None, TypeError, "measured: expected a non-empty dict"),
    ({"MHA": -1}, None, ValueError, r"measured\['MHA'\]: expected a finite number in \[0, inf\]"),
    ({"MHA": 1}, {"MQA": 1}, ValueError, r"formula: expected the same labels as measured, \['MHA'\]"),
])
def test_plot_kv_cache_per_token_rejects_bad_inputs(measured, formula, error, match):
    with pytest.raises(error, match=match):
        viz.plot_kv_cache_per_token(measured, formula)


def test_plot_masks_draws_each_mask_with_its_label():
    causal = causal_mask(5)
    window = causal & ~causal_mask(5).tril(-2)                                   # each query sees 2 keys at most
    fig = viz.plot_masks({"causal": causal, "window 2": window})
    panels = image_axes(fig)
    assert len(panels) == 2
    np.testing.assert_array_equal(panels[1].images[0].get_array(), window.int().numpy())
    assert panels[1].get_title() == "window 2\n2 keys at most per query"
    assert fig.course_data["keys_per_query"]["window 2"] == [1, 2, 2, 2, 2]
    with pytest.raises(TypeError, match=r"masks\['f'\]: expected a bool mask"):
        viz.plot_masks({"f": torch.ones(3, 3)})


# --------------------------------------------------------------------------- query explorer

@pytest.mark.parametrize("angle", [0, 90, 200.5, 360])
def test_query_explorer_state_matches_toy_attention(angle):
    state = viz.query_explorer_state(angle)
    rad = np.radians(angle)
    assert_close(state["query"], torch.tensor([np.cos(rad), np.sin(rad)], dtype=torch.float32))
    assert state["weights"].sum().item() == pytest.approx(1.0, abs=1e-6)
    assert_close(state["scores"], TOY_KEYS @ state["query"])
    assert_close(state["result"], toy_attention(state["query"], TOY_KEYS, TOY_VALUES))


def test_query_explorer_state_worked_examples_and_vector_values():
    right = viz.query_explorer_state(0)["weights"]
    assert right.argmax().item() == 0
    up = viz.query_explorer_state(90)["weights"]
    assert up.argmax().item() == 1 and up[0].item() == pytest.approx(up[2].item(), abs=1e-6)
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    state = viz.query_explorer_state(45, TOY_KEYS, values)
    assert_close(state["result"], toy_attention(state["query"], TOY_KEYS, values))


@pytest.mark.parametrize("args, error, match", [
    (("north",), ValueError, "angle_degrees: expected a finite number"),
    ((float("nan"),), ValueError, "angle_degrees: expected a finite number"),
    ((0, torch.ones(3, 3)), ValueError, r"keys: expected shape \(n, 2\)"),
    ((0, TOY_KEYS, torch.ones(2)), ValueError, r"values: expected one value per key \(3 rows\)"),
])
def test_query_explorer_state_rejects_bad_inputs(args, error, match):
    with pytest.raises(error, match=match):
        viz.query_explorer_state(*args)


def test_plot_query_explorer_bars_are_the_weights():
    fig = viz.plot_query_explorer(90)
    circle, bars = fig.axes
    weights = viz.query_explorer_state(90)["weights"]
    np.testing.assert_allclose([p.get_height() for p in bars.patches], weights.numpy(), rtol=1e-6)
    assert bars.get_title().endswith("= 2.00")            # 0.21 * 1 + 0.58 * 2 + 0.21 * 3
    assert circle.get_title().startswith("query at 90°")


def test_query_explorer_static_fallbacks(monkeypatch):
    fig = viz.query_explorer(static=True, angles=(0, 90, 180))
    assert isinstance(fig, Figure) and len(fig.axes) == 6   # a circle and a bar chart per angle
    assert [s["result"].item() for s in fig.course_data][1] == pytest.approx(2.0, abs=1e-6)
    monkeypatch.setenv("COURSE_STATIC_WIDGETS", "1")
    assert viz.use_static_widgets()
    assert isinstance(viz.query_explorer(angles=(0,)), Figure)
    monkeypatch.delenv("COURSE_STATIC_WIDGETS")
    monkeypatch.setitem(sys.modules, "ipywidgets", None)   # import ipywidgets now raises ImportError
    assert viz.use_static_widgets()
    assert isinstance(viz.query_explorer(static=False, angles=(0,)), Figure)


def test_query_explorer_widget_slider_updates_state(monkeypatch):
    import ipywidgets

    monkeypatch.delenv("COURSE_STATIC_WIDGETS", raising=False)
    assert not viz.use_static_widgets()
    box = viz.query_explorer()
    assert isinstance(box, ipywidgets.Widget) and box.slider in box.children
    assert (box.slider.min, box.slider.max) == (0.0, 360.0)
    assert_close(box.state["weights"], viz.query_explorer_state(0)["weights"])
    box.slider.value = 90.0
    assert_close(box.state["weights"], viz.query_explorer_state(90)["weights"])
    assert box.state["result"].item() == pytest.approx(2.0, abs=1e-6)


# --------------------------------------------------------------------------- generation playground

def fake_generate(calls=None):
    def generate(prompt, temperature, top_k, max_new_tokens):
        if calls is not None:
            calls.append((prompt, temperature, top_k, max_new_tokens))
        return f"{prompt}|t={temperature}|k={top_k}|n={max_new_tokens}"
    return generate


def test_playground_samples_calls_generate_fn_per_setting():
    calls = []
    rows = viz.playground_samples(fake_generate(calls), "ROMEO:", [(0.0, None), (1.5, 10)], max_new_tokens=7)
    assert calls == [("ROMEO:", 0.0, None, 7), ("ROMEO:", 1.5, 10, 7)]
    assert rows == [(0.0, None, "ROMEO:|t=0.0|k=None|n=7"), (1.5, 10, "ROMEO:|t=1.5|k=10|n=7")]


@pytest.mark.parametrize("fn, prompt, settings, error, match", [
    ("not a function", "", [(1.0, None)], TypeError, "generate_fn: expected a function"),
    (fake_generate(), 5, [(1.0, None)], TypeError, "prompt: expected a str, got 5"),
    (fake_generate(), "", [], ValueError, "settings: expected a non-empty list"),
    (fake_generate(), "", [(-1.0, None)], ValueError, r"settings \(temperature\): expected a finite number in \[0"),
    (fake_generate(), "", [(1.0, 0)], ValueError, r"settings \(top_k\): expected None or a positive int"),
    (lambda *a: 42, "", [(1.0, None)], TypeError, "generate_fn: expected it to return a str, got 42"),
])
def test_playground_samples_rejects_bad_inputs(fn, prompt, settings, error, match):
    with pytest.raises(error, match=match):
        viz.playground_samples(fn, prompt, settings)


def test_generation_playground_static_table():
    table = viz.generation_playground(fake_generate(), "To be", temperatures=(0.0, 1.0), top_k=5,
                                      max_new_tokens=3, static=True)
    assert isinstance(table, str) and repr(table) == str(table)     # shows without quotes in a notebook
    assert table.rows == [(0.0, 5, "To be|t=0.0|k=5|n=3"), (1.0, 5, "To be|t=1.0|k=5|n=3")]
    assert "temperature 0, top_k 5  (greedy)" in table and "    To be|t=1.0|k=5|n=3" in table
    with pytest.raises(ValueError, match="temperatures: expected a finite number"):
        viz.generation_playground(fake_generate(), temperatures=(float("inf"),), static=True)


def test_generation_playground_widget_button_generates(monkeypatch, capsys):
    import ipywidgets

    monkeypatch.delenv("COURSE_STATIC_WIDGETS", raising=False)
    calls = []
    box = viz.generation_playground(fake_generate(calls), "Hi", max_new_tokens=9, static=False)
    assert isinstance(box, ipywidgets.Widget)
    assert (box.temperature.min, box.temperature.max, box.top_k.value) == (0.0, 2.0, 0)
    box.prompt.value, box.temperature.value = "Once", 0.5
    box.button.click()
    box.top_k.value = 5
    box.button.click()
    assert calls == [("Once", 0.5, None, 9), ("Once", 0.5, 5, 9)]   # slider 0 means top-k off
    assert box.samples[-1] == (0.5, 5, "Once|t=0.5|k=5|n=9") and box.error is None
    assert not box.button.disabled


def test_generation_playground_widget_reports_errors_instead_of_raising(monkeypatch):
    def broken(*args):
        raise RuntimeError("model not trained")

    box = viz.generation_playground(broken, static=False)
    box.button.click()
    assert isinstance(box.error, RuntimeError) and box.samples == [] and not box.button.disabled


def test_a_live_widget_comes_with_a_note_that_survives_a_reopened_notebook(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    monkeypatch.delenv("COURSE_STATIC_WIDGETS", raising=False)
    for make in (lambda: viz.query_explorer(), lambda: viz.generation_playground(lambda *a: "x", static=False)):
        shown.clear()
        make()
        texts = [getattr(obj, "_repr_markdown_", lambda: "")() or "" for obj in shown]
        notes = [t for t in texts if "Error displaying widget" in t and "run this cell again" in t]
        assert len(notes) == 1, shown


def test_the_query_explorer_slider_reads_whole_degrees():
    box = viz.query_explorer(static=False)
    assert box.slider.step == 5.0 and box.slider.readout_format == ".0f"
    assert format(190.0, box.slider.readout_format) == "190"


def _overlaps(fig, text, line) -> bool:
    """Whether ``line`` passes through the box of ``text`` (both in display coordinates)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    box = text.get_window_extent(canvas.get_renderer())
    xs, ys = line.get_xdata(), line.get_ydata()
    dense_x = np.linspace(min(xs), max(xs), 4000)
    points = line.axes.transData.transform(np.column_stack([dense_x, np.interp(dense_x, xs, ys)]))
    return bool(((points[:, 0] >= box.x0) & (points[:, 0] <= box.x1)
                 & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1)).any())


@pytest.mark.parametrize("gap", [0.18, -0.18, 0.0])
def test_the_best_validation_label_sits_clear_of_both_curves(gap):
    steps = list(range(10, 2001, 10))
    train = [1.4 + 2.8 * math.exp(-s / 150) for s in steps]   # falls steeply, then slowly
    val_steps = list(range(200, 2001, 200))
    val = [1.4 + gap + 2.8 * math.exp(-s / 150) for s in val_steps]
    fig = viz.plot_loss_curves({"step": steps, "train_loss": train, "val_step": val_steps, "val_loss": val})
    ax = fig.axes[0]
    (label,) = [t for t in ax.texts if t.get_text().startswith("best ")]
    train_line, val_line = ax.get_lines()[:2]
    assert not _overlaps(fig, label, train_line) and not _overlaps(fig, label, val_line)


def test_rope_rotation_position_labels_never_pile_up():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from course_lib import modern
    cos, sin = modern.rope_tables(16, max_tokens=64)
    torch.manual_seed(0)
    q = torch.randn(16)
    q_at = modern.apply_rotary(q.expand(1, 1, 8, 16), cos, sin)[0, 0]   # (8, 16): notebook 09's figure
    fig = viz.plot_rope_rotation(q_at, pairs=[0, 1, 2, 7])
    assert fig.course_data["labels"][3] == ["0-7"]   # pair 7 barely turns: one label, not eight in a blob
    for labels in fig.course_data["labels"]:   # every position named once, in order
        named = []
        for text in labels:
            first, _, last = text.partition("-")
            named.extend(range(int(first), int(last or first) + 1))
        assert named == list(range(8))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    for ax in fig.axes:
        texts = [t for t in ax.texts if t.get_text()]   # the arrows are annotations without text
        boxes = [t.get_window_extent(canvas.get_renderer()) for t in texts]
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                assert not boxes[a].overlaps(boxes[b]), (ax.get_title(), texts[a].get_text(), texts[b].get_text())
