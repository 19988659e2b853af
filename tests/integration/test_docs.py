"""The docs name only what exists. README.md and docs/ (docs/history/ aside, a notebook of what was
in the words of its day, and the reports servescope wrote) are read for what they name of ours —
a file or folder, a `servescope` command, subcommand or flag, a make target, a Python symbol —
and each name is resolved against the repository: paths against the checkout, commands and flags
against the parsers `servescope` itself builds, symbols by importing them. A name that is
legitimately not ours (vLLM's flags, other projects' names, a model's files) sits in `NOT_OURS`,
with why; what cannot be ours by its shape (Prometheus's `vllm:` metric names, URL paths such as
`/metrics`, a JSON key path such as `notes.instance`) is not read as a reference at all.

This is what makes "the tests keep it true" true of the docs: a module renamed, a command
removed or a flag dropped fails here with the doc's file:line until the doc follows."""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import inspect
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

from servescope.cli import build_parser
from servescope.commands import NAMES
from servescope.store.settings import DEFAULT_DATA_DIR

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("store", "wire", "collector", "loadgen", "gateway", "reports", "dashboards")

# Names the docs mention that are not ours to resolve, with why. Everything else that looks like
# a path, a command, a flag or a symbol must exist.
NOT_OURS = {
    # vLLM's own flags, named where the docs say how vLLM is started or what it accepts
    "--otlp-traces-endpoint", "--enable-log-requests", "--logging-config", "--goodput",
    "--enable-chunked-prefill", "--load-format", "--enable-sleep-mode",
    # a model's own config (Hugging Face's layout), in the model's folder
    "config.json",
    # other projects' names: vLLM's allocator, delta-rs's error, ClickHouse's table function,
    # the cloud stores' credentials (read by delta-rs from the environment)
    "CuMemAllocator", "CommitFailedException", "deltaLake", "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY", "AWS_S3_ALLOW_UNSAFE_RENAME",
}  # fmt: skip
# Words that stand for a value in a doc's path (`OUT/report.json`, `repeat-N.md`).
PLACEHOLDERS = {"N", "OUT", "DIR", "RUN", "BASE", "FILE", "PATH", "NAME", "X"}

FILE_SUFFIX = re.compile(r"\.(py|md|ya?ml|json|toml|sh|j2|txt|cfg|env|jsonl|html)$")
PATH = re.compile(r"[\w.+-]+(/[\w.+-]+)*/?")
IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"{IDENT}(\.{IDENT})+")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path of the checkout written in prose, outside code: it starts with one of its folders.
PROSE_PATH = re.compile(
    r"(?<![\w/.`-])((?:store|wire|collector|loadgen|gateway|reports|dashboards|servescope"
    r"|benchmarks|tests|docs|compose)/[\w./-]*[\w/])"
)


@dataclass(frozen=True)
class Mention:
    """What a doc names at one place: a code span, a code block's command line, a link or a path
    written in prose."""

    doc: Path
    line: int
    text: str
    kind: str  # "span", "block", "link" or "path" (in prose)

    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def docs() -> list[Path]:
    """The docs people write: README.md and docs/, less docs/history/ and the reports servescope
    wrote into docs/gpu/ (each folder with a report.json), which say what their run said."""
    folder = ROOT / "docs"
    found = [
        p
        for p in folder.rglob("*.md")
        if p.relative_to(folder).parts[0] != "history" and not (p.parent / "report.json").exists()
    ]
    return [ROOT / "README.md", *sorted(found)]


def mentions(doc: Path) -> Iterator[Mention]:
    """Every code span, code block line (a `\\` continuation joined), local link and path in
    prose of `doc`."""
    text = doc.read_text(encoding="utf-8")
    lines = text.split("\n")
    prose: list[str] = []
    block: list[str] | None = None
    for number, line in enumerate(lines, 1):
        if FENCE.match(line.strip()):
            block = [] if block is None else None
            prose.append("")
            continue
        if block is None:
            prose.append(line)
            continue
        prose.append("")
        block.append(line)
        if line.rstrip().endswith("\\"):
            continue
        joined = " ".join(part.rstrip().removesuffix("\\") for part in block)
        yield Mention(doc, number - len(block) + 1, joined, "block")
        block.clear()
    body = "\n".join(prose)
    for match in CODE_SPAN.finditer(body):
        line = body.count("\n", 0, match.start()) + 1
        yield Mention(doc, line, " ".join(match[2].split()), "span")
    outside = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), body)
    for match in LINK.finditer(outside):
        line = outside.count("\n", 0, match.start()) + 1
        yield Mention(doc, line, match[1], "link")
    for match in PROSE_PATH.finditer(outside):
        line = outside.count("\n", 0, match.start()) + 1
        yield Mention(doc, line, match[1].rstrip("."), "path")


