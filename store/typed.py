"""An operator's file read into typed records, with errors in the file's terms.

The configuration files an operator writes (gateway.yaml, workload files, profiles and
experiments files) are declared as msgspec Structs and converted at the boundary, so types,
ranges, allowed values and unknown keys come from the declarations and only the rules that span
several fields are written out by hand. msgspec's own complaint speaks of JSON and of paths like
`$.workloads[0].turns`; `typed` turns it into what a person editing the file needs: the file,
the place (`teams.a.max_queue`, a list item by its `name`: `workload 'chat': turns`) and what
the key takes, `expected an integer ≥ 0, got -1`. It lives in the store's room because every
room that reads an operator's file may import the store, and the store owns the other input
rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

T = TypeVar("T")

_MESSAGE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_EXPECTED = re.compile(r"^Expected `(?P<kinds>[^`]+)`(?:, got `[^`]+`)?(?P<rule>.*)$", re.S)
_FIELD = re.compile(r"^Object (?P<problem>contains unknown|missing required) field `(?P<f>.+)`$")
_KINDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "object": "a mapping",
    "array": "a list",
}
_SHOWN_CHARS = 60


@dataclass(frozen=True)
class Named:
    """A place in a file named by what the operator called it: `workload 'chat'`."""

    label: str
    name: str


Step = str | int | Named


def typed(
    data: Any,
    kind: type[T],
    source: str,
    *,
    error: type[Exception] = ValueError,
    at: Sequence[Step] = (),
    names: Mapping[str, str] | None = None,
) -> T:
    """`data` (part of a YAML file's content) as `kind`, a msgspec Struct, or `error` saying
    where and what in the file's terms.

    `at` is where `data` sits in the file (`("teams", "a")` for one entry of a mapping,
    converted on its own because msgspec writes a mapping's key as `[...]`); `names` names the
    items of the lists under these keys by their `name` (`{"workloads": "workload"}`), since
    an operator knows a workload by its name, not its position."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise error(readable(str(exc), data, kind, source, at, names or {})) from None


def where(steps: Sequence[Step]) -> str:
    """A place as the file's words: keys dotted, list items `[i]`, a named item then `: `."""
    out, after_name = "", False
    for step in steps:
        if isinstance(step, Named):
            out += f"{': ' if out else ''}{step.label} {step.name!r}"
        elif isinstance(step, int):
            out += f"[{step}]"
        else:
            out += (": " if after_name else ".") + step if out else step
        after_name = isinstance(step, Named)
    return out


def readable(
    message: str,
    data: Any,
    kind: type,
    source: str,
    at: Sequence[Step] = (),
    names: Mapping[str, str] | None = None,
) -> str:
    """msgspec's `Expected `int` >= 0 - at `$.max_queue`` as
    `gateway.yaml: teams.a.max_queue: expected an integer ≥ 0, got -1`."""
    found = _MESSAGE.match(message)
    assert found is not None  # the pattern matches any text
    what, path = found["what"], found["path"] or ""
    steps: list[str | int] = [name if name else int(index) for name, index in _STEP.findall(path)]
    value, declared = _walk(data, steps), _declared(kind, steps)
    place = where([*at, *_named(data, steps, names or {})])
    prefix = f"{source}: {place}: " if place else f"{source}: "
    return prefix + _explain(what, value, declared)


def _named(data: Any, steps: list[str | int], names: Mapping[str, str]) -> list[Step]:
    """The path with each item of a `names` list that has a string `name` shown by it."""
    out: list[Step] = []
    for i, step in enumerate(steps):
        previous = steps[i - 1] if i else None
        if isinstance(step, int) and isinstance(previous, str) and previous in names:
            name = _walk(data, [*steps[: i + 1], "name"])
            if isinstance(name, str):
                out[-1] = Named(names[previous], name)
                continue
        out.append(step)
    return out


def _walk(data: Any, steps: list[str | int]) -> Any:
    """The value at a path of the data (None where there is none)."""
    for step in steps:
        if isinstance(step, int):
            data = data[step] if isinstance(data, list) and step < len(data) else None
        else:
            data = data.get(step) if isinstance(data, dict) else None
    return data


def _declared(kind: type, steps: list[str | int]) -> mi.Type | None:
    """The msgspec type declared at a path of `kind` (None where the path leaves the types)."""
    at: mi.Type | None = mi.type_info(kind)
    for step in steps:
        at = _inner(at)
        if isinstance(at, mi.Metadata):
            at = _inner(at.type)
        if isinstance(at, mi.ListType | mi.TupleType | mi.VarTupleType) and isinstance(step, int):
            at = at.item_type if not isinstance(at, mi.TupleType) else None
        elif isinstance(at, mi.StructType) and isinstance(step, str):
            at = next((f.type for f in at.fields if f.name == step), None)
        else:
            return None
    return _inner(at)


def _inner(at: mi.Type | None) -> mi.Type | None:
    """A nullable type as its value's, a token count's union as its mapping's."""
    if isinstance(at, mi.UnionType):
        kinds = [k for k in at.types if not isinstance(k, mi.NoneType)]
        structs = [k for k in kinds if isinstance(k, mi.StructType)]
        return structs[0] if structs else kinds[0] if len(kinds) == 1 else at
    return at


def _explain(what: str, value: Any, declared: mi.Type | None) -> str:
    """One msgspec complaint as a person reads it."""
    if what.startswith("Invalid enum value"):
        choices = (
            ", ".join(map(str, declared.values))
            if isinstance(declared, mi.LiteralType)
            else "one of the known values"
        )
        return f"expected one of {choices}, got {shown(value)}"
    if expected := _EXPECTED.match(what):
        schema = declared.extra_json_schema if isinstance(declared, mi.Metadata) else None
        if described := (schema or {}).get("description"):
            return f"expected {described}, got {shown(value)}"
        kinds = [_KINDS.get(k, k) for k in expected["kinds"].split(" | ") if k != "null"]
        rule = expected["rule"].replace(">=", "≥").replace("<=", "≤")
        rule = re.sub(r"(\d)\.0\b", r"\1", rule)  # a float bound as written: `> 0`
        return f"expected {' or '.join(kinds)}{rule}, got {shown(value)}"
    if field := _FIELD.match(what):
        if field["problem"] == "missing required":
            return f"missing `{field['f']}`"
        struct = declared.type if isinstance(declared, mi.Metadata) else declared
        known = sorted(f.name for f in struct.fields) if isinstance(struct, mi.StructType) else []
        return f"unknown key {field['f']!r}" + (f" (known: {', '.join(known)})" if known else "")
    return what


def shown(value: Any) -> str:
    """A value as the operator could have written it in YAML (JSON is YAML's flow form),
    shortened: `"three"`, `-1`, `null`, `["a"]`."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
