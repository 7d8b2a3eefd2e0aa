"""docker/k8s manifests and docker/compose.yaml, validated offline (no cluster, no Docker engine here).

- Kubernetes' own kinds: kubernetes-validate (its bundled schemas, strict: unknown fields are errors).
- KEDA ScaledObject, InferencePool, HTTPRoute: JSON schemas vendored in docker/schemas (made strict from
  the upstream CRDs by docker/schemas/vendor.py); the compose file: the vendored compose specification.
- Then what a schema cannot see: selectors match the pods, ports and names refer to things that exist,
  the embedded gateway configs load, commands use real options, autoscaling queries name exported metrics.
Each check is shown to catch a broken input.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml

from runtime.gateway.routing import GatewayConfig

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SCHEMAS = DOCKER / "schemas"
K8S_VERSION = "1.34.0"
IMAGE = "trtserve:0.1.0"  # what docker/compose.yaml builds from docker/Dockerfile
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.keda.sh-v1alpha1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.inference.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.gateway.networking.k8s.io-v1.json",
}
USER_CREATED_SECRETS = {"trtserve-api-key"}  # documented in docker/k8s/gateway.yaml


def load_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


DOCS = load_docs()


def problems(doc: dict[str, Any]) -> list[str]:
    """Schema violations of one manifest ([] when valid)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        schema = json.loads((SCHEMAS / CRD_SCHEMAS[key]).read_text())
        return [f"{e.json_path}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{exc.json_path}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


def compose_problems(data: object) -> list[str]:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    return [f"{e.json_path}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(data)]


def find(kind: str, name: str | None = None, docs: list[dict[str, Any]] = DOCS) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def pod_templates(docs: list[dict[str, Any]] = DOCS) -> list[dict[str, Any]]:
    return [d["spec"]["template"] for d in find("Deployment", docs=docs)]


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid(doc):
    assert problems(doc) == []


def test_every_kind_is_covered():
    kinds = {d["kind"] for d in DOCS}
    assert {"Deployment", "Service", "ScaledObject", "InferencePool", "HTTPRoute"} <= kinds


def broken(kind: str, name: str, change) -> dict[str, Any]:
    doc = copy.deepcopy(find(kind, name)[0])
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (broken("Deployment", "trtserve-triton", lambda d: d["spec"].update(replica=2)), "replica"),
        (broken("Deployment", "trtserve-gateway",
                lambda d: d["spec"]["template"]["spec"]["containers"][0].update(args="--port 9000")), "args"),
        (broken("Service", "trtserve-triton", lambda d: d["spec"]["ports"][0].update(port="grpc")), "port"),
        (broken("InferencePool", "trtserve", lambda d: d["spec"]["targetPorts"][0].update(number=0)), "minimum"),
        (broken("InferencePool", "trtserve", lambda d: d.update(apiVersion="inference.networking.x-k8s.io/v1alpha2")),
         "Couldn't find schema"),
        (broken("ScaledObject", "trtserve-triton", lambda d: d["spec"].update(maxReplicas=8)), "maxReplicas"),
        (broken("ScaledObject", "trtserve-triton", lambda d: d["spec"].pop("triggers")), "triggers"),
        (broken("HTTPRoute", "trtserve", lambda d: d["spec"]["rules"][0].update(timeout="300s")), "timeout"),
    ],
)  # fmt: skip
def test_the_validators_catch_broken_manifests(doc, expected):
    found = problems(doc)
    assert found and expected in " ".join(found), found


def test_compose_file_follows_the_compose_specification():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert compose_problems(compose) == []
    bad = copy.deepcopy(compose)
    bad["services"]["gateway"]["depends_on"]["triton-1"]["condition"] = "service_ready"
    assert any("service_ready" in p for p in compose_problems(bad))
    bad = copy.deepcopy(compose)
    bad["services"]["gateway"]["port"] = ["9000:9000"]
    assert any("port" in p for p in compose_problems(bad))


