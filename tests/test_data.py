"""Tests for course_lib.data: corpora on disk and over a (fake) network, tokenizers, LM datasets."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from course_lib import corpora
from course_lib.data import (
    CORPORA,
    IGNORE_INDEX,
    CharTokenizer,
    Corpus,
    CorpusError,
    char_corpus,
    corpus_path,
    download_corpus,
    lm_windows,
    load_corpus,
    load_names,
    load_text,
    locate_corpus,
    names_dataset,
    names_tokenizer,
    random_batch,
    split_by_position,
    split_names,
    train_subword_tokenizer,
)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def shared_data(monkeypatch):
    """Point COURSE_DATA_DIR at the read-only shared copies of the real corpora."""
    missing = [c.filename for c in CORPORA.values() if not (SHARED_DATA / c.filename).is_file()]
    assert not missing, (f"the shared corpora {missing} are missing from {SHARED_DATA}; "
                         f"these tests verify the real files and need them there")
    monkeypatch.setenv("COURSE_DATA_DIR", str(SHARED_DATA))
    return SHARED_DATA


@pytest.fixture
def empty_dirs(tmp_path, monkeypatch, isolated_user_data_dir):
    """COURSE_DATA_DIR, the per-user folder and the checkout's data/ folder, all empty."""
    env_dir, repo_dir = tmp_path / "env", tmp_path / "repo"
    env_dir.mkdir()
    repo_dir.mkdir()
    isolated_user_data_dir.mkdir()
    monkeypatch.setenv("COURSE_DATA_DIR", str(env_dir))
    monkeypatch.setattr(corpora, "REPO_DATA_DIR", repo_dir)
    return env_dir, repo_dir


def _no_network(*args, **kwargs):
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


def _serve(monkeypatch, payload: bytes) -> list:
    """Make urlopen return ``payload``; returns the list of (url, kwargs) it was called with."""
    calls = []

    def fake_urlopen(url, *args, **kwargs):
        calls.append((url, kwargs))
        return io.BytesIO(payload)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    return calls


def _small_corpus(monkeypatch, payload: bytes) -> Corpus:
    """Swap the names corpus for one whose checksum is that of ``payload``."""
    small = Corpus("names", "names.txt", "https://example.invalid/names.txt",
                   hashlib.sha256(payload).hexdigest(), len(payload))
    monkeypatch.setitem(CORPORA, "names", small)
    return small


# --------------------------------------------------------------------------- the real corpora

def test_shared_corpora_are_found_and_verified(shared_data):
    for name, corpus in CORPORA.items():
        location = locate_corpus(name)
        assert location.path == shared_data / corpus.filename
        assert location.checksum_ok is True and location.ok
        assert location.searched[0] == shared_data
        assert hashlib.sha256(location.path.read_bytes()).hexdigest() == corpus.sha256
    assert CORPORA["tinyshakespeare"].sha256 == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert CORPORA["names"].sha256 == "0a30b5557f192f32ab962680889aac5f6fda0f4cecf40a6d0b5694f58ea8cc4d"


def test_tinyshakespeare_char_split_matches_published_baselines(shared_data):
    text = load_corpus("tinyshakespeare", download=False)
    assert len(text) == 1_115_394
    corpus = char_corpus("tinyshakespeare")
    assert corpus.tokenizer.vocab_size == 65
    assert (corpus.train_ids.numel(), corpus.val_ids.numel()) == (1_003_854, 111_540)
    assert corpus.train_ids.dtype == torch.long
    assert corpus.tokenizer.decode(corpus.val_ids[-20:]) == text[-20:]


def test_names_corpus_and_deterministic_split(shared_data):
    names = load_names(download=False)
    assert len(names) == 32_033
    assert names[0] == "emma" and all(n and n == n.strip() for n in names)
    before = list(names)
    train, val = split_names(names)
    assert names == before, "split_names must not shuffle its argument in place"
    assert (len(train), len(val)) == (28_829, 3_204)
    assert sorted(train + val) == sorted(names)
    assert split_names(names) == (train, val)
    assert split_names(names, seed=1)[0] != train
    assert train[:200] != names[:200], "names must be shuffled before splitting"


