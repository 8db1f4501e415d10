"""What the Kubernetes export keeps clients and pods from (issue 45): the servers admit only the routers, each
other and Prometheus; every container runs without privilege escalation or capabilities it does not need."""

from __future__ import annotations

import kubernetes_validate
import pytest

from pdserve.export.k8s_common import K8S_VERSION
from pdserve.orchestrate import ops
from pdserve.roles import SERVER_ROLES
from pdserve.spec.load import SHIPPED_CONFIGS


def exported(config, fmt: str = "statefulset") -> list[dict]:
    return ops.export("kubernetes", config, fmt=fmt).documents


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def pod_labels(doc: dict) -> list[dict[str, str]]:
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [lwt[t]["metadata"]["labels"] for t in ("leaderTemplate", "workerTemplate") if t in lwt]
    return [doc["spec"]["template"]["metadata"]["labels"]]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In) against a pod's labels."""
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []) if e["operator"] == "In")


@pytest.mark.parametrize("fmt", ["statefulset", "lws"])
def test_servers_admit_the_routers_each_other_and_prometheus_only(fmt):
    """Issue 45: the export kept nothing off P and D: any pod could call their OpenAI routes and D's held-KV
    control routes (list, release, pin every tenant's held turns)."""
    docs = exported(SHIPPED_CONFIGS / "p5en-2p2d-4hosts.yaml", fmt=fmt)
    policy = next(d for d in kinds(docs, "NetworkPolicy") if d["metadata"]["name"] == "p5en-2p2d-servers")
    validate(policy)
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "LeaderWorkerSet", "Deployment")]
    servers = [ls for d in workloads for ls in pod_labels(d) if ls["app.kubernetes.io/component"] in SERVER_ROLES]
    others = [ls for d in workloads for ls in pod_labels(d) if ls["app.kubernetes.io/component"] not in SERVER_ROLES]
    assert len(servers) >= 4 and others
    assert all(selects(policy["spec"]["podSelector"], ls) for ls in servers)
    assert not any(selects(policy["spec"]["podSelector"], ls) for ls in others)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peers, scrape = policy["spec"]["ingress"]
    admitted = [ls for ls in servers + others if any(selects(f["podSelector"], ls) for f in peers["from"])]
    assert sorted(ls["app.kubernetes.io/component"] for ls in admitted) == sorted(
        ls["app.kubernetes.io/component"] for ls in servers + others if ls["app.kubernetes.io/component"] != "store")
    assert "ports" not in peers                  # NIXL's side channel and UCX's transfer ports: any
    assert scrape["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert scrape["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}]


@pytest.mark.parametrize("config,fmt", [("local-cpu", "statefulset"), ("p5en-2p2d-4hosts", "lws"),
                                        ("gpu-1p1d", "statefulset")])
def test_every_container_runs_unprivileged_with_the_runtime_s_seccomp_profile(config, fmt):
    """Issue 45: the export set no securityContext: a container could gain privileges (setuid binaries) and
    kept the runtime's default capabilities."""
    docs = exported(SHIPPED_CONFIGS / f"{config}.yaml", fmt)
    pods = []
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            pods.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            pods += [lwt[t]["spec"] for t in ("leaderTemplate", "workerTemplate") if t in lwt]
    assert pods
    efa = config.startswith("p5en")
    for pod in pods:
        assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"], c["name"]
            gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
            assert ctx["capabilities"].get("add", []) == (["IPC_LOCK"] if efa and gpu else []), c["name"]


def test_the_routers_and_decode_servers_may_read_the_control_token_from_the_cluster_s_secret():
    """D's held-KV routes take the control token when the Secret holds one (`up` makes it on one machine);
    both sides read the same optional key, so pods start with or without it."""
    from pdserve.engine.names import CONTROL_TOKEN_ENV
    docs = exported(SHIPPED_CONFIGS / "p5en-2p2d-4hosts.yaml")
    seen = {}
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            c = d["spec"]["template"]["spec"]["containers"][0]
            refs = [e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if e["name"] == CONTROL_TOKEN_ENV]
            seen.setdefault(d["metadata"]["labels"]["app.kubernetes.io/component"], []).append(refs)
    assert all(refs == [{"name": "p5en-2p2d-api-key", "key": CONTROL_TOKEN_ENV, "optional": True}]
               for role in ("router", "decode") for refs in seen[role]), seen
    assert seen["prefill"] and all(refs == [] for refs in seen["prefill"])
