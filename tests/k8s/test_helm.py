"""deploy/helm/pdgate checked offline with Helm's own Go SDK (the `helm-python-sdk` wheel,
installed by .ci/run; these tests skip, saying so, without it): `helm lint --strict`, then
`helm template` with several values, every rendered object validated against the Kubernetes
schema as deploy/ is (test_manifests.py), the gateway's command line parsed by the gateway's own
option parser, the values toggles checked by what they change, and the monitoring objects checked
to carry deploy/'s rules and dashboard (the chart reads them through symlinks, never a copy)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import yaml

from manifests import CRD_KINDS, DEPLOY, MONITORING, validate
from test_manifests import gateway_drain_seconds, pre_stop_sleep

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (Helm's SDK; .ci/run installs it)")

CHART = DEPLOY / "helm" / "pdgate"
RELEASE, NAMESPACE = "demo", "ml"
EVERYTHING = {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                             "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}},
              "apiKey": {"existingSecret": "client-key"}, "workerAuth": {"existingSecret": "worker-key"},
              "workerTls": {"caConfigMap": "workers-ca"}}
REGULAR = {"gateway": {"pdDisaggregation": False}}
BARE = {"discovery": {"enabled": False}, "referenceWorkers": {"enabled": False}, "gateway": {"podDisruptionBudget": {"enabled": False}}}
EPD = {"gateway": {"epdDisaggregation": True}}
VARIANTS = {"default": {}, "everything": EVERYTHING, "regular": REGULAR, "bare": BARE, "epd": EPD}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`helm template demo deploy/helm/pdgate -n ml` with `values`, as objects."""
    rendered = helm.Chart.load(str(CHART)).render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def gateway(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (d,) = [d for d in of_kind(docs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/name"] == "pdgate-gateway"]
    return d


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def workers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in of_kind(docs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/name"] == "pdgate-reference"]


def gateway_argv(docs: list[dict[str, Any]]) -> list[str]:
    c = container(gateway(docs))
    assert c["command"] == ["pdgate", "launch"]
    return [str(a) for a in c["args"]]


def parsed(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway's resolved config for the rendered command line (its own parser and checks)."""
    core = pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    return json.loads(core.parse_cli(gateway_argv(docs)))


def labels_of(selector: list[str]) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in selector)


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_helm_lint_is_clean() -> None:
    for name, values in VARIANTS.items():
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
        assert report["errors"] == [], f"{name}: {report}"
        # Severity 2 = warning, 3 = error; 1 (info, e.g. "icon is recommended") is allowed.
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], f"{name}: {report['messages']}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_objects_are_valid_against_the_kubernetes_schema(variant: str) -> None:
    docs = render(VARIANTS[variant])
    assert docs, "nothing rendered"
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
            validate(doc, f"helm template ({variant})")
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"
    assert not of_kind(docs, "Secret"), "the chart never creates a Secret: keys come from existing ones"


def test_the_default_render_needs_no_crds_and_the_toggles_add_them() -> None:
    default = render()
    kinds = {(d["apiVersion"], d["kind"]) for d in default}
    assert not kinds & CRD_KINDS, "the default chart must install on a cluster without the Prometheus Operator"
    assert not [d for d in of_kind(default, "ConfigMap") if "dashboard" in d["metadata"]["name"]]
    everything = render(EVERYTHING)
    assert CRD_KINDS <= {(d["apiVersion"], d["kind"]) for d in everything}
    assert [d for d in of_kind(everything, "ConfigMap") if "dashboard" in d["metadata"]["name"]]


def test_monitoring_objects_carry_deploys_rules_and_dashboard() -> None:
    docs = render(EVERYTHING)
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]
    (dashboard,) = [d for d in of_kind(docs, "ConfigMap") if "dashboard" in d["metadata"]["name"]]
    assert json.loads(dashboard["data"]["pdgate.json"]) == json.loads((DEPLOY / "dashboards" / "pdgate.json").read_text())
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    # Read through symlinks: one copy of the rules and dashboard in the repository.
    for name in ("prometheusrule.yaml", "pdgate.json"):
        assert (CHART / "files" / name).is_symlink(), f"files/{name} must link to deploy/, not copy it"
    (monitor,) = of_kind(docs, "ServiceMonitor")
    (service,) = of_kind(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kps", "extra labels for the operator's selector"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


def test_gateway_command_line_parses_and_finds_the_reference_workers() -> None:
    docs = render()
    config = parsed(docs)
    assert config["pd_disaggregation"] and config["service_discovery"]
    assert config["service_discovery_namespace"] == NAMESPACE, "the Role grants only the release's namespace"
    assert config["port"] == 8000 and config["host"] == "0.0.0.0"
    common = labels_of(config["selector"])
    roles = {"prefill": {**common, **labels_of(config["prefill_selector"])},
             "decode": {**common, **labels_of(config["decode_selector"])}}
    found = {}
    for d in workers(docs):
        labels = pod_labels(d)
        matched = [role for role, sel in roles.items() if sel.items() <= labels.items()]
        assert len(matched) == 1, f"{d['metadata']['name']}: matches {matched}"
        found[matched[0]] = d
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        ports = {p["containerPort"] for p in container(d)["ports"]}
        assert int(annotations.get("pdgate.ai/port", config["service_discovery_port"])) in ports
    assert set(found) == {"prefill", "decode"}
    prefill = found["prefill"]
    bootstrap = prefill["spec"]["template"]["metadata"]["annotations"]["sglang.ai/bootstrap-port"]
    assert bootstrap in container(prefill)["args"] and int(bootstrap) in {p["containerPort"] for p in container(prefill)["ports"]}
    assert labels_of(config["selector"])["app.kubernetes.io/instance"] == RELEASE, "releases do not share workers"
    for sel in roles.values():
        assert not sel.items() <= pod_labels(gateway(docs)).items(), "the gateway's own pods are never workers"


def test_epd_mode_runs_encode_workers_the_encode_selector_finds() -> None:
    docs = render(EPD)
    config = parsed(docs)
    assert config["epd_disaggregation"] and config["pd_disaggregation"] and config["kv_connector"] == "bootstrap"
    common = labels_of(config["selector"])
    roles = {role: {**common, **labels_of(config[f"{role}_selector"])} for role in ("prefill", "decode", "encode")}
    found = {}
    for d in workers(docs):
        matched = [role for role, sel in roles.items() if sel.items() <= pod_labels(d).items()]
        assert len(matched) == 1, f"{d['metadata']['name']}: matches {matched}"
        found[matched[0]] = d
        args = container(d)["args"]
        assert args[args.index("--model") + 1] == "tiny-mm", "every EPD worker serves the multimodal preset"
    assert set(found) == {"prefill", "decode", "encode"}
    encode = found["encode"]
    args, ports = container(encode)["args"], {p["containerPort"] for p in container(encode)["ports"]}
    assert "--encoder-only" in args and "--disaggregation-mode" not in args
    annotations = encode["spec"]["template"]["metadata"]["annotations"]
    bootstrap = annotations["sglang.ai/bootstrap-port"]
    assert bootstrap == "8990" and bootstrap in args and int(bootstrap) in ports, "the encode worker serves the port announced"
    assert int(annotations["pdgate.ai/port"]) in ports
    assert encode["spec"]["replicas"] == 1
    # PD mode (the default) has no encode workers and no encode selector.
    default = render()
    assert not parsed(default)["encode_selector"] and len(workers(default)) == 2
    assert parsed(default)["epd_disaggregation"] is False
    with pytest.raises(helm.HelmError, match="epdDisaggregation needs gateway.pdDisaggregation"):
        render({"gateway": {"epdDisaggregation": True, "pdDisaggregation": False}})


def test_policy_and_extra_args_values_reach_the_gateway() -> None:
    config = parsed(render({"gateway": {"policy": "power_of_two", "prefillPolicy": "cache_aware", "decodePolicy": "random",
                                        "kvConnector": "nixl", "extraArgs": ["--retry-max-retries", "4"]}}))
    assert (config["policy"], config["prefill_policy"], config["decode_policy"]) == ("power_of_two", "cache_aware", "random")
    assert config["kv_connector"] == "nixl" and config["retry_max_retries"] == 4
    default = parsed(render())
    assert (default["policy"], default["prefill_policy"], default["decode_policy"]) == ("round_robin", None, None)


def test_regular_mode_runs_colocated_workers_the_selector_finds() -> None:
    docs = render(REGULAR)
    config = parsed(docs)
    assert not config["pd_disaggregation"] and not config["prefill_selector"]
    (worker,) = workers(docs)
    assert "--disaggregation-mode" not in container(worker)["args"]
    selector = labels_of(config["selector"])
    assert selector.items() <= pod_labels(worker).items()
    assert not selector.items() <= pod_labels(gateway(docs)).items(), "the gateway would route to itself"


def test_without_discovery_there_is_no_rbac_and_no_workers() -> None:
    docs = render(BARE)
    assert not of_kind(docs, "Role") and not of_kind(docs, "RoleBinding") and not workers(docs)
    assert not of_kind(docs, "PodDisruptionBudget")
    assert "--service-discovery" not in gateway_argv(docs)


def secret_env(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container(gateway(docs))["env"] if "secretKeyRef" in e.get("valueFrom", {})}


def test_keys_come_only_from_existing_secrets() -> None:
    default = secret_env(render())
    assert set(default) == {"PDGATE_ADMIN_API_KEY"}, "the client and worker keys are off by default"
    admin = default["PDGATE_ADMIN_API_KEY"]
    assert admin == {"name": "pdgate-admin-api-key", "key": "admin-api-key"}, "required: no Secret, no start"
    everything = secret_env(render(EVERYTHING))
    assert everything["PDGATE_API_KEY"]["name"] == "client-key"
    assert everything["PDGATE_WORKER_API_KEY"] == {"name": "worker-key", "key": "worker-api-key"}
    for docs in (render(), render(EVERYTHING)):
        assert not [a for a in gateway_argv(docs) if "api-key" in a], "keys never go on the command line"
    with pytest.raises(helm.HelmError, match="adminApiKey.existingSecret"):
        render({"adminApiKey": {"existingSecret": ""}})


def test_the_gateway_reads_the_worker_key_from_the_secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart sets PDGATE_WORKER_API_KEY; `pdgate launch` turns it into --worker-api-key."""
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    from pdgate import _core
    from pdgate.cli import WORKER_API_KEY_ENV, _with_worker_key_from_env

    docs = render(EVERYTHING)
    assert WORKER_API_KEY_ENV in secret_env(docs)
    monkeypatch.setenv(WORKER_API_KEY_ENV, "-worker-secret")
    config = json.loads(_core.parse_cli(_with_worker_key_from_env(gateway_argv(docs))))
    assert config["worker_api_key"] == "-worker-secret"


def test_the_worker_ca_is_mounted_where_the_flag_points() -> None:
    docs = render(EVERYTHING)
    argv = gateway_argv(docs)
    path = pathlib.PurePosixPath(argv[argv.index("--worker-ca-cert") + 1])
    c = container(gateway(docs))
    (mount,) = c["volumeMounts"]
    assert path.parent == pathlib.PurePosixPath(mount["mountPath"]) and path.name == "ca.crt"
    (volume,) = gateway(docs)["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"] and volume["configMap"]["name"] == "workers-ca"
    assert "--worker-ca-cert" not in gateway_argv(render()), "system roots by default"


def test_shutdown_fits_in_the_grace_period() -> None:
    for values in ({}, {"gateway": {"preStopSleepSeconds": 12, "drainSeconds": 40}}):
        docs = render(values)
        pod = gateway(docs)["spec"]["template"]["spec"]
        sleep = pre_stop_sleep(container(gateway(docs)))
        drain = max(gateway_drain_seconds(gateway_argv(docs)), values.get("gateway", {}).get("drainSeconds", 10))
        assert pod["terminationGracePeriodSeconds"] > sleep + drain, values
    default = gateway(render())
    assert pre_stop_sleep(container(default)) == 5
    # The chart's default drain is the gateway's own.
    assert default["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 5 + gateway_drain_seconds(gateway_argv(render())) + 5
    for d in workers(render()):
        spec = d["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] > pre_stop_sleep(spec["containers"][0])


def test_pod_disruption_budget_keeps_a_gateway_serving() -> None:
    docs = render()
    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    deployment = gateway(docs)
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()
    assert "minAvailable" not in pdb["spec"] and 1 <= pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_rbac_grants_only_reading_pods_in_the_namespace() -> None:
    docs = render()
    (role,) = of_kind(docs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    (binding,) = of_kind(docs, "RoleBinding")
    (account,) = of_kind(docs, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    assert gateway(docs)["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_service_selects_the_gateway_pods_and_port() -> None:
    docs = render()
    (service,) = of_kind(docs, "Service")
    deployment = gateway(docs)
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in container(deployment)["ports"]}
    probes = container(deployment)
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readiness" and probes["livenessProbe"]["httpGet"]["path"] == "/liveness"


def test_values_schema_enums_are_the_gateways_choices() -> None:
    core = pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    choices = {o["name"]: set(o["choices"]) for o in json.loads(core.config_schema())["options"]}
    gateway_values = json.loads((CHART / "values.schema.json").read_text())["properties"]["gateway"]["properties"]
    assert set(gateway_values["policy"]["enum"]) == choices["policy"]
    assert set(gateway_values["prefillPolicy"]["enum"]) == set(gateway_values["decodePolicy"]["enum"]) == choices["policy"] | {""}
    assert set(gateway_values["kvConnector"]["enum"]) == choices["kv_connector"]
    assert set(gateway_values["cacheSource"]["enum"]) == choices["cache_source"]


@pytest.mark.parametrize("values", [{"gateway": {"policy": "fastest"}}, {"gateway": {"kvConnector": "lmcache"}},
                                    {"gateway": {"cacheSource": "guess"}},
                                    {"discovery": {"port": 0}}, {"gateway": {"replicas": "two"}}])
def test_bad_values_are_refused_before_anything_is_applied(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(values)
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"], f"helm lint accepted {values}"
