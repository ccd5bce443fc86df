"""deploy/'s monitoring, offline: the ServiceMonitor and the PrometheusRule (CRDs of the Prometheus
Operator: `kubernetes-validate` ships only the built-in API schemas and the CRDs' schemas are not
available offline, so they get a structural check of the fields the operator needs), the dashboard
and its ConfigMap, every metric and label the dashboard and the alerts use against those the
gateway registers (crates/pdgate-gateway/src/observe/metrics.rs), and, with `promtool` installed (Debian
package `prometheus`), the rules and queries parsed and the alerts unit-tested
(alert_rules_test.yaml).
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

from manifests import DEPLOY, MONITORING, REPO, by_kind, dashboard_configmap, kustomization, one, validate

DASHBOARD = DEPLOY / "dashboards" / "pdgate.json"
METRICS_RS = REPO / "crates" / "pdgate-gateway" / "src" / "observe" / "metrics.rs"
DASHBOARD_METRICS = [
    "pdgate_requests_total", "pdgate_request_duration_seconds", "pdgate_time_to_first_byte_seconds",
    "pdgate_pd_leg_duration_seconds", "pdgate_retries_total", "pdgate_worker_errors_total", "pdgate_worker_inflight",
    "pdgate_worker_healthy", "pdgate_pd_silent_recompute_total", "pdgate_discovery_events_total",
    "pdgate_discovery_watch_restarts_total", "pdgate_workers", "pdgate_worker_breaker_state", "pdgate_worker_load",
    "pdgate_policy_decisions_total", "pdgate_pairing_refusals_total",
    "pdgate_admission_running", "pdgate_admission_waiting", "pdgate_admission_refused_total",
    "pdgate_admission_queue_wait_seconds",
]
# What the alert rules must watch: hangs and timeouts, silent recomputes, breakers, pools.
ALERT_METRICS = [
    "pdgate_requests_total", "pdgate_worker_errors_total", "pdgate_worker_inflight", "pdgate_pd_silent_recompute_total",
    "pdgate_worker_breaker_state", "pdgate_worker_healthy", "pdgate_workers", "pdgate_pairing_refusals_total",
]
# Labels Prometheus adds at scrape time (job, instance; namespace/pod from the ServiceMonitor) and le.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint", "le"}


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


def test_dashboard_ships_as_a_configmap_for_the_grafana_sidecar() -> None:
    cm = dashboard_configmap()
    validate(cm, "deploy/dashboards/kustomization.yaml")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", "the label Grafana's sidecar watches by default"
    assert list(cm["data"]) == ["pdgate.json"] and json.loads(cm["data"]["pdgate.json"])["uid"]
    # `kubectl apply` keeps the whole object in an annotation, which is capped at 256 KiB.
    assert len(json.dumps(cm)) < 256 * 1024
    assert (DEPLOY / "dashboards").resolve() in [(MONITORING / r).resolve() for r in kustomization(MONITORING)["resources"]]


def declared_metrics() -> dict[str, set[str]]:
    """The gateway's metrics and their labels, as metrics.rs registers them:
    `counter(&r, "pdgate_requests_total", "help", &["route", "status"])` (or `counter(r, ...)`)."""
    source = METRICS_RS.read_text()
    found = {name: set(re.findall(r'"([a-z_]+)"', labels))
             for name, labels in re.findall(r'\(\s*&?r,\s*"(pdgate_[a-z_]+)",\s*"(?:[^"\\]|\\.)*",\s*&\[([^\]]*)\]', source)}
    # Metrics without labels: `single("pdgate_x_total", "help")`, `IntGauge::new("pdgate_x", ...)`,
    # `single_gauge(&r, "pdgate_x", "help")`, `HistogramOpts::new("pdgate_x_seconds", ...)`.
    found.update({name: set() for name in re.findall(r'(?:\bsingle|IntGauge::new|IntCounter::new|HistogramOpts::new)\(\s*"(pdgate_[a-z_]+)"', source)})
    found.update({name: set() for name in re.findall(r'\bsingle_gauge\(\s*&?r,\s*"(pdgate_[a-z_]+)"', source)})
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