# --- paths -----------------------------------------------------------------------------------


@cache
def tracked() -> frozenset[str]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return frozenset(out.split())


@cache
def tracked_names() -> frozenset[str]:
    """The base name of every tracked file and folder."""
    names = set()
    for path in tracked():
        names.update(path.split("/"))
    return frozenset(names)


def is_path(token: str, alone: bool) -> bool:
    """A token that names a file or folder of the checkout: a path under one of its top-level
    entries or with a suffix we keep files under, or a file name with such a suffix that is a
    code span of its own (`test_layout.py`; in a command line a bare name is the user's file).
    Not: `owner/model` ids, URL paths, `.events.jsonl` (a suffix), paths with a placeholder."""
    token = token.rstrip(".,;:")
    if not PATH.fullmatch(token) or token.startswith(("/", "../", ".")) or "//" in token:
        return False
    if PLACEHOLDERS & set(re.split(r"[/.-]", token)):
        return False
    if "/" not in token.strip("/"):
        return alone and bool(FILE_SUFFIX.search(token))
    top = token.removeprefix("./").split("/")[0]
    return top in tracked_names() or bool(FILE_SUFFIX.search(token))


@cache
def tracked_folders() -> frozenset[str]:
    """Every folder that holds a tracked file."""
    return frozenset(str(parent) for path in tracked() for parent in Path(path).parents)


def in_checkout(path: Path) -> bool:
    """Whether `path` is a tracked file or a folder of tracked files: what a fresh clone has,
    not what this working tree has made since (the data folder, build outputs)."""
    try:
        relative = str(path.resolve().relative_to(ROOT))
    except ValueError:
        return False
    return relative in tracked() or relative in tracked_folders()


def path_exists(token: str, doc: Path) -> bool:
    token = token.rstrip(".,;:")
    if token in NOT_OURS or token.removeprefix("./") in NOT_OURS:
        return True
    bare = token.rstrip("/").removeprefix("./")
    if bare.split("/")[0] == str(DEFAULT_DATA_DIR):
        return True  # the data folder: what servescope writes when run, never in a checkout
    if in_checkout(ROOT / bare) or in_checkout(doc.parent / bare):
        return True
    return "/" not in bare and bare in tracked_names()


def link_exists(target: str, doc: Path) -> bool:
    target = target.split("#", 1)[0]
    if not target or re.match(r"^[a-z]+:", target):
        return True  # an anchor in the same file, a URL
    return in_checkout(doc.parent / target)


# --- commands and flags ----------------------------------------------------------------------


@cache
def cli() -> argparse.ArgumentParser:
    return build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def every_parser(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for child in subcommands(parser).values():
        yield from every_parser(child)


@cache
def every_flag() -> frozenset[str]:
    return frozenset(flag for p in every_parser(cli()) for flag in p._option_string_actions)


def command_words(text: str) -> list[str] | None:
    """`text` as the words after `servescope`, if it is a servescope command line: `servescope
    …` (any path to it), or a command group and what follows (`report build RUN`, `bench run`)."""
    try:
        words = shlex.split(text.split(" # ", 1)[0].replace("…", " "), comments=False)
    except ValueError:
        words = text.split()
    for stop in ("|", "&&", ";", ">", "2>&1"):
        if stop in words:
            words = words[: words.index(stop)]
    if words and words[0] == "$":
        words = words[1:]
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]  # VAR=value before the command
    if words and words[0].split("/")[-1] == "servescope":
        return words[1:]
    if words[:3] == ["python", "-m", "servescope.cli"] or words[1:3] == ["-m", "servescope.cli"]:
        return words[3:]
    if len(words) > 1 and words[0] in NAMES:
        return words
    return None


def command_problem(words: list[str]) -> str | None:
    """What is wrong with `servescope WORDS`: an unknown command or subcommand, or a flag that its
    parsers do not have. Positional values are not checked (the docs write placeholders)."""
    parser = cli()
    chain = [parser]
    options = dict(parser._option_string_actions)
    skip = False
    for raw in words:
        word = raw.strip("[](){}")
        if skip or not word or word == "--":
            skip = False
            continue
        if word.startswith("-") and not re.fullmatch(r"-[\d.]+", word):
            flag = word.split("=", 1)[0]
            action = options.get(flag)
            if action is None:
                if flag in NOT_OURS:
                    continue
                return f"no flag {flag} in `servescope {' '.join(chain_names(chain))}`"
            skip = "=" not in word and action.nargs != 0
            continue
        children = subcommands(chain[-1])
        if children and "/" in word:  # `report build/list/flips`: each one a subcommand
            missing = [name for name in word.split("/") if name not in children]
            return (
                f"no command `servescope {' '.join(chain_names(chain))} {missing}`"
                if missing
                else None
            )
        if children:
            if word not in children:
                return f"no command `servescope {' '.join([*chain_names(chain), word])}`"
            chain.append(children[word])
            options.update(children[word]._option_string_actions)
    return None


