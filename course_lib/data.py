"""Corpora, tokenizers and language-model datasets.

The path from a file on disk to batches a GPT can learn from:
text -> tokenizer -> token ids -> windows of ``max_tokens + 1`` -> (inputs, targets).

The two corpora are found, verified and downloaded by ``course_lib.corpora`` (its names
are re-exported here, so ``data.load_corpus("tinyshakespeare")`` works as the notebooks teach).
"""
from __future__ import annotations

import difflib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from . import _validate as validate
from .corpora import (
    CORPORA,
    Corpus,
    CorpusError,
    CorpusLocation,
    corpus_path,
    download_corpus,
    load_corpus,
    load_text,
    locate_corpus,
)

__all__ = [
    "IGNORE_INDEX",
    "Corpus",
    "CORPORA",
    "CorpusError",
    "CorpusLocation",
    "locate_corpus",
    "corpus_path",
    "load_corpus",
    "download_corpus",
    "load_text",
    "CharTokenizer",
    "train_subword_tokenizer",
    "lm_windows",
    "split_by_position",
    "random_batch",
    "load_names",
    "names_tokenizer",
    "split_names",
    "names_dataset",
    "Split",
    "TokenStream",
    "Examples",
    "CharCorpus",
    "char_corpus",
    "corpus_splits",
]

# Targets equal to this are skipped by cross-entropy (PyTorch's default ignore_index).
IGNORE_INDEX = -100


# --------------------------------------------------------------------------- tokenizers

REPLACEMENT_CHAR = "\ufffd"
UNKNOWN_POLICIES = ("error", "skip", "replace")