def test_checksum_is_cached_per_path_mtime_and_size(tmp_path, monkeypatch):
    payload = b"anna\nbob\n"
    _small_corpus(monkeypatch, payload)
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    (tmp_path / "names.txt").write_bytes(payload)
    hashed = []
    real_hash = corpora._hash_file
    monkeypatch.setattr(corpora, "_hash_file", lambda path: hashed.append(path) or real_hash(path))
    assert locate_corpus("names").checksum_ok is True
    assert locate_corpus("names").checksum_ok is True
    assert load_corpus("names") == "anna\nbob\n"
    assert len(hashed) == 1
    (tmp_path / "names.txt").write_bytes(b"anna\nbox\n")  # same size, new contents and mtime
    os.utime(tmp_path / "names.txt", ns=(1, 1))
    assert locate_corpus("names").checksum_ok is False
    assert len(hashed) == 2


# --------------------------------------------------------------------------- missing, corrupt, downloads

def test_locate_never_downloads(empty_dirs, monkeypatch):
    env_dir, repo_dir = empty_dirs
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("locate_corpus downloaded"))
    location = locate_corpus("tinyshakespeare")
    assert location.path is None and location.checksum_ok is None and not location.ok
    assert location.searched == [env_dir, corpora.user_data_dir(), repo_dir]


def test_offline_missing_corpus_says_where_to_put_it(empty_dirs, monkeypatch):
    env_dir, repo_dir = empty_dirs
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    corpus = CORPORA["tinyshakespeare"]
    with pytest.raises(CorpusError) as info:
        load_corpus("tinyshakespeare")
    message = str(info.value)
    for needed in (corpus.url, corpus.sha256, str(env_dir / corpus.filename),
                   str(repo_dir / corpus.filename), "COURSE_DATA_DIR", "internet"):
        assert needed in message
    assert info.value.__cause__ is None and info.value.__suppress_context__, "one error, not a chain"
    assert list(env_dir.iterdir()) == [] and list(repo_dir.iterdir()) == []


def test_missing_corpus_without_download_does_not_touch_network(empty_dirs, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(CorpusError, match="download=False") as info:
        corpus_path("names", download=False)
    assert CORPORA["names"].url in str(info.value)


def test_corrupt_local_file_names_expected_sha(empty_dirs, monkeypatch):
    env_dir, repo_dir = empty_dirs
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("overwrote a local file"))
    bad = repo_dir / "names.txt"
    bad.write_text("emma\nolivia\n")
    location = locate_corpus("names")
    assert location.path == bad and location.checksum_ok is False
    with pytest.raises(CorpusError) as info:
        load_names()
    assert CORPORA["names"].sha256 in str(info.value)
    assert str(bad) in str(info.value)
    assert bad.read_text() == "emma\nolivia\n", "a user's file is reported, never deleted"


class _BrokenStream(io.BytesIO):
    def read(self, *args):
        if self.tell() > 0:
            raise ConnectionResetError("connection reset by peer")
        return super().read(4)


@pytest.mark.parametrize("response", ["wrong bytes", "too many bytes", "dies midway"])
def test_bad_download_leaves_no_file_behind(empty_dirs, monkeypatch, response):
    env_dir, repo_dir = empty_dirs
    _small_corpus(monkeypatch, b"anna\nbob\n")
    stream = {"wrong bytes": io.BytesIO(b"anna\nbox\n"),
              "too many bytes": io.BytesIO(b"anna\nbob\n" * 1000),
              "dies midway": _BrokenStream(b"anna\nbob\n")}[response]
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: stream)
    with pytest.raises(CorpusError, match="Nothing was saved") as info:
        corpus_path("names")
    assert CORPORA["names"].sha256 in str(info.value)
    assert list(env_dir.iterdir()) == [] and list(repo_dir.iterdir()) == []


def test_good_download_lands_verified_in_course_data_dir(empty_dirs, monkeypatch):
    env_dir, repo_dir = empty_dirs
    payload = "anna\nbob\nzoë\n".encode()
    _small_corpus(monkeypatch, payload)
    calls = _serve(monkeypatch, payload)
    path = corpus_path("names")
    assert path == env_dir / "names.txt" and path.read_bytes() == payload
    assert [p.name for p in env_dir.iterdir()] == ["names.txt"] and list(repo_dir.iterdir()) == []
    assert calls[0][0] == "https://example.invalid/names.txt" and calls[0][1].get("timeout")
    assert locate_corpus("names").ok
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("downloaded twice"))
    assert load_names() == ["anna", "bob", "zoë"]


