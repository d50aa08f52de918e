"""The shared argument checks: each message names the argument, what was expected and what was given."""
import numpy as np
import pytest
import torch

from course_lib import _validate as validate


def test_accepted_values_come_back_in_a_plain_type():
    assert validate.finite_number("x", np.float32(0.5), minimum=0.0) == 0.5
    assert type(validate.positive_int_or_none("k", np.int64(3))) is int
    assert validate.positive_int_or_none("k", None) is None
    assert validate.int_list("dims", (0, 3), minimum=0, below=4) == [0, 3]
    assert validate.boolean("flag", False) is False
    assert validate.is_number(np.float64("nan")) and not validate.is_number(True)


@pytest.mark.parametrize("call, error, message", [
    (lambda: validate.boolean("fused", 1), TypeError, "fused: expected True or False, got 1 (int)"),
    (lambda: validate.finite_number("angle", "north"), ValueError,
     "angle: expected a finite number in [-inf, inf], got 'north' (str)"),
    (lambda: validate.finite_number("t", -1, minimum=0), ValueError, "t: expected a finite number in [0, inf]"),
    (lambda: validate.finite_number("t", float("inf")), ValueError, "t: expected a finite number"),
    (lambda: validate.positive_int_or_none("top_k", 0), ValueError, "top_k: expected None or a positive int, got 0"),
    (lambda: validate.positive_int_or_none("top_k", True), ValueError, "top_k: expected None or a positive int"),
    (lambda: validate.int_list("dims", [4, True]), ValueError,
     "dims: expected a non-empty list of positive ints, got an item True (bool)"),
    (lambda: validate.int_list("dims", "12"), ValueError, "dims: expected a non-empty list of positive ints, got '12'"),
    (lambda: validate.int_list("dims", [5], minimum=0, below=5), ValueError,
     "dims: expected a non-empty list of ints in [0, 5), got an item 5 (int)"),
    (lambda: validate.probability("p", 1.0, hint="0.1 is typical"), ValueError,
     "p: expected a number in [0, 1), got 1.0 (float); 0.1 is typical"),
    (lambda: validate.positive_float("eps", 0), ValueError, "eps: expected a number > 0, got 0 (int)"),
    (lambda: validate.positive_float("seconds", float("inf"), finite=True), ValueError,
     "seconds: expected a finite number > 0, got inf (float)"),
    (lambda: validate.token_ids("ids", torch.tensor([0, 5]), vocab_size=5), ValueError,
     "ids: expected token ids in 0..4 (vocab_size=5), got 5"),
    (lambda: validate.token_ids("targets", torch.tensor([-100, -1]), vocab_size=5, padding=-100), ValueError,
     "targets: expected token ids in 0..4 (vocab_size=5), got -1"),
    (lambda: validate.token_ids("ids", torch.tensor([0.0]), vocab_size=5), TypeError,
     "ids: expected integer token ids (torch.long), got dtype torch.float32"),
    (lambda: validate.expect(False, "keys", "shape (n, 2) to match query of shape (2,)", (3, 3)), ValueError,
     "keys: expected shape (n, 2) to match query of shape (2,), got (3, 3)"),
    (lambda: validate.expect(False, "cache", "a KVCache or None", "3 (int)", TypeError), TypeError,
     "cache: expected a KVCache or None, got 3 (int)"),
    (lambda: validate.divisor("num_heads", 3, 10, "embed_dim=10", "pick a divisor of 10"), ValueError,
     "num_heads: embed_dim=10 must be divisible by num_heads, got num_heads=3; pick a divisor of 10"),
    (lambda: validate.instance("model", 3, torch.nn.Module, "an nn.Module"), TypeError,
     "model: expected an nn.Module, got 3 (int)"),
    (lambda: validate.instance("config", {}, torch.nn.Module, "a GPTConfig", brief=True, hint="build one"), TypeError,
     "config: expected a GPTConfig, got dict; build one"),
    (lambda: validate.instance("state", 0, dict, "a dict or None", or_none=True), TypeError,
     "state: expected a dict or None, got 0 (int)"),
])
def test_messages_name_the_argument(call, error, message):
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value).startswith(message)


def test_one_line_checks_pass_what_they_should():
    validate.expect(True, "k", "anything", "never formatted")
    assert validate.divisor("num_heads", 4, 8, "embed_dim=8") == 4
    assert validate.instance("state", None, dict, "a dict or None", or_none=True) is None
    layer = torch.nn.Linear(1, 1)
    assert validate.instance("model", layer, torch.nn.Module, "an nn.Module") is layer


def test_describe_gives_shapes_not_contents():
    assert validate.describe(torch.zeros(2, 3)) == "a torch.float32 tensor of shape (2, 3)"
    assert validate.describe(np.zeros((2, 3))) == "a float64 array of shape (2, 3)"
    assert validate.describe(list(range(10))) == "a list of length 10"


def test_path_and_number_in_name_the_argument_and_what_was_given(tmp_path):
    from course_lib import _validate as validate
    assert validate.path("out", str(tmp_path)) == tmp_path
    with pytest.raises(TypeError, match=r"^out: expected a folder \(str or os.PathLike\), got 3 \(int\)"):
        validate.path("out", 3, "a folder")
    with pytest.raises(ValueError, match="^out: expected a path, got an empty string"):
        validate.path("out", "")
    assert validate.number_in("p", 1, low=0, high=1, low_open=True) == 1.0
    for bad in (0, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match=r"^p: expected a number in \(0, 1\]"):
            validate.number_in("p", bad, low=0, high=1, low_open=True)


def test_token_ids_in_the_vocabulary_pass_with_their_padding():
    ids = torch.tensor([[0, 4, -100]])
    assert validate.token_ids("targets", ids, dim=2, vocab_size=5, padding=-100) is ids
    assert validate.positive_float("seconds", 1e9, finite=True) == 1e9
