"""The gateway's HTTP surface: OpenAI routes in front of the upstreams, `/health`, `/metrics`.

Every request to `/v1/completions` or `/v1/chat/completions` gets exactly one response and
writes exactly one event (`source = gateway`), whatever happens: admitted and served, rejected
(status `rejected`, `error = rejected:<reason>`), failed upstream, or client gone (`disconnect`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from servescope.gateway.admission import Rejected, Scheduler, Slot
from servescope.gateway.config import GatewayConfig, Route, Team, Upstream, load_config
from servescope.gateway.eventlog import EventLog
from servescope.gateway.httpserver import Reply, Request, Response, Server, json_response
from servescope.gateway.metrics import GatewayMetrics
from servescope.gateway.proxy import Attempt, ClientGone, UpstreamFailed, forward
from servescope.gateway.routing import Pick, Router, routing_changes
from servescope.gateway.timing import RelayTiming
from servescope.gateway.tokens import TokenCounter
from servescope.gateway.upstream import UpstreamPool
from servescope.store import Store
from servescope.wire import tracing
from servescope.wire.stream import CHAT, COMPLETIONS, Endpoint, utc_now_iso

log = logging.getLogger("servescope.gateway")

DOWN_FOR_S = 2.0  # an upstream that refused a connection or dropped a stream is skipped this long
PROBE_EVERY_S = 0.5  # pool replicas' /health, so a dead one is skipped even with no traffic to it
PROBE_TIMEOUT_S = 5.0
MAX_REQUEST_ID = 200
PASSED_HEADERS = ("traceparent", "tracestate")


@dataclass
class UpstreamHealth:
    down_until: float = 0.0

    def usable(self, now: float) -> bool:
        return now >= self.down_until


class Gateway:
    """State shared by all requests: the config (swapped whole on reload), the scheduler, the
    upstream connection pool, the event log and the metrics."""

    def __init__(
        self, config: GatewayConfig, config_path: Path | None = None, store: Store | None = None
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.store = store  # where a reload that changes a routing policy writes its lever flip
        self.router = Router()
        self._flip_writers: list[threading.Thread] = []
        self._prober: asyncio.Task[None] | None = None
        self.metrics = GatewayMetrics()
        self.scheduler = Scheduler(config.teams, self._caps(config))
        self.events = EventLog(config.events_dir)
        self.upstream_health: dict[str, UpstreamHealth] = {}
        self.pools: dict[str, UpstreamPool] = {}  # by URL, so they outlive reloads
        self.session: aiohttp.ClientSession | None = None
        self.tokens: TokenCounter | None = None
        self._boot_run = f"run-{datetime.now(UTC).strftime('%Y%m%d')}-gateway"
        self.tracer = tracing.tracer_from_env("servescope-gateway")  # a span per request
        self._wire_gauges()

    @staticmethod
    def _caps(config: GatewayConfig) -> dict[str, int]:
        return {name: u.max_concurrent for name, u in config.upstreams.items()}

    def _wire_gauges(self) -> None:
        for name in self.config.teams:
            self.metrics.queue_depth.labels(name).set_function(
                lambda n=name: self.scheduler.queue_depth(n)
            )
            if self.config.teams[name].token_budget is not None:
                self.metrics.budget_used.labels(name).set_function(
                    lambda n=name: self.scheduler.teams[n].budget_used_ratio()
                )
        for name in self.config.upstreams:
            self.metrics.inflight.labels(name).set_function(
                lambda n=name: self.scheduler.inflight.get(n, 0)
            )
            self.metrics.upstream_up.labels(name).set_function(
                lambda n=name: float(self._health(n).usable(time.monotonic()))
            )

    # --- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.tokens = TokenCounter(self.session)
        self._prober = asyncio.create_task(self._probe_replicas())

    async def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        if self.session is not None:
            await self.session.close()
        for pool in self.pools.values():
            pool.close()
        self.events.close()
        self.flush_flips()

    def flush_flips(self, timeout_s: float = 30.0) -> None:
        """Wait for the lever flips being written (a gateway stopped right after a reload)."""
        for thread in self._flip_writers:
            thread.join(timeout_s)
        self._flip_writers = [t for t in self._flip_writers if t.is_alive()]

    def reload(self) -> bool:
        """Re-read gateway.yaml (SIGHUP). In-flight requests keep going; new limits apply to the
        next admission. A bad file changes nothing and is reported."""
        if self.config_path is None:
            return False
        try:
            config = load_config(self.config_path)
        except ValueError as exc:
            self.metrics.reloads.labels("error").inc()
            log.error("reload refused, keeping the running config: %s", exc)
            return False
        if (config.host, config.port) != (self.config.host, self.config.port):
            log.warning(
                "listen address changes need a restart; keeping %s:%s",
                self.config.host,
                self.config.port,
            )
        if config.events_dir != self.config.events_dir:
            self.events.close()
            self.events = EventLog(config.events_dir)
        changes = routing_changes(self.config.routes, config.routes)
        self.config = config
        self.scheduler.configure(config.teams, self._caps(config))
        self._wire_gauges()
        self.metrics.reloads.labels("ok").inc()
        log.info(
            "reloaded %s: %d teams, %d upstreams, %d models",
            config.source,
            len(config.teams),
            len(config.upstreams),
            len(config.routes),
        )
        if changes:
            self._record_flips(changes)
        return True

    def _record_flips(self, changes: list[tuple[str, str, str]]) -> None:
        """A routing policy is a lever: each change is a `lever_flips` row (lever `routing`),
        written off the event loop (the store may be busy with another writer)."""
        for model, before, after in changes:
            log.info("routing of %s: %s -> %s", model, before, after)
        if self.store is None:
            return
        store, source = self.store, self.config.source

        def write() -> None:
            try:
                for model, before, after in changes:
                    store.add_lever_flip(
                        "routing", before, after, note=f"gateway reload of {source}: {model}"
                    )
            except Exception as exc:  # a store that cannot be written loses a note, not requests
                log.error("could not record the routing flip in %s: %r", store.path, exc)

        thread = threading.Thread(target=write, name="routing-flip", daemon=True)
        thread.start()
        self._flip_writers.append(thread)

    # --- routing ----------------------------------------------------------------------------

    def candidates(self, model: str) -> list[Upstream]:
        """The route's pool then its fallback, usable ones first (calls that hold no KV cache,
        like `/tokenize`, need no routing decision)."""
        route = self.config.routes[model]
        names = (*route.pool, route.fallback) if route.fallback else route.pool
        if len(names) == 1:  # one candidate: nothing to order
            return [self.config.upstreams[names[0]]]
        now = time.monotonic()
        ups = [self.config.upstreams[n] for n in names]
        return sorted(ups, key=lambda u: not self._health(u.name).usable(now))

    def plan(self, route: Route, body: dict[str, Any], chat: bool) -> list[Pick]:
        """The routing decision: the upstreams to try, in order, each with its reason."""
        if len(route.pool) == 1 and route.fallback is None:
            return [Pick(route.pool[0], "only")]
        now = time.monotonic()
        return self.router.plan(route, body, chat, lambda n: self._health(n).usable(now))

    async def _probe_replicas(self) -> None:
        """Every `PROBE_EVERY_S`, `GET /health` on each replica of a pool (routes of one upstream
        keep the passive rule alone): a refused, failed or timed-out probe marks it down, a 200
        brings it back at once. Requests that fail mark an upstream down too, without waiting.
        Each replica keeps its own pace: a busy one slow to answer never delays the probe that
        finds another one dead."""
        probing: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                names = {n for r in self.config.routes.values() if len(r.pool) > 1 for n in r.pool}
                for name in sorted(names):
                    if name not in probing or probing[name].done():
                        probing[name] = asyncio.create_task(self._probe(name))
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            for task in probing.values():
                task.cancel()

    async def _probe(self, name: str) -> None:
        upstream = self.config.upstreams.get(name)
        if upstream is None or self.session is None:
            return
        try:
            async with self.session.get(
                f"{upstream.url}/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as resp:
                healthy = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            healthy = False
        if healthy:
            self._health(name).down_until = 0.0
        else:
            self.mark_down(name)

    def mark_down(self, name: str) -> None:
        """Skip an upstream for `DOWN_FOR_S`; it is tried again after that by itself."""
        self._health(name).down_until = time.monotonic() + DOWN_FOR_S

    def _pool(self, url: str) -> UpstreamPool:
        if (pool := self.pools.get(url)) is None:
            pool = self.pools[url] = UpstreamPool(url)
        return pool

    def _health(self, name: str) -> UpstreamHealth:
        return self.upstream_health.setdefault(name, UpstreamHealth())

    def team_of(self, request: Request) -> Team:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else None
        team = self.config.team_for_key(key or request.headers.get("x-api-key"))
        if team is None:
            raise Rejected("unknown_key", "missing or unknown API key")
        return team

    # --- the OpenAI routes ------------------------------------------------------------------

    async def completions(self, request: Request, reply: Reply) -> Response | Reply:
        return await self._serve(request, reply, COMPLETIONS)

    async def chat_completions(self, request: Request, reply: Reply) -> Response | Reply:
        return await self._serve(request, reply, CHAT)

    async def _serve(self, request: Request, reply: Reply, endpoint: Endpoint) -> Response | Reply:
        start = time.perf_counter()
        given = request.headers.get("x-request-id", "")[:MAX_REQUEST_ID]
        event: dict[str, Any] = {
            "request_id": given or f"gw-{uuid.uuid4().hex}",
            "ts": utc_now_iso(),
            "source": "gateway",
        }
        if not given:
            event["run_id"] = self._boot_run
        span = None
        trace_headers: dict[str, str] = {}  # the traceparent of the gateway's own span
        if self.tracer is not None:  # a child of the client's span; vLLM's becomes ours
            operation = "chat" if endpoint.chat else "text_completion"
            span, trace_headers = tracing.start_request_span(
                self.tracer,
                f"gateway {operation}",
                kind=tracing.SpanKind.SERVER,
                attributes=tracing.genai_attributes(operation, None, event["request_id"]),
                parent_headers=request.headers,
            )
            event["trace_id"] = tracing.trace_id_of(span)
        elif "traceparent" in request.headers and (
            trace_id := tracing.trace_id_from_headers(request.headers)
        ):  # untraced clients skip the propagator's work
            event["trace_id"] = trace_id
        slot: Slot | None = None
        held: list[str] = []  # the replica this request counts against in the router
        response: Response | Reply | None = None
        try:
            team = self.team_of(request)
            event["team"] = team.name
            body = self._body(request)
            model = body.get("model")
            if not isinstance(model, str) or model not in self.config.routes:
                raise Rejected(
                    "unknown_model",
                    f"unknown model {model!r}; served: {sorted(self.config.routes)}",
                )
            event["model"] = model
            if team.models is not None and model not in team.models:
                raise Rejected("model_not_allowed", f"team {team.name!r} may not use {model!r}")
            stream = bool(body.get("stream"))
            event["stream"] = stream
            route = self.config.routes[model]
            picks = self.plan(route, body, endpoint.chat)
            if len(route.pool) > 1:
                event["routing"] = route.routing
            self.router.hold(picks[0].upstream)
            held.append(picks[0].upstream)
            upstreams = [self.config.upstreams[p.upstream] for p in picks]
            admission_start = time.time_ns()
            prompt_tokens = await self._prompt_tokens(team, upstreams, body, endpoint)
            slot = await self.scheduler.admit(
                team.name, upstreams[0].name, prompt_tokens=prompt_tokens
            )
            event["queue_ms"] = slot.queue_ms
            if span is not None and self.tracer is not None:
                span.set_attribute("gen_ai.request.model", model)
                tracing.record_child_span(
                    self.tracer,
                    span,
                    "gateway admission",
                    admission_start,
                    {"servescope.team": team.name, "servescope.queue_ms": slot.queue_ms},
                )
            response = await self._proxy(
                request, reply, endpoint, team, body, picks, slot, event, start, trace_headers, held
            )
        except Rejected as rej:
            response = self._reject(rej, event, start)
        except ClientGone as exc:
            self._gone(event, start, str(exc))
        except asyncio.CancelledError:  # the client closed the connection
            self._gone(event, start, "client closed the connection")
            raise
        except Exception as exc:  # a bug must still answer and leave its event
            log.exception("request %s failed inside the gateway", event["request_id"])
            event.update(
                status="error",
                error="http_5xx",
                finish_reason="error",
                error_detail=f"gateway: {exc!r}",
                http_status=500,
            )
            response = json_response(_error_body("internal gateway error", "internal", 500), 500)
        finally:
            if slot is not None:
                if event.get("status") == "ok" and slot.team.team.token_budget:
                    slot.charge(
                        (event.get("prompt_tokens") or 0) + (event.get("completion_tokens") or 0)
                    )
                slot.release()
            for name in held:
                self.router.let_go(name)
            self.events.write(event)
            self.metrics.observe(event)
            if span is not None:
                tracing.end_request_span(span, event)
        if response is None:  # the client is gone; nothing left to say to it
            response = Response(499, b"")
        if isinstance(response, Response):
            response.headers["X-Request-Id"] = event["request_id"]
            if "upstream" in event:
                response.headers.update(route_headers(event))
        return response

    @staticmethod
    def _body(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(request.body)
        except ValueError as exc:
            raise Rejected("bad_request", f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Rejected("bad_request", "request body must be a JSON object")
        return body

    async def _prompt_tokens(
        self, team: Team, upstreams: list[Upstream], body: dict[str, Any], endpoint: Endpoint
    ) -> int:
        if team.max_prompt_tokens is None and team.token_budget is None:
            return 0
        assert self.tokens is not None
        count: int | None = None
        for upstream in upstreams:
            try:
                count = await self.tokens.count(
                    upstream.url, upstream.model or body["model"], body, endpoint.chat
                )
                break
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                log.warning("tokenize on %s failed: %r", upstream.name, exc)
        if count is None:
            raise Rejected(
                "upstream_unavailable",
                "no upstream could count the prompt",
                retry_after_s=DOWN_FOR_S,
            )
        if team.max_prompt_tokens is not None and count > team.max_prompt_tokens:
            raise Rejected(
                "prompt_too_long",
                f"prompt has {count} tokens; team {team.name!r} allows {team.max_prompt_tokens}",
            )
        return count

    async def _proxy(
        self,
        request: Request,
        reply: Reply,
        endpoint: Endpoint,
        team: Team,
        body: dict[str, Any],
        picks: list[Pick],
        slot: Slot,
        event: dict[str, Any],
        start: float,
        trace_headers: dict[str, str],
        held: list[str],
    ) -> Response | Reply:
        headers = {"Content-Type": "application/json", "X-Request-Id": event["request_id"]}
        for name in PASSED_HEADERS:
            if value := request.headers.get(name):
                headers[name] = value
        headers.update(trace_headers)  # the gateway's own span, if traced
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        raw = (
            None
            if stream and not (isinstance(options, dict) and options.get("include_usage"))
            else request.body
        )  # unchanged bodies go upstream as they came
        if raw is None and stream:  # the gateway needs usage for TPOT and budgets
            body["stream_options"] = {
                **(options if isinstance(options, dict) else {}),
                "include_usage": True,
            }
        failure: UpstreamFailed | None = None
        model = body["model"]
        for i, pick in enumerate(picks):
            upstream = self.config.upstreams[pick.upstream]
            if i > 0:
                slot.move_to(upstream.name)
                self.router.let_go(held.pop())
                self.router.hold(upstream.name)
                held.append(upstream.name)
            if pick.reason in ("retry", "fallback"):  # not the policy's first choice
                event["fallback"] = True
            event["upstream"] = upstream.name
            event["route_reason"] = pick.reason
            self.metrics.route(model, upstream.name, pick.reason)
            served = upstream.model or body["model"]
            if raw is not None and served == body["model"]:
                payload_bytes = raw
            else:
                payload_bytes = json.dumps({**body, "model": served}).encode()
            attempt = Attempt(
                reply=reply,
                pool=self._pool(upstream.url),
                endpoint=endpoint,
                body=payload_bytes,
                headers=headers,
                stream=stream,
                timing=RelayTiming(endpoint, start),
                prefill_timeout_s=team.prefill_timeout_s,
                decode_timeout_s=team.decode_timeout_s,
                route_headers=route_headers(event),
            )
            try:
                response = await forward(attempt, event)
            except UpstreamFailed as exc:
                failure = exc
                if exc.kind in ("connect", "disconnect"):  # gone, not merely busy
                    self.mark_down(upstream.name)
                event.setdefault("failed_upstreams", []).append(f"{upstream.name}:{exc.kind}")
                log.warning(
                    "upstream %s failed for %s: %s", upstream.name, event["request_id"], exc.detail
                )
                continue
            if event.get("error") == "disconnect" and str(event.get("error_detail", "")).startswith(
                "upstream"
            ):  # it dropped a stream it had started: the next requests go elsewhere at once
                self.mark_down(upstream.name)
            return response
        assert failure is not None
        if failure.kind == "connect":
            raise Rejected(
                "upstream_unavailable",
                f"no upstream of {body['model']!r} accepted the connection",
                retry_after_s=DOWN_FOR_S,
            )
        event.update(
            status="error",
            error=failure.kind,
            finish_reason="error",
            error_detail=failure.detail,
            http_status=failure.http_status or 502,
        )
        event["e2e_ms"] = (time.perf_counter() - start) * 1000.0
        return json_response(
            _error_body(
                f"upstream failed: {failure.detail}", "upstream_error", failure.http_status or 502
            ),
            failure.http_status or 502,
        )

    def _reject(self, rej: Rejected, event: dict[str, Any], start: float) -> Response:
        event.update(
            status="rejected",
            error=f"rejected:{rej.reason}",
            finish_reason="error",
            error_detail=rej.message,
            http_status=rej.http_status,
        )
        event["e2e_ms"] = (time.perf_counter() - start) * 1000.0
        event.setdefault("team", "unknown")
        headers = {}
        if rej.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(rej.retry_after_s)))
        return json_response(
            _error_body(rej.message, "admission_rejected", rej.reason), rej.http_status, headers
        )

    def _gone(self, event: dict[str, Any], start: float, detail: str) -> None:
        if "status" in event:  # the answer was complete before the client left
            return
        event.update(
            status="error",
            error="disconnect",
            finish_reason="abort",
            error_detail=f"client: {detail}",
        )
        event["e2e_ms"] = (time.perf_counter() - start) * 1000.0
        event.setdefault("team", "unknown")

    # --- the other routes -------------------------------------------------------------------

    async def models(self, request: Request, reply: Reply) -> Response:
        data = [
            {"id": m, "object": "model", "owned_by": "servescope-gateway"}
            for m in sorted(self.config.routes)
        ]
        return json_response({"object": "list", "data": data})

    async def passthrough(self, request: Request, reply: Reply) -> Response:
        """`/tokenize`, `/detokenize`, `/version`: no generation, no admission; sent to the
        upstream of the body's model (or the first upstream)."""
        assert self.session is not None
        raw = request.body
        model = None
        if raw:
            try:
                model = json.loads(raw).get("model")
            except (ValueError, AttributeError):
                model = None
        upstreams = (
            self.candidates(model)
            if model in self.config.routes
            else list(self.config.upstreams.values())
        )
        for upstream in upstreams:
            if model and upstream.model:
                raw = json.dumps({**json.loads(raw), "model": upstream.model}).encode()
            try:
                async with self.session.request(
                    request.method,
                    upstream.url + request.path,
                    data=raw or None,
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as resp:
                    body = await resp.read()
                    return Response(resp.status, body, {"Content-Type": "application/json"})
            except (aiohttp.ClientError, TimeoutError):
                continue
        return json_response(
            _error_body("no upstream reachable", "upstream_error", 503),
            503,
            {"Retry-After": str(int(DOWN_FOR_S))},
        )

    async def health(self, request: Request, reply: Reply) -> Response:
        now = time.monotonic()
        ups = {
            n: ("down" if not self._health(n).usable(now) else "up") for n in self.config.upstreams
        }
        return json_response({"status": "ok", "upstreams": ups})

    async def prometheus(self, request: Request, reply: Reply) -> Response:
        return Response(
            200, generate_latest(self.metrics.registry), {"Content-Type": CONTENT_TYPE_LATEST}
        )


def route_headers(event: dict[str, Any]) -> dict[str, str]:
    """Which upstream served the response and why, for the client: a load generator behind the
    gateway records them in its own events (the replica of each request, per-replica reports)."""
    return {
        "X-Servescope-Upstream": event["upstream"],
        "X-Servescope-Route": event.get("route_reason", "only"),
    }


def _error_body(message: str, kind: str, code: str | int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def build_server(gateway: Gateway) -> Server:
    server = Server()
    server.add("POST", "/v1/completions", gateway.completions)
    server.add("POST", "/v1/chat/completions", gateway.chat_completions)
    server.add("GET", "/v1/models", gateway.models)
    server.add("POST", "/tokenize", gateway.passthrough)
    server.add("POST", "/detokenize", gateway.passthrough)
    server.add("GET", "/version", gateway.passthrough)
    server.add("GET", "/health", gateway.health)
    server.add("GET", "/metrics", gateway.prometheus)
    return server


async def serve(gateway: Gateway, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM; SIGHUP reloads gateway.yaml. Client disconnects cancel their
    handler, which closes the upstream request."""
    await gateway.start()
    server = build_server(gateway)
    try:
        await server.serve(host, port, backlog=4096)
    except BaseException:
        await gateway.stop()
        raise
    # Garbage collection was a tenth of the CPU per proxied request and its full passes paused
    # the loop for ~45 ms: what start-up built (modules, config, metrics) is frozen out of every
    # later scan, and a young collection, which scans every request in flight, runs when 10,000
    # objects have piled up rather than 700 (the default, reached by a burst of arrivals).
    gc.freeze()
    gc.set_threshold(10_000)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, gateway.reload)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "gateway on http://%s:%d: %d teams, models %s",
        host,
        port,
        len(gateway.config.teams),
        ", ".join(sorted(gateway.config.routes)),
    )
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.shutdown()
        await gateway.stop()
