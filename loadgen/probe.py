"""What a benchmark run learns of the server besides its answers: the served model and vLLM
version (asked before anything is measured), what the launcher that started it wrote down (its
levers, process, time to ready, KV-cache statement), its `/metrics` scraped through the run —
each replica's too, for a fleet behind a gateway — and the peak memory of its process tree.

Nothing here sends a measured request; the scrapes and the memory samples run beside them.
"""

from __future__ import annotations

import asyncio

import aiohttp

from servescope.loadgen.client import get_json
from servescope.loadgen.launcher import Levers, process_tree_rss, state_for
from servescope.loadgen.server_metrics import MetricsScraper
from servescope.store import Store
from servescope.store.notes import ServerNotes

MEMORY_SAMPLE_S = 0.5


class TargetUnreachable(RuntimeError):
    """The target did not answer the set-up calls (models, tokenizer): nothing was measured."""


class ServerProbe:
    """One run's view of its server (and of the replicas behind it), apart from the requests.

    `levers` and `server_pid` given override what the launcher's state file says; the state
    file, where this machine has one for the target, gives the rest."""

    def __init__(
        self,
        target: str,
        *,
        replicas: dict[str, str],
        levers: Levers | None,
        server_pid: int | None,
    ) -> None:
        self.target = target
        self.replicas = replicas
        state = state_for(target)
        self.levers = levers if levers is not None else (state.levers if state else None)
        self.server_pid = server_pid or (state.pid if state else None)
        self.ready_s = state.ready_s if state else None
        self.kv_cache = state.kv_cache if state else None
        self.peak_rss = 0
        self._scrapers: list[MetricsScraper] = []
        self._sampler: asyncio.Task[None] | None = None

    async def identify(
        self, session: aiohttp.ClientSession, model: str | None
    ) -> tuple[str, str | None]:
        """(the served model — `model` when given —, the vLLM version if it says); raises
        TargetUnreachable when the target does not answer."""
        try:
            served = model or await self._served_model(session)
            return served, await self._vllm_version(session)
        except (TimeoutError, aiohttp.ClientError, KeyError, IndexError) as exc:
            raise TargetUnreachable(f"{self.target} did not answer: {exc!r}") from exc

    def watch(
        self, session: aiohttp.ClientSession, run_id: str, store: Store, lock: asyncio.Lock
    ) -> None:
        """Get ready to scrape the target and every replica into `run_id`, and start sampling
        the server's memory (where its process is known)."""
        self._scrapers = [
            MetricsScraper(session, url, run_id, store, lock=lock)
            for url in (self.target, *self.replicas.values())
        ]
        if self.server_pid:
            self._sampler = asyncio.create_task(self._sample_memory(self.server_pid))

    async def key_page(self) -> None:
        """A page of every server now, which the run's deltas are taken between (its start,
        each level's end: counters split exactly between levels that run one after another)."""
        await asyncio.gather(*(s.scrape(key=True) for s in self._scrapers))

    def start_scraping(self) -> None:
        for scraper in self._scrapers:
            scraper.start()

    async def stop(self) -> None:
        """Stop sampling; every scraper's last page taken and everything written."""
        if self._sampler is not None:
            self._sampler.cancel()
        for scraper in self._scrapers:
            await scraper.stop()

    def server_numbers(self) -> ServerNotes:
        """The run's counters summed over every scraped server: a fleet's totals."""
        numbers = self._scrapers[0].server_numbers()
        numbers["scrapes"] = sum(s.scrapes for s in self._scrapers)
        numbers["scrape_failures"] = sum(s.failures for s in self._scrapers)
        return numbers

    @property
    def memory_peak_gb(self) -> float | None:
        return round(self.peak_rss / 2**30, 3) if self.peak_rss else None

    async def _served_model(self, session: aiohttp.ClientSession) -> str:
        models = await get_json(session, f"{self.target}/v1/models")
        return str(models["data"][0]["id"])

    async def _vllm_version(self, session: aiohttp.ClientSession) -> str | None:
        try:
            return str((await get_json(session, f"{self.target}/version"))["version"])
        except (aiohttp.ClientError, KeyError, ValueError):
            return None

    async def _sample_memory(self, pid: int) -> None:
        while True:
            self.peak_rss = max(self.peak_rss, process_tree_rss(pid))
            await asyncio.sleep(MEMORY_SAMPLE_S)