def chain_names(chain: list[argparse.ArgumentParser]) -> list[str]:
    return [p.prog.split()[-1] for p in chain[1:]]


@cache
def script_flags(script: str) -> frozenset[str]:
    """The flags a script of ours declares with `add_argument` (benchmarks/bench_lake.py's)."""
    tree = ast.parse((ROOT / script).read_text(encoding="utf-8"))
    return frozenset(
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")
    )


@cache
def benchmark_flags() -> frozenset[str]:
    return frozenset().union(
        *(script_flags(p) for p in tracked() if p.startswith("benchmarks/") and p.endswith(".py"))
    )


def script_problems(text: str) -> Iterator[str]:
    """A flag that a `benchmarks/….py` command line gives and the script does not declare."""
    words = text.split(" # ", 1)[0].split()
    scripts = [w for w in words if re.fullmatch(r"(\./)?benchmarks/[\w/]+\.py", w)]
    if not scripts or not (ROOT / scripts[0]).is_file():
        return
    declared = script_flags(scripts[0].removeprefix("./"))
    after = words[words.index(scripts[0]) + 1 :]
    for word in after:
        flag = word.strip("[]()").split("=", 1)[0]
        if re.fullmatch(r"--[\w-]+", flag) and flag not in declared and flag not in NOT_OURS:
            yield f"no flag {flag} in {scripts[0]}"


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([\w.-]+):", text, re.M))


# --- Python symbols --------------------------------------------------------------------------


@cache
def our_modules() -> dict[str, ModuleType]:
    """Every module of ours, imported, by its dotted name."""
    found = {}
    for room in (*ROOMS, "servescope"):
        for path in (ROOT / room).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(
                ["servescope", *([] if room == "servescope" else parts[:1]), *parts[1:]]
            )
            found[name] = importlib.import_module(name)
    return found


@cache
def by_short_name() -> dict[str, list[object]]:
    """A module's last part (`queries`) or a room-level name (`Store`) → what it may mean."""
    table: dict[str, list[object]] = {}
    for name, module in our_modules().items():
        table.setdefault(name.rsplit(".", 1)[-1], []).append(module)
        for attr, value in vars(module).items():
            if not attr.startswith("__"):
                table.setdefault(attr, []).append(value)
    return table


def has_attribute(value: object, name: str) -> bool:
    """`value.name` exists: an attribute, a field of a dataclass, Struct or TypedDict, or a
    submodule."""
    if hasattr(value, name):
        return True
    fields = getattr(value, "__annotations__", None) or {}
    if name in fields or name in getattr(value, "__struct_fields__", ()):
        return True
    if isinstance(value, ModuleType):
        return f"{value.__name__}.{name}" in our_modules()
    if isinstance(value, type):  # an attribute its methods set (`self.exporters = …`)
        return any(
            re.search(rf"\bself\.{name}\b\s*[:=]", inspect.getsource(klass))
            for klass in value.__mro__
            if klass.__module__.startswith("servescope.")
        )
    return False


def resolves(dotted: str) -> bool | None:
    """True or False for a dotted name of ours; None for one that is not ours (an OpenTelemetry
    attribute `gen_ai.request.id`, a JSON key path `notes.instance`)."""
    first, *rest = dotted.split(".")
    if first == "servescope":
        candidates: list[object] = [importlib.import_module("servescope")]
    elif first in ROOMS:
        candidates = [importlib.import_module(f"servescope.{first}")]
    else:
        candidates = by_short_name().get(first, [])
        if not candidates:
            return False if first[:1].isupper() and first not in NOT_OURS else None
        if not any(isinstance(c, type) for c in candidates) and rest[0][:1].islower():
            # `server.phase_means_ms`, `fleet.replicas`: a key path of report.json or a YAML
            # file, which shares its first word with a module of ours
            return None
    for value in candidates:
        for part in rest:
            if not has_attribute(value, part):
                break
            value = getattr(value, part, None)
        else:
            return True
    return False


