"""Wrong inputs a student can pass to training, attention, generation, data and checkpoint functions.

Each row is one call: it must raise exactly the given type, in one line naming the argument the student
passed and something of what was given (never an AttributeError from inside, nor torch's own text).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from course_lib import attention, checkpoints, data, generate, train
from course_lib.model import GPT, GPTConfig
from course_lib.runs import bench
from course_lib.runs.run_folder import RunRefused

torch.manual_seed(0)
GPT_MODEL = GPT(GPTConfig(vocab_size=10, max_tokens=8, embed_dim=16, num_heads=2, num_layers=1))
OPTIMIZER = torch.optim.AdamW(GPT_MODEL.parameters())
TOKENIZER = data.CharTokenizer("abcdefghij")
X = torch.tensor([[1, 2, 3, 4]])
Y = torch.tensor([[2, 3, 4, 5]])
TOO_HIGH = torch.full((1, 4), 12)
NINE = torch.zeros(1, 9, dtype=torch.long)
LOGITS = torch.randn(1, 3, 10)
Q, K, V = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20


def _text_file(tmp):
    path = tmp / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


CASES = [
    # train
    ("lm_loss list targets", lambda tmp: train.lm_loss(LOGITS, [[1, 2, 3]]), TypeError, ["targets", "list"]),
    ("lm_loss None targets", lambda tmp: train.lm_loss(LOGITS, None), TypeError, ["targets", "None"]),
    ("lm_loss numpy targets", lambda tmp: train.lm_loss(LOGITS, np.array([[1, 2, 3]])), TypeError,
     ["targets", "array of shape (1, 3)"]),
    ("train_step list targets", lambda tmp: train.train_step(GPT_MODEL, OPTIMIZER, X, [[1, 2, 3]]), TypeError,
     ["targets", "list"]),
    ("train_step inputs past vocab", lambda tmp: train.train_step(GPT_MODEL, OPTIMIZER, TOO_HIGH, Y), ValueError,
     ["inputs:", "got 12"]),
    ("train_step inputs past context", lambda tmp: train.train_step(GPT_MODEL, OPTIMIZER, NINE, NINE), ValueError,
     ["inputs:", "9 tokens", "max_tokens=8"]),
    ("evaluate inputs past vocab", lambda tmp: train.evaluate(GPT_MODEL, TOO_HIGH, Y), ValueError,
     ["inputs:", "got 12"]),
    ("evaluate inputs past context", lambda tmp: train.evaluate(GPT_MODEL, NINE, NINE), ValueError,
     ["inputs:", "9 tokens", "max_tokens=8"]),
    ("evaluate model a str", lambda tmp: train.evaluate("gpt", X, Y), TypeError, ["model", "'gpt'"]),
    ("learning_rate config a dict", lambda tmp: train.learning_rate({"warmup": 1}, 0, 0.5), TypeError,
     ["config", "dict"]),
    ("learning_rate progress nan", lambda tmp: train.learning_rate(train.TrainConfig(), 500, math.nan), ValueError,
     ["progress", "nan"]),
    # attention
    ("sdpa k a list", lambda tmp: attention.scaled_dot_product_attention(Q, [[1.0]], V), TypeError, ["k", "list"]),
    ("sdpa k None", lambda tmp: attention.scaled_dot_product_attention(Q, None, V), TypeError, ["k", "None"]),
    ("sdpa k 1-d", lambda tmp: attention.scaled_dot_product_attention(Q, torch.randn(4), V), ValueError,
     ["k", "(4,)"]),
    ("attention_weights k float64", lambda tmp: attention.attention_weights(Q, K.double()), TypeError,
     ["k", "torch.float64"]),
    ("attention_weights batches differ", lambda tmp: attention.attention_weights(Q, torch.randn(3, 5, 4)), ValueError,
     ["k", "(3, 5, 4)"]),
    ("attention_weights mask batch", lambda tmp: attention.attention_weights(Q, K, torch.ones(3, 3, 5, dtype=torch.bool)),
     ValueError, ["mask", "(3, 3, 5)"]),
    ("sdpa v float64", lambda tmp: attention.scaled_dot_product_attention(Q, K, V.double()), TypeError,
     ["v", "torch.float64"]),
    ("toy_attention dtypes differ",
     lambda tmp: attention.toy_attention(torch.ones(2, dtype=torch.float64), attention.TOY_KEYS, attention.TOY_VALUES),
     TypeError, ["keys", "query", "torch.float64"]),
    ("sdpa v invents a batch",
     lambda tmp: attention.scaled_dot_product_attention(Q[:1], K[:1], torch.randn(3, 5, 6)), ValueError,
     ["v", "(3, 5, 6)"]),
    ("attention_weights d = 0", lambda tmp: attention.attention_weights(torch.randn(3, 0), torch.randn(5, 0)),
     ValueError, ["q", "(3, 0)"]),
    ("causal_mask device 'gpu'", lambda tmp: attention.causal_mask(4, device="gpu"), ValueError, ["device", "'gpu'"]),
    ("causal_mask device True", lambda tmp: attention.causal_mask(4, device=True), TypeError, ["device", "True"]),
    ("KVCache v float64",
     lambda tmp: attention.KVCache(8).append(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4, dtype=torch.float64)),
     TypeError, ["v", "torch.float64"]),
    # generate
    ("generate generator 0", lambda tmp: generate.generate(GPT_MODEL, X, 3, generator=0), TypeError,
     ["generator", "0 (int)"]),
    ("sample_next_token generator 42", lambda tmp: generate.sample_next_token(torch.randn(1, 10), generator=42),
     TypeError, ["generator", "42 (int)"]),
    ("generate_with_cache empty prompt", lambda tmp: generate.generate_with_cache(GPT_MODEL, X[:, :0], 2), ValueError,
     ["idx", "(1, 0)"]),
    ("generate_text tokenizer None", lambda tmp: generate.generate_text(GPT_MODEL, None, "ab"), TypeError,
     ["tokenizer", "None"]),
    ("generate_text swapped", lambda tmp: generate.generate_text(TOKENIZER, GPT_MODEL, "ab"), TypeError,
     ["model", "CharTokenizer"]),
    ("generate_text tokenizer a str", lambda tmp: generate.generate_text(GPT_MODEL, "abcdefghij", "ab"), TypeError,
     ["tokenizer", "'abcdefghij'"]),
    ("generate swapped", lambda tmp: generate.generate(X, GPT_MODEL, 3), TypeError, ["idx", "a GPT (nn.Module)"]),
    # data, corpora, checkpoints
    ("char_corpus a capital", lambda tmp: data.char_corpus("Tinyshakespeare"), ValueError,
     ["name_or_text", "'Tinyshakespeare'", "did you mean 'tinyshakespeare'"]),
    ("char_corpus part of a name", lambda tmp: data.char_corpus("shakespeare"), ValueError,
     ["name_or_text", "'shakespeare'", "did you mean 'tinyshakespeare'"]),
    ("char_corpus too short", lambda tmp: data.char_corpus("a"), ValueError, ["name_or_text", "1 characters"]),
    ("corpus_splits max_tokens 0", lambda tmp: data.corpus_splits(_text_file(tmp), 0), ValueError,
     ["max_tokens", "got 0"]),
    ("corpus_splits max_tokens -5", lambda tmp: data.corpus_splits(_text_file(tmp), -5), ValueError,
     ["max_tokens", "got -5"]),
    ("corpus_splits max_tokens '8'", lambda tmp: data.corpus_splits(_text_file(tmp), "8"), ValueError,
     ["max_tokens", "'8'"]),
    ("Examples without rows",
     lambda tmp: data.Examples(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long))
     .sample(2, 4, torch.Generator()), ValueError, ["inputs", "(0, 4)"]),
    ("CharTokenizer ''", lambda tmp: data.CharTokenizer(""), ValueError, ["chars", "'' (str)"]),
    ("load_text ''", lambda tmp: data.load_text(""), ValueError, ["path", "''"]),
    ("split_by_position too few", lambda tmp: data.split_by_position(torch.tensor([1])), ValueError,
     ["ids", "1 tokens"]),
    ("load_checkpoint a folder", lambda tmp: checkpoints.load_checkpoint(tmp), IsADirectoryError,
     ["path", "is a folder"]),
    ("save_checkpoint path None", lambda tmp: checkpoints.save_checkpoint(None, GPT_MODEL), TypeError,
     ["path", "None"]),
    # the command line's benchmark: --seconds inf as `train --seconds inf` refuses it (steps 0: never runs)
    ("bench --seconds inf", lambda tmp: bench.main(["training", "--seconds", "inf", "--steps", "0", "--device", "cpu"]),
     RunRefused, ["seconds", "inf"]),
    ("training_benchmark seconds inf", lambda tmp: bench.training_benchmark(math.inf, steps=0), ValueError,
     ["seconds", "inf"]),
]


@pytest.mark.parametrize("call, error, words", [pytest.param(*row[1:], id=row[0]) for row in CASES])
def test_a_wrong_input_is_named_in_one_line(call, error, words, tmp_path):
    with pytest.raises(Exception) as raised:
        call(tmp_path)
    message = str(raised.value)
    assert type(raised.value) is error, f"{type(raised.value).__name__}: {message}"
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


def test_what_the_checks_now_accept_gives_the_same_results():
    # any integer dtype of token ids, as token_ids promises, and numpy integers wherever an int is asked for
    targets = torch.tensor([[1, 2, 3]])
    assert torch.equal(train.lm_loss(LOGITS, targets.int()), train.lm_loss(LOGITS, targets))
    assert train.evaluate(GPT_MODEL, X.int(), Y.int()) == train.evaluate(GPT_MODEL, X, Y)
    assert torch.equal(attention.causal_mask(np.int64(4)), attention.causal_mask(4))
    assert train.TrainConfig(batch_size=np.int64(4)).batch_size == 4
    assert GPTConfig(vocab_size=np.int64(10), max_tokens=np.int32(8)).vocab_size == 10
    # ... and kept as plain ints, so that a config saves as JSON (a checkpoint's config)
    assert json.loads(json.dumps(GPTConfig(vocab_size=np.int64(10), max_tokens=np.int32(8)).to_dict()))["vocab_size"] == 10
