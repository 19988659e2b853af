"""Reports and CLI help speak to people who run vLLM: no course words ("Lab 10", "Week 11",
"seeds"), "not measured" only where a run could have measured the figure, host memory never
labelled as the server's memory beside GPU memory, and a missing KV figure printed once.

Real reports: runs stored in a real DuckDB store, built by the report builder and rendered by
the templates to Markdown, HTML and JSON, as `servescope report build` writes them."""

from __future__ import annotations

import argparse
import copy
import json
import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from servescope.cli import build_parser, main
from servescope.loadgen.workload import WORKLOADS_DIR
from servescope.reports import build_diff, build_summary, render
from servescope.reports.diagnosis import RULES_FILE
from servescope.store import Store
from tests.helpers.fleet import fleet_run

T0 = datetime(2026, 11, 26, 8, 0, 0)
COURSE_WORDS = re.compile(
    r"\blab\b|\blab's\b|\blab ?\d|\bweek ?\d|\bseeds\b|\blecture\b|\bpracticum\b|study guide",
    re.IGNORECASE,
)
# vLLM's start-up statement on a CPU server that said its KV size but not its concurrency
CPU_KV = {"vllm": {"kv_cache_device": "CPU", "kv_cache_tokens": 4096}, "servescope": None}


def events(run_id: str, start: datetime, *, output_tokens: int = 16, n: int = 30,
           slow: float = 1.0) -> list[dict[str, Any]]:  # fmt: skip
    """`n` chat requests; a one-token output has no gap between tokens, so no TPOT or ITL."""
    out = []
    for i in range(n):
        ttft = (40.0 + i) * slow
        tpot = 8.0 + i % 3 if output_tokens > 1 else None
        out.append({
            "request_id": f"{run_id}-{i + 1:06d}", "run_id": run_id,
            "ts": (start + timedelta(milliseconds=100 * i)).isoformat() + "Z",
            "model": "tiny", "workload": "chat", "concurrency": 2, "endpoint": "chat",
            "prompt_tokens": 64, "completion_tokens": output_tokens, "ttft_ms": ttft,
            "tpot_ms": tpot, "e2e_ms": ttft + (tpot or 0.0) * (output_tokens - 1),
            "itl_ms": [tpot] * (output_tokens - 1) if tpot else None,
            "status": "ok", "finish_reason": "length",
        })  # fmt: skip
    return [{k: v for k, v in e.items() if v is not None} for e in out]


