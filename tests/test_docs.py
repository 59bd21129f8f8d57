"""The promise list names its tests: every test that docs/SEMANTICS.md cites
exists, so a renamed or removed test cannot leave a promise unbacked.

A citation is ``file.py::test_name``, or ``::test_name`` for the file cited
last before it; ``test_name_*`` stands for every test of that prefix (at
least one must exist).  Parametrised ids (``[local]``) are ignored."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"(test_\w+\.py)?::(test_\w+\*?)")


def _tests_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def citations(text: str) -> list[tuple[str, str]]:
    """(file, test) for every citation in ``text``, in order."""
    found, current = [], None
    for match in CITATION.finditer(text):
        current = match.group(1) or current
        assert current is not None, f"::{match.group(2)} cites no file before it"
        found.append((current, match.group(2)))
    return found


def test_citations_are_read_as_meant():
    text = "a `test_x.py::test_a`, `::test_b[s3]` and `test_y.py::test_c_*`, `::test_d`"
    assert citations(text) == [("test_x.py", "test_a"), ("test_x.py", "test_b"), ("test_y.py", "test_c_*"),
                               ("test_y.py", "test_d")]


def test_every_test_semantics_cites_exists():
    found = citations((ROOT / "docs/SEMANTICS.md").read_text())
    assert len(found) > 100  # (the list is long: a regex that finds nothing must not pass)
    known: dict[str, set[str]] = {}
    missing = []
    for file, name in found:
        path = ROOT / "tests" / file
        if file not in known:
            known[file] = _tests_of(path) if path.exists() else set()
        names = known[file]
        ok = any(n.startswith(name[:-1]) for n in names) if name.endswith("*") else name in names
        if not ok:
            missing.append(f"{file}::{name}")
    assert not missing, f"SEMANTICS.md cites tests that do not exist: {missing}"
