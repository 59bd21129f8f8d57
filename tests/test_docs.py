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


def _readme_options_paragraph() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("Options (`-o a,b=c`")
    return text[start:text.index("\n\n", start)]


def _parsed(name: str, value: str):
    """``value`` as option ``name`` takes it, or None if it is no value of it
    (``prefetch=on|off``, ``shard=K|K1xK2x...``)."""
    from zshardfs.config import OPTIONS, OptionError

    _, parser, _ = OPTIONS[name]
    if parser is None or parser is str or "|" in value:  # (no default to compare: `log_file=`, `prefetch=on|off`)
        return None
    try:
        return parser(value, name)
    except OptionError:
        return None


def test_the_readme_and_the_help_name_every_mount_option_with_the_code_s_default():
    """README's option paragraph names every ``-o`` option config.py takes
    (and no other), and where it or ``zshardfs mount --help`` gives a
    default, it is the one the code uses.  (Found missing: ``fsname``.)"""
    from zshardfs.config import OPTIONS, MountConfig

    defaults = MountConfig(source="s", mountpoint="m")
    paragraph = _readme_options_paragraph()
    named, wrong = set(), []
    for match in re.finditer(r"`([a-z_]+)(=[^`]*)?`", paragraph):
        name, value = match.group(1), (match.group(2) or "")[1:]
        if name not in OPTIONS:
            if match.group(2) is not None:
                wrong.append(f"README names -o {match.group(0)}, which config.py does not take")
            continue
        named.add(name)
        parsed = _parsed(name, value) if value else None
        if parsed is not None and parsed != getattr(defaults, OPTIONS[name][0]):
            wrong.append(f"README: {match.group(0)}, the code's default is {getattr(defaults, OPTIONS[name][0])!r}")
    wrong += [f"README does not name -o {name}" for name in sorted(set(OPTIONS) - named)]
    for name, (attr, _, text) in OPTIONS.items():
        for value in re.findall(r"default ([^:;)\s]+)[;)]", text):
            parsed = _parsed(name, value) if OPTIONS[name][1] is not str else value
            if parsed != getattr(defaults, attr):
                wrong.append(f"--help of {name}: default {value}, the code's is {getattr(defaults, attr)!r}")
    assert len(named) > 20  # (a regex that finds nothing must not pass)
    assert not wrong, "\n".join(wrong)