def test_download_without_course_data_dir_goes_to_the_per_user_folder(tmp_path, monkeypatch,
                                                                      isolated_user_data_dir):
    monkeypatch.delenv("COURSE_DATA_DIR", raising=False)
    monkeypatch.setattr(corpora, "REPO_DATA_DIR", tmp_path / "repo")
    payload = b"anna\n"
    _small_corpus(monkeypatch, payload)
    _serve(monkeypatch, payload)
    assert load_corpus("names") == "anna\n"
    assert (isolated_user_data_dir / "names.txt").read_bytes() == payload
    assert not (tmp_path / "repo").exists(), "downloads never go into the checkout"


def test_download_corpus_to_folder_from_mirror(tmp_path, monkeypatch):
    payload = b"anna\n"
    _small_corpus(monkeypatch, payload)
    calls = _serve(monkeypatch, payload)
    path = download_corpus("names", dest_dir=tmp_path / "mine", url="http://127.0.0.1:1/names.txt")
    assert path == tmp_path / "mine" / "names.txt" and path.read_bytes() == payload
    assert calls[0][0] == "http://127.0.0.1:1/names.txt"


# --------------------------------------------------------------------------- where corpora are looked for

def _put(folder: Path, payload: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "names.txt").write_bytes(payload)
    return folder / "names.txt"


def test_search_order_is_env_then_user_folder_then_checkout(empty_dirs, monkeypatch, isolated_user_data_dir):
    env_dir, repo_dir = empty_dirs
    payload = b"anna\n"
    _small_corpus(monkeypatch, payload)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("downloaded"))
    in_env, in_user, in_repo = (_put(d, payload) for d in (env_dir, isolated_user_data_dir, repo_dir))
    assert corpus_path("names") == in_env
    monkeypatch.delenv("COURSE_DATA_DIR")
    assert corpus_path("names") == in_user
    in_user.unlink()
    assert corpus_path("names") == in_repo
    assert locate_corpus("names").searched == [isolated_user_data_dir, repo_dir]


def test_an_installed_course_never_looks_in_or_writes_to_its_package_folder(tmp_path, monkeypatch,
                                                                             isolated_user_data_dir):
    """Installed from a wheel, course_lib sits in site-packages: no data/ is searched or created there."""
    site = tmp_path / "site-packages"
    package = site / "course_lib"
    package.mkdir(parents=True)
    monkeypatch.setattr(corpora, "running_from_checkout", lambda: False)
    monkeypatch.setattr(corpora, "PACKAGE_DIR", package)
    monkeypatch.setattr(corpora, "REPO_DATA_DIR", site / "data")
    monkeypatch.delenv("COURSE_DATA_DIR", raising=False)
    _put(site / "data", b"anna\n")   # even a file there is not used
    _small_corpus(monkeypatch, b"anna\n")
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    location = locate_corpus("names")
    assert location.path is None and location.searched == [isolated_user_data_dir]
    with pytest.raises(CorpusError) as info:
        corpus_path("names")
    assert str(isolated_user_data_dir / "names.txt") in str(info.value), "the message names the user's folder"
    assert "site-packages" not in str(info.value)
    assert not isolated_user_data_dir.exists(), "a failed download leaves no empty folder behind"
    assert sorted(p.name for p in site.iterdir()) == ["course_lib", "data"]
    assert list(package.iterdir()) == []
    with pytest.raises(CorpusError, match="inside the installed course_lib package"):
        download_corpus("names", dest_dir=package / "data")
    assert list(package.iterdir()) == []


def test_a_failed_download_removes_the_folders_it_created(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path / "new" / "deeper"))
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    with pytest.raises(CorpusError, match="no internet connection"):
        corpus_path("names")
    assert not (tmp_path / "new").exists()


