"""Retention of /metrics samples (store/retention.py) on a real DuckDB store file: what
`servescope collect --retain` applies every few minutes and `servescope store prune --before`
once. Older than the cutoff: dropped; from the cutoff to 24 hours ago: one sample a minute per
series, the minute's last; the last 24 hours and every other table: untouched."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import pytest

from servescope import cli
from servescope.collector import Collector
from servescope.collector.selfmetrics import SelfMetrics
from servescope.collector.sources.events import EventsFiles
from servescope.store import Store, import_file, retention
from tests.helpers.cli import SERVESCOPE, servescope

DAY = timedelta(days=1)
SERIES = [  # (target, name, labels, run_id)
    ("http://a:8000/metrics", "vllm:prompt_tokens_total", {"model_name": "m"}, "vllm-a"),
    ("http://a:8000/metrics", "vllm:num_requests_running", {"model_name": "m"}, "vllm-a"),
    ("http://b:8000/metrics", "vllm:num_requests_running", {"model_name": "m"}, None),
]
OTHER_TABLES = ("events", "runs", "lever_flips", "runtime_events", "ingest_errors")

Row = tuple[datetime, str, str, str, str | None, float]


def _seconds() -> list[int]:
    """Seconds before now sampled: 20 days, at 1 s around each line the retention draws (the
    14-day cutoff, the 24-hour line), for ten minutes a week ago and the last ten minutes, at
    40 s between them (1 s throughout would be 5 million rows: a minute of the suite)."""
    dense = [
        (14 * 86400 - 300, 14 * 86400 + 300),  # the 14-day cutoff
        (7 * 86400, 7 * 86400 + 600),  # ten minutes a week ago
        (86400 - 1200, 86400 + 1200),  # the 24-hour line
        (0, 600),  # the last ten minutes
    ]
    found = set(range(0, 20 * 86400, 40))
    for lo, hi in dense:
        found.update(range(lo, hi))
    return sorted(found, reverse=True)


def _samples(now: datetime) -> list[tuple[datetime, str, str, dict[str, str], str | None, float]]:
    rows = []
    for ago in _seconds():
        ts = now - timedelta(seconds=ago)
        for i, (target, name, labels, run_id) in enumerate(SERIES):
            value = float(20 * 86400 - ago) if name.endswith("_total") else float((ago + i) % 17)
            rows.append((ts, target, name, labels, run_id, value))
    return rows


def _requests(tmp: Path, now: datetime) -> Path:
    """Requests and runtime events 20 and 19 days old (retention keeps them)."""
    lines = []
    for i in range(5):
        ts = (now - 20 * DAY + timedelta(minutes=i)).isoformat() + "Z"
        lines.append({"request_id": f"run-old-{i:03d}", "run_id": "run-old", "ts": ts,
                      "ttft_ms": 10 + i, "status": "ok"})  # fmt: skip
        lines.append({"type": "tool_call", "run_id": "run-old", "ts": ts, "tool": "grep"})
    path = tmp / "old.events.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, datetime]:
    """A store with 20 days of samples of three series, requests, a run, a lever flip and an
    ingest error, all older than the retention; built once, copied by each test."""
    folder = tmp_path_factory.mktemp("retention")
    now = retention.utcnow().replace(microsecond=0)
    store = Store(folder / "template.duckdb")
    store.add_metric_samples(_samples(now))
    import_file(store, _requests(folder, now))
    store.upsert_run("run-old", started_at=now - 20 * DAY, model="m", status="done")
    store.add_lever_flip("max_num_seqs", "128", "256", run_id="run-old", ts=now - 20 * DAY)
    store.add_ingest_error("old.log", 0, "invalid JSON", b"{")
    return store.path, now


@pytest.fixture
def store(made: tuple[Path, datetime], tmp_path: Path) -> Iterator[Store]:
    path = tmp_path / "s.duckdb"
    shutil.copy(made[0], path)
    yield Store(path)


def _rows(path: Path, sql: str = "SELECT ts, target, name, labels, run_id, value "
                                 "FROM metric_samples") -> list[Row]:  # fmt: skip
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [tuple(r) for r in con.execute(sql).fetchall()]  # type: ignore[misc]
    finally:
        con.close()


def _other_tables(path: Path) -> dict[str, list[str]]:
    return {
        t: sorted(map(str, _rows(path, f"SELECT * FROM {t}")))  # noqa: S608 - our table names
        for t in OTHER_TABLES
    }


def _expected(rows: list[Row], before: datetime, now: datetime) -> set[Row]:
    """The rule, in Python: dropped before `before`, the minute's last sample per series up to
    the whole minute 24 hours before `now`, everything after."""
    line = (now - DAY).replace(second=0, microsecond=0)
    kept: set[Row] = set()
    last: dict[tuple, Row] = {}
    for row in rows:
        ts, target, name, labels, run_id, _value = row
        if ts < before:
            continue
        if ts >= line:
            kept.add(row)
            continue
        key = (target, name, labels, run_id, ts.replace(second=0, microsecond=0))
        if key not in last or last[key][0] < ts:
            last[key] = row
    return kept | set(last.values())


def test_retention_drops_downsamples_and_keeps_the_rest(
    store: Store, made: tuple[Path, datetime]
) -> None:
    now = made[1]
    rows = _rows(store.path)
    others = _other_tables(store.path)
    assert all(others.values())  # every other table holds rows older than the retention
    assert len(rows) == len(_seconds()) * len(SERIES)
    before = now - 14 * DAY
    started = time.monotonic()
    result = retention.prune(store, before, now=now)
    took = time.monotonic() - started
    after = _rows(store.path)
    assert set(after) == _expected(rows, before, now)
    assert len(after) == len(rows) - result.dropped - result.downsampled
    assert result.dropped == sum(1 for r in rows if r[0] < before)
    assert result.done and result.downsample_until == (now - DAY).replace(second=0)
    # between the cutoff and the 24-hour line: one sample a minute per series, its last
    old = [r for r in after if r[0] < result.downsample_until]
    minutes = {(r[1], r[2], r[3], r[4], r[0].replace(second=0)) for r in old}
    assert len(minutes) == len(old)
    # ten minutes a week ago were sampled every second: their whole minutes keep their 59th
    first = (now - 7 * DAY - timedelta(seconds=599)).replace(second=0) + timedelta(minutes=1)
    whole = [first + timedelta(minutes=i) for i in range(9)]
    week = [r for r in after if whole[0] <= r[0] < whole[-1] + timedelta(minutes=1)]
    assert sorted({r[0] for r in week}) == [m + timedelta(seconds=59) for m in whole]
    assert len(week) == len(whole) * len(SERIES)
    # the last 24 hours: every sample
    recent = sorted(r for r in rows if r[0] >= now - DAY)
    assert sorted(r for r in after if r[0] >= now - DAY) == recent
    assert _other_tables(store.path) == others  # requests, runs, flips… are kept
    # a cumulative counter keeps the minute's last value: its growth between two kept samples
    # is what the dropped ones summed to (this one grows 1 a second)
    counter = sorted((r[0], r[5]) for r in after if r[2] == "vllm:prompt_tokens_total")
    for (t0, v0), (t1, v1) in zip(counter, counter[1:], strict=False):
        assert v1 - v0 == (t1 - t0).total_seconds()
    print(f"{len(rows)} samples → {len(after)} in {took:.2f} s")
    # again: nothing left to do
    again = retention.prune(store, before, now=now)
    assert (again.dropped, again.downsampled) == (0, 0)
    assert sorted(_rows(store.path)) == sorted(after)


def test_the_collector_keeps_its_place_and_does_little_when_nothing_aged(
    store: Store, made: tuple[Path, datetime], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = made[1]
    monkeypatch.setattr(retention, "SLICE_ROWS", 40_000)
    rule = retention.Retention(store, timedelta(days=14), budget_s=0.0)
    first = rule.apply(now)  # a budget of nothing: one slice, then the next pass goes on
    passes = 1
    while not rule.apply(now).done:
        passes += 1
    assert first.dropped > 0 and passes > 1
    rows = _rows(store.path)
    five_minutes_on = rule.apply(now + timedelta(minutes=5))
    assert five_minutes_on.downsample_from == (now - DAY).replace(second=0)
    assert five_minutes_on.downsampled == 5 * 59 * len(SERIES)  # 5 minutes sampled at 1 s
    assert set(_rows(store.path)) == _expected(
        rows, now + timedelta(minutes=5) - 14 * DAY, now + timedelta(minutes=5)
    )


def test_store_prune_cli(store: Store, made: tuple[Path, datetime]) -> None:
    now = made[1]
    others = _other_tables(store.path)
    rows = _rows(store.path)
    before = (now - 14 * DAY).isoformat() + "Z"
    dry = servescope("store", "prune", "--store", str(store.path), "--before", before,
                     "--dry-run", "--json")  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    counted = json.loads(dry.stdout)
    assert counted["dry_run"] and counted["samples_after"] == counted["samples_before"]
    assert counted["samples_before"] == len(rows)
    done = servescope("store", "prune", "--store", str(store.path), "--before", before, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["dropped"] == counted["dropped"] == sum(1 for r in rows if r[0] < now - 14 * DAY)
    assert abs(out["downsampled"] - counted["downsampled"]) <= 3 * 59 * len(SERIES)  # a minute on
    assert out["samples_after"] == out["samples_before"] - out["dropped"] - out["downsampled"]
    assert out["samples_after"] == len(_rows(store.path))
    assert _other_tables(store.path) == others
    assert "downsampling" in done.stderr


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--before", "last tuesday", "not a date"),
        ("--before", "2999-01-01", "in the future"),
    ],
)
def test_store_prune_refuses_bad_dates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, says: str
) -> None:
    code = cli.main(["store", "prune", "--store", str(tmp_path / "s.duckdb"), option, value])
    assert code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("text", ["14x", "14", "0d", "1.5d", "-2w", "d", "14 d", "9" * 5000])
def test_a_bad_retention_is_refused(text: str) -> None:
    with pytest.raises(retention.BadRetention):
        retention.parse_duration(text)


def test_durations() -> None:
    assert retention.parse_duration("36h") == timedelta(hours=36)
    assert retention.parse_duration("14d") == timedelta(days=14)
    assert retention.parse_duration("2w") == timedelta(days=14)
    assert retention.parse_duration("90m") == timedelta(minutes=90)


def test_collect_refuses_a_bad_retain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = tmp_path / "a.events.jsonl"
    events.write_text("")
    code = cli.main(["collect", "--once", "--events", str(events), "--retain", "14x",
                     "--store", str(tmp_path / "s.duckdb")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--retain" in err and "36h, 14d, 2w" in err
    assert not (tmp_path / "s.duckdb").exists()  # refused before the store is opened


def test_collect_once_with_retain_prunes(store: Store, made: tuple[Path, datetime]) -> None:
    now = made[1]
    rows = _rows(store.path)
    events = store.path.parent / "new.events.jsonl"
    events.write_text(json.dumps({"request_id": "run-new-000", "ttft_ms": 5}) + "\n")
    result = servescope("collect", "--once", "--events", str(events), "--retain", "14d",
                        "--store", str(store.path), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    totals = json.loads(result.stdout)
    assert totals["events"] == 1 and totals["samples_dropped"] > 0
    after = _rows(store.path)
    assert len(after) == len(rows) - totals["samples_dropped"] - totals["samples_downsampled"]
    assert min(r[0] for r in after) >= now - 14 * DAY


def test_a_running_collector_prunes_at_start_and_counts_it(
    store: Store, made: tuple[Path, datetime]
) -> None:
    now = made[1]
    metrics = SelfMetrics()
    collector = Collector(store, [], retain=timedelta(days=14), metrics=metrics)
    stop = threading.Event()
    loop = threading.Thread(target=collector.run, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while collector.retention is not None and collector.retention.done_until is None:
            assert time.monotonic() < deadline, "no retention pass"
            time.sleep(0.05)
        while not collector.totals["samples_downsampled"] or collector.retention.done_until < (
            now - DAY
        ).replace(second=0):  # the pass may go in slices
            assert time.monotonic() < deadline, "the retention pass did not finish"
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join(30)
    value = metrics.registry.get_sample_value
    dropped = value("servescope_collector_samples_pruned_total", {"reason": "expired"})
    downsampled = value("servescope_collector_samples_pruned_total", {"reason": "downsampled"})
    assert dropped == collector.totals["samples_dropped"] > 0
    assert downsampled == collector.totals["samples_downsampled"] > 0
    assert min(r[0] for r in _rows(store.path)) >= now - 14 * DAY


def test_store_prune_beside_a_running_collector(store: Store, made: tuple[Path, datetime]) -> None:
    """`store prune` in another process while a collector writes the same store: both go on,
    taking turns at the file; every request the collector read is stored."""
    now = made[1]
    events = store.path.parent / "live.events.jsonl"
    events.write_text("")
    collector = Collector(store, [EventsFiles(str(events))], metrics=SelfMetrics())
    stop = threading.Event()
    loop = threading.Thread(target=collector.run, args=(stop,))
    loop.start()
    written = 0

    def write(n: int) -> None:
        nonlocal written
        with events.open("a") as out:
            for _ in range(n):
                out.write(
                    json.dumps({"request_id": f"run-live-{written:05d}", "ttft_ms": 1}) + "\n"
                )
                written += 1

    try:
        write(100)
        before = (now - 14 * DAY).isoformat() + "Z"
        prune = subprocess.Popen(
            [*SERVESCOPE, "store", "prune", "--store", str(store.path), "--before", before,
             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while prune.poll() is None:
            write(20)
            time.sleep(0.05)
        out, err = prune.communicate()
        assert prune.returncode == 0, err
        write(100)
        deadline = time.monotonic() + 30
        while collector.totals["events"] < written:
            assert time.monotonic() < deadline, (collector.totals, written)
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join(30)
    assert json.loads(out)["dropped"] > 0
    stored = _rows(store.path, "SELECT count(*) FROM events WHERE run_id = 'run-live'")
    assert stored == [(written,)]
    assert min(r[0] for r in _rows(store.path)) >= now - 14 * DAY
