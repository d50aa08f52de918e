"""`python -m course_lib progress`: the room shows the names students chose to give, and only those."""
from __future__ import annotations

import json

from course_lib.classroom import progress


def _line(folder, student, stamp, exercise, passed, diagnosis=None, name=None):
    entry = {"v": 1, "time": stamp, "student": student, "exercise": exercise, "passed": passed,
             "diagnosis": diagnosis}
    if name is not None:
        entry["name"] = name
    with open(folder / f"{student}.jsonl", "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def test_the_room_shows_the_names_students_chose(tmp_path):
    _line(tmp_path, "a" * 16, "T1", "2.1", False, "causal_mask", name="Ada")
    _line(tmp_path, "a" * 16, "T2", "2.1", False, "causal_mask", name="Ada L.")   # renamed since: the latest
    _line(tmp_path, "b" * 16, "T1", "2.1", False, "causal_mask", name="Bo\x1b[2J")   # no terminal escapes
    _line(tmp_path, "c" * 16, "T1", "2.1", False, "causal_mask")                   # anonymous: stays so
    _line(tmp_path, "d" * 16, "T1", "2.1", True, name="Cy")
    room = progress.read_room(tmp_path)
    assert room.names == {"a" * 16: "Ada L.", "b" * 16: "Bo[2J", "d" * 16: "Cy"}
    table = progress.room_table(room, titles={})
    assert "Named: Ada L., Bo[2J, Cy; 1 anonymous" in table
    row = next(line for line in table.splitlines() if line.startswith("2.1 "))
    assert row.endswith("causal_mask 3 (Ada L., Bo[2J)")   # failing now, named; Cy passes
    assert "\x1b" not in table and "c" * 16 not in table and "Ada," not in table


def test_a_room_without_names_is_shown_as_before(tmp_path):
    _line(tmp_path, "a" * 16, "T1", "2.1", False, "causal_mask")
    table = progress.room_table(progress.read_room(tmp_path), titles={})
    assert "Named" not in table and table.splitlines()[-1].endswith("causal_mask 1")
