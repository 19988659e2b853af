"""One proxied request, from its arrival to its event.

`RequestContext` holds what the gateway learns about a request as it goes through it: its
team, its route and the upstreams planned for it, its admission slot, the replica it counts
against in the router, its span, and the event being built from all of that. The event stays a
plain dict: it is written as one JSON line, and the relay (`proxy.forward`, `timing`) adds
what it measured. The outcome methods (`reject`, `gone`, `crash`, `upstream_failed`) set the
event's status fields and build the client's answer together, so the two never disagree.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Tracer

from servescope.gateway.admission import Rejected, Slot
from servescope.gateway.config import Route, Team, Upstream
from servescope.gateway.httpserver import Reply, Request, Response, json_response
from servescope.gateway.proxy import UpstreamFailed
from servescope.gateway.routing import Pick
from servescope.gateway.spans import RequestSpan
from servescope.store.clock import utc_now_iso
from servescope.wire import tracing
from servescope.wire.stream import Endpoint

MAX_REQUEST_ID = 200
PASSED_HEADERS = ("traceparent", "tracestate")  # the client's trace, when the gateway has none


@dataclass(slots=True, eq=False)
class RequestContext:
    """What one request carries between the gateway's steps (see the module docstring)."""

    endpoint: Endpoint
    start: float  # `perf_counter` at arrival: the origin of TTFT and e2e
    request_id: str
    event: dict[str, Any]  # the event being built, written once when the request ends
    span: RequestSpan | None = None
    team: Team | None = None
    route: Route | None = None
    body: dict[str, Any] | None = None
    picks: Sequence[Pick] = ()  # the routing plan, in order of trial
    upstreams: Sequence[Upstream] = ()  # the picks' upstreams
    slot: Slot | None = None
    held: str | None = None  # the replica this request counts against in the router

    @classmethod
    def arrive(
        cls, request: Request, endpoint: Endpoint, run_id: str, tracer: Tracer | None
    ) -> RequestContext:
        """The context of a request that just arrived: its id (the client's `X-Request-Id`, or
        one of ours in the gateway's own run `run_id`), its start and its span."""
        start = time.perf_counter()
        given = request.headers.get("x-request-id", "")[:MAX_REQUEST_ID]
        rid = given or f"gw-{uuid.uuid4().hex}"
        event: dict[str, Any] = {"request_id": rid, "ts": utc_now_iso(), "source": "gateway"}
        if not given:
            event["run_id"] = run_id
        ctx = cls(endpoint, start, rid, event)
        if tracer is not None:
            ctx.span = RequestSpan(tracer, request.headers, endpoint, rid)
            event["trace_id"] = ctx.span.trace_id
        elif "traceparent" in request.headers and (
            trace_id := tracing.trace_id_from_headers(request.headers)
        ):  # untraced clients skip the propagator's work
            event["trace_id"] = trace_id
        return ctx

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000.0

    def upstream_headers(self, request: Request) -> dict[str, str]:
        """What goes upstream besides the body: the request's id and the trace it belongs to
        (the gateway's span when traced, else the client's)."""
        headers = {"Content-Type": "application/json", "X-Request-Id": self.request_id}
        for name in PASSED_HEADERS:
            if value := request.headers.get(name):
                headers[name] = value
        if self.span is not None:
            headers.update(self.span.headers)
        return headers

    def routed(self, pick: Pick) -> None:
        """The attempt about to go to `pick.upstream`."""
        if pick.reason in ("retry", "fallback"):  # not the policy's first choice
            self.event["fallback"] = True
        self.event["upstream"] = pick.upstream
        self.event["route_reason"] = pick.reason

    def route_headers(self) -> dict[str, str]:
        """Which upstream served the response and why, for the client: a load generator behind
        the gateway records them in its own events (the replica of each request, per-replica
        reports)."""
        return {
            "X-Servescope-Upstream": self.event["upstream"],
            "X-Servescope-Route": self.event.get("route_reason", "only"),
        }

    def answer(self, response: Response | Reply | None) -> Response | Reply:
        """The response as the client gets it, carrying the request's id and its route."""
        if response is None:  # the client is gone; nothing left to say to it
            response = Response(499, b"")
        if isinstance(response, Response):
            response.headers["X-Request-Id"] = self.request_id
            if "upstream" in self.event:
                response.headers.update(self.route_headers())
        return response

    # --- outcomes other than the relay's own ----------------------------------------------

    def reject(self, rej: Rejected) -> Response:
        self._end("rejected", f"rejected:{rej.reason}", rej.message, rej.http_status)
        self.event.setdefault("team", "unknown")
        headers = {}
        if rej.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(rej.retry_after_s)))
        return json_response(
            error_body(rej.message, "admission_rejected", rej.reason), rej.http_status, headers
        )

    def gone(self, detail: str) -> None:
        """The client left; its event says so unless its answer was already complete."""
        if "status" in self.event:
            return
        self.event.update(
            status="error",
            error="disconnect",
            finish_reason="abort",
            error_detail=f"client: {detail}",
        )
        self.event["e2e_ms"] = self.elapsed_ms()
        self.event.setdefault("team", "unknown")

    def crash(self, exc: Exception) -> Response:
        """A bug of the gateway's: the request still gets an answer and leaves its event."""
        self.event.update(
            status="error",
            error="http_5xx",
            finish_reason="error",
            error_detail=f"gateway: {exc!r}",
            http_status=500,
        )
        return json_response(error_body("internal gateway error", "internal", 500), 500)

    def upstream_failed(self, failure: UpstreamFailed) -> Response:
        """Every upstream of the plan failed before sending a byte; `failure` was the last."""
        code = failure.http_status or 502
        self._end("error", failure.kind, failure.detail, code)
        return json_response(
            error_body(f"upstream failed: {failure.detail}", "upstream_error", code), code
        )

    def _end(self, status: str, error: str, detail: str, http_status: int) -> None:
        self.event.update(
            status=status,
            error=error,
            finish_reason="error",
            error_detail=detail,
            http_status=http_status,
        )
        self.event["e2e_ms"] = self.elapsed_ms()


def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, or a `bad_request` rejection."""
    try:
        body = json.loads(request.body)
    except ValueError as exc:
        raise Rejected("bad_request", f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Rejected("bad_request", "request body must be a JSON object")
    return body


def api_key(request: Request) -> str | None:
    """The key a client sent: `Authorization: Bearer …`, else `X-Api-Key`."""
    header = request.headers.get("authorization", "")
    key = header[7:].strip() if header[:7].lower() == "bearer " else None
    return key or request.headers.get("x-api-key")


def error_body(message: str, kind: str, code: str | int) -> dict[str, Any]:
    """An error in OpenAI's shape, which clients of vLLM already parse."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
