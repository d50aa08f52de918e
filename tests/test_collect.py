"""Collecting a student's own parts from their learner copies: only the definitions run, and
anything missing, unfinished or broken falls back to the course's solution."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch

from course_lib import GPT
from course_lib.classroom.assignments import update_learner_copies
from course_lib.classroom.collect import GPT_EXERCISES, collect_student_parts, course_exercises
from course_lib.model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = GPTConfig(vocab_size=11, embed_dim=16, num_heads=2, num_layers=2, max_tokens=8)


@pytest.fixture
def learner_copies(tmp_path) -> Path:
    update_learner_copies(ROOT / "notebooks", tmp_path / "student")
    return tmp_path / "student"


def _set_exercise_cell(folder: Path, exercise_id: str, source: str, before: str | None = None) -> None:
    """Replace the student's cell of an exercise (found by its cell id); optionally add a cell before it."""
    exercise = course_exercises()[exercise_id]
    path = folder / exercise.notebook
    nb = nbformat.read(path, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if c.get("id") == exercise.cell_id)
    nb.cells[index].source = source
    if before is not None:
        nb.cells.insert(index, nbformat.v4.new_code_cell(before))
    nbformat.write(nb, path)


def _gpt_logits(namespace: dict) -> torch.Tensor:
    torch.manual_seed(0)
    reference = GPT(CONFIG).eval()
    model = namespace["GPT"](CONFIG).eval()
    model.load_state_dict(reference.state_dict())
    idx = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(idx) - reference(idx)


def test_in_the_solution_notebooks_every_part_is_the_solution_and_composes_into_the_reference_gpt():
    collection = collect_student_parts(ROOT / "notebooks")
    assert collection.yours() == list(GPT_EXERCISES)
    namespace = collection.namespace()
    block = namespace["GPT"](CONFIG).blocks[0]
    assert type(block) is namespace["TransformerBlock"], "the GPT is built from the block defined beside it"
    assert type(block.attn) is namespace["MultiHeadMaskedAttention"]
    assert _gpt_logits(namespace).abs().max() < 1e-5


def test_an_untouched_learner_copy_falls_back_to_the_course_for_every_part(learner_copies):
    collection = collect_student_parts(learner_copies)
    assert collection.yours() == []
    assert all(part.status == "unfinished" for part in collection.parts.values())
    assert "course's (yours is not written yet)" in collection.table()
    assert _gpt_logits(collection.namespace()).abs().max() < 1e-5


STUDENT_MHA = '''\
import math

class MultiHeadMaskedAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj(merge_heads(my_softmax(scores) @ v))

RAN.append("the exercise cell's other statements")
print("MultiHeadMaskedAttention defined")
'''


def test_only_the_definitions_run_with_the_helpers_they_name(learner_copies, capsys):
    _set_exercise_cell(learner_copies, "3.3", STUDENT_MHA,
                       before="RAN = []\n\ndef my_softmax(s):\n    return s.softmax(dim=-2)   # the wrong axis\n\n"
                              "RAN.append('the helper cell ran')\n")
    collection = collect_student_parts(learner_copies)
    assert collection.yours() == ["3.3"]
    namespace = collection.namespace()
    assert "RAN" not in namespace and capsys.readouterr().out == "", "nothing but definitions ran"
    assert "def my_softmax" in collection.parts["3.3"].source
    # The student's attention (softmax over the queries) flows into the GPT built in that namespace.
    assert _gpt_logits(namespace).abs().max() > 1e-3
    assert _gpt_logits(collection.namespace(yours=[])).abs().max() < 1e-5


@pytest.mark.parametrize("cell, status, detail", [
    ("def causal_mask(n)\n    return None\n", "broken", "SyntaxError"),
    ("@undefined_decorator\ndef causal_mask(n):\n    return None\n", "broken", "NameError"),
    ("causal_mask = 3\n", "missing", "no longer defines causal_mask"),
    ("def causal_mask(n):\n    return torch.ones(n, n, dtype=torch.bool).tril()\n", "yours", ""),
])
def test_each_part_is_judged_yours_missing_unfinished_or_broken(learner_copies, cell, status, detail):
    _set_exercise_cell(learner_copies, "2.1", cell)
    part = collect_student_parts(learner_copies).parts["2.1"]
    assert part.status == status and detail in part.detail


def test_a_missing_notebook_falls_back_and_says_so(learner_copies):
    (learner_copies / "05_training_gpt.ipynb").unlink()
    collection = collect_student_parts(learner_copies)
    assert {ex: p.status for ex, p in collection.parts.items() if ex.startswith("5.")} == \
        {"5.2": "missing", "5.3": "missing", "5.4": "missing"}
    assert "no 05_training_gpt.ipynb in" in collection.parts["5.3"].detail


def test_arguments_are_checked(learner_copies, tmp_path):
    with pytest.raises(FileNotFoundError, match="folder: expected a folder"):
        collect_student_parts(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="folder: expected the folder"):
        collect_student_parts(3)
    with pytest.raises(TypeError, match="exercises: expected a list"):
        collect_student_parts(learner_copies, exercises="2.1")
    with pytest.raises(ValueError, match=r"exercises: expected ids among .* got \['9.9'\]"):
        collect_student_parts(learner_copies, exercises=["9.9"])
    collection = collect_student_parts(learner_copies)
    with pytest.raises(ValueError, match=r"yours: exercises \['2.1'\] have no usable part"):
        collection.namespace(["2.1"])
