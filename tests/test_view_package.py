"""``zshardfs.view`` is a package: ``View`` composed of one mixin per concern,
each in its own module (see its docstring).  What its users count on from
the single module it was stays so: its names and its logger; a limit is
patched in the module whose code reads it."""

import errno
import logging

import pytest
import trio

from zshardfs import view
from zshardfs.backends.local import LocalBackend
from zshardfs.config import MountConfig
from zshardfs.daemon import build_view


def test_a_limit_patched_where_it_is_read_reaches_the_moved_code_and_is_undone(tmp_path, monkeypatch, caplog):
    """``monkeypatch.setattr(view.writing, "MAX_FILE", n)`` (a test lowering
    a limit) is read by ``View.truncate`` (view/writing.py), the refusal is
    logged as "zshardfs.view" as before the split, and the undo gives the
    limit back."""
    (tmp_path / "f.txt").write_bytes(b"0123456789")
    cfg = MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False)
    v = build_view(cfg, LocalBackend(str(tmp_path)))
    v.writeback.max_dirty_bytes = 0  # (the limit is the larger of MAX_FILE and max_dirty)
    monkeypatch.setattr(view.writing, "MAX_FILE", 16)

    async def truncate(size):
        return await v.truncate(await v.resolve("f.txt"), size)

    with caplog.at_level(logging.WARNING, logger="zshardfs"):
        with pytest.raises(view.ViewError) as refused:
            trio.run(truncate, 17)
    assert refused.value.errno == errno.EFBIG
    assert [r.name for r in caplog.records if "more than a file written through the view may hold" in r.message] \
        == ["zshardfs.view"]
    assert trio.run(truncate, 16).size == 16
    monkeypatch.undo()
    assert trio.run(truncate, 1000).size == 1000
    assert (tmp_path / "f.txt").stat().st_size == 1000


def test_the_names_of_the_single_module_are_still_there():
    """Every name other modules, tests and scripts take from ``zshardfs.view``
    is one object, wherever in the package it lives now."""
    from zshardfs.view import (Changed, DirectoryInTheWay, DirMove, FileBuffer, Handle, Node, View, ViewError,
                               _stays_in_view, _TTLCache)
    from zshardfs.view import nodes, renames, writing
    assert [Changed, DirectoryInTheWay, FileBuffer, Handle, Node, ViewError, _stays_in_view, _TTLCache] == [
        nodes.Changed, nodes.DirectoryInTheWay, nodes.FileBuffer, nodes.Handle, nodes.Node, nodes.ViewError,
        nodes._stays_in_view, nodes._TTLCache]
    assert DirMove is renames.DirMove and View is view.View and view.LISTED_NODES == 1 << 14
    assert View.EMPTIED_MAX == 4096 and View.SCRATCH_KEEP == writing.WritingMixin.SCRATCH_KEEP == 600.0
    assert view.log is logging.getLogger("zshardfs.view")
