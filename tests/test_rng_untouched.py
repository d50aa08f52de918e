"""Every public call that is not about randomness leaves the caller's random streams as it found them.

A notebook's next ``torch.randn`` (or ``random.random``, or ``np.random.rand``) must give the numbers its text
shows, whatever course call came before: converting a model to or from Hugging Face builds one with random
initial weights only to overwrite them, and a demonstration that trains with its own seed must not reseed
the notebook's stream.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from course_lib import flash, generate, heads
from course_lib.checkpoints import load_checkpoint, save_checkpoint
from course_lib.classroom import capstone
from course_lib.classroom.collect import collect_student_parts
from course_lib.data import CharTokenizer, char_corpus
from course_lib.model import GPT, GPTConfig
from course_lib.modern_gpt import ModernGPT, ModernGPTConfig
from course_lib.runs import bench
from course_lib.runs.export import export_run
from course_lib.runtime import calibrate
from course_lib.train import evaluate

transformers = pytest.importorskip("transformers")
from course_lib import hf  # noqa: E402  (after the importorskip)

TOKENIZER = CharTokenizer("abcdefgh")


def gpt():
    return GPT(GPTConfig(vocab_size=TOKENIZER.vocab_size, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))


def modern():
    return ModernGPT(ModernGPTConfig(vocab_size=TOKENIZER.vocab_size, max_tokens=8, embed_dim=8, num_heads=2,
                                     num_kv_heads=1, num_layers=1))


def _saved(tmp_path):
    folder = tmp_path / "hf"
    if not folder.exists():
        hf.save_pretrained(gpt(), TOKENIZER, folder)
    return folder


def _checkpoint(tmp_path):
    path = tmp_path / "run" / "checkpoint.pt"
    if not path.exists():
        save_checkpoint(path, gpt(), TOKENIZER)
    return path


IDX = torch.tensor([[1, 2, 3]])
Q = torch.arange(24.0).reshape(1, 2, 3, 4) / 24

# (name, call(tmp_path)): built before the streams are saved, so only the call itself is measured
CALLS = {
    "to_hf_gpt2": lambda m, tmp: hf.to_hf_gpt2(m["gpt"]),
    "from_hf_gpt2": lambda m, tmp: hf.from_hf_gpt2(m["hf_gpt2"]),
    "to_hf_llama": lambda m, tmp: hf.to_hf_llama(m["modern"]),
    "from_hf_llama": lambda m, tmp: hf.from_hf_llama(m["hf_llama"]),
    "save_pretrained GPT": lambda m, tmp: hf.save_pretrained(m["gpt"], TOKENIZER, tmp / "a"),
    "save_pretrained ModernGPT": lambda m, tmp: hf.save_pretrained(m["modern"], TOKENIZER, tmp / "b"),
    "from_pretrained folder": lambda m, tmp: hf.from_pretrained(m["folder"]),
    "train_induction": lambda m, tmp: heads.train_induction(heads.InductionConfig(
        vocab_size=8, half=8, embed_dim=8, steps=3, log_every=1, batch_size=2, min_period=2)),
    "load_checkpoint": lambda m, tmp: load_checkpoint(m["checkpoint"]),
    "save_checkpoint": lambda m, tmp: save_checkpoint(tmp / "c.pt", m["gpt"], TOKENIZER),
    "generate greedy": lambda m, tmp: generate.generate(m["gpt"], IDX, 3, temperature=0),
    "generate greedy modern": lambda m, tmp: generate.generate(m["modern"], IDX, 3, temperature=0),
    "generate_with_cache": lambda m, tmp: generate.generate_with_cache(m["gpt"], IDX, 3),
    "flash_attention": lambda m, tmp: flash.flash_attention(Q, Q, Q, block_q=2, block_k=2, causal=True),
    "FlashAttentionFunction": lambda m, tmp: flash.FlashAttentionFunction.apply(
        Q.clone().requires_grad_(), Q, Q, True, 2, 2).sum().backward(),
    "online_softmax": lambda m, tmp: flash.online_softmax(Q, 2),
    "attention_patterns": lambda m, tmp: heads.attention_patterns(m["gpt"], IDX),
    "measure_matmul_peak": lambda m, tmp: bench.measure_matmul_peak(sizes=(8,), repeats=1),
    "attention_benchmark": lambda m, tmp: bench.attention_benchmark(lengths=[4], embed_dim=8, num_heads=2,
                                                                    repeats=1, tokens_per_call=8),
    "export_run": lambda m, tmp: export_run(m["checkpoint"].parent, tmp / "exported"),
    "evaluate": lambda m, tmp: evaluate(m["gpt"], IDX, IDX),
    "half_losses": lambda m, tmp: heads.half_losses(m["gpt"], torch.tensor([[1, 2, 1, 2]]), 2),
    "ablate_head": lambda m, tmp: _ablated(m["gpt"]),
    "char_corpus": lambda m, tmp: char_corpus("abcdefgh " * 20),
    "calibrate": lambda m, tmp: calibrate(0.01),
    "capstone.train_parts": lambda m, tmp: capstone.train_parts(
        collect_student_parts(tmp), None, capstone.names_setup(steps=2)),
    "generation_benchmark": lambda m, tmp: bench.generation_benchmark(
        dict(vocab_size=8, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1), new_tokens=2, prompt_tokens=2),
}


def _ablated(model):
    with heads.ablate_head(model, 0, 0):
        return model(IDX)


def _streams():
    return torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_not_about_randomness_leaves_every_stream_alone(name, tmp_path, capsys):
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    made = {"gpt": gpt(), "modern": modern()}
    made["hf_gpt2"] = hf.to_hf_gpt2(made["gpt"])
    made["hf_llama"] = hf.to_hf_llama(made["modern"])
    made["folder"] = _saved(tmp_path)
    made["checkpoint"] = _checkpoint(tmp_path)
    torch.rand(1), random.random(), np.random.rand()   # somewhere in the middle of each stream
    before = _streams()
    CALLS[name](made, tmp_path)
    after = _streams()
    assert torch.equal(before[0], after[0]), f"{name} moved torch's global generator"
    assert before[1] == after[1], f"{name} moved Python's random"
    assert (before[2] == after[2]).all(), f"{name} moved NumPy's global generator"


def test_the_streams_come_back_even_when_the_call_fails():
    before = _streams()
    with pytest.raises(TypeError):
        hf.to_hf_gpt2("not a model")
    with pytest.raises(ValueError):
        heads.train_induction(heads.InductionConfig(steps=0))
    assert torch.equal(before[0], _streams()[0])


def test_train_induction_is_still_reproducible_and_seeded_by_its_config():
    config = heads.InductionConfig(vocab_size=8, half=8, embed_dim=8, steps=3, log_every=1, batch_size=2,
                                   min_period=2)
    torch.manual_seed(1)
    a = heads.train_induction(config)
    torch.manual_seed(2)
    b = heads.train_induction(config)
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
