"""report.json's published JSON Schema (docs/report.schema.json), generated from
`document.Report` by msgspec, so the file cannot say other than the code; a test fails when the
published file is not what this prints. After changing a type of reports/document.py:

    python -m servescope.reports.schema > docs/report.schema.json
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from servescope.reports.document import Report


def _any_json(kind: type) -> dict[str, Any]:
    """`object` in a type (a value the producer writes free-form, e.g. a bench level's fields)
    is any JSON value: no constraint."""
    if kind is object:
        return {"description": "any JSON value, as its producer wrote it"}
    raise NotImplementedError(kind)


def json_schema() -> dict[str, Any]:
    """report.json's JSON Schema (2020-12), generated from `Report`. Every object
    reports/document.py types is closed (`additionalProperties: false`): a key its type does not
    name is a change of the published shape, made by changing the type and regenerating the
    file."""
    body = msgspec.json.schema(Report, schema_hook=_any_json)
    for definition in body.get("$defs", {}).values():
        if "properties" in definition:
            definition["additionalProperties"] = False
    report = body["$defs"]["Report"]
    report["properties"].pop("charts", None)  # the HTML's; never written to report.json
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "servescope report.json",
        **{k: v for k, v in body.items() if k != "$defs"},
        "$defs": body["$defs"],
    }


def schema_text() -> str:
    """The published file's text: what docs/report.schema.json holds."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    print(schema_text(), end="")
