"""The typed records at the project's boundaries: a request event (store/validation.py), a
workload file (loadgen/workload.py) and report.json (reports/document.py), whose JSON Schema is
published as docs/report.schema.json. Real reports are built from a real DuckDB store and their
report.json validated against the published file with `jsonschema`, as anyone reading them would."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from servescope.loadgen.workload import WorkloadError, parse_config
from servescope.reports import ReportOptions, build_diff, build_split, build_summary, write_report
from servescope.reports.schema import schema_text
from servescope.store import InvalidEvent, Store, parse_line
from servescope.store.validation import CONTRACT_TYPES, COUNTS, DURATIONS, RequestEvent

SCHEMA = Path(__file__).parents[2] / "docs" / "report.schema.json"
T0 = datetime(2026, 11, 26, 8, 0, 0)
URLS = {"r1": "http://127.0.0.1:8011", "r2": "http://127.0.0.1:8012"}


# -- the request event ------------------------------------------------------------------------


def test_the_contract_constants_are_the_event_types_fields() -> None:
    assert list(CONTRACT_TYPES) == list(RequestEvent.__struct_fields__)
    assert {"ttft_ms", "itl_ms", "target_rate"} - {"itl_ms"} <= set(DURATIONS)
    assert "http_status" not in COUNTS and "prompt_tokens" in COUNTS


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (
            '{"request_id": "a-1", "itl_ms": [1, -2]}',
            "itl_ms holds a gap that is not a finite duration >= 0 (itl_ms[1])",
        ),
        (
            '{"request_id": "a-1", "ttft_ms": 1' + "0" * 400 + "}",
            "ttft_ms is a number of more than 40 digits: a duration must be finite and >= 0",
        ),
        ('{"request_id": "a-1", "http_status": 42}', "http_status is 42: not an HTTP status code"),
        (
            '{"request_id": "a-1", "concurrency": -1}',
            "concurrency is -1: a count must be in 0..2147483647",
        ),
        ('{"type": "tool_call", "run_id": 7}', "wrong type for run_id: int"),
    ],
)
def test_a_refused_record_names_its_key_in_the_contracts_words(line: str, reason: str) -> None:
    with pytest.raises(InvalidEvent) as refused:
        parse_line(line)
    assert str(refused.value) == reason


def test_unknown_keys_and_key_order_are_kept_verbatim() -> None:
    line = '{"z": {"nested": [1, 2]}, "request_id": "r-1", "ttft_ms": 3, "x": null}'
    assert list(parse_line(line)) == ["z", "request_id", "ttft_ms", "x"]
    assert parse_line(line)["ttft_ms"] == 3 and isinstance(parse_line(line)["ttft_ms"], int)


# -- the workload file ------------------------------------------------------------------------

CHAT = {"name": "chat", "input_tokens": 8, "output_tokens": 8, "concurrency": [1]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"workloads": [{**CHAT, "turns": "three"}]},
         'workloads/chat.yaml: workload \'chat\': turns: expected an integer, got "three"'),
        ({"workloads": [{**CHAT, "classes": [{"name": "a", "input_tokens": 1,
                                              "output_tokens": 1, "weight": 0}]}]},
         "workloads/chat.yaml: workload 'chat': classes[0].weight: expected a number > 0, got "
         "0"),
        ({"workloads": [{**CHAT, "input_tokens": {"dist": "zipf"}}]},
         "workloads/chat.yaml: workload 'chat': input_tokens.dist: expected one of lognormal, "
         'normal, uniform, got "zipf"'),
        ({"workloads": [{**CHAT, "input_tokens": {"dist": "uniform", "min": 9}}]},
         "workloads/chat.yaml: workload 'chat': input_tokens: a uniform distribution needs "
         "`min` and `max`"),
        ({"workloads": [CHAT], "warmup": -1},
         "workloads/chat.yaml: warmup: expected an integer ≥ 0, got -1"),
        ({"workloads": [CHAT], "model": "m"},
         "workloads/chat.yaml: unknown key 'model' (known: duration_s, endpoint, metrics, "
         "requests_per_level, seed, team, together, warmup, workloads)"),
        ({"workloads": [{"input_tokens": 8}]}, "workloads/chat.yaml: workloads[0]: missing `name`"),
    ],
)  # fmt: skip
def test_a_workload_file_says_where_and_what_is_wrong(data: Any, message: str) -> None:
    with pytest.raises(WorkloadError) as refused:
        parse_config(data, source="workloads/chat.yaml")
    assert str(refused.value) == message


def test_top_level_defaults_reach_every_workload_that_sets_none() -> None:
    config = parse_config({"workloads": [CHAT, {**CHAT, "name": "b", "warmup": 1}], "warmup": 3})
    assert [w.warmup for w in config.workloads] == [3, 1]


# -- report.json ------------------------------------------------------------------------------


def _events(run_id: str, start: datetime, n: int, scale: float, **extra: Any) -> list[dict]:
    out = []
    for i in range(n):
        ttft = (40.0 + 7.0 * (i % 9)) * scale
        out.append(
            {
                "request_id": f"{run_id}-{i + 1:06d}",
                "run_id": run_id,
                "ts": (start + timedelta(milliseconds=150 * i)).isoformat() + "Z",
                "model": "tiny",
                "workload": "chat" if i % 2 else "flood",
                "concurrency": 2 if i % 2 else 4,
                "team": "a" if i % 2 else "b",
                "prompt_tokens": 64,
                "completion_tokens": 8,
                "cached_tokens": 32 * (i % 2),
                "ttft_ms": ttft,
                "tpot_ms": 10.0 + i % 3,
                "e2e_ms": ttft + 80.0,
                "itl_ms": [9.0, 10.0 + i % 4, 11.0],
                "queue_ms": 1.0 + i % 5,
                "prefill_ms": 20.0,
                "decode_ms": 70.0,
                "status": "ok",
                "finish_reason": "length",
                **extra,
            }
        )
    out[-1].update(status="rejected", error="rejected:queue_full", http_status=429, ttft_ms=None)
    out[-2].update(status="error", error="disconnect", ttft_ms=None)
    return [{k: v for k, v in e.items() if v is not None} for e in out]


def _counters(store: Store, run_id: str, url: str, start: datetime, hits: float) -> None:
    rows = []
    for k, ts in enumerate((start - timedelta(seconds=1), start + timedelta(seconds=8))):
        rows += [
            (ts, url, "vllm:prefix_cache_hits_total", {}, run_id, 100 + k * hits),
            (ts, url, "vllm:prefix_cache_queries_total", {}, run_id, 500 + k * 1000),
            (ts, url, "vllm:num_preemptions_total", {}, run_id, 1.0 + k),
            (ts, url, "vllm:kv_cache_usage_perc", {}, run_id, 0.2 + 0.3 * k),
        ]
    store.add_metric_samples(rows)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """A run's report (SLOs, errors, admission, server counters), a diff of three repeats a
    side, a split at a lever flip and a fleet run's report, each as written to report.json."""
    folder = tmp_path_factory.mktemp("typed")
    store = Store(folder / "s.duckdb")
    spec = {"workloads": [{**CHAT, "name": "chat"}]}
    arms = {"off": [], "on": []}
    for r in range(3):
        for arm, scale in (("off", 1.0), ("on", 0.5)):
            run_id = f"run-typed-{arm}-r{r}"
            start = T0 + timedelta(minutes=10 * r + 5 * (arm == "on"))
            store.add_events(_events(run_id, start, 30, scale))
            store.upsert_run(run_id, model="tiny", levers={"enable_prefix_caching": arm == "on"},
                             workload=spec, notes={"client": {"slo": {"ttft_ms": 60}},
                             "repeat_state": "prefix cache reset", "arm": arm})  # fmt: skip
            _counters(store, run_id, "vllm", start, 800.0 if arm == "on" else 0.0)
            arms[arm].append(run_id)
    split = "run-typed-split"
    store.add_events(_events(split, T0 + timedelta(hours=1), 40, 1.0))
    store.upsert_run(split, model="tiny", levers={"max_num_seqs": 4})
    store.add_lever_flip("max_num_seqs", "4", "8", run_id=split,
                         ts=T0 + timedelta(hours=1, seconds=3))  # fmt: skip
    fleet = "run-typed-fleet"
    start = T0 + timedelta(hours=2)
    events = _events(fleet, start, 30, 1.0, route_reason="round-robin")
    for i, event in enumerate(events):
        event["upstream"] = "r1" if i % 3 else "r2"
    store.add_events(events)
    store.upsert_run(fleet, model="tiny", levers={"routing": "round-robin"}, workload=spec,
                     notes={"replicas": URLS})  # fmt: skip
    for name, url in URLS.items():
        _counters(store, fleet, url, start, 300.0 if name == "r1" else 50.0)
    built = {
        "run": build_summary(store, arms["on"][0], ReportOptions(charts=False)),
        "repeats": build_diff(store, arms["on"], arms["off"], ReportOptions(charts=False)),
        "split": build_split(store, split, ReportOptions(charts=False)),
        "fleet": build_summary(store, fleet, ReportOptions(charts=False)),
    }
    out = folder / "reports"
    return {
        name: json.loads(write_report(report, out, ("json",))[0].read_text())
        for name, report in built.items()
    }


