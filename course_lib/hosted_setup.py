"""What each notebook's set-up cell does after it has installed the course into a hosted kernel.

The cell itself (written into every notebook by the course's notebook edit script) needs nothing
installed: when ``course_lib`` is missing it runs ``%pip install`` of ``COURSE_SOURCE`` (default: the
course's name on the package index, ``DISTRIBUTION``) with the kernel's own torch held where it is, then
calls :func:`finish`. When the kernel already has the course (after ``make lab``) it only checks that
``course_lib`` can be found and prints :data:`READY_LINE`, a line stable enough for nbval to compare.

:func:`finish` finds or downloads the corpora the notebook needs, chooses how widgets are shown on this
host, and prints one line saying what was done.
"""
from __future__ import annotations

import os
from collections.abc import Collection, Mapping, MutableMapping, Sequence
from importlib import metadata

from . import _validate as validate
from .corpora import CORPORA, CorpusError, corpus_path, locate_corpus, user_data_dir
from .runtime import __version__

__all__ = ["DISTRIBUTION", "SOURCE_ENV", "READY_LINE", "hosting", "widget_mode", "prepare_corpora", "finish"]

DISTRIBUTION = "attention-course"   # the course's name on the package index (pyproject.toml's [project] name)
SOURCE_ENV = "COURSE_SOURCE"        # an instructor's wheel, folder or git URL instead of DISTRIBUTION
READY_LINE = "set-up: the course is installed in this kernel; nothing to do"


def hosting(environ: dict | None = None, modules: Sequence[str] | None = None) -> str:
    """'colab', 'kaggle' or 'local': the host this kernel runs on, from what each host is known to set."""
    import sys
    validate.instance("environ", environ, Mapping, "a mapping of environment variables such as os.environ, or None",
                      or_none=True)
    if modules is not None and (isinstance(modules, (str, bytes)) or not isinstance(modules, Collection)):
        raise TypeError(f"modules: expected a collection of module names such as sys.modules, or None, got "
                        f"{validate.describe(modules)}")
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "google.colab" in modules or "COLAB_RELEASE_TAG" in environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in environ:
        return "kaggle"
    return "local"


def widget_mode(host: str, environ: dict | None = None) -> str:
    """'widgets' or 'static'. Colab shows ipywidgets once its custom widget manager is on (the cell
    turns it on); Kaggle's viewer does not show them, so the course draws its static figures there
    (COURSE_STATIC_WIDGETS=1). An explicit COURSE_STATIC_WIDGETS is always kept."""
    if host not in ("colab", "kaggle", "local"):
        raise ValueError(f"host: expected 'colab', 'kaggle' or 'local', got {host!r}")
    validate.instance("environ", environ, MutableMapping, "a mapping of environment variables such as os.environ, "
                      "or None", or_none=True)
    environ = os.environ if environ is None else environ
    if "COURSE_STATIC_WIDGETS" in environ:   # a stand-in dict may hold 1 or True: os.environ holds only text
        validate.env_text("environ['COURSE_STATIC_WIDGETS']", environ["COURSE_STATIC_WIDGETS"])
    if "COURSE_STATIC_WIDGETS" not in environ and host == "kaggle":
        environ["COURSE_STATIC_WIDGETS"] = "1"
    static = environ.get("COURSE_STATIC_WIDGETS", "").strip().lower() in ("1", "true", "yes")
    return "static" if static else "widgets"


def _check_names(name: str, names: object) -> None:
    if isinstance(names, str) or not isinstance(names, Sequence) \
            or not all(isinstance(n, str) and n in CORPORA for n in names):
        raise ValueError(f"{name}: expected a list of corpus names from {sorted(CORPORA)}, got {names!r}")


def prepare_corpora(names: Sequence[str], download: bool = True) -> list[str]:
    """One short phrase per corpus: where it was found, that it was downloaded, or where to put it."""
    _check_names("names", names)
    validate.boolean("download", download)
    said = []
    for name in names:
        if locate_corpus(name).ok:
            said.append(f"{name} found")
            continue
        if download:
            try:
                corpus_path(name, download=True)
                said.append(f"{name} downloaded")
                continue
            except CorpusError:
                pass
        folder = os.environ.get("COURSE_DATA_DIR") or str(user_data_dir())
        said.append(f"{name} missing: save it as {os.path.join(folder, CORPORA[name].filename)}")
    return said


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def finish(corpora: Sequence[str] = (), *, torch_before: str | None = None, source: str | None = None,
           download: bool = True) -> str:
    """After the cell's install: corpora, widgets, and the one line that says what was done (returned too).

    ``torch_before``: the torch version the kernel had before the install (None: it had none)."""
    _check_names("corpora", corpora)
    validate.instance("torch_before", torch_before, str, "the version string torch had before the install "
                      "(torch.__version__, such as '2.5.1'), or None if it had none", or_none=True)
    # an empty version would print "WARNING: torch  was replaced", about a torch that was never named
    validate.expect(torch_before is None or torch_before.strip() != "", "torch_before",
                    "a version string such as '2.5.1', or None if torch was not installed", "an empty string")
    validate.instance("source", source, str, "where the course was installed from (a package name, wheel, folder "
                      "or git URL), or None", or_none=True)
    validate.boolean("download", download)
    source = source or os.environ.get(SOURCE_ENV) or DISTRIBUTION
    host = hosting()
    now = _torch_version()
    if torch_before is None:
        kept = f"installed torch {now}"
    elif torch_before == now:
        kept = f"kept torch {now}"
    else:   # the cell's constraint forbids it; say so loudly rather than hide it
        kept = f"WARNING: torch {torch_before} was replaced by {now}"
    parts = [f"set-up: installed course_lib {__version__} from {source}, {kept}"]
    parts += prepare_corpora(corpora, download=download)
    parts.append(f"{host} host, {widget_mode(host)}")
    line = "; ".join(parts)
    print(line)
    return line
