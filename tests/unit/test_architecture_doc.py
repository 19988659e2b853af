"""docs/architecture.md's module table is the map a newcomer reads first: it must name every
module of every room, and nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("store", "wire", "collector", "loadgen", "gateway", "reports", "dashboards", "servescope")
ROW = re.compile(r"^\| `(?P<path>[\w/.-]+)`")


def modules_in_tree() -> set[str]:
    found = set()
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                found.add(path.relative_to(ROOT).as_posix())
    return found


def modules_in_table() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    return {
        match["path"]
        for line in section.splitlines()
        if (match := ROW.match(line)) and match["path"].endswith(".py")
    }


def test_the_module_table_names_every_module_in_the_tree() -> None:
    missing = sorted(modules_in_tree() - modules_in_table())
    assert not missing, f"modules with no row in docs/architecture.md's table: {missing}"


def test_the_module_table_names_nothing_that_is_gone() -> None:
    gone = sorted(modules_in_table() - modules_in_tree())
    assert not gone, f"rows of docs/architecture.md's table with no module: {gone}"


def test_every_row_says_what_its_module_does() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if ROW.match(line)]
    empty = [line for line in rows if line.rstrip().endswith("|  |")]
    assert not empty, empty
