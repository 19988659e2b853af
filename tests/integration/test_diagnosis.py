"""The diagnosis engine on stored runs built to show one symptom each of vLLM's tuning
matrix (queue-bound, prefill-bound with an unused shared prefix, decode-bound, KV pressure with
preemptions, errors), a healthy run that gets no recommendation, a run whose levers already hold
the recommendation, and a diff that says whether the flip moved its symptom. Every run goes
through the real store, `servescope diagnose` and `report build`."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from servescope.reports.diagnosis import load_rules
from servescope.store import Store
from tests.helpers.cli import servescope

T0 = datetime(2026, 11, 23, 9, 0, 0)
BASE_LEVERS = {"enable_prefix_caching": True, "enable_chunked_prefill": True,
               "max_num_seqs": "256", "dtype": "float32"}  # fmt: skip


def _spec(prefix: int = 0, inputs: int = 200, outputs: int = 64, concurrency: int = 4) -> dict:
    return {"workloads": [{"name": "w", "prefix_tokens": prefix, "input_tokens": inputs,
                           "output_tokens": outputs, "concurrency": [concurrency],
                           "endpoint": "completions", "classes": []}]}  # fmt: skip


def _events(run: str, n: int = 40, **over: Any) -> list[dict[str, Any]]:
    """`n` healthy requests (fast, short queue, small prefill), with `over` applied to each;
    a callable value gets the index."""
    out = []
    for i in range(n):
        e: dict[str, Any] = {
            "request_id": f"{run}-{i + 1:06d}", "run_id": run, "model": "tiny",
            "ts": (T0 + timedelta(milliseconds=250 * i)).isoformat() + "Z",
            "workload": "w", "concurrency": 4, "prompt_tokens": 200 + i % 5,
            "completion_tokens": 64, "ttft_ms": 120.0 + i % 7, "tpot_ms": 20.0 + i % 3,
            "e2e_ms": 120.0 + 63 * 20.0, "itl_ms": [19.0, 20.0, 21.0, 20.0],
            "queue_ms": 5.0, "prefill_ms": 100.0, "decode_ms": 1250.0,
            "cached_tokens": 0, "status": "ok", "finish_reason": "length",
        }  # fmt: skip
        for key, value in over.items():
            e[key] = value(i) if callable(value) else value
        out.append({k: v for k, v in e.items() if v is not None})
    return out


def _gauges(run: str, kv: float, preemptions: tuple[float, float], waiting: float) -> list:
    rows = []
    for k, (kv_v, pre) in enumerate([(kv / 2, preemptions[0]), (kv, preemptions[1])]):
        ts = T0 + timedelta(seconds=3 * k)
        rows += [
            (ts, f"vllm:{run}", "vllm:kv_cache_usage_perc", {"engine": "0"}, run, kv_v),
            (ts, f"vllm:{run}", "vllm:num_preemptions_total", {"engine": "0"}, run, pre),
            (ts, f"vllm:{run}", "vllm:num_requests_waiting", {"engine": "0"}, run, waiting * k),
            (ts, f"vllm:{run}", "vllm:num_requests_running", {"engine": "0"}, run, 4.0),
        ]
    return rows


def _spec_counters(run: str, drafts: float, draft_tokens: float, accepted: float) -> list:
    """vLLM's speculative-decoding counters at the start and end of the run."""
    names = ("drafts", "draft_tokens", "accepted_tokens")
    return [
        (T0 + timedelta(seconds=10 * k), f"vllm:{run}", f"vllm:spec_decode_num_{name}_total",
         {"engine": "0"}, run, value * k)
        for k in (0, 1)
        for name, value in zip(names, (drafts, draft_tokens, accepted), strict=True)
    ]  # fmt: skip


SPEC_LEVERS = {
    **BASE_LEVERS,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
}
DECODE_BOUND = {
    "tpot_ms": lambda i: 180.0 + i,
    "e2e_ms": 120.0 + 255 * 190.0,
    "completion_tokens": 256,
    "decode_ms": 255 * 190.0,
    "itl_ms": [180.0, 190.0],
}

