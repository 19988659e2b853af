"""Scrape the target's `/metrics` every second while a run goes, into `metric_samples`.

The server's counters are cumulative since it started; stored per run, the store turns them into
run-scoped deltas (`Store.counter_deltas`) and peaks (`Store.gauge_peaks`). Pages are fetched in
the event loop (one small GET) but parsed and written in a worker thread, a few at a time, so
the scrape never sits inside a measured request's timing.

A server busy serving can take seconds to answer `/metrics`, so every page may take up to
`TIMEOUT_S`. The deltas are differences between the run's first page and its last (and, between
levels, the page at each level's end): a key page lost would take requests out of the run's
numbers, so those are asked for again after a timeout or a lost connection. A periodic page gets
one try: the next one is a second away.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime

import aiohttp

from servescope.store import Store
from servescope.store.clock import utcnow
from servescope.store.notes import ServerNotes
from servescope.wire.exposition import Sample, parse_exposition, prefix_cache_hit_ratio

INTERVAL_S = 1.0
FLUSH_EVERY = 5
TIMEOUT_S = 30.0  # one try at a page (a periodic page waits that long at most, then is dropped)
KEY_TRIES = 3  # tries at a key page: the run's first, each level's end, its last
KEY_RETRY_S = 1.0  # between a key page's tries

COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


class MetricsScraper:
    """Samples `target/metrics` into the store under `run_id` until `stop()`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: str,
        run_id: str,
        store: Store,
        interval_s: float = INTERVAL_S,
        lock: asyncio.Lock | None = None,
    ) -> None:
        self.session = session
        self.url = f"{target}/metrics"
        self.target = target
        self.run_id = run_id
        self.store = store
        self.interval_s = interval_s
        self.lock = lock or asyncio.Lock()  # one store writer at a time in this process
        self.scrapes = 0
        self.failures = 0
        self._pages: list[tuple[datetime, str]] = []
        self._task: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    async def scrape(self, *, key: bool = False) -> None:
        """One page now. A periodic page gets one try; a `key` page (one the run's deltas are
        taken between) up to `KEY_TRIES`, tried again after a timeout or a lost connection. A
        scrape that ends with no page is one failure, counted, never raised: a dead server ends
        no run."""
        text = await self._page(key)
        if text is None:
            self.failures += 1
            return
        self.scrapes += 1
        self._pages.append((utcnow(), text))
        if len(self._pages) >= FLUSH_EVERY:
            task = asyncio.create_task(self._flush())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _page(self, key: bool) -> str | None:
        """The page's text, or None when every try failed."""
        tries = KEY_TRIES if key else 1
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        for attempt in range(1, tries + 1):
            try:
                async with self.session.get(self.url, timeout=timeout) as resp:
                    resp.raise_for_status()
                    return await resp.text()
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
                if attempt < tries:
                    await asyncio.sleep(KEY_RETRY_S)
            except aiohttp.ClientError:  # an error status: asking again gets the same answer
                return None
        return None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def stop(self) -> None:
        """Take a last page (a key page: the run's deltas end there), and write everything
        scraped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scrape(key=True)
        await asyncio.gather(*self._flushes)
        await self._flush()

    async def _flush(self) -> None:
        pages, self._pages = self._pages, []
        if pages:
            async with self.lock:
                await asyncio.to_thread(self._write, pages)

    def _write(self, pages: list[tuple[datetime, str]]) -> None:
        rows: list[Sample] = []
        for ts, text in pages:
            try:
                rows.extend(parse_exposition(text, target=self.target, ts=ts, run_id=self.run_id))
            except ValueError:  # an unparsable page: its samples are lost, not the run's
                self.failures += 1
        self.store.add_metric_samples(rows)

    def server_numbers(self) -> ServerNotes:
        """The run-scoped server numbers: counter deltas, gauge peaks, the prefix-cache hit
        ratio (Δhits / Δqueries, in tokens) — None where the run has too few samples."""
        deltas = self.store.counter_deltas(self.run_id, COUNTERS)
        peaks = self.store.gauge_peaks(self.run_id, GAUGES)
        hits = deltas["vllm:prefix_cache_hits_total"]
        queries = deltas["vllm:prefix_cache_queries_total"]
        prompt = deltas["vllm:prompt_tokens_total"]
        ratio, basis = prefix_cache_hit_ratio(hits, queries, prompt)
        drafted = deltas["vllm:spec_decode_num_draft_tokens_total"]
        accepted = deltas["vllm:spec_decode_num_accepted_tokens_total"]
        return {
            "prefix_cache_hit_ratio": ratio,
            "prefix_cache_hit_ratio_basis": basis,
            "prefix_cache_hits": hits,
            "prefix_cache_queries": queries,
            "preemptions": deltas["vllm:num_preemptions_total"],
            "prompt_tokens": deltas["vllm:prompt_tokens_total"],
            "generation_tokens": deltas["vllm:generation_tokens_total"],
            "requests_finished": deltas["vllm:request_success_total"],
            # None without speculative decoding (the server exports no spec_decode counters)
            "spec_decode_draft_tokens": drafted,
            "spec_decode_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / drafted
            if accepted is not None and drafted
            else None,
            "peak_running": peaks["vllm:num_requests_running"],
            "peak_waiting": peaks["vllm:num_requests_waiting"],
            "kv_cache_usage_peak": peaks["vllm:kv_cache_usage_perc"],
            "scrapes": self.scrapes,
            # scrapes that ended with no page (a key page after all its tries), and pages that
            # could not be parsed
            "scrape_failures": self.failures,
        }