def test_a_missing_corpus_shows_in_a_notebook_as_one_message_without_a_traceback(empty_dirs, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    with pytest.raises(CorpusError) as info:
        load_corpus("tinyshakespeare")
    shown = info.value._render_traceback_()   # what IPython prints instead of a traceback
    assert shown[0].startswith("CorpusError: Corpus 'tinyshakespeare'")
    assert "\n".join(shown[1:]) == str(info.value).split("\n", 1)[1]
    assert not any("Traceback" in line or 'File "' in line for line in shown)


def test_unknown_corpus_name():
    with pytest.raises(ValueError, match=r"name: .*'names'.*'tinyshakespeare'.*'shakespeare'"):
        locate_corpus("shakespeare")
    with pytest.raises(ValueError, match="name"):
        load_corpus(None)


# --------------------------------------------------------------------------- bring your own text

def test_load_text(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_bytes("\ufeffhéllo\r\nwörld\n".encode())
    assert load_text(path) == "héllo\r\nwörld\n"
    assert load_text(str(path)) == "héllo\r\nwörld\n"
    with pytest.raises(FileNotFoundError, match=r"path: .*nothere\.txt"):
        load_text(tmp_path / "nothere.txt")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("abcé".encode("latin-1"))
    with pytest.raises(ValueError, match=r"path: .*latin1\.txt.*not UTF-8.*0xe9 at byte offset 3"):
        load_text(latin)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"path: .*empty\.txt.*empty"):
        load_text(empty)
    with pytest.raises(TypeError, match="path"):
        load_text(42)


def test_char_corpus_from_text_and_path(tmp_path):
    text = "abcabcabcd"
    corpus = char_corpus(text, train_fraction=0.8)
    assert corpus.tokenizer.chars == "abcd" and corpus.vocab_size == 4
    assert corpus.train_ids.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert corpus.val_ids.tolist() == [2, 3]
    (tmp_path / "t.txt").write_text(text)
    assert char_corpus(tmp_path / "t.txt", 0.8).val_ids.tolist() == [2, 3]
    with pytest.raises(ValueError, match="name_or_text"):
        char_corpus("")


def test_corpus_splits_of_a_text_file_are_the_char_corpus_streams(tmp_path):
    from course_lib.data import TokenStream, corpus_splits
    (tmp_path / "t.txt").write_text("abcabcabcd" * 10)
    tokenizer, train_split, val_split = corpus_splits(tmp_path / "t.txt", max_tokens=4)
    corpus = char_corpus(tmp_path / "t.txt")
    assert tokenizer == corpus.tokenizer
    assert isinstance(train_split, TokenStream) and isinstance(val_split, TokenStream)
    assert torch.equal(train_split.ids, corpus.train_ids) and torch.equal(val_split.ids, corpus.val_ids)


@pytest.mark.parametrize("path_like", ["path/to/file.txt", "corpus.txt", "C:\\data\\t", "notes.md"])
def test_char_corpus_refuses_a_path_given_as_a_string(path_like):
    # trained on, it would be a model of the characters of the path
    with pytest.raises(ValueError, match=rf"name_or_text: got {re.escape(repr(path_like))}, which looks like a "
                                         rf"file path, not text; read the file with char_corpus\(Path\("):
        char_corpus(path_like)


# --------------------------------------------------------------------------- tokenizers

def test_char_tokenizer_round_trip_and_order():
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == " dehlorw" and tok.vocab_size == len(tok) == 8
    assert tok.stoi[" "] == 0 and tok.itos[7] == "w"
    ids = tok.encode("hello world")
    assert ids == [3, 2, 4, 4, 5, 0, 7, 5, 6, 4, 1]
    assert tok.decode(ids) == "hello world"
    assert tok.decode(torch.tensor(ids)) == "hello world"
    given = CharTokenizer("cab")
    assert given.encode("abc") == [1, 2, 0], "the vocabulary keeps the order given"
    assert "vocab_size=8" in repr(tok) and "CharTokenizer" in repr(tok)


def test_char_tokenizer_unknown_policies():
    strict = CharTokenizer.from_text("abc ")
    with pytest.raises(ValueError) as info:
        strict.encode("abcZ bQ")
    message = str(info.value)
    assert message.startswith("text: characters never seen in training: 'Z' (at index 3), 'Q' (at index 6)")
    assert 'unknown="replace" or "skip"' in message
    skip = CharTokenizer.from_text("abc ", unknown="skip")
    assert skip.decode(skip.encode("abcZ bQ")) == "abc b"
    replace = CharTokenizer.from_text("abc ", unknown="replace")
    assert replace.vocab_size == strict.vocab_size + 1
    assert replace.itos[replace.vocab_size - 1] == "\ufffd"
    assert replace.decode(replace.encode("abZ")) == "ab\ufffd"
    assert replace.encode("abc") == strict.encode("abc"), "the replacement id must not shift others"
    with pytest.raises(ValueError, match="unknown"):
        CharTokenizer("abc", unknown="ignore")


def test_char_tokenizer_to_dict_round_trip():
    for tok in (CharTokenizer.from_text("zoë and ∑\n"), CharTokenizer("xy", unknown="replace")):
        d = json.loads(json.dumps(tok.to_dict()))
        again = CharTokenizer.from_dict(d)
        assert again == tok and again.vocab_size == tok.vocab_size
        assert again.encode(tok.chars) == tok.encode(tok.chars)
    with pytest.raises(ValueError, match="d: "):
        CharTokenizer.from_dict({"vocab": "abc"})


def test_char_tokenizer_bad_inputs_name_the_argument():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"ids: token id 3 at position 1"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match=r"ids: token id -100 .*IGNORE_INDEX"):
        tok.decode(torch.tensor([0, -100]))
    with pytest.raises(TypeError, match="ids"):
        tok.decode(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="ids"):
        tok.decode(torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="ids"):
        tok.decode("abc")
    with pytest.raises(TypeError, match="text"):
        tok.encode([0, 1])
    with pytest.raises(ValueError, match="chars: .*'a' repeats"):
        CharTokenizer("aba")
    with pytest.raises(ValueError, match="chars"):
        CharTokenizer("")


