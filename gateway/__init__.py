"""The admission-control gateway: an OpenAI-compatible proxy in front of one or more vLLM
servers, with per-team queues, token budgets, priorities, timeouts and fallback, writing one
event per request. `gateway.server.Gateway` + `gateway.server.serve` run it; `servescope gateway`
is the command."""

from servescope.gateway.config import ConfigError, GatewayConfig, load_config, parse_config
from servescope.gateway.server import Gateway, build_server, serve

__all__ = [
    "ConfigError",
    "Gateway",
    "GatewayConfig",
    "build_server",
    "load_config",
    "parse_config",
    "serve",
]