RUNS: dict[str, dict[str, Any]] = {
    "run-healthy": {"events": {}, "spec": _spec(), "levers": BASE_LEVERS,
                    "gauges": (0.3, (0.0, 0.0), 0.0)},
    "run-queue": {"events": {"ttft_ms": lambda i: 2400.0 + 10 * i, "queue_ms": 2000.0,
                             "prefill_ms": 300.0},
                  "spec": _spec(concurrency=64), "levers": BASE_LEVERS,
                  "gauges": (0.5, (0.0, 0.0), 40.0)},
    "run-prefix-off": {"events": {"prompt_tokens": lambda i: 3100 + i % 50,
                                  "ttft_ms": lambda i: 1500.0 + i, "queue_ms": 10.0,
                                  "prefill_ms": 1400.0, "cached_tokens": 0},
                       "spec": _spec(prefix=3000, inputs=100),
                       "levers": {**BASE_LEVERS, "enable_prefix_caching": False},
                       "gauges": (0.2, (0.0, 0.0), 0.0)},
    "run-prefix-on": {"events": {"prompt_tokens": lambda i: 3100 + i % 50,
                                 "ttft_ms": lambda i: 150.0 + i, "queue_ms": 10.0,
                                 "prefill_ms": 100.0, "cached_tokens": 2992},
                      "spec": _spec(prefix=3000, inputs=100), "levers": BASE_LEVERS,
                      "gauges": (0.2, (0.0, 0.0), 0.0)},
    "run-prefix-missed": {"events": {"prompt_tokens": lambda i: 3100 + i % 50,
                                     "ttft_ms": lambda i: 1500.0 + i, "prefill_ms": 1400.0,
                                     "cached_tokens": 0},
                          "spec": _spec(prefix=3000, inputs=100), "levers": BASE_LEVERS,
                          "gauges": (0.2, (0.0, 0.0), 0.0)},
    "run-decode": {"events": {"tpot_ms": lambda i: 180.0 + i, "e2e_ms": 120.0 + 255 * 190.0,
                              "completion_tokens": 256, "decode_ms": 255 * 190.0,
                              "itl_ms": [180.0, 190.0, 200.0]},
                   "spec": _spec(outputs=256), "levers": BASE_LEVERS,
                   "gauges": (0.4, (0.0, 0.0), 0.0)},
    "run-spec-rejected": {"events": DECODE_BOUND, "spec": _spec(outputs=256),
                          "levers": SPEC_LEVERS, "gauges": (0.4, (0.0, 0.0), 0.0),
                          "spec_counters": (1000.0, 3000.0, 300.0)},
    "run-spec-accepted": {"events": DECODE_BOUND, "spec": _spec(outputs=256),
                          "levers": SPEC_LEVERS, "gauges": (0.4, (0.0, 0.0), 0.0),
                          "spec_counters": (1000.0, 3000.0, 2700.0)},
    "run-kv": {"events": {"ttft_ms": lambda i: 900.0 + i, "queue_ms": 300.0},
               "spec": _spec(concurrency=32), "levers": BASE_LEVERS,
               "gauges": (0.99, (3.0, 17.0), 6.0)},
    "run-errors": {"events": {"status": lambda i: "error" if i % 5 == 0 else "ok",
                              "error": lambda i: "http_4xx" if i % 5 == 0 else None,
                              "http_status": lambda i: 400 if i % 5 == 0 else None},
                   "spec": _spec(), "levers": BASE_LEVERS, "gauges": (0.3, (0.0, 0.0), 0.0)},
    # an operator's restart: a few requests timing out on both sides, and a queue at
    # max_num_seqs 2 that max_num_seqs 16 empties
    "run-seqs-2": {"events": {"ttft_ms": lambda i: 2400.0 + 10 * i, "queue_ms": 2000.0,
                              "prefill_ms": 300.0,
                              "status": lambda i: "timeout" if i % 10 == 0 else "ok",
                              "error": lambda i: "timeout" if i % 10 == 0 else None},
                   "spec": _spec(concurrency=16),
                   "levers": {**BASE_LEVERS, "max_num_seqs": "2"},
                   "gauges": (0.5, (0.0, 0.0), 14.0)},
    "run-seqs-16": {"events": {"status": lambda i: "timeout" if i % 10 == 0 else "ok",
                               "error": lambda i: "timeout" if i % 10 == 0 else None},
                    "spec": _spec(concurrency=16),
                    "levers": {**BASE_LEVERS, "max_num_seqs": "16"},
                    "gauges": (0.5, (0.0, 0.0), 0.0)},
    # requests that fail on the server's side (timeouts), not refused as invalid
    "run-failing": {"events": {"status": lambda i: "timeout" if i % 5 == 0 else "ok",
                               "error": lambda i: "timeout" if i % 5 == 0 else None},
                    "spec": _spec(), "levers": BASE_LEVERS, "gauges": (0.3, (0.0, 0.0), 0.0)},
}  # fmt: skip


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("diagnosis") / "s.duckdb"
    store = Store(path)
    for run, spec in RUNS.items():
        store.add_events(_events(run, **spec["events"]))
        store.upsert_run(run, model="tiny", levers=spec["levers"], workload=spec["spec"],
                         status="complete")  # fmt: skip
        store.add_metric_samples(_gauges(run, *spec["gauges"]))
        if "spec_counters" in spec:
            store.add_metric_samples(_spec_counters(run, *spec["spec_counters"]))
    store.add_lever_flip("enable_prefix_caching", "False", "True", run_id="run-prefix-on")
    return path