@cache
def names_in_code() -> frozenset[str]:
    """Every word in the checkout's tracked files other than the docs: where an environment
    variable, a constant, a class or a function of ours is named."""
    words: set[str] = set()
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its made-up names aside
    for path in tracked():
        if path.endswith(".md") or path == this or not (ROOT / path).is_file():
            continue
        try:
            words.update(re.findall(r"\w+", (ROOT / path).read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return frozenset(words)


def symbol_problem(span: str) -> str | None:
    """What is wrong with a code span that names a Python symbol: `module.name` (a call's
    parentheses aside), `CamelCase`, `UPPER_CASE` or `name()`."""
    text = re.sub(r"\(.*\)$", "", span)
    if text in tracked_names() or text in NOT_OURS:
        return None  # `Dockerfile.dockerignore`
    if DOTTED.fullmatch(text) and not FILE_SUFFIX.search(text):
        return None if resolves(text) is not False else f"no Python symbol {text}"
    bare = re.fullmatch(IDENT, text)
    called = span.endswith(")") and bare
    shaped = bare and (
        re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*", text) or re.fullmatch(r"[A-Z]+_[A-Z_\d]+", text)
    )
    known = names_in_code() | NOT_OURS | set(dir(builtins))
    if (called or shaped) and text not in known:
        return f"no name {text} anywhere in the code"
    return None


# --- the test --------------------------------------------------------------------------------


def problems(mention: Mention) -> Iterator[str]:
    """What is wrong with what `mention` names, one line each."""
    if mention.kind == "link":
        if not link_exists(mention.text, mention.doc):
            yield f"link to a missing file: {mention.text}"
    elif mention.kind == "path":
        if not path_exists(mention.text, mention.doc):
            yield f"no file or folder {mention.text}"
    else:
        yield from command_problems(mention)
        if mention.kind == "span":
            yield from span_problems(mention.text)
        tokens = mention.text.split()
        for token in tokens:
            if is_path(token, alone=len(tokens) == 1) and not path_exists(token, mention.doc):
                yield f"no file or folder {token}"


def command_problems(mention: Mention) -> Iterator[str]:
    """A servescope command line's, a benchmark script's, a make target's."""
    words = command_words(mention.text)
    if words is not None and (problem := command_problem(words)):
        yield problem
    yield from script_problems(mention.text)
    if mention.text.startswith("make "):
        for target in mention.text.split("#", 1)[0].split()[1:]:
            if re.fullmatch(r"[\w-]+", target) and target not in make_targets():
                yield f"no make target {target}"


def span_problems(text: str) -> Iterator[str]:
    """A code span's own: a flag named alone (`--lake`), a Python symbol."""
    flag = text.split("=", 1)[0].split(" ", 1)[0]
    known = every_flag() | benchmark_flags() | NOT_OURS
    if re.fullmatch(r"--[\w-]+", flag) and command_words(text) is None and flag not in known:
        yield f"no flag {flag} in any servescope command"
    if problem := symbol_problem(text):
        yield problem


def bad_references() -> list[str]:
    return [
        f"{mention.where()}: {problem}  [{mention.text[:80]}]"
        for doc in docs()
        for mention in mentions(doc)
        for problem in problems(mention)
    ]


def test_the_docs_name_only_what_exists() -> None:
    bad = bad_references()
    assert not bad, "the docs name what does not exist:\n" + "\n".join(bad)


def test_the_code_names_only_commands_that_exist() -> None:
    """A command the code's docstrings, comments and help texts name in backticks (`servescope
    model make-tiny`, `report build RUN --vs BASE`) exists, with its flags: what a user is told
    to type."""
    bad = []
    for room in (*ROOMS, "servescope", "benchmarks"):
        for path in sorted((ROOT / room).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for match in CODE_SPAN.finditer(text):
                if "\n" in match[2] or (words := command_words(match[2])) is None:
                    continue
                if problem := command_problem(words):
                    line = text.count("\n", 0, match.start()) + 1
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {problem}  [{match[2][:80]}]")
    assert not bad, "the code names commands that do not exist:\n" + "\n".join(bad)


def test_each_kind_of_reference_is_checked(tmp_path: Path) -> None:
    """The checks fail on what is made up: a path, a command, a subcommand, a flag, a symbol, a
    make target, a link; and pass what exists."""
    made_up = [
        "`tests/unit/test_nothing_here.py`",
        "`servescope query RUN`",
        "`servescope report bake RUN`",
        "`servescope bench run --no-such-flag`",
        "`--no-such-flag`",
        "`store.settings.NO_SUCH_NAME`",
        "`NO_SUCH_CONSTANT`",
        "`make no-such-target`",
        "[a link](no-such-file.md)",
        "as reports/no_such_module.py says",
        "```sh\nservescope store runs --no-such-flag\n```",
    ]
    for text in made_up:
        assert [p for m in mentions_of(text, tmp_path) for p in problems(m)], text
    real = "`tests/integration/test_docs.py` `servescope report build RUN --vs BASE` `make test`"
    assert not [p for m in mentions_of(real, tmp_path) for p in problems(m)]


def mentions_of(text: str, tmp_path: Path) -> list[Mention]:
    """`text`'s mentions, as if it were a doc of docs/."""
    probe = tmp_path / "probe.md"
    probe.write_text(text)
    return [Mention(ROOT / "docs" / "probe.md", m.line, m.text, m.kind) for m in mentions(probe)]


def test_the_commands_are_read_from_the_cli() -> None:
    assert set(subcommands(cli())) == set(NAMES)