def selector_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Services, the InferencePool and the ScaledObject must find what they point at."""
    out = []
    templates = pod_templates(docs)

    def pods(labels: dict[str, str]) -> list[dict[str, Any]]:
        return [t for t in templates if labels.items() <= t["metadata"]["labels"].items()]

    def port_names(selected: list[dict[str, Any]]) -> set[str]:
        return {p["name"] for t in selected for c in containers(t) for p in c.get("ports", []) if "name" in p}

    def port_numbers(selected: list[dict[str, Any]]) -> set[int]:
        return {p["containerPort"] for t in selected for c in containers(t) for p in c.get("ports", [])}

    for service in find("Service", docs=docs):
        selected = pods(service["spec"]["selector"])
        if not selected:
            out.append(f"Service {service['metadata']['name']} selects no pod")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if target not in (port_names(selected) if isinstance(target, str) else port_numbers(selected)):
                out.append(f"Service {service['metadata']['name']} targets no container port {target!r}")
    for pool in find("InferencePool", docs=docs):
        selected = pods(pool["spec"]["selector"]["matchLabels"])
        if not selected:
            out.append("the InferencePool selects no pod")
        for port in pool["spec"]["targetPorts"]:
            if port["number"] not in port_numbers(selected):
                out.append(f"the InferencePool targets no container port {port['number']}")
        epp = pool["spec"]["endpointPickerRef"]
        services = find("Service", epp["name"], docs)
        if not services or epp["port"]["number"] not in {p["port"] for p in services[0]["spec"]["ports"]}:
            out.append(f"the InferencePool's picker {epp['name']}:{epp['port']['number']} is no Service port")
    for scaled in find("ScaledObject", docs=docs):
        if not find("Deployment", scaled["spec"]["scaleTargetRef"]["name"], docs):
            out.append(f"ScaledObject {scaled['metadata']['name']} scales no Deployment")
    for route in find("HTTPRoute", docs=docs):
        for rule in route["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                if not find(ref["kind"], ref["name"], docs):
                    out.append(f"HTTPRoute {route['metadata']['name']} routes to no {ref['kind']} {ref['name']}")
    return out


def reference_problems(docs: list[dict[str, Any]]) -> list[str]:
    """ConfigMaps, Secrets, claims, service accounts and probe ports that pods name must exist."""
    out = []
    for template in pod_templates(docs):
        spec = template["spec"]
        for volume in spec.get("volumes", []):
            for kind, key, field in (("ConfigMap", "configMap", "name"),
                                     ("PersistentVolumeClaim", "persistentVolumeClaim", "claimName")):  # fmt: skip
                if key in volume and not find(kind, volume[key][field], docs):
                    out.append(f"volume {volume['name']}: no {kind} {volume[key][field]}")
        if "serviceAccountName" in spec and not find("ServiceAccount", spec["serviceAccountName"], docs):
            out.append(f"no ServiceAccount {spec['serviceAccountName']}")
        for container in containers(template):
            names = {p["name"] for p in container.get("ports", []) if "name" in p}
            for env in container.get("env", []):
                secret = env.get("valueFrom", {}).get("secretKeyRef", {}).get("name")
                if secret and secret not in USER_CREATED_SECRETS and not find("Secret", secret, docs):
                    out.append(f"{container['name']}: no Secret {secret}")
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = container.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in names:
                    out.append(f"{container['name']}.{probe}: no port named {port}")
    return out


def test_selectors_and_references_find_their_targets():
    assert selector_problems(DOCS) == []
    assert reference_problems(DOCS) == []


def test_the_consistency_checks_catch_broken_references():
    docs = copy.deepcopy(DOCS)
    find("InferencePool", docs=docs)[0]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "triton"
    find("InferencePool", docs=docs)[0]["spec"]["targetPorts"][0]["number"] = 8080
    find("ScaledObject", docs=docs)[0]["spec"]["scaleTargetRef"]["name"] = "triton"
    find("Service", "trtserve-gateway", docs)[0]["spec"]["ports"][0]["targetPort"] = "web"
    gateway = find("Deployment", "trtserve-gateway", docs)[0]["spec"]["template"]["spec"]
    gateway["volumes"][0]["configMap"]["name"] = "gateway-config"
    gateway["containers"][0]["readinessProbe"]["httpGet"]["port"] = "health"
    assert selector_problems(docs) == [
        "Service trtserve-gateway targets no container port 'web'",
        "the InferencePool selects no pod",
        "the InferencePool targets no container port 8080",
        "ScaledObject trtserve-triton scales no Deployment",
    ]
    assert reference_problems(docs) == ["volume config: no ConfigMap gateway-config",
                                        "gateway.readinessProbe: no port named health"]  # fmt: skip


def test_the_gateway_configs_load_and_find_the_replicas():
    [config_map] = find("ConfigMap", "trtserve-gateway")
    config = GatewayConfig.from_dict(yaml.safe_load(config_map["data"]["gateway.yaml"]))
    [backend] = config.backends.values()
    # The backend's own replicas (its `both` workers), and its prefill and decode pools: each discovers the
    # headless Service of the Deployment that runs that role.
    for source, service in ((backend, "trtserve-triton"), (backend.prefill, "trtserve-prefill"),
                            (backend.decode, "trtserve-decode")):  # fmt: skip
        [headless] = find("Service", service)
        assert headless["spec"].get("clusterIP") == "None"
        namespace = headless["metadata"]["namespace"]
        assert source is not None and source.discover is not None
        assert source.discover.host == f"{service}.{namespace}.svc.cluster.local"
        ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
        assert (source.discover.grpc_port, source.discover.metrics_port) == (ports["grpc"], ports["metrics"])

    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    local = GatewayConfig.load(DOCKER / "gateway.compose.yaml")
    [replicas] = [b.configured_replicas for b in local.backends.values()]
    hosts = {r.url.rpartition(":")[0] for r in replicas}
    assert len(replicas) == 2 and hosts <= set(compose["services"])
    mounts = compose["services"]["gateway"]["volumes"]
    assert "./gateway.compose.yaml:/etc/trtserve/gateway.yaml:ro" in mounts


def option_problems(args: list[str], command: click.Command) -> list[str]:
    """Options in `args` that `command` does not declare."""
    declared = {opt for param in command.params for opt in param.opts}
    return [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in declared]


def commands() -> list[tuple[str, list[str]]]:
    """(command, its arguments) for every container of ours in the manifests and the compose file."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    specs = [(c["image"], c.get("command"), c.get("args", [])) for t in pod_templates() for c in containers(t)]
    specs += [(s["image"], s.get("entrypoint"), s.get("command", [])) for s in compose["services"].values()]
    out = []
    for image, entry, args in specs:
        if image != IMAGE:
            continue
        if entry == ["sh", "-c"]:
            out.append(("script", args))
        else:
            out.append((" ".join(entry) if entry else "trtserve serve", args))  # the image's entrypoint: serve
    return out