def test_subword_vocabulary_is_bounded_by_what_the_text_can_give():
    # 10**9 once aborted the whole process (a dead kernel); now it is a message before any work
    with pytest.raises(ValueError, match=r"vocab_size: expected at most 265 for this text of 9 bytes .*got 1000000000"):
        train_subword_tokenizer("aaaa bbbb", vocab_size=10**9)
    assert len(train_subword_tokenizer("aaaa bbbb", vocab_size=265)) <= 265


def test_subword_tokenizer_round_trips():
    from transformers import PreTrainedTokenizerFast

    text = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
            "All:\nSpeak, speak.\n\n") * 40
    tok = train_subword_tokenizer(text, vocab_size=300)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.eos_token == tok.bos_token == tok.unk_token == "<|endoftext|>"
    assert 257 < len(tok) <= 300
    for sample in (text[:200], "  Speak , speak!  ", "zoë ∑ 😀 never seen\t\n"):
        assert tok.decode(tok.encode(sample)) == sample
    ids = tok.encode(text[:200])
    assert len(ids) < len(text[:200].encode()), "merges were learned"
    assert tok.encode("<|endoftext|>") == [tok.eos_token_id]
    with pytest.raises(ValueError, match="vocab_size"):
        train_subword_tokenizer(text, vocab_size=100)
    with pytest.raises(ValueError, match="text"):
        train_subword_tokenizer("")


# --------------------------------------------------------------------------- LM datasets

def test_lm_windows_line_up():
    ids = torch.arange(100, 123)  # (23,)
    inputs, targets = lm_windows(ids, 5)
    assert inputs.shape == targets.shape == (4, 5)  # windows of 6 every 5 tokens: (23 - 6) // 5 + 1
    assert inputs.dtype == targets.dtype == torch.long
    for i in range(4):
        assert torch.equal(targets[i, :-1], inputs[i, 1:])
        assert targets[i, -1] == ids[i * 5 + 5]
        assert torch.equal(inputs[i], ids[i * 5: i * 5 + 5])
    inputs, targets = lm_windows(ids.int(), 5, stride=1)
    assert inputs.shape == (18, 5) and inputs.dtype == torch.long
    assert torch.equal(targets[:, -1], ids[5:])
    one = lm_windows(torch.arange(6), 5)
    assert one[0].tolist() == [[0, 1, 2, 3, 4]] and one[1].tolist() == [[1, 2, 3, 4, 5]]


