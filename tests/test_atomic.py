"""lowmembp.atomic: whole-or-nothing writes with ordinary permissions, and clear errors for bad destinations."""
from __future__ import annotations

import os
import stat

import pytest

from lowmembp.atomic import DestinationError, atomic_open, atomic_write, check_writable, file_mode


@pytest.fixture
def umask():
    def set_(mask):
        old.append(os.umask(mask))
    old = []
    yield set_
    if old:
        os.umask(old[0])


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_file_gets_the_umask_permissions_not_0600(tmp_path, umask, mask, mode):
    umask(mask)
    assert file_mode() == mode
    for i, data in enumerate(("text ü\n", b"\x00\x01bytes")):
        out = tmp_path / f"deep/er/f{i}"
        atomic_write(out, data)
        assert stat.S_IMODE(out.stat().st_mode) == mode
        assert (out.read_bytes() if isinstance(data, bytes) else out.read_text(encoding="utf-8")) == data


def test_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "r.json"
    atomic_write(out, "old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_open(out) as fh:
            fh.write("half of the new")
            raise RuntimeError("writer failed")
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with atomic_open(out, "wb") as fh:
        fh.write(b"new")
    assert out.read_bytes() == b"new" and len(list(tmp_path.iterdir())) == 1


def test_bad_destinations_raise_a_clear_error(tmp_path):
    (tmp_path / "a_file").write_text("x")
    cases = {"": "empty path", str(tmp_path): "is a directory", str(tmp_path / "a_file" / "r.json"): "is a file",
             str(tmp_path / "a_file" / "x" / "r.json"): "is a file"}
    for path, needle in cases.items():
        for call in (check_writable, lambda p: atomic_write(p, "x")):
            with pytest.raises(DestinationError, match=needle):
                call(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    with pytest.raises(TypeError):
        atomic_write(tmp_path / "n", 3)
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "n", "a"):
            pass


def test_unwritable_directory(tmp_path):
    if os.geteuid() == 0:  # root writes through permissions; a place nobody can create files in
        target = "/proc/lowmembp-no-such-dir/r.json"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        target = str(locked / "sub" / "r.json")
    with pytest.raises(DestinationError, match="cannot write"):
        check_writable(target)
    with pytest.raises(OSError):
        atomic_write(target, "x")


def test_check_writable_leaves_nothing(tmp_path):
    assert check_writable(tmp_path / "new" / "r.json") == tmp_path / "new" / "r.json"
    assert list(tmp_path.iterdir()) == []