def spec(output_tokens: int) -> dict[str, Any]:
    return {"workloads": [{"name": "chat", "input_tokens": 64, "output_tokens": output_tokens,
                           "concurrency": [2], "endpoint": "chat"}]}  # fmt: skip


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each report kind, as a dict: a CPU server's summary, a diff of two CPU servers, a run of
    one-token outputs, a fleet's summary and a fleet's diff."""
    store = Store(tmp_path_factory.mktemp("words") / "s.duckdb")
    for run_id, start, caching in (("run-cpu-off", T0, False),
                                   ("run-cpu-on", T0 + timedelta(minutes=5), True)):  # fmt: skip
        store.add_events(events(run_id, start, slow=1.0 if not caching else 0.5))
        store.upsert_run(run_id, model="tiny", vllm_version="0.32.0",
                         levers={"enable_prefix_caching": caching}, workload=spec(16),
                         notes={"kv_cache": CPU_KV, "memory_peak_gb": 2.5})  # fmt: skip
    store.add_events(events("run-one-token", T0 + timedelta(minutes=10), output_tokens=1))
    store.upsert_run("run-one-token", model="tiny", levers={}, workload=spec(1))
    fleet_run(
        store,
        "run-fleet-rr",
        share_r1=19,
        start=T0 + timedelta(minutes=20),
        policy="round-robin",
        hits={"r1": (1000.0, 5000.0), "r2": (1000.0, 5000.0)},
    )
    fleet_run(
        store,
        "run-fleet-pa",
        share_r1=21,
        start=T0 + timedelta(minutes=25),
        policy="prefix-affinity",
        hits={"r1": (4000.0, 5000.0), "r2": (3800.0, 5000.0)},
    )
    return {
        "summary": build_summary(store, "run-cpu-on"),
        "diff": build_diff(store, "run-cpu-on", "run-cpu-off"),
        "one-token": build_summary(store, "run-one-token"),
        "fleet": build_summary(store, "run-fleet-pa"),
        "fleet-diff": build_diff(store, "run-fleet-pa", "run-fleet-rr"),
    }


def rendered(report: dict[str, Any]) -> dict[str, str]:
    return {fmt: render(report, fmt) for fmt in ("md", "html", "json")}  # type: ignore[arg-type]


def test_no_report_says_lab_week_or_seeds(reports: dict[str, dict[str, Any]]) -> None:
    for kind, report in reports.items():
        for fmt, text in rendered(report).items():
            found = COURSE_WORDS.findall(text)
            assert not found, (kind, fmt, found)
            assert "n/ax" not in text, (kind, fmt)
            assert "server memory" not in text, (kind, fmt)


def test_a_cpu_server_has_no_gpu_rather_than_unmeasured_gpu_rows(
    reports: dict[str, dict[str, Any]],
) -> None:
    md = render(reports["summary"], "md")
    assert "GPU: none (a CPU server" in md
    assert "GPU: not measured" not in md and "GPU: not measured" not in render(
        reports["summary"], "html"
    )
    diff = render(reports["diff"], "md").splitlines()
    unmeasured = [line for line in diff if line.startswith("Not measured (on one side")]
    assert all("gpu." not in line and "goodput." not in line for line in unmeasured)
    assert [
        line
        for line in diff
        if line.startswith("Not applicable, no GPU on either side (CPU servers): gpu.")
    ]
    assert [line for line in diff
            if line.startswith("Not applicable, no SLO given (--slo): goodput.")]  # fmt: skip


def test_a_missing_kv_figure_prints_once(reports: dict[str, dict[str, Any]]) -> None:
    """vLLM stated its KV tokens, not its concurrency: the multiplier is "n/a", not "n/ax"."""
    md = render(reports["summary"], "md")
    assert "| vLLM | 4,096 | n/a | n/a | |" in md.splitlines()
    assert "<td>vLLM</td><td>4,096</td><td>n/a</td><td>n/a</td>" in render(
        reports["summary"], "html"
    )


def test_host_memory_is_named_host_memory(reports: dict[str, dict[str, Any]]) -> None:
    md = render(reports["summary"], "md")
    assert "- host memory (RSS) peak of vLLM's processes: 2.50 GB" in md.splitlines()
    html = render(reports["summary"], "html")
    assert "<th>host memory (RSS) peak of vLLM's processes</th><td>2.50 GB</td>" in html


def test_one_token_outputs_have_no_tpot_to_measure(reports: dict[str, dict[str, Any]]) -> None:
    lines = render(reports["one-token"], "md").splitlines()
    for metric in ("tpot_ms", "itl_ms"):
        rows = [line for line in lines if line.startswith(f"| {metric} | client |")]
        assert rows and all("not applicable (one-token outputs" in row for row in rows), rows
    # a run whose outputs have several tokens and no TPOT could have measured it
    assert "| tpot_ms | client | not applicable" not in render(reports["summary"], "md")


def test_security_is_not_measurable_from_a_run(reports: dict[str, dict[str, Any]]) -> None:
    checks = {c["item"]: c for c in reports["summary"]["checklist"]}
    assert checks["Security"]["status"] == "not measurable here"
    assert "Pass criteria (a vLLM deployment's checklist)" in render(reports["summary"], "md")


def test_a_cpu_servers_engines_are_not_called_gpus(reports: dict[str, dict[str, Any]]) -> None:
    report = copy.deepcopy(reports["summary"])
    report["engines"] = {
        "session": "vllm-cpu-dp2", "device": "CPU", "engines": [], "skew": None,
        "parallel": {"data_parallel_size": 2, "tensor_parallel_size": 1,
                     "pipeline_parallel_size": 1, "gpus": 2},
        "gpus": [{"gpu": "dp0-tp0", "engine": "0", "rank": "0", "model_load_gib": 0.5,
                  "kv_cache_available_gib": 4.0}],
    }  # fmt: skip
    for fmt in ("md", "html"):
        text = render(report, fmt)  # type: ignore[arg-type]
        assert "GPU (engine, rank)" not in text and "By engine and GPU" not in text, fmt
        assert "CPU worker (engine, rank)" in text and "(GiB, host memory)" in text, fmt
    report["engines"]["device"] = "GPU"
    assert "| GPU (engine, rank) | weights loaded (GiB) |" in render(report, "md")  # type: ignore[arg-type]
    report["engines"]["parallel"]["expert_parallel"] = True  # a mixture-of-experts model's
    for fmt in ("md", "html"):
        text = render(report, fmt)  # type: ignore[arg-type]
        assert "the experts spread whole over 2 of them (expert parallel)" in text, fmt


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_cli_help_says_no_course_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """Help lists the shipped workload files by name: a file name is data (stored runs and
    experiments name it), so only the words around it are checked."""
    monkeypatch.setenv("COLUMNS", "10000")  # no line wrapped inside a name
    names = sorted((p.stem for p in WORKLOADS_DIR.glob("*.yaml")), key=len, reverse=True)
    for parser in _parsers(build_parser()):
        text = parser.format_help()
        for name in names:
            text = text.replace(name, "")
        assert not COURSE_WORDS.findall(text), (parser.prog, COURSE_WORDS.findall(text))


def test_diagnosis_rules_name_the_practice() -> None:
    """Every rule's title, why and source reach the report as they are written."""
    rules = yaml.safe_load(Path(RULES_FILE).read_text())
    for rule in rules["rules"]:
        for key in ("title", "why", "source"):
            text = str(rule.get(key) or "")
            assert not COURSE_WORDS.findall(text), (rule["id"], key, text)
            assert "issue " not in text.lower(), (rule["id"], key, text)


# Llama 3 8B's config.json, enough for the capacity worksheet's arithmetic
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "max_position_embeddings": 8192,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
             "vocab_size": 128256}  # fmt: skip


def test_the_capacity_worksheet_of_a_cpu_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a KV space the concurrency is "n/a" (never "n/ax"), and vLLM-CPU's share of the
    model is a CPU worker's, never a GPU's."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    assert main(["capacity", str(config), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| max concurrency at 8,192 tokens per request | n/a |" in out.splitlines()
    assert "n/ax" not in out and "GPU" not in out.split("```")[0].replace("--gpu", "")
    assert "| KV bytes per token (per CPU worker) | 131,072 |" in out.splitlines()
    assert main(["capacity", str(config), "--gpu-memory-gib", "79.2"]) == 0
    out = capsys.readouterr().out
    assert "| KV bytes per token (per GPU) | 131,072 |" in out.splitlines()
    assert "| max concurrency at 8,192 tokens per request | 53.29x |" in out.splitlines()
