"""deploy/ as data, for the tests of this directory: the manifests, their kustomizations, the
gateway's container and command line, and strict validation against the Kubernetes OpenAPI schema
(`kubernetes-validate`: unknown fields are errors)."""

from __future__ import annotations

import pathlib
import shlex
from typing import Any, Iterator

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MONITORING = DEPLOY / "components" / "monitoring"
K8S_VERSION = "1.30.0"
# Prometheus Operator CRDs: their schemas are not available offline (see test_monitoring.py).
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def manifest_files() -> list[pathlib.Path]:
    # deploy/helm holds templates, rendered and checked on their own.
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml" and "helm" not in p.relative_to(DEPLOY).parts)


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


def validate(doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where}: {doc['kind']}/{doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


def kustomization(directory: pathlib.Path) -> dict[str, Any]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert (k["apiVersion"], k["kind"]) in {("kustomize.config.k8s.io/v1beta1", "Kustomization"),
                                            ("kustomize.config.k8s.io/v1alpha1", "Component")}, directory
    return k


def kustomization_dirs() -> list[pathlib.Path]:
    return sorted(k.parent for k in DEPLOY.rglob("kustomization.yaml") if "helm" not in k.relative_to(DEPLOY).parts)


def gateway_container() -> dict[str, Any]:
    return one("Deployment", "pdgate-gateway")["spec"]["template"]["spec"]["containers"][0]


def gateway_argv(options: str | None = None) -> list[str]:
    """The `pdgate launch` command line the gateway container runs, from the ConfigMap (or with
    these options instead, as an overlay patches them in)."""
    c = gateway_container()
    if options is None:
        options = one("ConfigMap", "pdgate-gateway-options")["data"]["options"]
    script = c["args"][0].replace('"$POD_NAMESPACE"', "pdgate").replace("$PDGATE_OPTIONS", options)
    argv = shlex.split(script)
    assert argv[:3] == ["exec", "pdgate", "launch"], script
    return argv[3:]


def dashboard_configmap() -> dict[str, Any]:
    """The ConfigMap deploy/dashboards/kustomization.yaml generates, built by hand (offline)."""
    (gen,) = kustomization(DEPLOY / "dashboards")["configMapGenerator"]
    assert gen["options"]["disableNameSuffixHash"], "one name, so an edit replaces the dashboard instead of adding a copy"
    data = {}
    for f in gen["files"]:
        key, _, path = f.rpartition("=")
        data[key or pathlib.Path(path).name] = (DEPLOY / "dashboards" / path).read_text()
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"], "labels": gen["options"]["labels"]}, "data": data}


EPD = DEPLOY / "overlays" / "epd"


def epd_gateway_argv() -> list[str]:
    """The gateway's command line in deploy/overlays/epd: the options its ConfigMap patch sets."""
    (patch,) = [yaml.safe_load(p["patch"]) for p in kustomization(EPD)["patches"] if p["target"]["kind"] == "ConfigMap"]
    assert patch["metadata"]["name"] == "pdgate-gateway-options"
    return gateway_argv(patch["data"]["options"])