def diagnose(store: Path, run: str) -> dict[str, Any]:
    result = servescope("diagnose", run, "--json", "--store", str(store), check=True)
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("run", "symptom", "lever"),
    [
        ("run-queue", "queue", "max_num_seqs"),
        ("run-prefix-off", "prefill", "enable_prefix_caching"),
        ("run-decode", "decode", "speculative_config"),
        ("run-kv", "memory", "max_num_seqs"),
        ("run-errors", "api", "max_model_len"),
        ("run-failing", "api", "max_num_seqs"),
        ("run-prefix-missed", "cache", "stable_prefix"),
        ("run-spec-rejected", "decode", "speculative_config"),
    ],
)
def test_each_symptom_gets_its_first_lever(store_path: Path, run: str, symptom: str,
                                           lever: str) -> None:  # fmt: skip
    d = diagnose(store_path, run)
    assert d["first"]["symptom"] == symptom, d["findings"]
    assert d["first"]["lever"] == lever
    first = d["findings"][0]
    assert first["evidence"] and first["why"] and first["source"]


def test_evidence_carries_the_runs_numbers(store_path: Path) -> None:
    d = diagnose(store_path, "run-errors")
    assert "share refused as invalid (HTTP 4xx) 20.0 % (≥ 2.0 %)" in d["findings"][0]["evidence"]
    failing = diagnose(store_path, "run-failing")["findings"][0]["evidence"]
    assert "failure rate (rejections and 4xx excluded) 20.0 % (≥ 2.0 %)" in failing
    kv = diagnose(store_path, "run-kv")["findings"][0]["evidence"]
    assert "preemptions 14 (≥ 1)" in kv and "KV-cache usage peak 99.0 % (≥ 90.0 %)" in kv


def test_a_healthy_run_gets_no_recommendation(store_path: Path) -> None:
    d = diagnose(store_path, "run-healthy")
    assert d["findings"] == [] and d["first"] is None
    assert d["workload_shape"]["shape"] == "chat"
    text = servescope("diagnose", "run-healthy", "--store", str(store_path), check=True).stdout
    assert "No recommendation" in text


def test_a_lever_already_set_is_never_recommended(store_path: Path) -> None:
    d = diagnose(store_path, "run-prefix-missed")
    offered = {lever["lever"] for f in d["findings"] for lever in f["levers"]}
    assert "enable_prefix_caching" not in offered
    held = [lever for a in d["already_set"] for lever in a["levers"]]
    assert {"lever": "enable_prefix_caching", "value": True, "want": True} in held
    on = diagnose(store_path, "run-prefix-on")
    assert "enable_prefix_caching" not in {
        lv["lever"] for f in on["findings"] for lv in f["levers"]
    }


def test_workload_shape_of_a_long_static_prefix_is_agent(store_path: Path) -> None:
    assert diagnose(store_path, "run-prefix-off")["workload_shape"]["shape"] == "agent"