def test_lm_windows_bad_inputs():
    with pytest.raises(ValueError, match=r"ids: need at least max_tokens \+ 1 = 6 tokens.*got 5"):
        lm_windows(torch.arange(5), 5)
    with pytest.raises(TypeError, match="ids"):
        lm_windows(torch.rand(10), 3)
    with pytest.raises(ValueError, match="ids"):
        lm_windows(torch.arange(10).view(2, 5), 3)
    with pytest.raises(TypeError, match="ids"):
        lm_windows(list(range(10)), 3)
    with pytest.raises(ValueError, match="max_tokens"):
        lm_windows(torch.arange(10), 0)
    with pytest.raises(ValueError, match="stride"):
        lm_windows(torch.arange(10), 3, stride=0)


def test_split_by_position():
    train, val = split_by_position(torch.arange(10), 0.7)
    assert train.tolist() == list(range(7)) and val.tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="train_fraction"):
        split_by_position(torch.arange(10), 1.0)
    with pytest.raises(ValueError, match="ids"):
        split_by_position(torch.arange(1), 0.5)


def test_random_batch():
    ids = torch.arange(50, dtype=torch.int32)
    inputs, targets = random_batch(ids, 8, 6, generator=torch.Generator().manual_seed(0), device="cpu")
    assert inputs.shape == targets.shape == (8, 6)
    assert inputs.dtype == targets.dtype == torch.long and inputs.device.type == "cpu"
    steps = torch.arange(6)
    assert torch.equal(inputs - inputs[:, :1], steps.expand(8, 6)), "each row is a slice of ids"
    assert torch.equal(targets, inputs + 1)
    assert int(targets.max()) <= 49
    again = random_batch(ids, 8, 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again[0], inputs), "the same generator seed gives the same batch"
    starts = torch.cat([random_batch(ids, 64, 6, generator=torch.Generator().manual_seed(s))[0][:, 0]
                        for s in range(5)])
    assert int(starts.min()) == 0 and int(starts.max()) == 50 - 7, "every start position is reachable"
    with pytest.raises(ValueError, match=r"ids: .*got 6"):
        random_batch(torch.arange(6), 2, 6)
    with pytest.raises(TypeError, match="generator"):
        random_batch(ids, 2, 6, generator=0)
    with pytest.raises(ValueError, match="batch_size"):
        random_batch(ids, 0, 6)


# --------------------------------------------------------------------------- names

def test_names_tokenizer_and_dataset_alignment():
    names = ["emma", "bo", "ava"]
    tok = names_tokenizer(names)
    assert tok.itos[0] == "." and tok.chars == ".abemov"
    inputs, targets = names_dataset(names, tok, max_tokens=6)
    assert inputs.shape == targets.shape == (3, 6) and inputs.dtype == targets.dtype == torch.long
    assert tok.decode(inputs[0]) == ".emma."
    assert tok.decode(inputs[1]) == ".bo...", "inputs are padded with the boundary token"
    assert tok.decode(targets[0][:5]) == "emma." and targets[0][5] == IGNORE_INDEX
    assert tok.decode(targets[1][:3]) == "bo." and targets[1][3:].tolist() == [IGNORE_INDEX] * 3
    real = targets[:, :-1] != IGNORE_INDEX  # (3, 5)
    assert torch.equal(targets[:, :-1][real], inputs[:, 1:][real]), "each target is the next input"
    assert real.sum(dim=1).tolist() == [5, 3, 4]
    exact = names_dataset(names, tok, max_tokens=5)[1]
    assert exact[0].tolist() == tok.encode("emma.")


def test_names_dataset_bad_inputs():
    names = ["emma", "christopher", "bo"]
    tok = names_tokenizer(names)
    with pytest.raises(ValueError, match=r"max_tokens: .*'christopher'.*max_tokens >= 12.*got 8"):
        names_dataset(names, tok, max_tokens=8)
    with pytest.raises(ValueError, match=r"names: .*'zed'"):
        names_dataset(["zed"], tok, max_tokens=8)
    with pytest.raises(ValueError, match="tokenizer"):
        names_dataset(names, CharTokenizer("abc"), max_tokens=12)
    with pytest.raises(ValueError, match="names"):
        names_tokenizer(["a.b"])
    with pytest.raises(ValueError, match="names"):
        split_names([])
    with pytest.raises(ValueError, match="train_fraction"):
        split_names(names, train_fraction=0)