def test_the_published_schema_is_the_one_the_report_type_gives() -> None:
    assert SCHEMA.read_text(encoding="utf-8") == schema_text(), (
        "docs/report.schema.json is stale: python -m servescope.reports.schema > "
        "docs/report.schema.json"
    )


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    """The published file, itself checked as a 2020-12 schema."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("name", ["run", "repeats", "split", "fleet"])
def test_real_reports_validate_against_the_published_schema(
    reports: dict[str, dict[str, Any]], validator: jsonschema.Draft202012Validator, name: str
) -> None:
    report = reports[name]
    errors = sorted(
        validator.iter_errors(report),
        key=lambda e: list(map(str, e.absolute_path)),
    )
    assert not errors, [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    assert report["kind"] == {"repeats": "diff", "split": "split"}.get(name, "run")


def test_each_report_holds_what_its_kind_promises(reports: dict[str, dict[str, Any]]) -> None:
    assert reports["repeats"]["repeats"]["before"] == 3 == reports["repeats"]["repeats"]["after"]
    assert reports["repeats"]["overall"] == reports["repeats"]["after"]["overall"]
    assert reports["split"]["run"]["cold_start"] is None  # every report's run says it
    # a split is judged by the symptom its flipped lever targets, as a diff is
    assert reports["split"]["primary"]["why"].startswith("max_num_seqs targets queue")
    assert {r["replica"] for r in reports["fleet"]["replicas"]} == {"r1", "r2"}
    assert reports["run"]["overall"]["goodput"]["slo"] == {"ttft_ms": 60.0}
    assert reports["run"]["admission"]["rejections"] == [
        {"team": "a", "reason": "queue_full", "n": 1}
    ]


def test_the_schema_is_closed_a_key_it_does_not_name_is_refused(
    reports: dict[str, dict[str, Any]], validator: jsonschema.Draft202012Validator
) -> None:
    report = {**reports["run"], "overall": {**reports["run"]["overall"], "ttft": 1}}
    errors = list(validator.iter_errors(report))
    assert [list(e.absolute_path) for e in errors] == [["overall"]]
    assert "'ttft' was unexpected" in errors[0].message


# The committed reports that cannot be rebuilt, and the keys report.json gained after they were
# made. They were made on GPU servers (docs/gpu/README.md): max-num-seqs and routing on one H100
# on 2026-11-25, before report.json had a schema; routing-two-gpus and speculative-decoding-real
# on two H200s on 2026-11-27, before the arms were named in `repeats`. Their stores came back in
# the jobs' tarballs, which were not committed, so `report build` cannot make them again. They
# may lack exactly these keys; everything they hold must still be what the schema says.
ADDED_SINCE_2026_11_25 = {
    "one_chunk_streams", "engines", "detectable", "detectable_pct", "level", "p_value",
    "repeats", "role", "test",
}  # fmt: skip
ADDED_SINCE_2026_11_27 = {"before_arm", "after_arm"}
MADE_BEFORE = {
    "docs/gpu/max-num-seqs/report.json": ADDED_SINCE_2026_11_25,
    "docs/gpu/routing/repeat-1/report.json": ADDED_SINCE_2026_11_25,
    "docs/gpu/routing/repeat-2/report.json": ADDED_SINCE_2026_11_25,
    "docs/gpu/routing-two-gpus/report.json": ADDED_SINCE_2026_11_27,
    "docs/gpu/speculative-decoding-real/report.json": ADDED_SINCE_2026_11_27,
}
REQUIRED = re.compile(r"^'(\w+)' is a required property$")


def test_every_committed_report_validates_against_the_published_schema(
    validator: jsonschema.Draft202012Validator,
) -> None:
    """Every report.json under docs/ validates, or lacks only the keys added since it was made
    (`MADE_BEFORE`, exact: a report rebuilt leaves the list)."""
    root = SCHEMA.parents[1]
    committed = sorted((root / "docs").rglob("report.json"))
    assert committed
    wrong, lacking = [], {}
    for path in committed:
        name = path.relative_to(root).as_posix()
        for error in validator.iter_errors(json.loads(path.read_text(encoding="utf-8"))):
            missing = REQUIRED.match(error.message)
            if missing and missing[1] in MADE_BEFORE.get(name, ()):
                lacking.setdefault(name, set()).add(missing[1])
            else:
                where = "/".join(map(str, error.absolute_path))
                wrong.append(f"{name}: {where}: {error.message[:200]}")
    assert not wrong, wrong
    assert lacking == MADE_BEFORE
