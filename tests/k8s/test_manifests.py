"""deploy/ checked offline: every manifest against the Kubernetes OpenAPI schema
(`kubernetes-validate`, strict: unknown fields are errors), the kustomizations and components
against the files (and rendered with `kubectl kustomize` where it is installed), the cross-references
between objects (labels, names, ports, the admin key Secret), the gateway options in the ConfigMap
against the gateway's own option parser, the shutdown timings, the Dockerfile, and the dashboard and
alert rules against the metrics the gateway has.

The ServiceMonitor and PrometheusRule are CRDs (Prometheus Operator): `kubernetes-validate` ships
only the built-in API schemas and the CRDs' schemas are not available offline, so they get a
structural check of the fields the operator needs instead, and the alert rules are checked and
unit-tested with `promtool` (Debian/Ubuntu package `prometheus`) where it is installed.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from typing import Any, Iterator

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.30.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
MONITORING = DEPLOY / "components" / "monitoring"
DASHBOARD = DEPLOY / "dashboards" / "pdgate.json"
METRICS_RS = REPO / "crates" / "pdgate-gateway" / "src" / "metrics.rs"
DASHBOARD_METRICS = [
    "pdgate_requests_total", "pdgate_request_duration_seconds", "pdgate_time_to_first_byte_seconds",
    "pdgate_pd_leg_duration_seconds", "pdgate_retries_total", "pdgate_worker_errors_total", "pdgate_worker_inflight",
    "pdgate_worker_healthy", "pdgate_pd_silent_recompute_total", "pdgate_discovery_events_total",
    "pdgate_discovery_watch_restarts_total", "pdgate_workers", "pdgate_worker_breaker_state", "pdgate_worker_load",
    "pdgate_policy_decisions_total", "pdgate_pairing_refusals_total",
]
# What the alert rules must watch: hangs and timeouts, silent recomputes, breakers, pools.
ALERT_METRICS = [
    "pdgate_requests_total", "pdgate_worker_errors_total", "pdgate_worker_inflight", "pdgate_pd_silent_recompute_total",
    "pdgate_worker_breaker_state", "pdgate_worker_healthy", "pdgate_workers", "pdgate_pairing_refusals_total",
]
# Labels Prometheus adds at scrape time (job, instance; namespace/pod from the ServiceMonitor) and le.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint", "le"}


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


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_against_the_kubernetes_schema(path: pathlib.Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # see the module docstring; checked in test_service_monitor_* and test_prometheus_rule_*
        validate(doc, str(path.relative_to(REPO)))


def kustomization(directory: pathlib.Path) -> dict[str, Any]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert (k["apiVersion"], k["kind"]) in {("kustomize.config.k8s.io/v1beta1", "Kustomization"),
                                            ("kustomize.config.k8s.io/v1alpha1", "Component")}, directory
    return k


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


def kustomization_dirs() -> list[pathlib.Path]:
    return sorted(k.parent for k in DEPLOY.rglob("kustomization.yaml") if "helm" not in k.relative_to(DEPLOY).parts)


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


def validate(doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where}: {doc['kind']}/{doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


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


def dashboard_configmap() -> dict[str, Any]:
    """The ConfigMap deploy/dashboards/kustomization.yaml generates, built by hand (offline)."""
    (gen,) = kustomization(DEPLOY / "dashboards")["configMapGenerator"]
    assert gen["options"]["disableNameSuffixHash"], "one name, so an edit replaces the dashboard instead of adding a copy"
    data = {}
    for f in gen["files"]:
        key, _, path = f.rpartition("=")
        data[key or pathlib.Path(path).name] = (DEPLOY / "dashboards" / path).read_text()
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"], "labels": gen["options"]["labels"]}, "data": data}


def test_dashboard_ships_as_a_configmap_for_the_grafana_sidecar() -> None:
    cm = dashboard_configmap()
    validate(cm, "deploy/dashboards/kustomization.yaml")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", "the label Grafana's sidecar watches by default"
    assert list(cm["data"]) == ["pdgate.json"] and json.loads(cm["data"]["pdgate.json"])["uid"]
    # `kubectl apply` keeps the whole object in an annotation, which is capped at 256 KiB.
    assert len(json.dumps(cm)) < 256 * 1024
    assert (DEPLOY / "dashboards").resolve() in [(MONITORING / r).resolve() for r in kustomization(MONITORING)["resources"]]


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
    where the gateway has that option (the ConfigMap's value, else its default), else server.rs's
    fixed DRAIN_TIMEOUT."""
    try:
        from pdgate import _core
    except ImportError:
        _core = None
    if _core is not None:
        names = {o["name"] for o in json.loads(_core.config_schema())["options"]}
        if "shutdown_grace_period_secs" in names:
            return int(json.loads(_core.parse_cli(argv))["shutdown_grace_period_secs"])
    source = (REPO / "crates" / "pdgate-gateway" / "src" / "server.rs").read_text()
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


