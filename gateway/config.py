"""`gateway.yaml`: teams, upstreams and model routes, validated into frozen objects.

```yaml
listen: {host: 127.0.0.1, port: 8080}
events_dir: servescope-data/events
upstreams:
  main:  {url: http://127.0.0.1:8000, model: tiny, max_concurrent: 32}
  small: {url: http://127.0.0.1:8001, model: tiny-small, max_concurrent: 8}
  r1:    {url: http://127.0.0.1:8011, model: tiny}
  r2:    {url: http://127.0.0.1:8012, model: tiny}
models:                       # the names clients send → upstream (+ fallback on failure)
  tiny: {upstream: main, fallback: small}
  tiny-fleet:                 # or a pool of replicas and a routing policy (gateway/routing.py)
    pool: [r1, r2]
    routing: prefix-affinity  # round-robin (default) | least-outstanding | prefix-affinity
    prefix_chars: 256         # prefix-affinity: a completions prompt's leading characters hashed
    load_factor: 1.25         # prefix-affinity: no replica above 1.25 × the mean outstanding
    fallback: small
defaults:                     # any team field; teams override
  max_concurrent: 4
  max_queue: 16
teams:
  demo:
    key_sha256: [9f86d0…]     # or `keys: [sk-…]` (hashed at load, the plain key is not kept)
    priority: 10              # strict: a higher class is always served first
    weight: 1                 # weighted fair share among teams of the same priority
    max_concurrent: 8
    max_queue: 32
    queue_timeout_s: 30
    max_prompt_tokens: 2048   # counted with the upstream's /tokenize (cached)
    token_budget: {tokens: 200000, window_s: 60}   # prompt + completion per window
    prefill_timeout_s: 30     # no first token in time → timeout (phase prefill)
    decode_timeout_s: 300     # first token → end of stream longer than this → timeout (decode)
```

Plain keys only ever exist here, long enough to be hashed: the gateway keeps SHA-256 digests
and compares digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from servescope.wire.routing import ROUTING_POLICIES

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_EVENTS_DIR = Path("servescope-data") / "events"


class ConfigError(ValueError):
    """A gateway.yaml that cannot be served; the message names the field and why."""


def key_digest(key: str) -> str:
    """The stored form of an API key: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TokenBudget:
    tokens: int
    window_s: float


@dataclass(frozen=True)
class Team:
    name: str
    key_digests: tuple[str, ...]
    priority: int = 0
    weight: float = 1.0
    max_concurrent: int = 4
    max_queue: int = 16
    queue_timeout_s: float = 30.0
    max_prompt_tokens: int | None = None
    token_budget: TokenBudget | None = None
    prefill_timeout_s: float | None = None
    decode_timeout_s: float | None = None
    models: tuple[str, ...] | None = None  # allowed model names; None = all


@dataclass(frozen=True)
class Upstream:
    name: str
    url: str
    model: str | None = None  # served name there; None = the name the client sent
    max_concurrent: int = 64


DEFAULT_ROUTING = "round-robin"
DEFAULT_PREFIX_CHARS = 256
DEFAULT_LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class Route:
    """A model's upstreams: a pool of replicas (one, in the plain `upstream:` form), the policy
    that picks one per request, and a fallback tried when the pool fails before any byte."""

    model: str
    pool: tuple[str, ...]
    fallback: str | None = None
    routing: str = DEFAULT_ROUTING
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    load_factor: float = DEFAULT_LOAD_FACTOR

    @property
    def upstream(self) -> str:
        """The pool's first replica (a plain route's one upstream)."""
        return self.pool[0]


