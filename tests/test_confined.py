"""grctl/confined.py on its own: the check made through the descriptor, not the path."""

from __future__ import annotations

import os

import pytest

from grctl import confined
from grctl.errors import Forbidden, ValidationError


def test_a_path_swapped_after_the_open_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    for d in (root, outside):
        d.mkdir()
    (root / "a").write_text("inside")
    (outside / "b").write_text("outside")
    link = root / "link"
    link.symlink_to(root / "a")
    fd = os.open(link, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        confined.check_inside(fd, st, link, root, "file")  # the file it names now
        link.unlink()
        link.symlink_to(outside / "b")  # swapped once opened: the path names another file
        with pytest.raises(Forbidden, match="changed while it was opened"):
            confined.check_inside(fd, st, link, root, "file")
    finally:
        os.close(fd)
    with pytest.raises(Forbidden, match="outside the weights root"):
        confined.open_read(link, root=root, what="catalog", follow=True)
    with pytest.raises(ValidationError, match="is a symlink"):
        confined.open_read(link, root=None, what="delta file", follow=False)
    assert confined.read_bytes(root / "a", root=root, what="x", limit=10) == b"inside"
    with pytest.raises(ValidationError, match="over 3 bytes"):
        confined.read_bytes(root / "a", root=root, what="x", limit=3)


def test_a_write_replaces_a_symlink_and_never_writes_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("kept")
    (tmp_path / "mark").symlink_to(victim)
    confined.write_file(tmp_path / "mark", b"1")
    assert victim.read_text() == "kept"
    assert not (tmp_path / "mark").is_symlink() and (tmp_path / "mark").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mark", "victim"]  # no temporary left
