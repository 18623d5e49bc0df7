"""The cluster configs in cluster/: offline checks of every file, and a one-machine rehearsal of the
autoscaling path with real Ray.

- Cluster-launcher YAMLs (aws, gcp, local) go through Ray's own `prepare_config` + `validate_config`.
  Nothing reaches a cloud: `prepare_config` only merges the installed ray's provider defaults file.
- Security invariants: no Ray/MLflow port open to the world, the dashboard and MLflow bind to
  127.0.0.1, no credentials in any file.
- KubeRay manifests: checked against the fields they use (see `test_kuberay_manifests`).
- Drift: the node types of cluster/local.yaml mirror those of the cloud configs.
- The rehearsal (`test_local_autoscaling_rehearsal`): `ray start --head` with cluster/local.yaml on
  Ray's fake_multinode provider, the smoke study submitted with `ray job submit` so that every trial
  needs a GPU (a logical one: the head has none), and the autoscaler has to add 1-GPU worker nodes,
  then remove them when idle. The only thing not real is the cloud API (the fake provider starts
  raylets on this machine instead of VMs); Ray, Tune, DeepSpeed and MLflow are the real ones.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import bucket_keys
from test_study import (
    BIN,
    ENV,
    ROOT,
    SMOKE,
    copy_checkout,
    head_ports,
    mlflow_runs,
    start_head,
    stop_ray_started_here,
    wait_for_job_api,
)

pytestmark = pytest.mark.slow

CLUSTER = ROOT / "cluster"
LAUNCHER = {name: CLUSTER / f"{name}.yaml" for name in ("aws", "gcp", "local")}
KUBERAY = {name: CLUSTER / "kuberay" / f"{name}.yaml" for name in ("raycluster", "rayjob", "mlflow")}
PRIVATE_PORTS = {6379, 8265, 10001, 5000}  # GCS, dashboard/job API, Ray client, MLflow
WORLD = {"0.0.0.0/0", "::/0"}
HEAD = "ray.head.default"
GPU_1 = {"gpu_1_spot", "gpu_1_ondemand"}  # the 1-GPU twins (which one: README.md)
LABEL = "lengthgen/node-type"  # every node type declares it, so a node says which type it is


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def gpu_types(cfg: dict) -> dict:
    return {n: t for n, t in cfg["available_node_types"].items() if t["resources"].get("GPU", 0) > 0}


# --- 1. Ray's own validation ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_cluster_launcher_yaml_passes_rays_validation(name):
    from study.ray_compat import cluster_config_validated

    config = cluster_config_validated(load(LAUNCHER[name]))
    assert config["head_node_type"] == HEAD
    assert config["available_node_types"][HEAD]["resources"].get("GPU", 0) == 0, "the head has no GPU"
    for node_type in config["available_node_types"].values():
        assert {"CPU", "GPU"} <= set(node_type["resources"]), "declare CPU and GPU for every node type"
    assert 0 < config["idle_timeout_minutes"] <= 10


# --- 2. safe by default -------------------------------------------------------------------------
def _ports(spec) -> set[int]:
    """Ports a rule allows: AWS FromPort..ToPort, GCP 'ports' strings ('8265', '6000-7000')."""
    if "FromPort" in spec:
        lo, hi = int(spec["FromPort"]), int(spec.get("ToPort", spec["FromPort"]))
        return set(range(lo, hi + 1)) if lo >= 0 else set(range(65536))  # -1: all ports
    ports = set()
    for p in spec.get("ports") or ["0-65535"]:
        lo, _, hi = str(p).partition("-")
        ports |= set(range(int(lo), int(hi or lo) + 1))
    return ports


def test_no_private_port_is_open_to_the_world():
    aws = load(LAUNCHER["aws"])
    rules = aws["provider"].get("security_group", {}).get("IpPermissions", [])
    assert rules, "aws.yaml declares its security group's ingress explicitly"
    for rule in rules:
        sources = {r["CidrIp"] for r in rule.get("IpRanges", [])} | {
            r["CidrIpv6"] for r in rule.get("Ipv6Ranges", [])}
        if sources & WORLD:
            assert not _ports(rule) & PRIVATE_PORTS, f"aws.yaml opens {_ports(rule) & PRIVATE_PORTS} to the world"

    rules = gcp_network_commands("YOUR-PROJECT-ID", "203.0.113.10/32")["firewall-rules"]
    assert rules, "cluster/gcp-network.sh creates gcp.yaml's firewall rules"
    for rule in rules:
        if set(rule.get("source-ranges", "").split(",")) & WORLD or not (
                rule.get("source-ranges") or rule.get("source-tags")):  # GCP: no source = 0.0.0.0/0
            for allowed in rule["allow"].split(","):
                proto, _, ports = allowed.partition(":")
                assert ports and not _ports({"ports": [ports]}) & PRIVATE_PORTS, f"{rule['name']} opens a private port"

    for doc in (d for path in KUBERAY.values() for d in yaml.safe_load_all(path.read_text()) if d):
        for service in _walk(doc, "serviceType"):
            assert service in (None, "ClusterIP"), "expose nothing outside the Kubernetes cluster"
        if doc.get("kind") == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP"

    # the dashboard/job API and MLflow listen on 127.0.0.1 where these files start them
    for name in ("aws", "gcp"):
        cfg = load(LAUNCHER[name])
        head_cmds = " ".join(cfg["head_setup_commands"] + cfg["head_start_ray_commands"])
        assert "--dashboard-host=127.0.0.1" in head_cmds, name
        assert re.search(r"mlflow server[^;&|]*--host 127\.0\.0\.1", head_cmds), name
        assert "0.0.0.0" not in head_cmds, name
    # KubeRay: the job API answers on the head Service (in the Kubernetes cluster only, with the
    # token): test_kuberay_job_api_is_in_cluster_only_and_token_authenticated


GCP_NETWORK = CLUSTER / "gcp-network.sh"
FAKE_GCLOUD = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def gcp_network_commands(project: str, ssh_from: str, tmp: Path | None = None) -> dict:
    """Run cluster/gcp-network.sh with a `gcloud` that records its arguments: what it would create,
    {"networks": [...], "subnets": [...], "firewall-rules": [...]}, each a dict of its flags (and name)."""
    tmp = Path(tempfile.mkdtemp(prefix="gcloud-")) if tmp is None else tmp
    (tmp / "gcloud").write_text(FAKE_GCLOUD)
    (tmp / "gcloud").chmod(0o755)
    log = tmp / "gcloud.log"
    log.write_text("")
    env = {"PATH": f"{tmp}:/usr/bin:/bin", "GCLOUD_LOG": str(log)}
    out = subprocess.run(["bash", str(GCP_NETWORK), project, ssh_from], env=env, capture_output=True, text=True,
                         timeout=60)
    made: dict = {"networks": [], "subnets": [], "firewall-rules": [], "returncode": out.returncode,
                  "stderr": out.stderr}
    for line in log.read_text().splitlines():
        args = json.loads(line)
        assert args[:1] == ["compute"] and "create" in args, args
        what = "subnets" if args[1:3] == ["networks", "subnets"] else args[1]
        name = args[args.index("create") + 1]
        flags, rest = {"name": name}, args[args.index("create") + 2:]
        for i, a in enumerate(rest):
            if a.startswith("--"):
                value = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else True
                flags[a[2:]] = value
        made[what].append(flags)
    return made


def test_gcp_nodes_live_in_the_network_whose_rules_are_applied(tmp_path):
    """gcp.yaml names a VPC (every node type's networkInterfaces: Ray uses it as given) and
    cluster/gcp-network.sh creates that VPC and its only firewall rules; no key of any launcher file is
    one Ray ignores (gcp.yaml's `firewall_rules` was documentation nothing applied)."""
    import ray.autoscaler

    source = " ".join(p.read_text() for p in Path(ray.autoscaler.__file__).parent.rglob("*.py"))
    for name, path in LAUNCHER.items():
        for key in load(path)["provider"]:
            assert re.search(rf"[\"']{re.escape(key)}[\"']", source), f"{name}.yaml: Ray never reads provider.{key}"

    made = gcp_network_commands("my-project", "198.51.100.7/32", tmp_path)
    assert made["returncode"] == 0, made["stderr"]
    (network,), (subnet,) = made["networks"], made["subnets"]
    assert network["subnet-mode"] == "custom" and subnet["network"] == network["name"]
    assert all(flags["project"] == "my-project" for kind in ("networks", "subnets", "firewall-rules")
               for flags in made[kind])
    gcp = load(LAUNCHER["gcp"])
    assert subnet["region"] == gcp["provider"]["region"]
    expected = f"regions/{subnet['region']}/subnetworks/{subnet['name']}"
    tags = set()
    for type_name, node_type in gcp["available_node_types"].items():
        interfaces = node_type["node_config"].get("networkInterfaces")
        assert interfaces and [i["subnetwork"] for i in interfaces] == [expected], type_name
        tags |= set(node_type["node_config"]["tags"]["items"])
    rules = {r["name"]: r for r in made["firewall-rules"]}
    assert all(r["network"] == network["name"] and r["direction"] == "INGRESS" for r in rules.values())
    assert {r["target-tags"] for r in rules.values()} == tags  # the rules apply to exactly these nodes
    internal = [r for r in rules.values() if r.get("source-tags")]
    assert [r["source-tags"] for r in internal] == [",".join(sorted(tags))]
    ssh = [r for r in rules.values() if r.get("source-ranges")]
    assert [(r["source-ranges"], r["allow"]) for r in ssh] == [("198.51.100.7/32", "tcp:22")]
    # SSH from the whole internet is refused, not applied
    for world in WORLD:
        refused = gcp_network_commands("my-project", world, tmp_path)
        assert refused["returncode"] == 2 and not refused["firewall-rules"], refused


def test_gcp_network_refuses_ssh_from_any_wide_or_malformed_range(tmp_path):
    """Not only the literal 0.0.0.0/0: any list of source ranges holding a public range wider than a
    /24 (IPv6: /48) is the internet, or much of it (0.0.0.0/1,128.0.0.0/1 is all of it), and a range
    that is not a CIDR is a mistake; refused with exit 2 and a line naming the range, before any
    gcloud call. Private ranges (RFC 1918, fc00::/7) and narrow public ones pass. (gcloud is faked:
    the cloud API cannot be reached from here; the check itself is the script's own.)"""
    refused = ["0.0.0.0/1,128.0.0.0/1", "203.0.113.10/32,0.0.0.0/1", "198.51.100.0/23", "1.0.0.0/8",
               "2001:db8::/32", "0.0.0.0/8", "not-a-range", "203.0.113.10/32,", "10.0.0.1/8"]
    for ranges in refused:
        made = gcp_network_commands("my-project", ranges, tmp_path)
        assert made["returncode"] == 2 and not made["networks"] and not made["firewall-rules"], (ranges, made)
        line = made["stderr"].strip().splitlines()[-1]
        assert line.startswith("error: SSH source range") and ("too wide" in line or "not a CIDR" in line), line
    for ranges in ["203.0.113.10/32", "203.0.113.10", "198.51.100.0/24", "10.0.0.0/8", "192.168.1.0/24,203.0.113.10/32",
                   "2001:db8:1::/48", "fd00::/8"]:
        made = gcp_network_commands("my-project", ranges, tmp_path)
        assert made["returncode"] == 0, (ranges, made["stderr"])
        assert [r["source-ranges"] for r in made["firewall-rules"] if r.get("source-ranges")] == [ranges]


def _walk(node, key):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, key)


SECRET = re.compile(
    r"(aws_secret_access_key|aws_access_key_id|secret_access_key|private_key(?!_path)|password|passwd|token)"
    r"\s*[:=]\s*['\"]?(?!\s*$)(?!\$\{?)(?!YOUR-)(?![~/])(\S+)", re.I)
KEY_MATERIAL = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----|AKIA[0-9A-Z]{16}|ghp_[0-9A-Za-z]{30,}")


def test_no_credentials_in_any_file():
    files = sorted(p for p in CLUSTER.rglob("*") if p.is_file())
    assert len(files) >= 5
    for path in files:
        text = path.read_text()
        assert not KEY_MATERIAL.search(text), path
        for line in text.splitlines():
            stripped = line.split("#", 1)[0]  # comments may name a variable, not hold a value
            assert not SECRET.search(stripped), f"{path}: {line.strip()}"


# --- 3. KubeRay manifests -----------------------------------------------------------------------
# KubeRay's own CRD schemas (operator v1.6.0, Apache-2.0; tests/data/kuberay/*.schema.json say where
# from): every field of the manifests is checked as the API server checks it with strict field
# validation (kubectl's default): an unknown or misspelled field is an error, not silently dropped.
KUBERAY_SCHEMAS = ROOT / "tests" / "data" / "kuberay"


def crd_validator(kind: str):
    import jsonschema

    data = json.loads((KUBERAY_SCHEMAS / f"{kind.lower()}s.v1.schema.json").read_text())
    assert data["kind"] == kind and data["license"].startswith("Apache-2.0")
    return jsonschema.Draft7Validator(_strict(data["openAPIV3Schema"]))


def _strict(schema):
    """A structural schema as the API server applies it with strict field validation: an object with
    `properties` admits no other field (unless x-kubernetes-preserve-unknown-fields), and
    int-or-string fields take either."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def schema_errors(kind: str, doc: dict) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                  for e in crd_validator(kind).iter_errors(doc))


def kuberay_docs() -> dict[str, dict]:
    docs = [d for path in KUBERAY.values() for d in yaml.safe_load_all(path.read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_kuberay_manifests_match_the_crd_schema():
    docs = kuberay_docs()
    for kind in ("RayCluster", "RayJob"):
        assert docs[kind]["apiVersion"] == "ray.io/v1"
        assert schema_errors(kind, docs[kind]) == [], kind
    # the check is real: a misspelled field, a wrong type, a value outside an enum
    rc = json.loads(json.dumps(docs["RayCluster"]))
    rc["spec"]["headGroupSpec"]["rayStartParam"] = rc["spec"]["headGroupSpec"].pop("rayStartParams")
    rc["spec"]["workerGroupSpecs"][0]["minReplicas"] = "0"
    rc["spec"]["authOptions"]["mode"] = "tokens"
    errors = " | ".join(schema_errors("RayCluster", rc))
    for expected in ("'rayStartParam' was unexpected", "minReplicas: '0' is not of type 'integer'",
                     "authOptions.mode: 'tokens' is not one of"):
        assert expected in errors, errors
    job = json.loads(json.dumps(docs["RayJob"]))
    job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["envv"] = []
    assert any("'envv' was unexpected" in e for e in schema_errors("RayJob", job))


def test_kuberay_manifests():
    """What the schema cannot say: enableInTreeAutoscaling, minReplicas 0, nvidia.com/gpu limits
    matching the declared GPU resource, rayStartParams values being strings, the RayJob's entrypoint."""
    docs = kuberay_docs()
    rc = docs["RayCluster"]
    assert rc["metadata"]["name"]
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["rayVersion"] == "2.60.0"
    _check_group(spec["headGroupSpec"], head=True)
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert {"gpu-1-spot", "gpu-1-ondemand", "gpu-8-spot", "gpu-8-ondemand"} <= set(groups)
    for name, group in groups.items():
        assert group["minReplicas"] == 0 and group["replicas"] == 0 and group["maxReplicas"] >= 1, name
        gpus = _check_group(group, head=False)
        assert gpus == (8 if name.startswith("gpu-8") else 1), name

    jspec = docs["RayJob"]["spec"]
    assert ("rayClusterSpec" in jspec) != ("clusterSelector" in jspec)
    assert "python study/run.py --space search_spaces/experiments/paper_sparse_parity.yaml" in jspec["entrypoint"]
    if "clusterSelector" in jspec:
        assert jspec["clusterSelector"]["ray.io/cluster"] == rc["metadata"]["name"]


# How the operator labels the pods (KubeRay ray-operator/controllers/ray/utils/constant.go and
# rayjob_controller.go getSubmitterTemplate; Helm chart labels of the operator's own pod)
def submitter_pod_labels(job: dict) -> dict:
    template = job["spec"].get("submitterPodTemplate", {}).get("metadata", {}).get("labels", {})
    return {**template, "ray.io/originated-from-cr-name": job["metadata"]["name"],
            "ray.io/originated-from-crd": "RayJob", "app.kubernetes.io/created-by": "kuberay-operator"}


def ray_pod_labels(rc: dict, node_type: str) -> dict:
    return {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": node_type}


OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/component": "kuberay-operator"}


def _selects(selector: dict | None, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


NAMESPACE = "lengthgen"  # where the manifests put the RayCluster, its RayJobs and MLflow
OPERATOR_NAMESPACE = "kuberay-system"


def namespace_labels(name: str) -> dict:
    """The labels of a namespace a pod cannot choose: the API server sets kubernetes.io/metadata.name."""
    return {"kubernetes.io/metadata.name": name}


def admitted(policies: list[dict], target: dict, source: dict, source_ns: str, port: int,
             target_ns: str = NAMESPACE) -> bool:
    """Whether NetworkPolicies admit a TCP connection from a pod with `source` labels in namespace
    `source_ns` to `port` of a pod with `target` labels in `target_ns` (Kubernetes semantics: a policy
    applies in its own namespace; a pod no Ingress policy selects admits everything; a peer without a
    namespaceSelector means the policy's namespace)."""
    selecting = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and p["metadata"].get("namespace", "default") == target_ns
                 and _selects(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port) for p in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True  # from everywhere
            for peer in peers:
                if "ipBlock" in peer:
                    return True  # addresses: anything outside the pod network too
                ns_ok = (_selects(peer["namespaceSelector"], namespace_labels(source_ns)) if "namespaceSelector" in peer
                         else source_ns == target_ns)
                if ns_ok and _selects(peer.get("podSelector"), source):
                    return True
    return False


def test_kuberay_job_api_is_in_cluster_only_and_token_authenticated():
    """The RayJob path works (its submitter reaches the job API through the head Service, with the
    token) and nothing else does: no other pod of the Kubernetes cluster reaches 8265, 6379 or 10001,
    and nothing outside it reaches the Service at all."""
    docs = [d for path in KUBERAY.values() for d in yaml.safe_load_all(path.read_text()) if d]
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    job = next(d for d in docs if d["kind"] == "RayJob")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    ray_policies = [p for p in policies if _selects(p["spec"]["podSelector"], ray_pod_labels(rc, "head"))]
    head = rc["spec"]["headGroupSpec"]

    # reachable through the head Service: the dashboard listens on the pod's address, port 8265
    assert head["rayStartParams"].get("dashboard-host") == "0.0.0.0", \
        "with 127.0.0.1 nothing answers on the head Service's 8265, which the RayJob submitter uses"
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 8265, 10001} <= ports
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == rc["metadata"]["name"]
    assert job["spec"].get("submissionMode", "K8sJobMode") == "K8sJobMode"

    # in-cluster only: who may connect to which port of the head
    assert policies, "a NetworkPolicy guards the cluster's ports"
    head_pod = ray_pod_labels(rc, "head")
    worker = ray_pod_labels(rc, "worker")
    submitter = submitter_pod_labels(job)
    assert rc["metadata"]["namespace"] == job["metadata"]["namespace"] == NAMESPACE
    for port in (6379, 8265, 10001):
        assert admitted(policies, head_pod, worker, NAMESPACE, port), port  # the cluster itself
        assert not admitted(policies, head_pod, {"app": "anything-else"}, NAMESPACE, port), port
        assert not admitted(policies, head_pod, {"app": "anything-else"}, "other", port), port
        # labels any pod can give itself: a Ray pod's, or the operator's, from another namespace
        assert not admitted(policies, head_pod, worker, "other", port), port
        assert not admitted(policies, head_pod, OPERATOR_LABELS, "other", port), port
    assert admitted(policies, head_pod, submitter, NAMESPACE, 8265)  # the RayJob submitter: the job API
    assert admitted(policies, head_pod, OPERATOR_LABELS, OPERATOR_NAMESPACE, 8265)  # the operator polls job status
    for port in (6379, 10001):
        assert not admitted(policies, head_pod, submitter, NAMESPACE, port), port
    assert not admitted(policies, head_pod, submitter, "other", 8265), "a RayJob of another namespace"
    for policy in ray_policies:  # nothing outside the pod network, and the cluster's workers are covered
        assert _selects(policy["spec"]["podSelector"], worker)
        assert not any("ipBlock" in peer for rule in policy["spec"]["ingress"] for peer in rule.get("from", []))

    # token-authenticated: the operator injects the token everywhere, the Ray containers and the
    # submitter name it too, all from one Secret
    auth = rc["spec"]["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"]
    containers = [head["template"]["spec"]["containers"][0]] + [
        g["template"]["spec"]["containers"][0] for g in rc["spec"]["workerGroupSpecs"]]
    containers.append(job["spec"]["submitterPodTemplate"]["spec"]["containers"][0])
    for container in containers:
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (auth["secretName"], "auth_token"), container["name"]


def pod_templates(doc: dict) -> list[tuple[dict, dict]]:
    """(pod labels, pod spec) of every pod a manifest makes (KubeRay's labels for a RayCluster's pods)."""
    if doc["kind"] == "RayCluster":
        groups = [("head", doc["spec"]["headGroupSpec"])] + [("worker", g) for g in doc["spec"]["workerGroupSpecs"]]
        return [(ray_pod_labels(doc, kind), {**g["template"]["spec"], "rayStartParams": g["rayStartParams"]})
                for kind, g in groups]
    if doc["kind"] == "RayJob":
        return [(submitter_pod_labels(doc), doc["spec"]["submitterPodTemplate"]["spec"])]
    if doc["kind"] == "Deployment":
        return [(doc["spec"]["template"]["metadata"]["labels"], doc["spec"]["template"]["spec"])]
    return []


def test_kuberay_policies_key_on_what_a_pod_cannot_claim_and_guard_mlflow():
    """Every NetworkPolicy peer that names pods by label also names their namespace by
    kubernetes.io/metadata.name (which the API server sets and no pod can), in the same `from` entry;
    the MLflow server (no auth of its own; it deletes runs and proxies the bucket) admits the
    RayCluster's pods only; nothing listens on 0.0.0.0 without a policy guarding its pod."""
    docs = [d for path in KUBERAY.values() for d in yaml.safe_load_all(path.read_text()) if d]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule without `from` admits every pod"
            for peer in rule["from"]:
                names = peer.get("namespaceSelector", {}).get("matchLabels", {})
                assert "podSelector" not in peer or names.get("kubernetes.io/metadata.name"), \
                    f"{policy['metadata']['name']}: {peer} admits pods by labels they can set on themselves"

    for doc in docs:  # whatever listens on every address of its pod has a policy selecting that pod
        for labels, spec in pod_templates(doc):
            listens = json.dumps([spec.get("rayStartParams", {}), [c.get("command") for c in spec["containers"]],
                                  [c.get("args") for c in spec["containers"]]])
            if "0.0.0.0" in listens:
                namespace = doc["metadata"].get("namespace", "default")
                assert any(p["metadata"].get("namespace", "default") == namespace
                           and _selects(p["spec"]["podSelector"], labels) for p in policies), \
                    f"{doc['kind']} {doc['metadata']['name']} listens on 0.0.0.0 with no NetworkPolicy"

    # MLflow: a Deployment runs the server the RayJob records to, and only the RayCluster reaches it
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    job = next(d for d in docs if d["kind"] == "RayJob")
    server = next(d for d in docs if d["kind"] == "Deployment" and "mlflow server" in json.dumps(d))
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "mlflow")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert _selects({"matchLabels": service["spec"]["selector"]}, server["spec"]["template"]["metadata"]["labels"])
    uri = f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:5000"
    assert f"--mlflow-uri {uri}" in job["spec"]["entrypoint"]
    mlflow_pod = server["spec"]["template"]["metadata"]["labels"]
    for kind in ("head", "worker"):
        assert admitted(policies, mlflow_pod, ray_pod_labels(rc, kind), NAMESPACE, 5000), kind
    for source, namespace in (({"app": "anything-else"}, NAMESPACE), (ray_pod_labels(rc, "head"), "other"),
                              (submitter_pod_labels(job), NAMESPACE), (OPERATOR_LABELS, OPERATOR_NAMESPACE)):
        assert not admitted(policies, mlflow_pod, source, namespace, 5000), (source, namespace)
    # no manifest's comment recommends a server on 0.0.0.0 that no manifest guards
    for path in KUBERAY.values():
        for line in path.read_text().splitlines():
            if "mlflow server" in line and "0.0.0.0" in line:
                assert path == KUBERAY["mlflow"], f"{path}: {line.strip()}"


def _check_group(group: dict, head: bool) -> int:
    params = group["rayStartParams"]
    assert all(isinstance(v, str) for v in params.values()), "rayStartParams values are strings"
    containers = group["template"]["spec"]["containers"]
    ray_container = containers[0]
    assert ray_container["image"].startswith("rayproject/ray:2.60.0")
    limits = ray_container["resources"]["limits"]
    gpus = int(limits.get("nvidia.com/gpu", 0))
    if head:
        assert gpus == 0 and params.get("num-gpus", "0") == "0"
    else:
        assert group["template"]["spec"].get("tolerations"), "GPU nodes are usually tainted"
    return gpus


# --- 4. drift between the rehearsal and the clouds -------------------------------------------------
def _shape(cfg: dict) -> dict:
    return {name: ({k: t["resources"].get(k, 0) for k in ("CPU", "GPU")}, t.get("labels", {}))
            for name, t in cfg["available_node_types"].items()}


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_local_yaml_mirrors_the_cloud_node_types(cloud):
    local, remote = load(LAUNCHER["local"]), load(LAUNCHER[cloud])
    assert _shape(local) == _shape(remote), f"cluster/local.yaml and cluster/{cloud}.yaml drifted apart"
    for cfg in (local, remote):
        assert {"gpu_1_spot", "gpu_1_ondemand", "gpu_8_spot", "gpu_8_ondemand"} == set(gpu_types(cfg))
        for name, t in gpu_types(cfg).items():
            assert t.get("min_workers", 0) == 0, f"{name} autoscales from 0"
            assert t["labels"][LABEL] == name
    # the KubeRay worker groups carry the same shapes (names with '-': Kubernetes naming)
    rc = next(d for d in yaml.safe_load_all(KUBERAY["raycluster"].read_text()) if d and d["kind"] == "RayCluster")
    for group in rc["spec"]["workerGroupSpecs"]:
        name = group["groupName"].replace("-", "_")
        cpu, _ = _shape(remote)[name][0]["CPU"], None
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == _shape(remote)[name][0]["GPU"], name
        assert int(group["rayStartParams"]["num-cpus"]) == cpu, name


# --- 5. the rehearsal ---------------------------------------------------------------------------
NODES = """
import json, sys
from ray.util.state import list_nodes
nodes = list_nodes(address=sys.argv[1], detail=True, limit=1000, raise_on_missing_output=False)
print(json.dumps([{"id": n.node_id, "state": n.state, "labels": n.labels, "resources": n.resources_total,
                   "head": n.is_head_node} for n in nodes]))
"""


def cluster_nodes(dash: int, env: dict) -> list[dict]:
    """Every node the cluster has had (alive and dead), from Ray's state API."""
    out = subprocess.run([sys.executable, "-c", NODES, f"http://127.0.0.1:{dash}"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# fake_multinode runs every node out of the head's session dir, and Ray unpacks an uploaded working_dir
# there with overwrite=True (ray/_private/runtime_env/working_dir.py): each new fake node would delete
# and re-extract the job's code under the processes running in it, and a trial starting at that moment
# dies before it runs. Real nodes have their own disks. The fake nodes share this one, so the job's
# code is a `local://` working_dir, a folder already on every node, used in place and never unpacked.
# The upload itself is tested by test_ray_job_submit_to_a_head_node.


def test_local_autoscaling_rehearsal(tmp_path, s3):
    """The study storage is a bucket (an S3 API on 127.0.0.1), as on a cloud cluster, not a shared folder."""
    local = load(LAUNCHER["local"])
    head_type = local["available_node_types"][HEAD]
    # the job's code: a copy of the checkout, with a smoke spec whose every trial needs one GPU
    work = tmp_path / "checkout"
    copy_checkout(work)
    spec = json.loads(json.dumps(SMOKE))
    spec["name"] = "smoke_gpu"
    # what is rehearsed is the cluster (nodes added for the trials, and removed), not the training:
    # one cell of two trials, one at a time, one report a trial, no sparsity meter
    spec["grid"] = {"task.params.train_length": [8]}
    spec["base"]["optim"]["steps"] = 20
    del spec["base"]["sparsity"]
    spec["resources"] = {"workers_per_trial": 1, "cpus_per_worker": 1, "gpus_per_worker": 1,
                         "max_concurrent_trials": 1, "max_failures": 0}  # a retry would hide a failure
    (work / "search_spaces" / "smoke_gpu.yaml").write_text(yaml.safe_dump(spec))

    ray_tmp = tempfile.mkdtemp(prefix="rayf", dir="/tmp")  # short: Ray's socket paths are limited
    ports = head_ports()
    from study.ray_compat import node_ip_address

    # the fake provider starts worker raylets against provider.gcs_address (default <ip>:6379)
    local["provider"]["gcs_address"] = f"{node_ip_address()}:{ports['port']}"
    config = Path(ray_tmp) / "local.yaml"
    config.write_text(yaml.safe_dump(local))
    env = {**ENV, **s3["env"], "PYTHONPATH": "", "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_AUTH_MODE": "token"}  # token auth: ENV's RAY_AUTH_TOKEN; the bucket's endpoint and keys
    head = start_head(env, tmp_path, ray_tmp, f"--autoscaling-config={config}",
                      f"--num-cpus={head_type['resources']['CPU']}", "--num-gpus=0",
                      f"--labels={LABEL}={HEAD}", ports=ports)
    dash = ports["dashboard-port"]
    storage, db = "s3://studies/rehearsal", tmp_path / "ml.db"
    timings = {}
    try:
        t0 = time.time()
        ray_cli = [str(BIN / "ray"), "job", "submit", f"--address={head.dashboard}"]
        wait_for_job_api(ray_cli, tmp_path, env, head)
        before = cluster_nodes(dash, env)
        assert [n["labels"].get(LABEL) for n in before if n["state"] == "ALIVE"] == [HEAD]
        assert not any(n["resources"].get("GPU") for n in before), "the head has no GPU"
        timings["head up"] = time.time() - t0

        t0 = time.time()
        out = subprocess.run(
            [*ray_cli, "--runtime-env-json", json.dumps({"working_dir": f"local://{work}"}), "--",
             "python", "study/run.py", "--space", "search_spaces/smoke_gpu.yaml",
             "--storage", storage, "--mlflow-uri", f"sqlite:///{db}"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )
        timings["study"] = time.time() - t0
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert "succeeded" in (out.stdout + out.stderr).lower()
        assert "1 worker(s) x 1 CPU + 1 GPU" in out.stdout

        # the autoscaler added GPU worker nodes, of a 1-GPU type among them (its bin packing may
        # also pick an 8-GPU node for several pending 1-GPU trials: it did once in our runs)
        added = [n for n in cluster_nodes(dash, env) if not n["head"]]
        types = [n["labels"].get(LABEL) for n in added]
        assert set(types) & GPU_1 and set(types) <= set(gpu_types(local)), added
        assert all(types.count(t) <= local["available_node_types"][t]["max_workers"] for t in GPU_1)
        for n in added:  # each node came up with the resources its type declares
            declared = local["available_node_types"][n["labels"][LABEL]]["resources"]
            assert (n["resources"]["CPU"], n["resources"]["GPU"]) == (declared["CPU"], declared["GPU"])

        # and removes them once idle (idle_timeout_minutes in local.yaml)
        t0 = time.time()
        while time.time() - t0 < 90:
            alive = [n for n in cluster_nodes(dash, env) if not n["head"] and n["state"] == "ALIVE"]
            if not alive:
                break
            time.sleep(2)
        assert not alive, f"idle GPU nodes were not removed: {alive}"
        timings["idle nodes removed"] = time.time() - t0
    finally:
        stop_ray_started_here(head, ray_tmp)
        print("rehearsal timings (s):", {k: round(v, 1) for k, v in timings.items()})

    # the study's record: a parent run and one FINISHED child run per trial
    _, parents, children = mlflow_runs(db, "smoke_gpu")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    keys = bucket_keys(s3, "rehearsal/")
    assert "rehearsal/smoke_gpu/results.csv" in keys  # the report, Tune's state and the checkpoints:
    assert any(k.startswith("rehearsal/smoke_gpu/tune/experiment_state") for k in keys)  # in the bucket
    assert any("/checkpoint_" in k for k in keys)
    assert any(k.startswith("rehearsal/mlartifacts/smoke_gpu/") for k in keys)  # and MLflow's artifacts


# --- the dry-run plan on a cluster: study/run.py --dry-run --cluster FILE ------------------------
# Nothing here needs a cloud, a GPU or Ray (the plan is computed from the YAML), so a missing flag or
# a missing line is a failure, never a skip.
@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_dry_run_names_the_node_type_of_each_trial(cloud, capsys, monkeypatch):
    """The workers of paper_sparse_parity (1 GPU, 4 CPU each) land on the smallest node type that
    fits one, a 1-GPU type; every other type that fits is named; 16 concurrent trials fit the
    types' max_workers, so there is no capacity warning."""
    from study import run as run_cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    space = ROOT / "search_spaces" / "experiments" / "paper_sparse_parity.yaml"
    try:
        code = run_cli.main(["--space", str(space), "--dry-run", "--cluster", str(LAUNCHER[cloud])])
    except SystemExit as e:  # argparse: no such flag
        pytest.fail(f"study/run.py refused --cluster (exit {e.code}): {capsys.readouterr().err}")
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [line for line in out.splitlines() if "node type:" in line]
    assert len(lines) == 1, out
    need = load(space)["resources"]
    fits = {name for name, t in load(LAUNCHER[cloud])["available_node_types"].items()
            if t["resources"].get("GPU", 0) >= need["gpus_per_worker"]
            and t["resources"].get("CPU", 0) >= need["cpus_per_worker"]}
    match = re.fullmatch(r"\s*node type: workers land on (\w+) \(1 GPU, (\d+) CPU; 1 worker\(s\) per node\)"
                         r"; also fit: ([\w, ]+)", lines[0])
    assert match, lines[0]
    assert match[1] in GPU_1 and match[1] in fits, (match[1], fits)
    assert set(match[3].split(", ")) == fits - {match[1]}
    assert "warning" not in out
