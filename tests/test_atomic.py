"""The one atomic-write helper: the old file or the new one, never half of one, and no leftovers."""
import pytest

from course_lib._atomic import atomic_file


def test_a_clean_exit_replaces_the_file(tmp_path):
    target = tmp_path / "deeper" / "notes.txt"
    with atomic_file(target) as handle:
        handle.write("zoë\n")
        assert not target.exists(), "nothing appears under the real name before the block ends"
    assert target.read_bytes() == "zoë\n".encode()
    assert [p.name for p in target.parent.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("error", [ValueError("checksum"), KeyboardInterrupt()])
def test_an_error_inside_keeps_the_old_file_and_leaves_no_temporary(tmp_path, error):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(type(error)):
        with atomic_file(target, "wb") as handle:
            handle.write(b"half of the new")
            raise error
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]


def test_mode_is_checked(tmp_path):
    with pytest.raises(ValueError, match="mode: expected 'w' or 'wb', got 'a'"):
        with atomic_file(tmp_path / "x", "a"):
            pass


def test_the_new_file_has_the_mode_a_plain_open_would_give(tmp_path):
    import os
    umask = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "shared.txt") as handle:
            handle.write("readable by the group, as open() would make it")
    finally:
        os.umask(umask)
    assert (tmp_path / "shared.txt").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("kind", ["fifo", "folder", "link"])
def test_a_target_that_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, kind):
    import os
    import stat
    target = tmp_path / "target"
    if kind == "fifo":   # stands in for a device node: a special file a rename would replace
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    else:
        (tmp_path / "real.txt").write_text("kept")
        target.symlink_to(tmp_path / "real.txt")
    before = os.lstat(target).st_mode
    with pytest.raises(ValueError, match=r"path: expected a regular file \(or a new name\), got .*target"):
        with atomic_file(target) as handle:
            handle.write("new")
    assert stat.S_IFMT(os.lstat(target).st_mode) == stat.S_IFMT(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["target"] + (["real.txt"] if kind == "link" else []))