@dataclass(frozen=True)
class GatewayConfig:
    upstreams: dict[str, Upstream]
    routes: dict[str, Route]
    teams: dict[str, Team]
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    events_dir: Path = DEFAULT_EVENTS_DIR
    source: str = "gateway.yaml"
    _digests: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def team_for_key(self, key: str | None) -> Team | None:
        """The team owning `key`, comparing digests in constant time against every stored one."""
        if not key:
            return None
        digest = key_digest(key)
        found: str | None = None
        for stored, team in self._digests:
            if hmac.compare_digest(stored, digest):
                found = team
        return self.teams[found] if found else None


TEAM_FIELDS = {f.name for f in fields(Team)} - {"name", "key_digests"} | {"keys", "key_sha256"}


def _number(value: Any, where: str, *, integer: bool = False, minimum: float = 0) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where} must be {kind} ≥ {minimum}, got {value!r}")
    return value


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _team(name: str, raw: dict[str, Any], defaults: dict[str, Any], source: str) -> Team:
    where = f"{source}: teams.{name}"
    merged = {**defaults, **_mapping(raw, where)}
    if unknown := sorted(set(merged) - TEAM_FIELDS):
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(TEAM_FIELDS)}")
    digests = [key_digest(str(k)) for k in merged.pop("keys", None) or []]
    for d in merged.pop("key_sha256", None) or []:
        d = str(d).lower()
        if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
            raise ConfigError(f"{where}: key_sha256 entries must be 64 hex digits")
        digests.append(d)
    if not digests:
        raise ConfigError(f"{where}: needs `keys` or `key_sha256`")
    kwargs: dict[str, Any] = {}
    for key in ("max_concurrent", "max_queue", "max_prompt_tokens", "priority"):
        if merged.get(key) is not None:
            minimum = {"max_concurrent": 1, "max_prompt_tokens": 1}.get(key, 0)
            if key == "priority":
                minimum = -(10**9)
            kwargs[key] = _number(merged[key], f"{where}.{key}", integer=True, minimum=minimum)
    for key in ("queue_timeout_s", "prefill_timeout_s", "decode_timeout_s"):
        if merged.get(key) is not None:
            kwargs[key] = float(_number(merged[key], f"{where}.{key}", minimum=0.001))
    if merged.get("weight") is not None:
        kwargs["weight"] = float(_number(merged["weight"], f"{where}.weight", minimum=0.001))
    if (budget := merged.get("token_budget")) is not None:
        budget = _mapping(budget, f"{where}.token_budget")
        kwargs["token_budget"] = TokenBudget(
            tokens=_number(budget.get("tokens"), f"{where}.token_budget.tokens", integer=True),
            window_s=float(
                _number(budget.get("window_s", 60), f"{where}.token_budget.window_s", minimum=1)
            ),
        )
    if (models := merged.get("models")) is not None:
        if not isinstance(models, list):
            raise ConfigError(f"{where}.models must be a list of model names")
        kwargs["models"] = tuple(str(m) for m in models)
    return Team(name=name, key_digests=tuple(digests), **kwargs)


ROUTE_FIELDS = ("upstream", "pool", "fallback", "routing", "prefix_chars", "load_factor")


def _route(model: str, raw: Any, upstreams: dict[str, Upstream], source: str) -> Route:
    where = f"{source}: models.{model}"
    raw = _mapping(raw, where)
    if unknown := sorted(set(raw) - set(ROUTE_FIELDS)):
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {list(ROUTE_FIELDS)}")
    if (raw.get("upstream") is None) == (raw.get("pool") is None):
        raise ConfigError(f"{where} needs either `upstream` or `pool` (a list of upstreams)")
    pool = raw.get("pool")
    if pool is None:
        pool = [raw["upstream"]]
    elif not isinstance(pool, list) or not pool:
        raise ConfigError(f"{where}.pool must be a non-empty list of upstream names")
    names = [str(n) for n in pool]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.pool names an upstream twice: {names}")
    fallback = raw.get("fallback")
    for key, name in [*(("pool" if len(names) > 1 else "upstream", n) for n in names),
                      ("fallback", fallback)]:  # fmt: skip
        if name is not None and str(name) not in upstreams:
            raise ConfigError(
                f"{where}.{key} {name!r} is not an upstream (known: {sorted(upstreams)})"
            )
    if fallback is not None and str(fallback) in names:
        raise ConfigError(f"{where}.fallback {fallback!r} is already in the pool")
    routing = raw.get("routing", DEFAULT_ROUTING)
    if routing not in ROUTING_POLICIES:
        raise ConfigError(
            f"{where}.routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}"
        )
    return Route(
        model=model,
        pool=tuple(names),
        fallback=str(fallback) if fallback is not None else None,
        routing=routing,
        prefix_chars=_number(
            raw.get("prefix_chars", DEFAULT_PREFIX_CHARS),
            f"{where}.prefix_chars",
            integer=True,
            minimum=1,
        ),
        load_factor=float(
            _number(raw.get("load_factor", DEFAULT_LOAD_FACTOR), f"{where}.load_factor", minimum=1)
        ),
    )


