"""The live room: opt-in lines from every check, no lost lines under concurrent kernels, the room's table."""
from __future__ import annotations

import json
import multiprocessing
import random
from types import SimpleNamespace

import pytest
import torch

from course_lib.__main__ import main as course_main
from course_lib.classroom import checks, progress


def causal_mask(n):   # a student's right answer, under the exercise's name
    return torch.ones(n, n, dtype=torch.bool).tril()


def wrong_mask(n):
    return torch.ones(n, n, dtype=torch.bool).triu()


@pytest.fixture(autouse=True)
def fresh_room_state(monkeypatch):
    """Each test starts as a new kernel: no id, no name, no warning yet, no room unless it sets one."""
    for key, value in (("id", None), ("name", None), ("warned", False)):
        monkeypatch.setitem(progress._STATE, key, value)
    monkeypatch.delenv(progress.PROGRESS_DIR_ENV, raising=False)
    monkeypatch.delenv(progress.NAME_ENV, raising=False)


def _lines(folder):
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_nothing_is_written_anywhere_when_the_variable_is_unset(tmp_path, monkeypatch, isolated_user_data_dir):
    monkeypatch.chdir(tmp_path)
    assert checks.check_causal_mask(causal_mask).passed
    assert list(tmp_path.iterdir()) == []
    assert not isolated_user_data_dir.exists()   # not even the anonymous id
    assert progress._STATE["id"] is None


def test_each_check_of_the_exercise_appends_one_line(tmp_path, monkeypatch, isolated_user_data_dir):
    room = tmp_path / "room"
    room.mkdir()
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(room))
    assert checks.check_causal_mask(causal_mask).passed
    wrong = wrong_mask
    wrong.__name__ = "causal_mask"   # what the student's cell defines, whatever its body
    assert not checks.check_causal_mask(wrong).passed
    demo = wrong_mask
    demo.__name__ = "BuggyMask"      # the notebooks' demonstrations of planted bugs are not attempts
    checks.check_causal_mask(demo)
    checks.check_toy_prediction(None, None)   # 1.1 judges values, not a named definition
    lines = _lines(room)
    assert [(e["exercise"], e["passed"], e["diagnosis"]) for e in lines] == [
        ("2.1", True, None), ("2.1", False, "causal_mask"), ("1.1", False, "not_implemented")]
    ids = {e["student"] for e in lines}
    assert len(ids) == 1 and (isolated_user_data_dir / "student-id").read_text().strip() in ids
    assert all("name" not in e and e["time"].endswith("Z") for e in lines)
    assert [p.name for p in room.iterdir()] == [f"{ids.pop()}.jsonl"]


def test_a_student_may_choose_to_be_named(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(progress.NAME_ENV, "Ada")
    checks.check_causal_mask(causal_mask)
    progress.set_name("Grace")
    checks.check_causal_mask(causal_mask)
    assert [e["name"] for e in _lines(tmp_path)] == ["Ada", "Grace"]
    with pytest.raises(ValueError, match="name: expected a non-empty str"):
        progress.set_name("  ")


def test_recording_leaves_the_kernel_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(tmp_path))
    random.seed(3)
    torch.manual_seed(3)
    python_state, torch_state = random.getstate(), torch.get_rng_state()
    checks.check_causal_mask(causal_mask)
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)
    assert len(_lines(tmp_path)) == 1


def test_a_room_that_cannot_be_written_never_breaks_a_check(tmp_path, monkeypatch, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(not_a_folder))
    assert checks.check_causal_mask(causal_mask).passed
    assert checks.check_causal_mask(causal_mask).passed
    assert capsys.readouterr().err.count("the live room did not record") == 1


LINES = 2000   # per writer; with two writes per line instead of one, lines interleave within a few hundred


def _writer(folder: str, number: int, count: int, start) -> None:
    start.wait()
    for i in range(count):
        result = SimpleNamespace(exercise="2.1", passed=i % 2 == 0, diagnosis=None if i % 2 == 0 else "causal_mask")
        progress._STATE["name"] = f"writer{number}-{i}-" + "x" * 3000   # long lines: more chance to interleave
        progress.record(result)


