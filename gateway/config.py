"""`gateway.yaml`: teams, upstreams and model routes, validated into frozen objects.

```yaml
listen: {host: 127.0.0.1, port: 8080}
events_dir: servescope-data/events   # default: events/ in the data folder (store.settings)
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

The file is checked once, at this boundary, by converting it into the typed structures below
(msgspec): types, ranges and unknown keys come from the declarations, and only the rules that
span several fields (a route's upstreams exist, a key belongs to one team) are written out. Each
entry of `upstreams`, `models` and `teams` is converted on its own, because msgspec writes a
mapping's key as `[...]` in its paths, and an error must name the entry (store/typed.py):
`gateway.yaml: teams.demo.max_queue: expected an integer ≥ 0, got -1`.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import yaml
from msgspec import Meta, Struct

from servescope.store import settings
from servescope.store.typed import shown, typed
from servescope.wire.routing import ROUTING_POLICIES

DEFAULT_ROUTING = "round-robin"
DEFAULT_PREFIX_CHARS = 256
DEFAULT_LOAD_FACTOR = 1.25

Count = Annotated[int, Meta(ge=0)]
AtLeastOne = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(ge=0.001)]
Share = Annotated[float, Meta(ge=0.001)]
Digest = Annotated[str, Meta(pattern="^[0-9a-fA-F]{64}$", description="a string of 64 hex digits")]
Names = Annotated[tuple[str, ...], Meta(min_length=1)]


class ConfigError(ValueError):
    """A gateway.yaml that cannot be served; the message names the field and why."""


def key_digest(key: str) -> str:
    """The stored form of an API key: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


class TokenBudget(Struct, frozen=True, forbid_unknown_fields=True):
    """Prompt + completion tokens a team may use per window."""

    tokens: Count
    window_s: Annotated[float, Meta(ge=1)] = 60.0


