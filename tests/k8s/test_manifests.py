"""deploy/ checked offline: every manifest against the Kubernetes OpenAPI schema
(`kubernetes-validate`, strict: unknown fields are errors), the kustomizations and components
against the files (and rendered with `kubectl kustomize` where it is installed, every object
validated), the cross-references between objects (labels, names, ports, the admin key Secret), the
gateway options in the ConfigMap against the gateway's own option parser, and the shutdown timings.
Monitoring (ServiceMonitor, alerts, dashboard) is in test_monitoring.py, the image in test_image.py.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from manifests import (CRD_KINDS, DEPLOY, EPD, MONITORING, REPO, by_kind, dashboard_configmap, epd_gateway_argv,
                       gateway_argv, gateway_container, kustomization, kustomization_dirs, manifest_files, objects, one,
                       validate)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_against_the_kubernetes_schema(path: pathlib.Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # see the module docstring; checked in test_service_monitor_* and test_prometheus_rule_*
        validate(doc, str(path.relative_to(REPO)))


def generator_files(k: dict[str, Any]) -> list[str]:
    """The files a kustomization's configMapGenerator/secretGenerator read (`key=path` or `path`)."""
    return [f.split("=", 1)[-1] for g in k.get("configMapGenerator", []) + k.get("secretGenerator", []) for f in g.get("files", [])]


def reachable(directory: pathlib.Path) -> set[pathlib.Path]:
    """The manifest files `kubectl kustomize DIRECTORY` reads, following resources and components;
    what kustomize itself checks (missing files, files outside a kustomization's root) fails here."""
    k = kustomization(directory)
    found: set[pathlib.Path] = set()
    for entry in k.get("resources", []) + k.get("components", []):
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory.relative_to(REPO)}/kustomization.yaml lists missing {entry}"
        if target.is_dir():
            assert (entry in k.get("components", [])) == (kustomization(target)["kind"] == "Component"), \
                f"{entry}: a Component goes under components:, a Kustomization under resources:"
            assert not directory.is_relative_to(target), f"{entry}: kustomize refuses a root that contains this one"
            found |= reachable(target)
        else:
            found.add(target)
    for f in generator_files(k):
        target = (directory / f).resolve()
        assert target.is_file(), f"{directory.relative_to(REPO)}: generator file {f} is missing"
        assert target.is_relative_to(directory.resolve()), f"{f}: kustomize only reads files at or below the kustomization"
    return found


def test_every_manifest_belongs_to_a_kustomization() -> None:
    listed: set[pathlib.Path] = set()
    for directory in kustomization_dirs():
        listed |= reachable(directory)
    assert set(manifest_files()) <= listed, f"not in any kustomization: {set(manifest_files()) - listed}"
    root = kustomization(DEPLOY)
    assert {"gateway", "workers/reference"} <= set(root["resources"]), "the default topology runs on CPUs"


def kinds(files: set[pathlib.Path]) -> set[tuple[str, str]]:
    return {(doc["apiVersion"], doc["kind"]) for f in files for doc in yaml.safe_load_all(f.read_text()) if doc}


def test_the_default_kustomization_needs_no_crds() -> None:
    assert not kinds(reachable(DEPLOY)) & CRD_KINDS, "deploy/ must apply on a cluster without the Prometheus Operator"
    assert kustomization(MONITORING)["kind"] == "Component"
    assert CRD_KINDS <= kinds(reachable(MONITORING))
    overlay = kustomization(DEPLOY / "overlays" / "monitoring")
    assert [(DEPLOY / "overlays" / "monitoring" / r).resolve() for r in overlay["resources"]] == \
        [(DEPLOY / r).resolve() for r in kustomization(DEPLOY)["resources"]], "the overlay is the default topology"
    assert [(DEPLOY / "overlays" / "monitoring" / c).resolve() for c in overlay["components"]] == [MONITORING.resolve()]


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(directory: pathlib.Path) -> list[dict[str, Any]]:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed; test_every_manifest_belongs_to_a_kustomization checks the references")
    out = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(command)} {directory.relative_to(REPO)}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda p: str(p.relative_to(REPO)))