def test_concurrent_kernels_lose_no_line(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_DIR_ENV, str(tmp_path))
    progress.student_id()   # one student's kernels share the id, so they append to one file
    progress._exercise_names()   # read once here, so that the writers start writing at once
    context = multiprocessing.get_context("fork")
    start = context.Event()
    writers = [context.Process(target=_writer, args=(str(tmp_path), n, LINES, start)) for n in range(6)]
    for writer in writers:
        writer.start()
    start.set()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    files = list(tmp_path.glob("*.jsonl"))
    assert len(files) == 1
    raw = files[0].read_text().split("\n")
    assert raw[-1] == ""
    entries = [json.loads(line) for line in raw[:-1]]   # every line parses: none interleaved
    seen = {entry["name"].split("-x")[0] for entry in entries}
    assert len(entries) == 6 * LINES and seen == {f"writer{n}-{i}" for n in range(6) for i in range(LINES)}


def _write(folder, student, *entries):
    with open(folder / f"{student}.jsonl", "a") as handle:
        for stamp, exercise, passed, diagnosis in entries:
            handle.write(json.dumps({"v": 1, "time": stamp, "student": student, "exercise": exercise,
                                     "passed": passed, "diagnosis": diagnosis}) + "\n")


def test_the_room_per_exercise_latest_attempts_count(tmp_path, capsys, monkeypatch):
    _write(tmp_path, "s1", ("T1", "2.1", False, "causal_mask"), ("T2", "2.1", True, None), ("T3", "10.1", True, None))
    _write(tmp_path, "s2", ("T1", "2.1", False, "causal_mask"))
    _write(tmp_path, "s3", ("T1", "2.1", False, "dtype"), ("T2", "2.1", False, "causal_mask"),
           ("T3", "3.1", False, "head_split"))
    with open(tmp_path / "s3.jsonl", "a") as handle:
        handle.write("not json\n")
        handle.write('{"v": 1, "time": "T9", "student": "s3", "exer')   # a write in progress
    room = progress.read_room(tmp_path)
    assert list(room.exercises) == ["2.1", "3.1", "10.1"]
    ex = room.exercises["2.1"]
    assert (ex.students, ex.passing, ex.attempts) == (3, 1, 5)
    assert ex.failing_now().most_common() == [("causal_mask", 2)]
    assert room.skipped == 1 and len(room.students) == 3
    assert course_main(["progress", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("2.1 "))
    assert row.split()[-5:] == ["3", "1", "5", "causal_mask", "2"]
    assert "1 unreadable line(s) skipped" in table

    def stop(seconds):
        raise KeyboardInterrupt
    monkeypatch.setattr("course_lib.classroom.progress.time.sleep", stop)
    assert progress.main([str(tmp_path), "--watch", "0.5"]) == 0
    assert "every 0.5 s" in capsys.readouterr().out
    assert progress.main([str(tmp_path / "nowhere")]) == 2
    assert "expected the live room's folder" in capsys.readouterr().err


def test_files_students_can_put_in_the_room_neither_hang_flood_nor_crash_it(tmp_path, capsys):
    """The room's folder is writable by every student: a FIFO, a link to /dev/zero, a folder, a line nested deep
    enough to recurse, unknown exercise ids and terminal escapes are skipped or shown as plain text."""
    import os
    _write(tmp_path, "s1", ("T1", "2.1", False, "causal_mask"))
    os.mkfifo(tmp_path / "fifo.jsonl")                       # read: it would wait for a writer for ever
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")       # read: it would fill the memory
    (tmp_path / "folder.jsonl").mkdir()
    with open(tmp_path / "s2.jsonl", "w") as handle:
        handle.write("[" * 200_000 + "\n")
        for exercise, diagnosis, stamp in (("2.\u00b2", "causal_mask", "T2"), ("9" * 5000, None, "T2"),
                                           ("2.1", "\x1b]0;owned\x07", "T2"), ("3.1", None, "T3\x1b[2J")):
            handle.write(json.dumps({"v": 1, "time": stamp, "student": "s2", "exercise": exercise,
                                     "passed": False, "diagnosis": diagnosis}) + "\n")
    room = progress.read_room(tmp_path)
    assert list(room.exercises) == ["2.1", "3.1"] and room.skipped == 3
    assert room.exercises["2.1"].failing_now() == {"causal_mask": 1, "?": 1}
    assert course_main(["progress", str(tmp_path)]) == 0
    assert "\x1b" not in capsys.readouterr().out
    assert course_main(["progress", ""]) == 2
    assert "Traceback" not in capsys.readouterr().err
