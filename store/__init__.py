"""The event store: schema, DuckDB file, `.events.jsonl` in and out, and the queries rooms share."""

from servescope.store.db import Store, StoreBusy
from servescope.store.jsonl import ImportResult, export_run, import_file
from servescope.store.merge import merge_docs
from servescope.store.validation import InvalidEvent, check, check_built, parse_line, run_id_of

__all__ = [
    "ImportResult",
    "InvalidEvent",
    "Store",
    "StoreBusy",
    "check",
    "check_built",
    "export_run",
    "import_file",
    "merge_docs",
    "parse_line",
    "run_id_of",
]
