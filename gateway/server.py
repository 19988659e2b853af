"""The gateway's HTTP surface: OpenAI routes in front of the upstreams, `/health`, `/metrics`.

Every request to `/v1/completions` or `/v1/chat/completions` gets exactly one response and
writes exactly one event (`source = gateway`), whatever happens: admitted and served, rejected
(status `rejected`, `error = rejected:<reason>`), failed upstream, or client gone (`disconnect`).

`Gateway` holds what all requests share and runs each one through three steps: admission
(team, model, routing plan, prompt count, a scheduler slot), the attempts along the plan (each
relayed by `proxy.forward`), and the finish (slot released, event written and counted). What a
request carries between the steps is its `context.RequestContext`. Upstream health and its
probes live in `health`, SIGHUP reloads and their lever flips in `reload`, spans in `spans`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import signal
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from servescope.gateway.admission import Rejected, Scheduler
from servescope.gateway.config import GatewayConfig, Route, Team, Upstream
from servescope.gateway.context import RequestContext, api_key, error_body, read_body
from servescope.gateway.eventlog import EventLog
from servescope.gateway.health import DOWN_FOR_S, UpstreamHealth
from servescope.gateway.httpserver import Reply, Request, Response, Server, json_response
from servescope.gateway.metrics import GatewayMetrics
from servescope.gateway.proxy import Attempt, ClientGone, UpstreamFailed, forward
from servescope.gateway.reload import Reloader
from servescope.gateway.routing import Pick, Router
from servescope.gateway.timing import RelayTiming
from servescope.gateway.tokens import TokenCounter
from servescope.gateway.upstream import UpstreamPool
from servescope.store import Store
from servescope.wire import tracing
from servescope.wire.stream import CHAT, COMPLETIONS, Endpoint

log = logging.getLogger("servescope.gateway")


class Gateway:
    """State shared by all requests: the config (swapped whole on reload), the scheduler, the
    router, upstream health, the upstream connection pools, the event log and the metrics."""

    def __init__(
        self, config: GatewayConfig, config_path: Path | None = None, store: Store | None = None
    ) -> None:
        self.config = config
        self.router = Router()
        self.upstream_health = UpstreamHealth()
        self.metrics = GatewayMetrics()
        # a reload that changes a routing policy writes its lever flip into `store`
        self.reloader = Reloader(config_path, store, self.metrics.reloads)
        self.scheduler = Scheduler(config.teams, _caps(config))
        self.events = EventLog(config.events_dir)
        self.pools: dict[str, UpstreamPool] = {}  # by URL, so they outlive reloads
        self.session: aiohttp.ClientSession | None = None
        self.tokens: TokenCounter | None = None
        self._prober: asyncio.Task[None] | None = None
        self._boot_run = f"run-{datetime.now(UTC).strftime('%Y%m%d')}-gateway"
        self.tracer = tracing.tracer_from_env("servescope-gateway")  # a span per request
        self._wire_gauges()

    def _wire_gauges(self) -> None:
        metrics, scheduler = self.metrics, self.scheduler
        for name, team in self.config.teams.items():
            metrics.queue_depth.labels(name).set_function(partial(scheduler.queue_depth, name))
            if team.token_budget is not None:
                metrics.budget_used.labels(name).set_function(
                    scheduler.teams[name].budget_used_ratio
                )
        for name in self.config.upstreams:
            metrics.inflight.labels(name).set_function(partial(scheduler.running_on, name))
            metrics.upstream_up.labels(name).set_function(partial(self.upstream_health.up, name))

    # --- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.tokens = TokenCounter(self.session)
        self._prober = asyncio.create_task(
            self.upstream_health.probe_pools(self.session, lambda: self.config)
        )

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
        self.reloader.flush()

    def reload(self) -> bool:
        """Re-read gateway.yaml (SIGHUP); see `gateway.reload`."""
        return self.reloader.reload(self.config, self._apply)

    def _apply(self, config: GatewayConfig) -> None:
        if config.events_dir != self.config.events_dir:
            self.events.close()
            self.events = EventLog(config.events_dir)
        self.config = config
        self.scheduler.configure(config.teams, _caps(config))
        self._wire_gauges()

    # --- routing ----------------------------------------------------------------------------

    def candidates(self, model: str) -> list[Upstream]:
        """The route's pool then its fallback, usable ones first (calls that hold no KV cache,
        like `/tokenize`, need no routing decision)."""
        route = self.config.routes[model]
        names = (*route.pool, route.fallback) if route.fallback else route.pool
        ups = [self.config.upstreams[n] for n in names]
        if len(ups) == 1:  # one candidate: nothing to order
            return ups
        usable = self.upstream_health.usable_now()
        return sorted(ups, key=lambda u: not usable(u.name))

    def plan(self, route: Route, body: dict[str, Any], chat: bool) -> list[Pick]:
        """The routing decision: the upstreams to try, in order, each with its reason."""
        if len(route.pool) == 1 and route.fallback is None:
            return [Pick(route.pool[0], "only")]
        return self.router.plan(route, body, chat, self.upstream_health.usable_now())

    def _pool(self, url: str) -> UpstreamPool:
        if (pool := self.pools.get(url)) is None:
            pool = self.pools[url] = UpstreamPool(url)
        return pool

    # --- the OpenAI routes ------------------------------------------------------------------

    async def completions(self, request: Request, reply: Reply) -> Response | Reply:
        return await self._serve(request, reply, COMPLETIONS)

    async def chat_completions(self, request: Request, reply: Reply) -> Response | Reply:
        return await self._serve(request, reply, CHAT)

    async def _serve(self, request: Request, reply: Reply, endpoint: Endpoint) -> Response | Reply:
        ctx = RequestContext.arrive(request, endpoint, self._boot_run, self.tracer)
        response: Response | Reply | None = None
        try:
            await self._admit(ctx, request)
            response = await self._proxy(ctx, request, reply)
        except Rejected as rej:
            response = ctx.reject(rej)
        except ClientGone as exc:
            ctx.gone(str(exc))
        except asyncio.CancelledError:  # the client closed the connection
            ctx.gone("client closed the connection")
            raise
        except Exception as exc:  # a bug must still answer and leave its event
            log.exception("request %s failed inside the gateway", ctx.request_id)
            response = ctx.crash(exc)
        finally:
            self._finish(ctx)
        return ctx.answer(response)

    async def _admit(self, ctx: RequestContext, request: Request) -> None:
        """Who asks for what, where it will go, and a slot for it: raises `Rejected` at the
        first rule it breaks. The config read at arrival serves the whole request."""
        config = self.config
        event = ctx.event
        team = ctx.team = config.team_for_key(api_key(request))
        if team is None:
            raise Rejected("unknown_key", "missing or unknown API key")
        event["team"] = team.name
        body = ctx.body = read_body(request)
        model = body.get("model")
        if not isinstance(model, str) or model not in config.routes:
            raise Rejected(
                "unknown_model", f"unknown model {model!r}; served: {sorted(config.routes)}"
            )
        event["model"] = model
        if team.models is not None and model not in team.models:
            raise Rejected("model_not_allowed", f"team {team.name!r} may not use {model!r}")
        event["stream"] = bool(body.get("stream"))
        route = ctx.route = config.routes[model]
        picks = ctx.picks = self.plan(route, body, ctx.endpoint.chat)
        if len(route.pool) > 1:
            event["routing"] = route.routing
        ctx.held = picks[0].upstream  # counted against it in the router from now on
        self.router.hold(ctx.held)
        ctx.upstreams = [config.upstreams[p.upstream] for p in picks]
        since_ns = time.time_ns() if ctx.span is not None else 0
        prompt_tokens = await self._prompt_tokens(team, ctx.upstreams, body, ctx.endpoint)
        slot = ctx.slot = await self.scheduler.admit(
            team.name, ctx.upstreams[0].name, prompt_tokens=prompt_tokens
        )
        event["queue_ms"] = slot.queue_ms
        if ctx.span is not None:
            ctx.span.admitted(model, team.name, slot.queue_ms, since_ns)

    async def _prompt_tokens(
        self, team: Team, upstreams: Sequence[Upstream], body: dict[str, Any], endpoint: Endpoint
    ) -> int:
        """The prompt's length as the first upstream that answers counts it; 0 for a team with
        no rule on it, which then pays for no count."""
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

    async def _proxy(self, ctx: RequestContext, request: Request, reply: Reply) -> Response | Reply:
        """The plan's upstreams in turn until one answers: one that fails before sending a byte
        is replaced by the next, on the same slot. When all fail, the client gets the last
        failure (a refused connection everywhere is `upstream_unavailable`)."""
        assert ctx.slot is not None and ctx.route is not None and ctx.body is not None
        headers = ctx.upstream_headers(request)
        as_sent = _unchanged_body(request, ctx.body)
        failure: UpstreamFailed | None = None
        for i, pick in enumerate(ctx.picks):
            upstream = ctx.upstreams[i]
            if i > 0:  # the request now counts against this upstream, not the last one
                ctx.slot.move_to(upstream.name)
                if ctx.held is not None:
                    self.router.let_go(ctx.held)
                ctx.held = upstream.name
                self.router.hold(upstream.name)
            ctx.routed(pick)
            self.metrics.route(ctx.route.model, upstream.name, pick.reason)
            attempt = self._attempt(ctx, reply, upstream, headers, as_sent)
            try:
                response = await forward(attempt, ctx.event)
            except UpstreamFailed as exc:
                failure = exc
                if exc.kind in ("connect", "disconnect"):  # gone, not merely busy
                    self.upstream_health.mark_down(upstream.name)
                ctx.event.setdefault("failed_upstreams", []).append(f"{upstream.name}:{exc.kind}")
                log.warning(
                    "upstream %s failed for %s: %s", upstream.name, ctx.request_id, exc.detail
                )
                continue
            if ctx.event.get("error") == "disconnect" and str(
                ctx.event.get("error_detail", "")
            ).startswith("upstream"):  # it dropped a stream it had started: go elsewhere at once
                self.upstream_health.mark_down(upstream.name)
            return response
        assert failure is not None
        if failure.kind == "connect":
            raise Rejected(
                "upstream_unavailable",
                f"no upstream of {ctx.route.model!r} accepted the connection",
                retry_after_s=DOWN_FOR_S,
            )
        return ctx.upstream_failed(failure)

    def _attempt(
        self,
        ctx: RequestContext,
        reply: Reply,
        upstream: Upstream,
        headers: dict[str, str],
        as_sent: bytes | None,
    ) -> Attempt:
        """One try of the request on `upstream`, under the team's phase timeouts."""
        assert ctx.team is not None and ctx.body is not None
        body = ctx.body
        model = body["model"]
        served = upstream.model or model
        if as_sent is not None and served == model:
            payload = as_sent
        else:
            payload = json.dumps({**body, "model": served}).encode()
        return Attempt(
            reply=reply,
            pool=self._pool(upstream.url),
            endpoint=ctx.endpoint,
            body=payload,
            headers=headers,
            stream=bool(body.get("stream")),
            timing=RelayTiming(ctx.endpoint, ctx.start),
            prefill_timeout_s=ctx.team.prefill_timeout_s,
            decode_timeout_s=ctx.team.decode_timeout_s,
            route_headers=ctx.route_headers(),
        )

    def _finish(self, ctx: RequestContext) -> None:
        """Whatever the outcome: the slot charged and released, the router let go, the event
        written, counted and put on the span."""
        event, slot = ctx.event, ctx.slot
        if slot is not None:
            if event.get("status") == "ok" and slot.team.team.token_budget:
                slot.charge(
                    (event.get("prompt_tokens") or 0) + (event.get("completion_tokens") or 0)
                )
            slot.release()
        if ctx.held is not None:
            self.router.let_go(ctx.held)
        self.events.write(event)
        self.metrics.observe(event)
        if ctx.span is not None:
            ctx.span.end(event)

    # --- the other routes -------------------------------------------------------------------

    async def models(self, _request: Request, _reply: Reply) -> Response:
        data = [
            {"id": m, "object": "model", "owned_by": "servescope-gateway"}
            for m in sorted(self.config.routes)
        ]
        return json_response({"object": "list", "data": data})

    async def passthrough(self, request: Request, _reply: Reply) -> Response:
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
            error_body("no upstream reachable", "upstream_error", 503),
            503,
            {"Retry-After": str(int(DOWN_FOR_S))},
        )

    async def health(self, _request: Request, _reply: Reply) -> Response:
        ups = self.upstream_health.states(self.config.upstreams)
        return json_response({"status": "ok", "upstreams": ups})

    async def prometheus(self, _request: Request, _reply: Reply) -> Response:
        return Response(
            200, generate_latest(self.metrics.registry), {"Content-Type": CONTENT_TYPE_LATEST}
        )


def _caps(config: GatewayConfig) -> dict[str, int]:
    return {name: u.max_concurrent for name, u in config.upstreams.items()}


def _unchanged_body(request: Request, body: dict[str, Any]) -> bytes | None:
    """The client's bytes when they can go upstream as they came; None when the body must be
    re-encoded: a stream that does not ask for usage gets `include_usage` added (in `body`),
    since the gateway needs usage for TPOT and token budgets."""
    if not body.get("stream"):
        return request.body
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return request.body
    body["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return None


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
    # Garbage collection is a large share of the CPU per proxied request, and its full passes
    # pause the loop: what start-up built (modules, config, metrics) is frozen out of every
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
