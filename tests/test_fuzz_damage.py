"""Fixed seeds of the damage fuzzer (scripts/fuzz_damage.py, SEMANTICS 5.7): a good store of
each layout, damaged at random from the seed, mounted read-only and read-write, walked and
read: every call ends in time with success, EIO, ENOENT or ENOTDIR, the daemon stays up,
its log has no traceback and a bounded number of lines per damaged object, the files the
damage cannot reach read as before, writes to undamaged chunks work, and fsck ends cleanly.

Each layout's seed was chosen so that it damages metadata, shard bytes and the tree (a file where a directory is expected, or the reverse); this is asserted, so a
change of the generator cannot drop a kind unnoticed. A failure prints the replay line;
run more seeds with the script after changing how damage is read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fuzz_damage.py"

#: layout -> seeds (each two mounts and an fsck: a few seconds)
SEEDS = {
    "zarr": [179],       # a nested codec list changed, bits flipped in a shard, a file for an array's directory
    "zarr2": [42],       # chunk_grid resized, bits flipped in an index, a file for a chunk directory
    "pc_volume": [78],   # minishard_bits hostile, a directory for a shard, 0xff over a shard index
    "pc_kv": [58],       # data_encoding NaN, a directory for a shard, zeros over data
}


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_damage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    module.cleanup()


@pytest.mark.parametrize("layout", list(SEEDS))
def test_damaged_stores_answer_clearly(layout, fuzz, tmp_path, capsys):
    kinds = set()
    found = {}
    try:
        for seed in SEEDS[layout]:
            findings, damages = fuzz.run_seed(layout, seed, tmp_path / "stores", tmp_path / "runs")
            if findings:
                found[seed] = findings
            for d in damages:
                kinds.add("tree" if d["kind"] == "tree" or "directory" in d["what"]
                          else "metadata" if fuzz.is_metadata(d["path"]) else "data")
    finally:
        fuzz.cleanup()
    assert not found, capsys.readouterr().out
    assert kinds == {"tree", "metadata", "data"}, f"the seeds of {layout} no longer damage every kind: {kinds}"
