"""Run ids are data, never paths: the one mapping from a run id (or a report id built from run
ids) to a file or folder name.

A run id comes from files other people wrote; `../../x`, `a/b`, a NUL, 300 characters or an
emoji must all be stored, reported and exported without a byte landing outside the folder the
user named. `safe_name` percent-encodes every byte outside `[A-Za-z0-9._-]` (and a leading
dot), so ordinary ids read as they are, the mapping is reversible (`name_of`), and two ids
never share a name. Names longer than a file system takes (`MAX_NAME` bytes) keep their head
and end in `~` and a digest of the whole id: collision-free, though no longer reversible.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import quote, unquote

MAX_NAME = 200  # bytes of a name: below every common file system's 255, room for a suffix
_EMPTY = "%"  # no other id maps to a lone %, which is never the start of an escape
_SAFE = "-_."  # besides letters and digits


def safe_name(run_id: str) -> str:
    """A single path component that stands for `run_id` and for nothing else."""
    if run_id == "":
        return _EMPTY
    name = quote(run_id.encode("utf-8", "surrogatepass"), safe=_SAFE).replace("~", "%7E")
    if name.startswith("."):  # never hidden, never "." or ".."
        name = "%2E" + name[1:]
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        head = name[: MAX_NAME - 18]
        head = re.sub(r"%[0-9A-F]?$", "", head)  # never cut an escape in two
        name = f"{head}~{digest}"
    return name


def name_of(name: str) -> str | None:
    """The run id a `safe_name` stands for (None for a shortened one)."""
    if name == _EMPTY:
        return ""
    if "~" in name:
        return None
    return unquote(name, errors="surrogatepass")


def inside(folder: Path, run_id: str, suffix: str = "") -> Path:
    """`folder/<safe_name(run_id)><suffix>`, checked to be inside `folder`."""
    path = folder / f"{safe_name(run_id)}{suffix}"
    if path.resolve().parent != folder.resolve():
        raise ValueError(f"{run_id!r} does not map inside {folder}")  # cannot happen: a guard
    return path


def partition_value(run_id: str) -> str:
    """The `run_id=` value of a Parquet partition: the id itself (DuckDB percent-encodes it)
    unless its folder name would be too long; then its head, `~` and a digest of it."""
    if len(safe_name(run_id)) <= MAX_NAME - len("run_id="):
        return run_id
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    head = run_id[:32]
    while len(safe_name(head)) > 120:
        head = head[:-1]
    return f"{head}~{digest}"
