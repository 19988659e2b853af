"""The house's layout, as docs/architecture.md states it: one installed namespace, rooms that
import only what the contract allows (the wire room nothing of ours), no import circle, no
room outside the store running the store's SQL, and no module taking another's private names."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

from servescope.commands import NAMES

ROOT = Path(__file__).resolve().parents[2]
ROOMS = {  # folder → the rooms of ours it may import (docs/architecture.md, "Rooms")
    "store": set(),
    "wire": set(),
    "collector": {"store", "wire"},
    "loadgen": {"store", "wire"},
    "gateway": {"store", "wire"},
    "reports": {"store", "wire"},
    "dashboards": set(),
    "servescope": {
        "store", "wire", "collector", "loadgen", "gateway", "reports", "dashboards"
    },
}  # fmt: skip


def module_of(path: Path) -> str:
    room, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = ["servescope"] + ([] if room == "servescope" else [room]) + rest
    return ".".join(p for p in parts if p != "__init__")


def imports_of(path: Path) -> set[str]:
    """Every `servescope.…` module this file imports, at any depth (imports inside functions
    count: a late import is still an arrow)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("servescope"):
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("servescope"))
    return found


def graph() -> dict[str, set[str]]:
    files = [f for room in ROOMS for f in (ROOT / room).rglob("*.py")]
    modules = {module_of(f): f for f in files}
    return {
        name: {target for target in imports_of(path) if target in modules and target != name}
        for name, path in modules.items()
    }


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "servescope"


def test_rooms_import_only_what_the_contract_allows() -> None:
    wrong = sorted(
        f"{source} → {target}"
        for source, targets in graph().items()
        for target in targets
        if room_of(target) != room_of(source) and room_of(target) not in ROOMS[room_of(source)]
    )
    assert not wrong


# What a store statement starts with (the store writes SQL keywords upper-case).
SQL = re.compile(r"^\s*(SELECT|WITH|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|COPY)\b")