def test_unmeasured_indicators_are_reported_not_guessed(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    store.add_events(_events("run-bare", ttft_ms=2500.0, queue_ms=None, prefill_ms=None,
                             decode_ms=None))  # fmt: skip
    d = diagnose(tmp_path / "s.duckdb", "run-bare")
    reasons = {u["rule"]: u["reason"] for u in d["not_judged"]}
    assert "queue share of TTFT not measured" in reasons["queue-bound"]
    assert "KV-cache usage peak not measured" in reasons["kv-pressure"]


def test_the_diff_says_whether_the_flip_moved_its_symptom(store_path: Path,
                                                          tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "r"
    servescope("report", "build", "run-prefix-on", "--vs", "run-prefix-off", "--store",
               str(store_path), "--out", str(out), check=True)  # fmt: skip
    folder = out / "run-prefix-on-vs-run-prefix-off"
    report = json.loads((folder / "report.json").read_text())
    d = report["diagnosis"]
    assert d["before_first"]["lever"] == "enable_prefix_caching"
    (flip,) = d["flip"]
    assert flip["lever"] == "enable_prefix_caching" and flip["verdict"] == "resolved"
    hit = next(i for i in flip["indicators"] if i["indicator"] == "prefix_cache_hit_ratio")
    assert hit["before"] == pytest.approx(0.0) and hit["after"] > 0.9
    md = (folder / "report.md").read_text()
    assert "## What should I flip first?" in md and "resolved" in md


def test_a_flip_is_judged_against_the_finding_that_wants_its_direction(
        store_path: Path, tmp_path: Path) -> None:  # fmt: skip
    """max_num_seqs 2 → 16: the errors finding (timeouts) wants max_num_seqs lower, the queue
    finding wants it raised; the raise was meant for the queue, and the queue is gone."""
    before = diagnose(store_path, "run-seqs-2")
    assert [f["rule"] for f in before["findings"]][:2] == ["errors", "queue-bound"]
    servescope("report", "build", "run-seqs-16", "--vs", "run-seqs-2", "--format", "json,md",
               "--store", str(store_path), "--out", str(tmp_path), check=True)  # fmt: skip
    folder = tmp_path / "run-seqs-16-vs-run-seqs-2"
    (flip,) = json.loads((folder / "report.json").read_text())["diagnosis"]["flip"]
    assert flip["lever"] == "max_num_seqs" and flip["rule"] == "queue-bound", flip
    assert flip["verdict"] == "resolved"
    md = (folder / "report.md").read_text()
    assert "max_num_seqs was meant to fix queue" in md and "meant to fix api" not in md
    # the other way round (16 → 2) goes the way the errors finding asks
    servescope("report", "build", "run-seqs-2", "--vs", "run-seqs-16", "--format", "json",
               "--store", str(store_path), "--out", str(tmp_path), check=True)  # fmt: skip
    back = json.loads((tmp_path / "run-seqs-2-vs-run-seqs-16" / "report.json").read_text())
    (flip,) = back["diagnosis"]["flip"]
    assert flip["rule"] == "errors" and flip["verdict"] == "still present", flip


def test_requests_refused_as_invalid_get_only_the_context_limit(store_path: Path) -> None:
    """HTTP 400s (a bad parameter, a prompt over the context limit) are not server failures:
    max_model_len is the one lever, never fewer sequences or more memory."""
    d = diagnose(store_path, "run-errors")
    assert [f["rule"] for f in d["findings"]][:1] == ["invalid-requests"]
    assert [lever["lever"] for lever in d["findings"][0]["levers"]] == ["max_model_len"]
    assert "errors" not in [f["rule"] for f in d["findings"]]


def test_every_report_format_carries_the_diagnosis(store_path: Path, tmp_path: Path) -> None:
    servescope("report", "build", "run-kv", "--store", str(store_path), "--out", str(tmp_path),
               check=True)  # fmt: skip
    folder = tmp_path / "run-kv"
    assert json.loads((folder / "report.json").read_text())["diagnosis"]["first"]["symptom"] == (
        "memory"
    )
    html = (folder / "index.html").read_text()
    assert "What should I flip first?" in html and "<code>max_num_seqs</code>" in html


def test_unknown_run_exits_2(store_path: Path) -> None:
    result = servescope("diagnose", "run-nope", "--store", str(store_path))
    assert result.returncode == 2 and "unknown run" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_rule_names_its_source_and_levers() -> None:
    rules = load_rules()
    symptoms = {"queue", "prefill", "decode", "streaming", "memory", "api", "cache", "fleet"}
    for rule in rules["rules"]:
        assert rule["symptom"] in symptoms and rule["source"] and rule["levers"], rule["id"]


def test_a_window_of_a_run_is_diagnosed_alone(store_path: Path) -> None:
    result = servescope("diagnose", "run-errors", "--since", "start+5s", "--json", "--store",
                        str(store_path), check=True)  # fmt: skip
    d = json.loads(result.stdout)
    assert d["window"] is not None and d["indicators"]["requests"]["value"] == 20
    bad = servescope("diagnose", "run-errors", "--since", "yesterday-ish", "--store",
                     str(store_path))  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.strip()


def test_speculation_is_judged_by_its_acceptance(store_path: Path) -> None:
    rejected = diagnose(store_path, "run-spec-rejected")
    assert rejected["first"]["rule"] == "speculation-disappoints"
    assert any("draft acceptance rate 10.0 %" in e for e in rejected["findings"][0]["evidence"])
    accepted = diagnose(store_path, "run-spec-accepted")
    rules = [f["rule"] for f in accepted["findings"]]
    assert "speculation-disappoints" not in rules
    decode = next(f for f in accepted["findings"] if f["rule"] == "decode-bound")
    assert "speculative_config" not in [lever["lever"] for lever in decode["levers"]]
    assert {"rule": "decode-bound", "symptom": "decode"}.items() <= next(
        a for a in accepted["already_set"] if a["rule"] == "decode-bound"
    ).items()