def test_commands_use_options_the_cli_declares():
    from builder.cli import main as build_engine
    from runtime.cli import serve
    from runtime.gateway.cli import gateway

    known = {"trtserve serve": serve, "trtserve gateway": gateway}
    seen = set()
    for name, args in commands():
        if name == "script":
            for line in re.findall(r"build-engine ([^\n;|&]*)", args[0]):
                assert option_problems(line.split(), build_engine) == [], line
                seen.add("build-engine")
            continue
        assert name in known, name
        assert option_problems(args, known[name]) == [], (name, args)
        seen.add(name)
    assert seen == {"trtserve serve", "trtserve gateway", "build-engine"}
    assert option_problems(["--engine", "e", "--openai-prot", "9000"], serve) == ["--openai-prot"]


def test_images_are_the_projects_or_pinned():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    images = [c["image"] for t in pod_templates() for c in containers(t)]
    images += [s["image"] for s in compose["services"].values()]
    for image in images:
        assert image == IMAGE or re.fullmatch(r"[\w.\-/]+:v?\d+\.\d+\.\d+", image), image
    assert compose["services"]["engine"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_autoscaling_queries_name_metrics_that_are_exported():
    from prometheus_client import CollectorRegistry

    from runtime.gateway.fair_queue import FairQueue
    from runtime.triton_model import disagg_metrics
    from runtime.triton_model.metrics import GAUGES, HISTOGRAMS

    registry = CollectorRegistry()
    FairQueue(1, 1, 1, registry)
    exported = set(GAUGES) | {m.name for m in registry.collect()} | {f"{h}_bucket" for h in HISTOGRAMS}
    exported |= set(disagg_metrics.GAUGES) | set(disagg_metrics.COUNTERS)
    names = {}
    for scaled in find("ScaledObject"):
        queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
        names[scaled["metadata"]["name"]] = {n for q in queries for n in re.findall(r"([A-Za-z_:][\w:]*)\{", q)}
        # Each pool counts its own pods (their names start with their Deployment's): no signal of another pool.
        target = scaled["spec"]["scaleTargetRef"]["name"]
        assert all(f'pod=~"{target}-.*"' in q for q in queries if "trtserve_gateway" not in q), queries
    assert names == {
        "trtserve-triton": {"vllm:num_requests_waiting", "trtserve_gateway_queue_depth", "vllm:kv_cache_usage_perc"},
        "trtserve-prefill": {"vllm:num_requests_waiting", "trtserve_time_to_first_token_seconds_bucket"},
        "trtserve-decode": {"vllm:kv_cache_usage_perc", "trtserve_kv_staged_blocks"},
    }
    assert set().union(*names.values()) <= exported
    assert "vllm:num_requests_wating" not in exported  # a misspelt name would be caught


def test_each_pool_runs_its_role():
    """The prefill and decode Deployments start `trtserve serve` with their role (and no pod-local gateway)."""
    for role in ("prefill", "decode"):
        [deployment] = find("Deployment", f"trtserve-{role}")
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert args[args.index("--role") + 1] == role and "--no-openai" in args
    triton = find("Deployment", "trtserve-triton")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--role" not in triton  # the unified pool: role both, the gateway's fallback
