"""deploy/ checked offline: every manifest against the Kubernetes OpenAPI schema
(`kubernetes-validate`, strict: unknown fields are errors), the kustomizations against the files,
the cross-references between objects (labels, names, ports), the gateway options in the ConfigMap
against the gateway's own option parser, and the dashboard against the metrics the gateway has.

The ServiceMonitor is a CRD (Prometheus Operator): `kubernetes-validate` ships only the built-in
API schemas and the CRD's schema is not available offline, so it gets a structural check of the
fields the operator needs instead.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
from typing import Any, Iterator

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.30.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
DASHBOARD_METRICS = [
    "pdgate_requests_total", "pdgate_request_duration_seconds", "pdgate_time_to_first_byte_seconds",
    "pdgate_pd_leg_duration_seconds", "pdgate_retries_total", "pdgate_worker_errors_total", "pdgate_worker_inflight",
    "pdgate_worker_healthy", "pdgate_pd_silent_recompute_total", "pdgate_discovery_events_total",
    "pdgate_discovery_watch_restarts_total", "pdgate_workers",
]


def manifest_files() -> list[pathlib.Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def objects() -> Iterator[tuple[pathlib.Path, dict[str, Any]]]:
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for _, o in objects() if o["kind"] == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in by_kind(kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_against_the_kubernetes_schema(path: pathlib.Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # see the module docstring; checked in test_service_monitor_scrapes_the_gateway
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(REPO)}: {doc['kind']}/{doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


def test_every_manifest_belongs_to_a_kustomization() -> None:
    listed: set[pathlib.Path] = set()
    for kfile in DEPLOY.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        assert k["kind"] == "Kustomization" and k["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
        for res in k["resources"]:
            target = (kfile.parent / res).resolve()
            assert target.exists(), f"{kfile.relative_to(REPO)} lists missing {res}"
            listed.add(target / "kustomization.yaml" if target.is_dir() else target)
    assert set(manifest_files()) <= listed, f"not in any kustomization: {set(manifest_files()) - listed}"
    root = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert {"gateway", "workers/reference"} <= set(root["resources"]), "the default topology runs on CPUs"


def test_rbac_grants_only_reading_pods_in_the_namespace() -> None:
    role = one("Role", "pdgate-gateway-pod-reader")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not by_kind("ClusterRole") and not by_kind("ClusterRoleBinding")
    binding = one("RoleBinding", "pdgate-gateway-pod-reader")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pdgate-gateway-pod-reader"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdgate-gateway"}]
    one("ServiceAccount", "pdgate-gateway")
    pod = one("Deployment", "pdgate-gateway")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pdgate-gateway"


def gateway_container() -> dict[str, Any]:
    return one("Deployment", "pdgate-gateway")["spec"]["template"]["spec"]["containers"][0]


def test_gateway_probes_service_and_selector_agree() -> None:
    deployment = one("Deployment", "pdgate-gateway")
    c = gateway_container()
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    port_names = {p["name"] for p in c["ports"]}
    service = one("Service", "pdgate-gateway")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_service_monitor_scrapes_the_gateway() -> None:
    (sm,) = by_kind("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    service = one("Service", "pdgate-gateway")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in sm["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+s", endpoint["interval"])
    assert set(sm["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}


def gateway_argv() -> list[str]:
    """The `pdgate launch` command line the gateway container runs, from the ConfigMap."""
    c = gateway_container()
    options = one("ConfigMap", "pdgate-gateway-options")["data"]["options"]
    script = c["args"][0].replace('"$POD_NAMESPACE"', "pdgate").replace("$PDGATE_OPTIONS", options)
    argv = shlex.split(script)
    assert argv[:3] == ["exec", "pdgate", "launch"], script
    return argv[3:]


def selectors(argv: list[str]) -> dict[str, dict[str, str]]:
    from pdgate import _core

    config = json.loads(_core.parse_cli(argv))
    pairs = lambda items: dict(i.split("=", 1) for i in items)  # noqa: E731
    common = pairs(config["selector"])
    return {"prefill": {**common, **pairs(config["prefill_selector"])},
            "decode": {**common, **pairs(config["decode_selector"])}, "port": config["service_discovery_port"]}


def test_configmap_options_are_valid_gateway_options() -> None:
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    from pdgate import _core

    argv = gateway_argv()
    flags = {o["flag"] for o in json.loads(_core.config_schema())["options"]}
    used = {a for a in argv if a.startswith("--")}
    assert used <= flags, f"unknown options: {used - flags}"
    # The gateway's own parser and cross-field validation accept the whole command line.
    config = json.loads(_core.parse_cli(argv))
    assert config["service_discovery"] and config["pd_disaggregation"]
    assert config["service_discovery_namespace"] == "pdgate" and config["port"] == 8000


def worker_deployments() -> list[tuple[pathlib.Path, dict[str, Any]]]:
    return [(p, o) for p, o in objects() if o["kind"] == "Deployment" and "workers" in p.parts]


@pytest.mark.parametrize("path", sorted({p for p, _ in worker_deployments()}), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_worker_pods_are_found_by_the_gateway(path: pathlib.Path) -> None:
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    sel = selectors(gateway_argv())
    for _, d in [(p, o) for p, o in worker_deployments() if p == path]:
        template = d["spec"]["template"]
        labels, annotations = template["metadata"]["labels"], template["metadata"].get("annotations", {})
        role = "prefill" if sel["prefill"].items() <= labels.items() else "decode"
        assert sel[role].items() <= labels.items(), f"{path.name}: labels {labels} match no selector"
        other = "decode" if role == "prefill" else "prefill"
        assert not sel[other].items() <= labels.items(), "a pod in both pools would be refused"
        assert path.stem == role
        assert set(annotations) <= {"pdgate.ai/port", "sglang.ai/bootstrap-port", "smg.ai/kv-connector", "smg.ai/kv-engine-id"}
        container = template["spec"]["containers"][0]
        ports = {p["containerPort"] for p in container["ports"]}
        assert int(annotations.get("pdgate.ai/port", sel["port"])) in ports, "the gateway reaches the engine port"
        if role == "prefill" and "sglang.ai/bootstrap-port" in annotations:
            assert int(annotations["sglang.ai/bootstrap-port"]) in ports
            assert annotations["sglang.ai/bootstrap-port"] in container["args"], "the engine serves the port announced"
        assert annotations.get("smg.ai/kv-connector", "bootstrap") in ("bootstrap", "nixl", "mooncake")
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", "Ready means serving"


def test_dashboard_covers_the_gateway_metrics() -> None:
    dashboard = json.loads((DEPLOY / "dashboards" / "pdgate.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bpdgate_[a-z_]+", exprs)}
    assert set(DASHBOARD_METRICS) <= used, f"not on the dashboard: {set(DASHBOARD_METRICS) - used}"
    source = (REPO / "crates" / "pdgate-gateway" / "src" / "metrics.rs").read_text()
    declared = set(re.findall(r'"(pdgate_[a-z_]+)"', source))
    assert used <= declared, f"the dashboard uses metrics the gateway does not have: {used - declared}"
    assert {p["gridPos"]["y"] for p in dashboard["panels"]}, "panels are laid out"