class CharTokenizer:
    """One token per character, in the order given; ``unknown`` says what to do with unseen ones."""

    def __init__(self, chars: str | Sequence[str], unknown: str = "error") -> None:
        validate.one_of("unknown", unknown, UNKNOWN_POLICIES)
        given = chars
        if isinstance(chars, str):
            chars = list(chars)
        if not isinstance(chars, (list, tuple)) or not chars:
            raise ValueError(f"chars: expected a non-empty string or list of characters, "
                             f"got {validate.describe(given)}")
        seen: set[str] = set()
        for i, ch in enumerate(chars):
            if not isinstance(ch, str) or len(ch) != 1:
                raise ValueError(f"chars: expected single characters, got {ch!r} at index {i}")
            if ch in seen:
                raise ValueError(f"chars: each character must appear once, {ch!r} repeats at index {i}")
            seen.add(ch)
        chars = list(chars)
        if unknown == "replace" and REPLACEMENT_CHAR not in seen:
            chars.append(REPLACEMENT_CHAR)  # reserved id (the last one) for every unseen character
        self.unknown = unknown
        self.chars = "".join(chars)
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.itos = {i: ch for i, ch in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str, unknown: str = "error") -> CharTokenizer:
        """The vocabulary of ``text``: its distinct characters, sorted."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"text: expected a non-empty string, got {validate.describe(text)}")
        return cls(sorted(set(text)), unknown=unknown)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        preview = self.chars if len(self.chars) <= 40 else self.chars[:37] + "..."
        return f"CharTokenizer(vocab_size={self.vocab_size}, unknown={self.unknown!r}, chars={preview!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CharTokenizer):
            return NotImplemented
        return (self.chars, self.unknown) == (other.chars, other.unknown)

    __hash__ = None  # type: ignore[assignment]  # mutable attributes, like a dict

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {validate.describe(text)}")
        stoi = self.stoi
        try:
            return [stoi[ch] for ch in text]  # fast path: every character known
        except KeyError:
            pass
        if self.unknown == "skip":
            return [stoi[ch] for ch in text if ch in stoi]
        if self.unknown == "replace":
            fallback = stoi[REPLACEMENT_CHAR]
            return [stoi.get(ch, fallback) for ch in text]
        unseen: dict[str, int] = {}
        for i, ch in enumerate(text):
            if ch not in stoi and ch not in unseen:
                unseen[ch] = i
        listed = [f"{ch!r} (at index {i})" for ch, i in list(unseen.items())[:10]]
        more = f" and {len(unseen) - 10} more" if len(unseen) > 10 else ""
        raise ValueError(f"text: characters never seen in training: {', '.join(listed)}{more}; "
                         f'pass unknown="replace" or "skip" to the tokenizer to accept them')

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a list of token ids or a 1-D tensor of them."""
        if isinstance(ids, torch.Tensor):
            validate.token_ids("ids", ids, dim=1)
            ids = ids.tolist()
        elif not isinstance(ids, (list, tuple)):
            raise TypeError(f"ids: expected a list of ints or a 1-D integer tensor, got {validate.describe(ids)}")
        itos = self.itos
        out = []
        for pos, i in enumerate(ids):
            if isinstance(i, bool) or not isinstance(i, Integral):
                raise TypeError(f"ids: expected integer token ids, got {i!r} at position {pos}")
            ch = itos.get(int(i))
            if ch is None:
                hint = " (IGNORE_INDEX padding: drop it before decoding)" if i == IGNORE_INDEX else ""
                raise ValueError(f"ids: token id {i} at position {pos} is outside the vocabulary "
                                 f"0..{self.vocab_size - 1}{hint}")
            out.append(ch)
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description (saved next to checkpoints)."""
        return {"type": "CharTokenizer", "chars": self.chars, "unknown": self.unknown}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CharTokenizer:
        """Rebuild a tokenizer saved with ``to_dict``."""
        if not isinstance(d, dict) or "chars" not in d:
            raise ValueError(f"d: expected a dict from CharTokenizer.to_dict() with key 'chars', "
                             f"got {validate.describe(d)}")
        if d.get("type", "CharTokenizer") != "CharTokenizer":
            raise ValueError(f"d: expected type 'CharTokenizer', got {d['type']!r}")
        return cls(d["chars"], unknown=d.get("unknown", "error"))


ENDOFTEXT = "<|endoftext|>"


def train_subword_tokenizer(text: str, vocab_size: int = 512, min_frequency: int = 2):
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``text`` locally; nothing is downloaded.

    Returns a ``transformers.PreTrainedTokenizerFast`` whose bos, eos and unk token is
    ``"<|endoftext|>"``. Byte level means any text encodes, even characters never seen.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not isinstance(text, str) or not text:
        raise ValueError(f"text: expected a non-empty string, got {validate.describe(text)}")
    validate.positive_int("vocab_size", vocab_size)
    validate.positive_int("min_frequency", min_frequency)
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols
    smallest = len(alphabet) + 1
    if vocab_size < smallest:
        raise ValueError(f"vocab_size: expected at least {smallest} (256 bytes + {ENDOFTEXT}), "
                         f"got {vocab_size}")
    # Each merge joins two tokens that occur in the text, so a text of n bytes allows at most
    # n - 1 merges. Asking far more makes the trainer reserve memory for them (10**9 kills the process).
    largest = smallest + max(len(text.encode("utf-8")) - 1, 0)
    if vocab_size > largest:
        raise ValueError(f"vocab_size: expected at most {largest} for this text of "
                         f"{len(text.encode('utf-8'))} bytes (256 bytes + {ENDOFTEXT} + at most one merge "
                         f"per byte), got {vocab_size}")

    backend = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text exactly.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[ENDOFTEXT], initial_alphabet=alphabet,
                                  show_progress=False)
    backend.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=ENDOFTEXT, eos_token=ENDOFTEXT,
                                   unk_token=ENDOFTEXT, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------- LM datasets

def _check_fraction(name: str, value: Any) -> float:
    return validate.number_in(name, value, low=0, high=1, low_open=True, high_open=True)


def _check_enough_tokens(ids: torch.Tensor, max_tokens: int) -> None:
    if ids.numel() < max_tokens + 1:
        raise ValueError(f"ids: need at least max_tokens + 1 = {max_tokens + 1} tokens for one "
                         f"window (inputs and the targets one step ahead), got {ids.numel()}")


def lm_windows(ids: torch.Tensor, max_tokens: int, stride: int | None = None):
    """Cut ``ids`` into (inputs, targets) windows, targets being inputs shifted by one.

    ids (T,) -> inputs, targets each (num_windows, max_tokens). Windows start every
    ``stride`` tokens (default ``max_tokens``: each token is a target once); a last
    window that does not fit is dropped. The results are views of ``ids`` when it is long.
    """
    validate.token_ids("ids", ids, dim=1)
    validate.positive_int("max_tokens", max_tokens)
    stride = max_tokens if stride is None else validate.positive_int("stride", stride)
    _check_enough_tokens(ids, max_tokens)
    windows = ids.long().unfold(0, max_tokens + 1, stride)  # (num_windows, max_tokens + 1)
    inputs = windows[:, :-1]                                # (num_windows, max_tokens)
    targets = windows[:, 1:]                                # (num_windows, max_tokens)
    return inputs, targets


def split_by_position(ids: torch.Tensor, train_fraction: float = 0.9):
    """First ``train_fraction`` of the tokens for training, the rest for validation."""
    validate.token_ids("ids", ids, dim=1)
    try:
        return _split_at(ids, train_fraction)
    except _TooFewToSplit as exc:
        raise ValueError(str(exc)) from None   # the private class is corpus_splits' business


def _split_at(ids: torch.Tensor, train_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    # ids already checked (or made here by a tokenizer)
    fraction = _check_fraction("train_fraction", train_fraction)
    n_train = int(ids.numel() * fraction)
    if n_train == 0 or n_train == ids.numel():
        raise _TooFewToSplit(f"ids: {ids.numel()} tokens are too few to split with "
                             f"train_fraction={train_fraction} (one side would be empty)", ids.numel())
    return ids[:n_train], ids[n_train:]


class _TooFewToSplit(ValueError):
    """A text too short for a training and a validation part (corpus_splits says what it needs).

    Private: the public functions turn it into a plain ValueError naming their own argument."""

    def __init__(self, message: str, count: int):
        super().__init__(message)
        self.count = count


def random_batch(ids: torch.Tensor, batch_size: int, max_tokens: int,
                 generator: torch.Generator | None = None, device: str | torch.device | None = None):
    """``batch_size`` windows at random positions: (inputs, targets), each (batch_size, max_tokens), long."""
    validate.token_ids("ids", ids, dim=1)
    validate.positive_int("batch_size", batch_size)
    validate.positive_int("max_tokens", max_tokens)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {validate.describe(generator)}")
    _check_enough_tokens(ids, max_tokens)
    high = ids.numel() - max_tokens  # last start whose targets still fit
    gen_device = generator.device if generator is not None else torch.device("cpu")
    starts = torch.randint(high, (batch_size,), generator=generator, device=gen_device)  # (B,)
    offsets = torch.arange(max_tokens + 1, device=gen_device)                            # (max_tokens + 1,)
    index = (starts[:, None] + offsets).to(ids.device)                                   # (B, max_tokens + 1)
    windows = ids[index].long()                                                          # (B, max_tokens + 1)
    target_device = ids.device if device is None else validate.device("device", device)
    windows = windows.to(target_device)
    return windows[:, :-1], windows[:, 1:]                                               # (B, max_tokens) x2


# --------------------------------------------------------------------------- names (makemore)

BOUNDARY = "."  # starts and ends every name; id 0 in names_tokenizer


def _check_names(names: Any) -> list[str]:
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError(f"names: expected a non-empty list of strings, got {validate.describe(names)}")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise ValueError(f"names: expected non-empty strings, got {name!r} at index {i}")
        if BOUNDARY in name:
            raise ValueError(f"names: {name!r} at index {i} contains {BOUNDARY!r}, "
                             f"which is reserved as the start/end token")
    return list(names)


def load_names(download: bool = True) -> list[str]:
    """The names corpus: one lowercase name per line, empty lines dropped."""
    return [line.strip() for line in load_corpus("names", download=download).splitlines() if line.strip()]


def names_tokenizer(names: Sequence[str]) -> CharTokenizer:
    """A character tokenizer for ``names`` whose id 0 is the boundary token "."."""
    names = _check_names(names)
    letters = sorted(set("".join(names)))
    return CharTokenizer([BOUNDARY] + letters)


def split_names(names: Sequence[str], train_fraction: float = 0.9, seed: int = 1234):
    """Shuffle a copy of ``names`` with a fixed seed and split it: (train_names, val_names)."""
    names = _check_names(names)
    fraction = _check_fraction("train_fraction", train_fraction)
    validate.non_negative_int("seed", seed)
    shuffled = list(names)
    random.Random(seed).shuffle(shuffled)  # its own RNG: the split never depends on global state
    n_train = int(len(shuffled) * fraction)
    if n_train == 0 or n_train == len(shuffled):
        raise ValueError(f"names: {len(shuffled)} names are too few to split with "
                         f"train_fraction={train_fraction} (one side would be empty)")
    return shuffled[:n_train], shuffled[n_train:]


def names_dataset(names: Sequence[str], tokenizer: CharTokenizer, max_tokens: int):
    """One row per name: inputs "." + name (padded with "."), targets name + "." then IGNORE_INDEX.

    -> inputs, targets each (num_names, max_tokens), long.
    """
    names = _check_names(names)
    if not isinstance(tokenizer, CharTokenizer) or BOUNDARY not in tokenizer.stoi:
        raise ValueError(f"tokenizer: expected a CharTokenizer with the boundary token {BOUNDARY!r} "
                         f"(build it with names_tokenizer(names)), got {validate.describe(tokenizer)}")
    validate.positive_int("max_tokens", max_tokens)
    longest = max(names, key=len)
    if len(longest) + 1 > max_tokens:
        raise ValueError(f"max_tokens: the longest name {longest!r} has {len(longest)} characters and "
                         f"needs max_tokens >= {len(longest) + 1} (one more for the boundary), "
                         f"got {max_tokens}")
    boundary = tokenizer.stoi[BOUNDARY]
    inputs = torch.full((len(names), max_tokens), boundary, dtype=torch.long)     # (num_names, max_tokens)
    targets = torch.full((len(names), max_tokens), IGNORE_INDEX, dtype=torch.long)  # (num_names, max_tokens)
    for row, name in enumerate(names):
        try:
            ids = tokenizer.encode(name)
        except ValueError as exc:
            raise ValueError(f"names: name {name!r} at index {row} cannot be encoded: {exc}") from None
        n = len(ids)
        inputs[row, 1:n + 1] = torch.as_tensor(ids)
        targets[row, :n] = torch.as_tensor(ids)
        targets[row, n] = boundary
    return inputs, targets


# --------------------------------------------------------------------------- splits: what train() reads

@runtime_checkable
class Split(Protocol):
    """What train() needs from a split: random batches to train on, fixed windows to evaluate."""

    def sample(self, batch_size: int, max_tokens: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]: ...

    def eval_windows(self, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class TokenStream:
    """One long run of token ids: random windows to train on, consecutive windows to evaluate."""

    def __init__(self, ids: torch.Tensor):
        self.ids = validate.token_ids("ids", ids, dim=1).long()

    @classmethod
    def _of(cls, ids: torch.Tensor) -> TokenStream:
        """From ids a tokenizer here just made: checked once, where they came in (the text)."""
        stream = cls.__new__(cls)
        stream.ids = ids
        return stream

    def sample(self, batch_size: int, max_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows at random positions (the course's one batcher, random_batch)."""
        return random_batch(self.ids, batch_size, max_tokens, generator=generator)   # (B, max_tokens) x2

    def eval_windows(self, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return lm_windows(self.ids, max_tokens)


class Examples:
    """Fixed, padded examples (one name per row): random rows to train on, all rows to evaluate."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs = validate.token_ids("inputs", inputs, dim=2).long()
        self.targets = validate.token_ids("targets", targets, dim=2).long()
        if inputs.shape != targets.shape:
            raise ValueError(f"targets: expected shape {tuple(inputs.shape)}, got {tuple(targets.shape)}")
        if inputs.shape[0] == 0:   # nothing to sample or evaluate
            raise ValueError(f"inputs: expected at least one example (row), got shape {tuple(inputs.shape)}")

    @classmethod
    def _of(cls, inputs: torch.Tensor, targets: torch.Tensor) -> Examples:
        """From rows names_dataset just made: checked once, where they came in (the names)."""
        examples = cls.__new__(cls)
        examples.inputs, examples.targets = inputs, targets
        return examples

    def sample(self, batch_size: int, max_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        validate.positive_int("batch_size", batch_size)
        rows = torch.randint(self.inputs.shape[0], (batch_size,), generator=generator)
        return self.inputs[rows], self.targets[rows]

    def eval_windows(self, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets


# --------------------------------------------------------------------------- convenience

@dataclass
class CharCorpus:
    """A character-level corpus ready for training: its tokenizer and the two splits."""

    tokenizer: CharTokenizer
    train_ids: torch.Tensor
    val_ids: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def char_corpus(name_or_text: str | os.PathLike, train_fraction: float = 0.9) -> CharCorpus:
    """A corpus name ("tinyshakespeare"), a Path to a UTF-8 file, or the text itself -> tokenizer and splits.

    A file is read only when given as a ``pathlib.Path``: a string is a corpus name or text, and a
    string that looks like a file path (one word with a slash or a file extension) or like a misspelt
    corpus name (one short word close to one: "Tinyshakespeare") is refused, rather than trained on as
    its own characters.
    """
    try:
        return _char_corpus(name_or_text, train_fraction)
    except _TooFewToSplit as exc:
        raise ValueError(f"name_or_text: {exc.count} characters are too few to split with "
                         f"train_fraction={train_fraction} (one side would be empty); pass a longer text") from None


def _char_corpus(name_or_text: str | os.PathLike, train_fraction: float) -> CharCorpus:
    # char_corpus, raising _TooFewToSplit for a text too short (corpus_splits says what it needs instead)
    if isinstance(name_or_text, os.PathLike):
        text = load_text(name_or_text)
    elif isinstance(name_or_text, str) and name_or_text in CORPORA:
        text = load_corpus(name_or_text)
    elif isinstance(name_or_text, str) and name_or_text:
        if _looks_like_a_path(name_or_text):
            raise ValueError(f"name_or_text: got {name_or_text!r}, which looks like a file path, not text; "
                             f"read the file with char_corpus(Path({name_or_text!r})) (from pathlib import "
                             f"Path), or pass the text itself")
        close = _close_corpus_name(name_or_text)
        if close is not None:
            raise ValueError(f"name_or_text: got {name_or_text!r}, which looks like a misspelt corpus name, not "
                             f"text; did you mean {close!r}? (the corpora are {sorted(CORPORA)}, in lower case)")
        text = name_or_text
    else:
        raise ValueError(f"name_or_text: expected one of {sorted(CORPORA)}, a Path to a text file, "
                         f"or non-empty text, got {validate.describe(name_or_text)}")
    tokenizer = CharTokenizer.from_text(text)
    ids = torch.as_tensor(tokenizer.encode(text), dtype=torch.long)  # (num_chars,)
    train_ids, val_ids = _split_at(ids, train_fraction)
    return CharCorpus(tokenizer, train_ids, val_ids)


def corpus_splits(corpus: str | os.PathLike, max_tokens: int) -> tuple[CharTokenizer, Split, Split]:
    """A corpus ready for train(): (tokenizer, train_split, val_split).

    ``"names"``: one padded row per name (:class:`Examples`); any other corpus name, or the path of
    a UTF-8 text file: one long run of characters (:class:`TokenStream`).
    """
    max_tokens = validate.positive_int("max_tokens", max_tokens)
    if isinstance(corpus, str) and corpus == "names":
        names = load_names()
        tokenizer = names_tokenizer(names)
        train_names, val_names = split_names(names)
        return (tokenizer, Examples._of(*names_dataset(train_names, tokenizer, max_tokens)),
                Examples._of(*names_dataset(val_names, tokenizer, max_tokens)))
    source = corpus if isinstance(corpus, str) and corpus in CORPORA else _corpus_file(corpus)
    # each part must hold at least one window of max_tokens + 1 characters; the validation part is 10%
    too_short = ValueError(f"corpus: {source} is too short to train on: a character-level run with "
                           f"max_tokens={max_tokens} needs at least {10 * (max_tokens + 1)} characters (a training "
                           f"part and a validation part of 10%, each at least one window of {max_tokens + 1}), "
                           f"and a few thousand to learn anything; use a longer text")
    try:
        prepared = _char_corpus(source, 0.9)
    except _TooFewToSplit:
        raise too_short from None
    if min(prepared.train_ids.numel(), prepared.val_ids.numel()) < max_tokens + 1:
        raise too_short
    return prepared.tokenizer, TokenStream._of(prepared.train_ids), TokenStream._of(prepared.val_ids)


def _corpus_file(corpus: str | os.PathLike) -> Path:
    """The file a corpus argument names; a name that is neither a known corpus nor a file lists the corpora."""
    if not isinstance(corpus, (str, os.PathLike)) or not str(corpus).strip():
        raise TypeError(f"corpus: expected one of {sorted(CORPORA)} or the path of a UTF-8 text file, got "
                        f"{validate.describe(corpus)}")
    file = Path(corpus).expanduser()
    if not file.exists():
        close = [name for name in CORPORA if name.lower() == str(corpus).strip().lower()]
        hint = f"; did you mean {close[0]!r}? (names are lower case)" if close else \
            f" (no file at {file.absolute()})"
        raise FileNotFoundError(f"corpus: expected one of {sorted(CORPORA)} or the path of a UTF-8 text file, "
                                f"got {str(corpus)!r}{hint}")
    return file


def _close_corpus_name(text: str) -> str | None:
    """The corpus that a short one-word string seems to misspell ("Tinyshakespeare", "shakespeare"), or None.

    Text worth training on is longer, or has spaces or line breaks."""
    if len(text) > 40 or any(c.isspace() for c in text):
        return None
    word = text.lower()
    close = difflib.get_close_matches(word, sorted(CORPORA), n=1, cutoff=0.7)
    if close:
        return close[0]
    return next((name for name in sorted(CORPORA) if len(word) >= 5 and word in name), None)


def _looks_like_a_path(text: str) -> bool:
    # Text worth training on has spaces or line breaks; a path, as typed, usually has neither.
    if any(c.isspace() for c in text) or len(text) > 4096:
        return False
    return "/" in text or "\\" in text or Path(text).suffix != "" or Path(text).exists()