def store_names_used(path: Path) -> set[tuple[str, str]]:
    """(store module, name) for every name this file takes from a store module: imported by
    name (`from servescope.store.queries import X`), or read off an imported store module
    (`queries.X` after `from servescope.store import queries`)."""
    tree = ast.parse(path.read_text(), str(path))
    used: set[tuple[str, str]] = set()
    aliases: dict[str, str] = {}  # local name → store module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("servescope.store"):
                continue
            for alias in node.names:
                value = getattr(importlib.import_module(node.module), alias.name, None)
                if isinstance(value, ModuleType):
                    aliases[alias.asname or alias.name] = value.__name__
                else:
                    used.add((node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("servescope.store.") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        if (module := aliases.get(node.value.id)) is not None:
            used.add((module, node.attr))
    return used


def test_no_room_outside_the_store_takes_its_sql() -> None:
    """Other rooms call the store's functions (`store.reads`, `Store`, the SQL builders of
    `store.queries`), never one of its statements: a table changes with its statements in one
    room."""
    wrong = []
    for room in ROOMS:
        if room == "store":
            continue
        for path in (ROOT / room).rglob("*.py"):
            for module, name in store_names_used(path):
                value = getattr(importlib.import_module(module), name, None)
                if isinstance(value, str) and SQL.match(value):
                    wrong.append(f"{path.relative_to(ROOT)}: {module}.{name}")
    assert not wrong, wrong


def test_the_sql_check_sees_both_ways_of_taking_a_statement(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from servescope.store import queries\n"
        "from servescope.store.queries import GET_RUN\n"
        "queries.LIST_RUNS\n"
    )
    assert {("servescope.store.queries", "GET_RUN"), ("servescope.store.queries", "LIST_RUNS")} <= (
        store_names_used(probe)
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_named(package: str, name: str) -> str | None:
    """The module `from package import name` gives, if it gives one (not a function, a
    class or a constant)."""
    value = getattr(importlib.import_module(package), name, None)
    if value is None and hasattr(importlib.import_module(package), "__path__"):
        try:
            value = importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            return None
    return value.__name__ if isinstance(value, ModuleType) else None


def private_names_taken(path: Path) -> set[str]:
    """`module._name` for every private name this file takes from another module of ours:
    imported by name (`from servescope.x import _name`, at any depth: a late import counts),
    or read off a module of ours it imported (`x._name` after `from servescope import x` or
    `import servescope.x as x`). A private name is its module's own: what another module needs
    is made public where it lives (or moved to where it is shared)."""
    tree = ast.parse(path.read_text(), str(path))
    taken: set[str] = set()
    modules: dict[str, str] = {}  # local name → a module of ours
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("servescope"):
                continue
            for alias in node.names:
                if _private(alias.name):
                    taken.add(f"{node.module}.{alias.name}")
                elif (module := _module_named(node.module, alias.name)) is not None:
                    modules[alias.asname or alias.name] = module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("servescope.") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (module := modules.get(node.value.id)) is not None
            and _private(node.attr)
        ):
            taken.add(f"{module}.{node.attr}")
    own = module_of(path) if path.is_relative_to(ROOT) else None
    return {name for name in taken if name.rpartition(".")[0] != own}


def test_no_module_takes_another_modules_private_names() -> None:
    wrong = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for room in ROOMS
        for path in (ROOT / room).rglob("*.py")
        for name in private_names_taken(path)
    )
    assert not wrong, wrong


def test_the_private_name_check_sees_every_way_of_taking_one(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from servescope.reports import svg\n"
        "import servescope.reports.judge as judge\n"
        "from servescope.reports.build import _slice, build_diff\n"
        "def late():\n"
        "    from servescope.commands.common import _interrupt\n"
        "    return svg._legend_places, judge._call, svg.chart, build_diff.__doc__\n"
    )
    assert private_names_taken(probe) == {
        "servescope.reports.build._slice",
        "servescope.commands.common._interrupt",
        "servescope.reports.svg._legend_places",
        "servescope.reports.judge._call",
    }


def modules_of_tests_taken(source: str, package: tuple[str, ...]) -> set[str]:
    """The modules under tests/ that a file of `package` imports, at any depth: `from tests.x
    import …`, `from tests import x`, `import tests.x`, or relative (`from .x import …`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module.split(".")[0] != "tests":
                continue
            if (ROOT / module.replace(".", "/")).is_dir():  # `from tests.helpers import cli`
                found.update(f"{module}.{alias.name}" for alias in node.names)
            else:
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tests")
    return found


def test_test_modules_share_code_only_through_tests_helpers() -> None:
    """A test module takes shared code from tests/helpers and fixtures from its conftest (by
    name, never imported), nothing from another test module or a conftest: a test module can
    change without breaking one of another tier. tests/helpers takes nothing from the tests."""
    wrong = sorted(
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / "tests").rglob("*.py")
        for module in modules_of_tests_taken(path.read_text(), path.relative_to(ROOT).parts[:-1])
        if not module.startswith("tests.helpers.")
    )
    assert not wrong, wrong


def test_the_tests_import_check_sees_every_way_of_taking_a_test_module() -> None:
    probe = (
        "from tests.helpers.cli import servescope\n"
        "from tests.helpers import stats\n"
        "from tests.integration.test_report import markdown_text\n"
        "from tests import conftest\n"
        "from . import test_lake\n"
        "from ..unit.test_store import SEED_LINE\n"
        "def late():\n"
        "    import tests.e2e.conftest\n"
    )
    assert modules_of_tests_taken(probe, ("tests", "integration")) == {
        "tests.helpers.cli",
        "tests.helpers.stats",
        "tests.integration.test_report",
        "tests.conftest",
        "tests.integration.test_lake",
        "tests.unit.test_store",
        "tests.e2e.conftest",
    }


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
TABLE = re.compile(r"declarative table", re.IGNORECASE)
# The "at most N `dict[str, Any]`" that docs/architecture.md states, read from its sentence.
ANY_DICTS = re.compile(r"at most (\d+) `dict\[str, Any\]`")


def long_functions(path: Path, base: Path = ROOT) -> list[str]:
    """The functions of `path` over MAX_FUNCTION_LINES that do not call themselves a declarative
    table, in their docstring or in the comment lines right above their `def`."""
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines), str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        if node.end_lineno - first + 1 <= MAX_FUNCTION_LINES:
            continue
        above, row = [], first - 2
        while row >= 0 and lines[row].lstrip().startswith("#"):
            above.append(lines[row])
            row -= 1
        if not TABLE.search(" ".join(above) + (ast.get_docstring(node) or "")):
            found.append(f"{path.relative_to(base)}:{node.lineno} {node.name}")
    return found


def room_files() -> list[Path]:
    return [f for room in ROOMS for f in sorted((ROOT / room).rglob("*.py"))]


def test_units_stay_small() -> None:
    big = [
        f"{f.relative_to(ROOT)} ({n} lines)"
        for f in room_files()
        if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not big, big
    long = [name for f in room_files() for name in long_functions(f)]
    assert not long, long


def test_the_long_function_check_sees_an_unmarked_one(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    probe = tmp_path / "probe.py"
    probe.write_text(f"def long():\n{body}\n\n# A declarative table.\ndef marked():\n{body}")
    assert long_functions(probe, tmp_path) == ["probe.py:1 long"]


def test_the_untyped_dicts_stay_within_what_the_architecture_states() -> None:
    stated = ANY_DICTS.findall((ROOT / "docs" / "architecture.md").read_text())
    assert len(stated) == 1, "docs/architecture.md states the `dict[str, Any]` bound once"
    count = sum(f.read_text().count("dict[str, Any]") for f in room_files())
    assert count <= int(stated[0]) <= 200, (count, stated[0])


def test_no_import_circle() -> None:
    edges = graph()
    # a package's __init__ re-exporting its own modules is not a circle between modules
    edges = {
        m: {t for t in ts if not (m.startswith(t + ".") and m.rsplit(".", 1)[0] == t)}
        for m, ts in edges.items()
    }
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if seen.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError("import circle: " + " → ".join(cycle))
            if nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = 2

    for module in sorted(edges):
        if module not in seen:
            visit(module, [module])


def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    """`pip install .` puts exactly one package into site-packages, with its data files."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("servescope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "servescope"
    }
    for data in (
        "servescope/loadgen/profiles.yaml",
        "servescope/loadgen/workloads/ralph-loop.yaml",
        "servescope/reports/diagnosis.yaml",
        "servescope/dashboards/rules/servescope.rules.yml",
        "servescope/reports/templates/report.html.j2",
        "servescope/wire/stream.py",
    ):
        assert data in names


def test_a_command_imports_its_own_room_only() -> None:
    """`servescope store runs` builds its parser without the collector, the load generator or the
    gateway (their imports took 3 of a CLI call's 3.6 s); help still lists every command."""
    probe = (
        "import sys; from servescope.cli import build_parser; "
        "build_parser(['store', 'runs']).parse_args(['store', 'runs']); "
        "print(sorted(m for m in sys.modules if m.startswith('servescope.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert "servescope.commands.store" in loaded
    for room in ("collector", "loadgen", "gateway", "reports", "dashboards"):
        assert f"'servescope.{room}." not in loaded, (room, loaded)
    help_text = subprocess.run(
        [sys.executable, "-m", "servescope.cli", "--help"], capture_output=True, text=True
    ).stdout
    for command in NAMES:
        assert re.search(rf"^ +{command}\b", help_text, re.M), command
