"""Hidden staging files a killed `export` or `start` left behind are removed by the next run, and only those.

A run writes under ``.NAME.pid<PID>.<random>.tmp`` and renames at the end; SIGKILL leaves that name behind.
The next writer of NAME removes it once its process is gone (and it is a minute old), or, for a name without
a pid (an older course_lib) or where the pid cannot be checked, once it is an hour old. A user's own ``.tmp``
files, another NAME's staging, links, and staging a live process still holds are never touched.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_lib._atomic import STALE_AFTER_S, UNKNOWN_HOLDER_STALE_AFTER_S, atomic_file, remove_stale_staging
from course_lib.checkpoints import save_checkpoint
from course_lib.data import CharTokenizer
from course_lib.model import GPT, GPTConfig

pytestmark = pytest.mark.skipif(os.name != "posix", reason="process ids are checked on POSIX only")


@pytest.fixture(scope="module")
def dead_pid():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.fixture
def live_pid():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process.pid
    process.kill()
    process.wait()


def _aged(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)
    return path


_COUNT = iter(range(10 ** 6))


def _plant(folder: Path, name: str, holder: str, age: float, *, directory: bool = False) -> Path:
    path = folder / f".{name}.{holder}abcd{next(_COUNT):04d}.tmp"   # as tempfile names it: 8 more characters
    if directory:
        path.mkdir()
        (path / "config.json").write_text("{}")
    else:
        path.write_text("half of a file")
    return _aged(path, age)


def test_only_stale_staging_of_that_name_is_removed(tmp_path, dead_pid, live_pid):
    old, young = UNKNOWN_HOLDER_STALE_AFTER_S + 10, 1.0
    removed = {_plant(tmp_path, "notes.txt", f"pid{dead_pid}.", STALE_AFTER_S + 5),
               _plant(tmp_path, "notes.txt", "", old),
               _plant(tmp_path, "notes.txt", f"pid{dead_pid}.", STALE_AFTER_S + 5, directory=True)}
    kept = {_plant(tmp_path, "notes.txt", f"pid{dead_pid}.", young),          # its process just died: wait a minute
            _plant(tmp_path, "notes.txt", "", young),                          # no pid, and young
            _plant(tmp_path, "notes.txt", f"pid{live_pid}.", old),            # held by a live process
            _plant(tmp_path, "notes.txt", f"pid{os.getpid()}.", old),         # held by this very process
            _plant(tmp_path, "other.txt", f"pid{dead_pid}.", old)}           # another file's staging
    for path in (tmp_path / ".notes.txt.tmp", tmp_path / "notes.txt.bak.tmp", tmp_path / ".notes.txt.mine.tmp"):
        path.write_text("the user's own")
        kept.add(_aged(path, old))
    link = tmp_path / f".notes.txt.pid{dead_pid}.linklink.tmp"
    link.symlink_to(tmp_path / "elsewhere")
    kept.add(link)
    with atomic_file(tmp_path / "notes.txt") as handle:
        handle.write("new")
    assert (tmp_path / "notes.txt").read_text() == "new"
    for path in removed:
        assert not path.exists(), path
    for path in kept:
        assert path.is_symlink() or path.exists(), path
    assert remove_stale_staging(tmp_path, "notes.txt") == []   # nothing more of that name is stale


def test_a_file_killed_mid_write_is_left_then_removed_by_the_next_write(tmp_path):
    target = tmp_path / "notes.txt"
    code = (f"import os, signal\nfrom course_lib._atomic import atomic_file\n"
            f"with atomic_file({str(target)!r}) as handle:\n"
            f"    handle.write('half')\n    handle.flush()\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code])
    assert done.returncode == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".notes.txt.pid")]
    assert len(left) == 1 and not target.exists()      # what a crashed run leaves
    _aged(left[0], STALE_AFTER_S + 5)                   # a minute later
    with atomic_file(target) as handle:
        handle.write("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _run(folder: Path) -> Path:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=5, max_tokens=8, embed_dim=8, num_heads=2, num_layers=1))
    save_checkpoint(folder / "checkpoint.pt", model, CharTokenizer("abcde"))
    return folder


def test_export_removes_the_staging_folder_a_killed_export_left(tmp_path, dead_pid, live_pid):
    pytest.importorskip("transformers")
    from course_lib.runs.export import export_run
    run = _run(tmp_path / "run")
    code = (f"import os, signal\nfrom course_lib.hf import pretrained\n"
            f"def dies(*args, **kwargs):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            f"pretrained.save_pretrained = dies\n"
            f"from course_lib.runs.export import export_run\nexport_run({str(run)!r}, {str(tmp_path / 'hf')!r})\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -signal.SIGKILL
    crashed = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]
    assert len(crashed) == 1 and crashed[0].is_dir()   # the staging folder a kill leaves
    _aged(crashed[0], STALE_AFTER_S + 5)
    legacy = _plant(tmp_path, "hf", "", UNKNOWN_HOLDER_STALE_AFTER_S + 10, directory=True)
    held = _plant(tmp_path, "hf", f"pid{live_pid}.", UNKNOWN_HOLDER_STALE_AFTER_S + 10, directory=True)
    other = _plant(tmp_path, "hf2", f"pid{dead_pid}.", UNKNOWN_HOLDER_STALE_AFTER_S + 10, directory=True)
    export_run(run, tmp_path / "hf")
    assert not crashed[0].exists() and not legacy.exists()
    assert held.exists() and other.exists()
    assert (tmp_path / "hf" / "config.json").is_file()


def test_start_removes_what_a_killed_start_left_and_keeps_the_students_files(tmp_path, dead_pid, live_pid):
    from course_lib.classroom.assignments import start_main
    folder = tmp_path / "copies"
    assert start_main([str(folder), ]) == 0
    first = sorted(folder.glob("*.ipynb"))[0]
    first.write_text(first.read_text(encoding="utf-8").replace("attention", "my own words", 1), encoding="utf-8")
    mine = first.read_text(encoding="utf-8")
    stale = [_plant(folder, first.name, f"pid{dead_pid}.", STALE_AFTER_S + 5),
             _plant(folder, first.name, "", UNKNOWN_HOLDER_STALE_AFTER_S + 10),
             _plant(folder, ".course-copies.json", f"pid{dead_pid}.", STALE_AFTER_S + 5)]
    kept = [_plant(folder, first.name, f"pid{live_pid}.", UNKNOWN_HOLDER_STALE_AFTER_S + 10),
            _plant(folder, first.name, "", 1.0)]
    student_tmp = folder / f".{first.name}.tmp"
    student_tmp.write_text("mine")
    _aged(student_tmp, UNKNOWN_HOLDER_STALE_AFTER_S + 10)
    assert start_main([str(folder)]) == 0
    assert first.read_text(encoding="utf-8") == mine   # the student's edited copy is untouched
    for path in stale:
        assert not path.exists(), path
    for path in kept + [student_tmp]:
        assert path.exists(), path
