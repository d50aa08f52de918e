"""The two corpora: where they are looked for, how they are verified and downloaded.

A corpus is looked up, in this order, in

1. the folder named by ``COURSE_DATA_DIR`` (read at every call, so a notebook may set it);
2. the per-user data folder (``user_data_dir()``: ``~/.cache/attention-course`` on Linux);
3. the repository's ``data/`` folder, only when course_lib runs from a checkout.

Never inside site-packages: an installed course has no ``data/`` of its own. A missing
corpus is downloaded into ``COURSE_DATA_DIR`` when it is set and writable, else into the
per-user folder, and checked against its SHA-256 sum, so every machine trains on the same bytes.
"""
from __future__ import annotations

import codecs
import hashlib
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _validate as validate
from ._atomic import atomic_file
from .course_files import CHECKOUT_DIR, PACKAGE_DIR, running_from_checkout

__all__ = ["Corpus", "CORPORA", "CorpusError", "CorpusLocation", "DATA_DIR_ENV", "user_data_dir",
           "search_dirs", "locate_corpus", "corpus_path", "load_corpus", "download_corpus", "load_text"]

# The repository's own data/ folder: searched only when running from a checkout.
REPO_DATA_DIR = CHECKOUT_DIR / "data"
DATA_DIR_ENV = "COURSE_DATA_DIR"
APP_NAME = "attention-course"
DOWNLOAD_TIMEOUT = 30.0  # seconds; a classroom network that stalls should fail, not hang
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Corpus:
    """A public text corpus: where it comes from and the exact bytes expected."""

    name: str
    filename: str
    url: str
    sha256: str
    size: int


CORPORA: dict[str, Corpus] = {corpus.name: corpus for corpus in (
    Corpus("names", "names.txt", "https://raw.githubusercontent.com/karpathy/makemore/master/names.txt",
           "0a30b5557f192f32ab962680889aac5f6fda0f4cecf40a6d0b5694f58ea8cc4d", 228_145),
    Corpus("tinyshakespeare", "tinyshakespeare.txt",
           "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
           "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", 1_115_394),
)}