def test_kustomization_renders_valid_objects(directory: pathlib.Path) -> None:
    if kustomization(directory)["kind"] == "Component":
        pytest.skip("a component renders as part of a kustomization (overlays/monitoring)")
    docs = render(directory)
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
            validate(doc, f"kustomize {directory.relative_to(REPO)}")
    rendered = {(d["apiVersion"], d["kind"]) for d in docs}
    if directory == DEPLOY:
        assert not rendered & CRD_KINDS
    if directory == DEPLOY / "overlays" / "monitoring":
        assert CRD_KINDS <= rendered
        (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdgate-dashboard"]
        assert dashboard == dashboard_configmap()


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


def selectors(argv: list[str]) -> dict[str, dict[str, str]]:
    from pdgate import _core

    config = json.loads(_core.parse_cli(argv))
    pairs = lambda items: dict(i.split("=", 1) for i in items)  # noqa: E731
    common = pairs(config["selector"])
    roles = {"prefill": {**common, **pairs(config["prefill_selector"])},
             "decode": {**common, **pairs(config["decode_selector"])}}
    if config["encode_selector"]:
        roles["encode"] = {**common, **pairs(config["encode_selector"])}
    return {**roles, "port": config["service_discovery_port"]}


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


def pre_stop_sleep(container: dict[str, Any]) -> int:
    """The seconds a container's preStop hook sleeps (`exec: sleep N` or `sleep: {seconds: N}`)."""
    hook = container["lifecycle"]["preStop"]
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def gateway_drain_seconds(argv: list[str]) -> int:
    """How long the gateway drains in-flight requests after SIGTERM: `--shutdown-grace-period-secs`
    where the gateway has that option (the ConfigMap's value, else its default), else app/server.rs's
    fixed DRAIN_TIMEOUT."""
    try:
        from pdgate import _core
    except ImportError:
        _core = None
    if _core is not None:
        names = {o["name"] for o in json.loads(_core.config_schema())["options"]}
        if "shutdown_grace_period_secs" in names:
            return int(json.loads(_core.parse_cli(argv))["shutdown_grace_period_secs"])
    source = (REPO / "crates" / "pdgate-gateway" / "src" / "app" / "server.rs").read_text()
    (seconds,) = re.findall(r"const DRAIN_TIMEOUT: Duration = Duration::from_secs\((\d+)\);", source)
    return int(seconds)


def test_gateway_shutdown_fits_in_the_grace_period() -> None:
    pod = one("Deployment", "pdgate-gateway")["spec"]["template"]["spec"]
    sleep, drain = pre_stop_sleep(gateway_container()), gateway_drain_seconds(gateway_argv())
    # The endpoints controller and kube-proxy need a few seconds to stop sending to the pod.
    assert 3 <= sleep <= 15, "preStop: long enough for the Service to stop routing, short enough for rollouts"
    assert pod["terminationGracePeriodSeconds"] > sleep + drain, \
        f"SIGKILL would cut the drain: grace {pod['terminationGracePeriodSeconds']} s <= preStop {sleep} s + drain {drain} s"
    # docs/kubernetes.md states the same numbers.
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert f"terminationGracePeriodSeconds: {pod['terminationGracePeriodSeconds']}" in docs


def test_worker_pods_outlive_their_pre_stop() -> None:
    for _, d in worker_deployments():
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > pre_stop_sleep(pod["containers"][0]), d["metadata"]["name"]


def test_pod_disruption_budget_keeps_a_gateway_serving() -> None:
    pdb = one("PodDisruptionBudget", "pdgate-gateway")
    deployment = one("Deployment", "pdgate-gateway")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"], "exactly the gateway's pods"
    # maxUnavailable, not minAvailable: a one-replica gateway would block every node drain.
    assert "minAvailable" not in pdb["spec"]
    assert 1 <= pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"], "a disruption leaves a gateway serving"
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", "an unready gateway serves nothing; let drains evict it"


def secret_env(name: str) -> dict[str, Any]:
    (env,) = [e for e in gateway_container()["env"] if e["name"] == name]
    return env["valueFrom"]["secretKeyRef"]


def docs_secrets() -> dict[str, tuple[str, str]]:
    """The Secrets docs/kubernetes.md tells users to create: name -> (key, the command)."""
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    return {name: (key, line) for line, name, key in
            re.findall(r"^(kubectl\b.*\bcreate secret generic (\S+) --from-literal=([\w.-]+)=.*)$", docs, re.M)}


def test_admin_api_is_closed_by_default() -> None:
    ref = secret_env("PDGATE_ADMIN_API_KEY")
    assert not ref.get("optional", False), "without the Secret the pod must not start with an open admin API"
    # No key is committed: no Secret in deploy/ at all, and none in the ConfigMap's options.
    assert not by_kind("Secret")
    for directory in kustomization_dirs():
        assert not kustomization(directory).get("secretGenerator"), f"{directory}: a generated Secret commits its key"
    options = one("ConfigMap", "pdgate-gateway-options")["data"]["options"]
    assert "api-key" not in options, "keys belong in Secrets, not in the ConfigMap"
    # The docs say how to create it, with the name and key the Deployment reads, and a random key.
    secrets = docs_secrets()
    assert secrets[ref["name"]][0] == ref["key"] and "rand" in secrets[ref["name"]][1]
    client = secret_env("PDGATE_API_KEY")
    assert client["optional"] is True and secrets[client["name"]][0] == client["key"]
    for name, (key, _) in secrets.items():
        validate({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque",
                  "data": {key: "c2VjcmV0"}}, "docs/kubernetes.md")


def test_the_gateway_reads_its_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    from pdgate import _core

    monkeypatch.setenv("PDGATE_ADMIN_API_KEY", "admin-secret")
    monkeypatch.setenv("PDGATE_API_KEY", "client-secret")
    config = json.loads(_core.parse_cli(gateway_argv()))
    assert (config["admin_api_key"], config["api_key"]) == ("admin-secret", "client-secret")


def worker_deployments() -> list[tuple[pathlib.Path, dict[str, Any]]]:
    return [(p, o) for p, o in objects() if o["kind"] == "Deployment" and "workers" in p.parts]


@pytest.mark.parametrize("path", sorted({p for p, _ in worker_deployments()}), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_worker_pods_are_found_by_the_gateway(path: pathlib.Path) -> None:
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    # An encode worker serves the EPD overlay's gateway; the others the default one.
    sel = selectors(epd_gateway_argv() if path.stem == "encode" else gateway_argv())
    roles = [r for r in ("prefill", "decode", "encode") if r in sel]
    for _, d in [(p, o) for p, o in worker_deployments() if p == path]:
        template = d["spec"]["template"]
        labels, annotations = template["metadata"]["labels"], template["metadata"].get("annotations", {})
        matched = [r for r in roles if sel[r].items() <= labels.items()]
        assert len(matched) == 1, f"{path.name}: labels {labels} match {matched or 'no selector'}: a pod in two pools is refused"
        (role,) = matched
        assert path.stem == role
        assert set(annotations) <= {"pdgate.ai/port", "sglang.ai/bootstrap-port", "smg.ai/kv-connector", "smg.ai/kv-engine-id"}
        container = template["spec"]["containers"][0]
        ports = {p["containerPort"] for p in container["ports"]}
        assert int(annotations.get("pdgate.ai/port", sel["port"])) in ports, "the gateway reaches the engine port"
        if role in ("prefill", "encode") and "sglang.ai/bootstrap-port" in annotations:
            assert int(annotations["sglang.ai/bootstrap-port"]) in ports
            assert annotations["sglang.ai/bootstrap-port"] in container["args"], "the engine serves the port announced"
        if role == "encode":
            assert not {"smg.ai/kv-connector", "smg.ai/kv-engine-id"} & set(annotations), "an encode worker holds no KV"
            assert "--encoder-only" in container["args"]
        assert annotations.get("smg.ai/kv-connector", "bootstrap") in ("bootstrap", "nixl", "mooncake")
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", "Ready means serving"


def test_the_epd_overlay_is_the_default_topology_plus_an_encode_worker() -> None:
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    from pdgate import _core

    overlay = kustomization(EPD)
    assert [(EPD / r).resolve() for r in overlay["resources"]] == \
        [(DEPLOY / r).resolve() for r in kustomization(DEPLOY)["resources"]] + [(DEPLOY / "workers" / "reference" / "encode").resolve()]
    assert "workers/reference/encode" not in kustomization(DEPLOY)["resources"], "a PD gateway has no use for it"
    config = json.loads(_core.parse_cli(epd_gateway_argv()))
    assert config["epd_disaggregation"] and config["pd_disaggregation"] and config["encode_selector"]
    # The overlay's options are the default ones, in EPD mode with an encode selector.
    default = gateway_argv()
    epd = [a for a in epd_gateway_argv() if a not in ("--encode-selector", *config["encode_selector"])]
    assert epd == ["--epd-disaggregation" if a == "--pd-disaggregation" else a for a in default]


def test_the_epd_overlay_renders_workers_of_one_multimodal_model() -> None:
    docs = render(EPD)
    workers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["args"]
               for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("pdgate-reference-")}
    assert set(workers) == {"pdgate-reference-prefill", "pdgate-reference-decode", "pdgate-reference-encode"}
    for name, args in workers.items():
        assert args[args.index("--model") + 1] == "tiny-mm", name
    (options,) = [d["data"]["options"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdgate-gateway-options"]
    assert " ".join(options.split()) in " ".join(epd_gateway_argv()), "the rendered ConfigMap is the patch read offline"