def parse_config(data: Any, *, source: str = "gateway.yaml") -> GatewayConfig:
    """Validate a loaded YAML document; every problem is a `ConfigError` naming the field."""
    data = _mapping(data, source)
    known = {"listen", "events_dir", "upstreams", "models", "defaults", "teams"}
    if unknown := sorted(set(data) - known):
        raise ConfigError(f"{source}: unknown top-level keys {unknown}; known: {sorted(known)}")
    upstreams: dict[str, Upstream] = {}
    for name, raw in _mapping(data.get("upstreams"), f"{source}: upstreams").items():
        raw = _mapping(raw, f"{source}: upstreams.{name}")
        url = raw.get("url")
        if not isinstance(url, str) or not url.startswith("http://"):
            raise ConfigError(
                f"{source}: upstreams.{name}.url must be an http:// URL (vLLM sits on a private "
                "network behind the gateway; TLS terminates in front of it)"
            )
        upstreams[str(name)] = Upstream(
            name=str(name),
            url=url.rstrip("/"),
            model=str(raw["model"]) if raw.get("model") else None,
            max_concurrent=_number(
                raw.get("max_concurrent", 64),
                f"{source}: upstreams.{name}.max_concurrent",
                integer=True,
                minimum=1,
            ),
        )
    if not upstreams:
        raise ConfigError(f"{source}: needs at least one upstream")
    routes: dict[str, Route] = {}
    raw_models = data.get("models")
    if raw_models is None:  # one route per upstream, by its served name
        raw_models = {u.model or u.name: {"upstream": u.name} for u in upstreams.values()}
    for model, raw in _mapping(raw_models, f"{source}: models").items():
        routes[str(model)] = _route(str(model), raw, upstreams, source)
    defaults = _mapping(data.get("defaults") or {}, f"{source}: defaults")
    teams = {
        str(name): _team(str(name), raw, defaults, source)
        for name, raw in _mapping(data.get("teams"), f"{source}: teams").items()
    }
    if not teams:
        raise ConfigError(f"{source}: needs at least one team")
    owners: dict[str, str] = {}
    for team in teams.values():
        for digest in team.key_digests:
            if owners.setdefault(digest, team.name) != team.name:
                raise ConfigError(
                    f"{source}: one key is shared by teams {owners[digest]!r} and {team.name!r}"
                )
    listen = _mapping(data.get("listen") or {}, f"{source}: listen")
    return GatewayConfig(
        upstreams=upstreams,
        routes=routes,
        teams=teams,
        host=str(listen.get("host", DEFAULT_HOST)),
        port=_number(listen.get("port", DEFAULT_PORT), f"{source}: listen.port", integer=True),
        events_dir=Path(data.get("events_dir") or DEFAULT_EVENTS_DIR),
        source=source,
        _digests=tuple(sorted(owners.items())),
    )


def load_config(path: Path) -> GatewayConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return parse_config(data, source=str(path))