class TeamLimits(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A team's admission rules: the fields `defaults` and each team may set."""

    priority: Annotated[int, Meta(ge=-(10**9))] = 0
    weight: Share = 1.0
    max_concurrent: AtLeastOne = 4
    max_queue: Count = 16
    queue_timeout_s: Seconds = 30.0
    max_prompt_tokens: AtLeastOne | None = None
    token_budget: TokenBudget | None = None
    prefill_timeout_s: Seconds | None = None
    decode_timeout_s: Seconds | None = None
    models: tuple[str, ...] | None = None  # allowed model names; None = all


class TeamEntry(TeamLimits, frozen=True, kw_only=True):
    """A team as gateway.yaml writes it (its defaults merged in), plain keys included."""

    keys: tuple[str, ...] = ()
    key_sha256: tuple[Digest, ...] = ()


class Team(TeamLimits, frozen=True, kw_only=True):
    """A team as the gateway keeps it: its limits and the digests of its keys, never a key."""

    name: str
    key_digests: tuple[str, ...]


class Upstream(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str  # the entry's name in `upstreams`
    url: str
    model: str | None = None  # served name there; None = the name the client sent
    max_concurrent: AtLeastOne = 64


class RoutePolicy(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a model's pool is used: the fields a route shares with its gateway.yaml entry."""

    fallback: str | None = None
    routing: str = DEFAULT_ROUTING
    prefix_chars: AtLeastOne = DEFAULT_PREFIX_CHARS
    load_factor: Annotated[float, Meta(ge=1)] = DEFAULT_LOAD_FACTOR


class RouteEntry(RoutePolicy, frozen=True, kw_only=True):
    """A route as gateway.yaml writes it: one `upstream`, or a `pool` of replicas."""

    upstream: str | None = None
    pool: Names | None = None


class Route(RoutePolicy, frozen=True):
    """A model's upstreams: a pool of replicas (one, in the plain `upstream:` form), the policy
    that picks one per request, and a fallback tried when the pool fails before any byte."""

    model: str
    pool: tuple[str, ...]

    @property
    def upstream(self) -> str:
        """The pool's first replica (a plain route's one upstream)."""
        return self.pool[0]


class Listen(Struct, frozen=True, forbid_unknown_fields=True):
    host: str = settings.HOST
    port: Count = settings.GATEWAY_PORT


class GatewayFile(Struct, frozen=True, forbid_unknown_fields=True):
    """gateway.yaml's top level. The named entries stay raw here: each is converted on its
    own, so that an error can name it (see the module docstring)."""

    upstreams: Annotated[dict[Any, Any], Meta(min_length=1)]
    teams: Annotated[dict[Any, Any], Meta(min_length=1)]
    models: dict[Any, Any] | None = None
    defaults: dict[Any, Any] | None = None
    listen: Listen | None = None
    events_dir: str | None = None


class GatewayConfig(Struct, frozen=True, kw_only=True):
    upstreams: dict[str, Upstream]
    routes: dict[str, Route]
    teams: dict[str, Team]
    host: str = settings.HOST
    port: int = settings.GATEWAY_PORT
    events_dir: Path = msgspec.field(default_factory=settings.events_dir)
    source: str = "gateway.yaml"
    digests: tuple[tuple[str, str], ...] = ()  # (key digest, team), sorted

    def team_for_key(self, key: str | None) -> Team | None:
        """The team owning `key`, comparing digests in constant time against every stored one."""
        if not key:
            return None
        digest = key_digest(key)
        found: str | None = None
        for stored, team in self.digests:
            if hmac.compare_digest(stored, digest):
                found = team
        return self.teams[found] if found else None


S = TypeVar("S", bound=Struct)


def parse_config(data: Any, *, source: str = "gateway.yaml") -> GatewayConfig:
    """Validate a loaded YAML document; every problem is a `ConfigError` naming the field."""
    doc = _convert(data, GatewayFile, source, "")
    upstreams = {
        name: _upstream(name, raw, source)
        for name, raw in _named(doc.upstreams, source, "upstreams")
    }
    raw_models = doc.models
    if raw_models is None:  # one route per upstream, by its served name
        raw_models = {u.model or u.name: {"upstream": u.name} for u in upstreams.values()}
    routes = {
        model: _route(model, raw, upstreams, source)
        for model, raw in _named(raw_models, source, "models")
    }
    defaults = doc.defaults or {}
    teams = {
        name: _team(name, raw, defaults, source) for name, raw in _named(doc.teams, source, "teams")
    }
    owners: dict[str, str] = {}
    for team in teams.values():
        for digest in team.key_digests:
            if owners.setdefault(digest, team.name) != team.name:
                raise ConfigError(
                    f"{source}: one key is shared by teams {owners[digest]!r} and {team.name!r}"
                )
    listen = doc.listen or Listen()
    return GatewayConfig(
        upstreams=upstreams,
        routes=routes,
        teams=teams,
        host=listen.host,
        port=listen.port,
        events_dir=Path(doc.events_dir or settings.events_dir()),
        source=source,
        digests=tuple(sorted(owners.items())),
    )


def load_config(path: Path) -> GatewayConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return parse_config(data, source=str(path))


def _upstream(name: str, raw: Any, source: str) -> Upstream:
    where = f"upstreams.{name}"
    upstream = _convert({**_mapping(raw, source, where), "name": name}, Upstream, source, where)
    if not upstream.url.startswith("http://"):
        raise ConfigError(
            f"{source}: {where}.url must be an http:// URL (vLLM sits on a private network "
            "behind the gateway; TLS terminates in front of it)"
        )
    return msgspec.structs.replace(
        upstream, url=upstream.url.rstrip("/"), model=upstream.model or None
    )


def _route(model: str, raw: Any, upstreams: dict[str, Upstream], source: str) -> Route:
    where = f"models.{model}"
    entry = _convert(raw, RouteEntry, source, where)
    if (entry.upstream is None) == (entry.pool is None):
        raise ConfigError(
            f"{source}: {where} needs either `upstream` or `pool` (a list of upstreams)"
        )
    names = entry.pool or (str(entry.upstream),)
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: {where}.pool names an upstream twice: {list(names)}")
    field = "pool" if entry.pool is not None else "upstream"
    for key, name in [*((field, n) for n in names), ("fallback", entry.fallback)]:
        if name is not None and name not in upstreams:
            raise ConfigError(
                f"{source}: {where}.{key} {name!r} is not an upstream (known: {sorted(upstreams)})"
            )
    if entry.fallback is not None and entry.fallback in names:
        raise ConfigError(f"{source}: {where}.fallback {entry.fallback!r} is already in the pool")
    if entry.routing not in ROUTING_POLICIES:
        raise ConfigError(
            f"{source}: {where}.routing must be one of {', '.join(ROUTING_POLICIES)}, "
            f"got {entry.routing!r}"
        )
    policy = {f: getattr(entry, f) for f in RoutePolicy.__struct_fields__}
    return Route(model, names, **policy)


def _team(name: str, raw: Any, defaults: dict[Any, Any], source: str) -> Team:
    where = f"teams.{name}"
    merged = {**defaults, **_mapping(raw, source, where)}
    entry = _convert(
        {k: v for k, v in merged.items() if v is not None}, TeamEntry, source, where
    )  # a key set to null is a key left out, as in the defaults
    digests = (
        *(key_digest(k) for k in entry.keys),
        *(d.lower() for d in entry.key_sha256),
    )
    if not digests:
        raise ConfigError(f"{source}: {where} needs `keys` or `key_sha256`")
    limits = {f: getattr(entry, f) for f in TeamLimits.__struct_fields__}
    return Team(name=name, key_digests=digests, **limits)


def _named(raw: dict[Any, Any], source: str, where: str) -> list[tuple[str, Any]]:
    """A mapping's entries, named as strings (YAML may give a name as a number)."""
    return [(str(name), value) for name, value in _mapping(raw, source, where).items()]


def _mapping(raw: Any, source: str, where: str) -> dict[Any, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where}: expected a mapping, got {shown(raw)}")
    return raw


def _convert(raw: Any, kind: type[S], source: str, where: str) -> S:
    """`raw` as `kind`, or a `ConfigError` that says where and what, in the file's terms."""
    return typed(raw, kind, source, error=ConfigError, at=where.split(".", 1) if where else ())