def declared_metrics() -> dict[str, set[str]]:
    """The gateway's metrics and their labels, as metrics.rs registers them:
    `counter(&r, "pdgate_requests_total", "help", &["route", "status"])`."""
    source = METRICS_RS.read_text()
    found = {name: set(re.findall(r'"([a-z_]+)"', labels))
             for name, labels in re.findall(r'\(\s*&r,\s*"(pdgate_[a-z_]+)",\s*"(?:[^"\\]|\\.)*",\s*&\[([^\]]*)\]', source)}
    assert set(re.findall(r'"(pdgate_[a-z_]+)"', source)) == set(found), "metrics.rs registers metrics in a way this parser misses"
    return found


def used_metrics(exprs: list[str]) -> dict[str, set[str]]:
    """The pdgate metrics PromQL expressions read, with the labels they match on."""
    used: dict[str, set[str]] = {}
    for expr in exprs:
        for name, matchers in re.findall(r"\b(pdgate_[a-z_]+)(?:\{([^}]*)\})?", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            used.setdefault(base, set()).update(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", matchers))
    return used


def check_metrics_exist(exprs: list[str], what: str) -> set[str]:
    declared, used = declared_metrics(), used_metrics(exprs)
    assert set(used) <= set(declared), f"{what} uses metrics the gateway does not have: {set(used) - set(declared)}"
    for name, labels in used.items():
        assert labels <= declared[name] | TARGET_LABELS, f"{what}: {name} has no label {labels - declared[name] - TARGET_LABELS}"
    return set(used)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_dashboard_covers_the_gateway_metrics() -> None:
    used = check_metrics_exist(dashboard_exprs(), "the dashboard")
    assert set(DASHBOARD_METRICS) <= used, f"not on the dashboard: {set(DASHBOARD_METRICS) - used}"
    panels = dashboard()["panels"]
    assert {p["gridPos"]["y"] for p in panels}, "panels are laid out"
    cells = [(x, y) for p in panels for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
             for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])]
    assert len(cells) == len(set(cells)), "panels overlap"
    assert len({p["id"] for p in panels}) == len(panels) and len({p["title"] for p in panels}) == len(panels)


def breaker_states() -> dict[int, str]:
    """`BreakerState::as_gauge` in pdgate-core: the values of pdgate_worker_breaker_state."""
    source = (REPO / "crates" / "pdgate-core" / "src" / "breaker.rs").read_text()
    body = source[source.index("fn as_gauge"):]
    body = body[:body.index("\n    }\n")]
    states = {int(v): re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower() for name, v in re.findall(r"BreakerState::(\w+) => (\d+)", body)}
    assert states == {0: "closed", 1: "open", 2: "half-open"}, "the alert (> 0: not closed) and the dashboard's value mappings assume these"
    return states


def test_dashboard_breaker_panel_names_the_states() -> None:
    (panel,) = [p for p in dashboard()["panels"] if "pdgate_worker_breaker_state" in " ".join(t["expr"] for t in p["targets"])]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    assert {int(k): v["text"] for k, v in mapping["options"].items()} == breaker_states()


def promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables filled in, for promtool."""
    return expr.replace("$__rate_interval", "5m").replace("$job", ".*")


def prometheus_rule() -> dict[str, Any]:
    (rule,) = by_kind("PrometheusRule")
    return rule


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in prometheus_rule()["spec"]["groups"] for r in g["rules"]]


def test_prometheus_rule_structure() -> None:
    rule = prometheus_rule()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert rule["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdgate"
    assert set(rule["spec"]) == {"groups"}
    groups = rule["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    names = []
    for g in groups:
        assert set(g) <= {"name", "interval", "rules"} and g["rules"], g["name"]
        for r in g["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert re.fullmatch(r"Pdgate[A-Z][A-Za-z]+", r["alert"]) and isinstance(r["expr"], str)
            assert re.fullmatch(r"\d+[smh]", r["for"]), f"{r['alert']}: for"
            assert r["labels"]["severity"] in ("warning", "critical")
            assert {"summary", "description"} <= set(r["annotations"])
            names.append(r["alert"])
    assert len(names) == len(set(names))
    # The operator's rule files are namespaced per object: the rule must live with the gateway.
    assert "namespace" not in rule["metadata"]


def test_alerts_watch_existing_metrics() -> None:
    used = check_metrics_exist([r["expr"] for r in alert_rules()], "the alert rules")
    assert set(ALERT_METRICS) <= used, f"no alert on: {set(ALERT_METRICS) - used}"
    breaker = [r for r in alert_rules() if "pdgate_worker_breaker_state" in r["expr"]]
    assert breaker and all("> 0" in r["expr"] for r in breaker) and breaker_states()[0] == "closed"
    # The docs explain every alert.
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert {r["alert"] for r in alert_rules()} <= set(re.findall(r"`(Pdgate[A-Za-z]+)`", docs)), "docs/kubernetes.md, Alerts"


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return tool


def run_promtool(*args: str, cwd: pathlib.Path) -> None:
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_accepts_the_rules_and_the_dashboard_queries(tmp_path: pathlib.Path) -> None:
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump({"groups": prometheus_rule()["spec"]["groups"]}))
    # Dashboard queries as recording rules: promtool parses each one.
    records = [{"record": f"pdgate:dashboard:{i}", "expr": promql(e)} for i, e in enumerate(dashboard_exprs())]
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    run_promtool("check", "rules", "alerts.yaml", "dashboard.yaml", cwd=tmp_path)


def test_alerts_fire_on_their_failure_and_not_on_a_healthy_gateway(tmp_path: pathlib.Path) -> None:
    groups = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
              for g in prometheus_rule()["spec"]["groups"]]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    cases = pathlib.Path(__file__).with_name("alert_rules_test.yaml")
    shutil.copy(cases, tmp_path / cases.name)
    tested = set(re.findall(r"alertname: (Pdgate\w+)", cases.read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, "every alert has promtool cases"
    run_promtool("test", "rules", cases.name, cwd=tmp_path)


def dockerfile_stages() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return re.split(r"^FROM ", text, flags=re.M)[1:]


def test_dockerfile_pins_the_rust_toolchain() -> None:
    build = dockerfile_stages()[0]
    (pinned,) = re.findall(r"^ARG RUST_TOOLCHAIN=(\d+\.\d+\.\d+)$", build, re.M)
    assert '--default-toolchain "$RUST_TOOLCHAIN"' in build, "rustup installs the pinned toolchain"
    (minimum,) = re.findall(r'^rust-version = "([\d.]+)"', (REPO / "Cargo.toml").read_text(), re.M)
    version = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert version(pinned) >= version(minimum), f"toolchain {pinned} is older than the workspace's rust-version {minimum}"
    assert re.search(r"maturin build .*--locked", build), "the image builds the dependencies in Cargo.lock"


def pyproject_dependencies() -> set[str]:
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S)
    assert block, "pyproject.toml: [project] dependencies"
    return {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in re.findall(r'"([^"]+)"', block.group(1))}


def module_level_imports() -> dict[str, str]:
    """Third-party modules python/pdgate imports at module level (not in a function, try or
    TYPE_CHECKING block): what `pdgate launch` and `pdgate engine` need to start."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "python" / "pdgate").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("pdgate", "__future__"):
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_the_image_installs_the_complete_runtime_dependencies() -> None:
    runtime = dockerfile_stages()[-1]
    (install,) = re.findall(r"^RUN pip install (.*)$", runtime, re.M)
    assert "/wheels/*.whl" in install and "--no-deps" not in install, "the wheel with its dependencies"
    assert re.search(r'python -c "import pdgate\._core, .*pdgate\.engine\.server', install), "a missing module fails the build"
    # The distribution names of modules the package imports at start, as far as they differ.
    distribution = {"prometheus_client": "prometheus-client", "yaml": "pyyaml"}
    needed = {distribution.get(m, m).lower().replace("_", "-"): where for m, where in module_level_imports().items()}
    missing = set(needed) - pyproject_dependencies()
    assert not missing, f"imported at start but not in pyproject.toml's dependencies: {({m: needed[m] for m in missing})}"


def test_dockerignore_keeps_what_the_build_needs() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    needed = ["Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md", "crates", "bindings", "python"]
    for path in needed:
        assert (REPO / path).exists(), path
        assert not any(fnmatch.fnmatch(path, p.lstrip("/").rstrip("/")) for p in patterns), f".dockerignore drops {path}"
    assert {".git", "target"} <= set(patterns), "the context leaves out history and build outputs"