class CorpusError(RuntimeError):
    """A corpus could not be found, verified or downloaded; the message says what to do."""

    def __init__(self, message: str, *, corpus: Corpus | None = None,
                 searched: Sequence[Path] = ()) -> None:
        super().__init__(message)
        self.corpus = corpus
        self.searched = list(searched)
        self.reason: BaseException | None = None  # the underlying error of a failed download

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of a traceback: in a notebook, a missing corpus
        # is one clear message saying what to do, not a page of library frames.
        return [f"{type(self).__name__}: {line}" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


@dataclass
class CorpusLocation:
    """Where a corpus was found (``path`` is None when nowhere) and whether its bytes are right."""

    name: str
    path: Path | None
    checksum_ok: bool | None  # None when there was no file to check
    searched: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.path is not None and bool(self.checksum_ok)


def _corpus(name: Any) -> Corpus:
    if not isinstance(name, str) or name not in CORPORA:
        raise ValueError(f"name: expected one of {sorted(CORPORA)}, got {validate.describe(name)}; "
                         f"for a text file of your own use load_text(path)")
    return CORPORA[name]


def _env_data_dir() -> Path | None:
    # Read at call time so a notebook can set os.environ after importing course_lib.
    value = os.environ.get(DATA_DIR_ENV, "").strip()
    if not value:
        return None
    try:
        return Path(value).expanduser()
    except RuntimeError:   # pathlib's "Could not determine home directory" would not name the variable
        raise ValueError(f"{DATA_DIR_ENV}: expected a folder path, got {value!r}, whose ~user names no user "
                         f"here; write the folder's full path") from None


def user_data_dir() -> Path:
    """The per-user folder for the corpora: the platform's usual place for cached data.

    Linux and other Unixes: ``$XDG_CACHE_HOME/attention-course`` (``~/.cache/attention-course``);
    macOS: ``~/Library/Caches/attention-course``; Windows: ``%LOCALAPPDATA%\\attention-course``.
    """
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA", "").strip()
        return (Path(base) if base else Path.home() / "AppData" / "Local") / APP_NAME
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / APP_NAME
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    # The XDG spec ignores a relative XDG_CACHE_HOME.
    return (Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache") / APP_NAME


def search_dirs() -> list[Path]:
    """The folders searched for a corpus, in order (see the module docstring)."""
    dirs = [_env_data_dir(), user_data_dir(), REPO_DATA_DIR if running_from_checkout() else None]
    unique: list[Path] = []
    for folder in dirs:
        if folder is not None and folder not in unique:
            unique.append(folder)
    return unique



def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


# (resolved path, mtime_ns, size) -> sha256: a notebook that reloads a corpus hashes it once.
_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def _cache_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def _file_sha256(path: Path) -> str:
    key = _cache_key(path)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = _hash_file(path)
    return _SHA_CACHE[key]


def _matches(path: Path, corpus: Corpus) -> bool:
    # The size check is free and catches truncated downloads without hashing.
    return path.stat().st_size == corpus.size and _file_sha256(path) == corpus.sha256


def locate_corpus(name: str) -> CorpusLocation:
    """Find a corpus on disk and verify its checksum; never downloads."""
    corpus = _corpus(name)
    searched = search_dirs()
    for folder in searched:
        candidate = folder / corpus.filename
        if candidate.is_file():
            return CorpusLocation(corpus.name, candidate, _matches(candidate, corpus), searched)
    return CorpusLocation(corpus.name, None, None, searched)


def _where_to_put_it(corpus: Corpus, searched: Sequence[Path], target: Path | None = None) -> str:
    env = _env_data_dir()
    lines = ["Searched:"]
    for folder in searched:
        notes = []
        if env is not None and folder == env:
            notes.append(DATA_DIR_ENV)
        if not folder.is_dir():
            notes.append("folder does not exist")
        suffix = f"  ({', '.join(notes)})" if notes else ""
        lines.append(f"  - {folder / corpus.filename}{suffix}")
    target = target or _default_download_dir() / corpus.filename
    lines += [
        "To fix it, download",
        f"  {corpus.url}",
        f"and save it as {target}",
        f"(or in any folder named by the {DATA_DIR_ENV} environment variable), then run this again;",
        "when this machine is online, `python -m course_lib data` does it for you.",
        f"Expected: {corpus.size:,} bytes, sha256 {corpus.sha256}",
    ]
    return "\n".join(lines)


def _mismatch_error(corpus: Corpus, path: Path, searched: Sequence[Path]) -> CorpusError:
    size = path.stat().st_size
    got = _file_sha256(path)
    return CorpusError(
        f"Corpus {corpus.name!r}: the file {path} is not the expected corpus "
        f"(it has {size:,} bytes, sha256 {got}; expected {corpus.size:,} bytes, sha256 {corpus.sha256}). "
        f"It is probably an incomplete download or a different version. Delete it and run this again "
        f"to download a fresh copy, or replace it by hand.\n"
        + _where_to_put_it(corpus, searched, target=path),
        corpus=corpus, searched=searched)


def _inside_package(folder: Path) -> bool:
    # An installed course must never write into site-packages (a checkout's data/ is fine).
    if running_from_checkout():
        return False
    try:
        folder.resolve().relative_to(PACKAGE_DIR)
    except ValueError:
        return False
    return True


def _default_download_dir() -> Path:
    """COURSE_DATA_DIR when it is set and writable, else the per-user folder."""
    env = _env_data_dir()
    if env is not None and (os.access(env, os.W_OK) if env.is_dir() else not env.exists()):
        return env
    return user_data_dir()


def _remove_if_empty(folders: Sequence[Path]) -> None:
    for folder in folders:   # deepest first
        try:
            folder.rmdir()
        except OSError:
            return   # not empty (or not ours to remove): leave it and everything above it


def download_corpus(name: str, dest_dir: str | os.PathLike | None = None,
                    url: str | None = None) -> Path:
    """Download a corpus into ``dest_dir`` (default: COURSE_DATA_DIR if writable, else ``user_data_dir()``)."""
    corpus = _corpus(name)
    if url is not None and (not isinstance(url, str) or not url):
        raise ValueError(f"url: expected a non-empty string (a mirror of {corpus.url}), "
                         f"got {validate.describe(url)}")
    if dest_dir is not None and not isinstance(dest_dir, (str, os.PathLike)):
        raise TypeError(f"dest_dir: expected a folder path (str or Path), got {validate.describe(dest_dir)}")
    dest = Path(dest_dir).expanduser() if dest_dir is not None else _default_download_dir()
    return _download(corpus, dest, url or corpus.url, what="")


def _download(corpus: Corpus, dest: Path, source: str, what: str) -> Path:
    target = dest / corpus.filename
    searched = search_dirs()

    def fail(problem: str, reason: BaseException | None = None) -> CorpusError:
        error = CorpusError(f"Corpus {corpus.name!r} ({corpus.filename}): {what}{problem} Nothing was saved.\n"
                            + _where_to_put_it(corpus, searched), corpus=corpus, searched=searched)
        error.reason = reason
        return error

    if _inside_package(dest):
        raise CorpusError(f"Corpus {corpus.name!r}: refusing to download into {dest}, which is inside the "
                          f"installed course_lib package; use {user_data_dir()} or set {DATA_DIR_ENV}",
                          corpus=corpus, searched=searched)
    # Folders this call creates are removed again if the download fails: a failed
    # download leaves nothing behind, not even an empty folder.
    created = [folder for folder in (dest, *dest.parents) if not folder.exists()]
    try:
        # A file under the real name is always a verified one: the bytes go to a temporary
        # file beside it, renamed only once size and checksum match.
        with atomic_file(target, "wb", suffix=".part") as out, \
                urllib.request.urlopen(source, timeout=DOWNLOAD_TIMEOUT) as response:
            digest = hashlib.sha256()
            size = 0
            while True:
                chunk = response.read(_CHUNK)
                if not chunk:
                    break
                size += len(chunk)
                if size > corpus.size:
                    break  # already wrong; stop rather than download something huge
                digest.update(chunk)
                out.write(chunk)
            got = digest.hexdigest()
            if size != corpus.size or got != corpus.sha256:
                got_text = (f"more than {corpus.size:,} bytes" if size > corpus.size
                            else f"{size:,} bytes, sha256 {got}")
                raise fail(f"the download from {source} is not the expected file (got {got_text}; "
                           f"expected {corpus.size:,} bytes, sha256 {corpus.sha256}).")
        created = []
    except CorpusError:
        raise
    except Exception as exc:
        hint = " (no internet connection?)" if isinstance(exc, urllib.error.URLError) else ""
        # from None: one clear error in a notebook; the cause is in the message and in .reason
        raise fail(f"downloading it from {source} failed{hint}: {type(exc).__name__}: {exc}.", exc) from None
    finally:
        _remove_if_empty(created)
    _SHA_CACHE[_cache_key(target)] = corpus.sha256
    return target


def corpus_path(name: str, download: bool = True) -> Path:
    """The verified path of a corpus, downloading it when it is nowhere on disk."""
    validate.boolean("download", download)   # "no" or None are truthy stand-ins, never meant as a choice
    location = locate_corpus(name)
    corpus = CORPORA[location.name]
    if location.path is not None:
        if not location.checksum_ok:
            raise _mismatch_error(corpus, location.path, location.searched)
        return location.path
    if not download:
        raise CorpusError(f"Corpus {corpus.name!r} ({corpus.filename}) not found, and downloading was turned off (download=False, or --no-download).\n"
                          + _where_to_put_it(corpus, location.searched),
                          corpus=corpus, searched=location.searched)
    return _download(corpus, _default_download_dir(), corpus.url,
                     what="not found in the folders searched, and ")


def load_corpus(name: str, download: bool = True) -> str:
    """The text of a corpus (found, verified, downloaded if needed)."""
    return load_text(corpus_path(name, download=download))


def load_text(path: str | os.PathLike) -> str:
    """Read any UTF-8 text file (bring your own corpus); a leading byte-order mark is dropped."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path (str or Path), got {validate.describe(path)}")
    if str(path).strip() == "":   # Path("") is ".", the current folder
        raise ValueError(f"path: expected the path of a text file, got {validate.describe(path)}")
    file = Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(f"path: no file at {file} (absolute: {file.absolute()})")
    if not file.is_file():
        raise ValueError(f"path: {file} is not a file (a folder?); pass the path of a text file")
    data = file.read_bytes()
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        offset = start + exc.start
        raise ValueError(f"path: {file} is not UTF-8 text: byte 0x{data[offset]:02x} at byte offset "
                         f"{offset} cannot be decoded ({exc.reason}); save the file as UTF-8 "
                         f"and try again") from None
    if not text:
        raise ValueError(f"path: {file} is empty; a corpus needs some text")
    return text
