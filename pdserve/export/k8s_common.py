"""What every Kubernetes object of an export shares: names, labels, the image, how a planned command line and
environment become a container's (host-specific values replaced, `$(` kept literal)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pdserve import __version__
from pdserve.engine.names import CONTROL_TOKEN_ENV
from pdserve.plan.records import SIDE_CHANNEL_HOST, ClusterPlan, ProcessPlan, env_slot
from pdserve.roles import SERVER_ROLES
from pdserve.spec.schema import ClusterSpec
from pdserve.spec.topology import PLATFORMS

K8S_VERSION = "1.34"            # the Kubernetes API the objects are written for (tests validate against it)
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_RELEASE = "v0.10.0"         # the LWS release whose CRD the LeaderWorkerSets are written for (tests validate)
FORMATS = ("statefulset", "lws")
DEFAULT_IMAGE = f"pdserve:{__version__}"   # docs/kubernetes.md builds it: vLLM's image plus this pdserve
DEFAULT_GPUS_PER_NODE = 8
PYTHON = "python3"              # on the image's PATH, with vLLM and pdserve
MODELS_DIR = "/models"          # a built-in model is built here in the pod (an emptyDir)
CONFIG_DIR = "/etc/pdserve"     # the router's ConfigMap
STATE_DIR = "/var/lib/pdserve/clusters"   # the state folder the export plans with (no pod uses it)
REDIS_IMAGE = "redis:7.4"
REDIS_DATA = "/data"
SECRET_SUFFIX = "api-key"
STORE_SECRET_SUFFIX = "store-secret"   # the cluster's store secret (plan/routers.py's SECRET_FILE) as a Secret
STORE_SECRET_DIR = "/etc/pdserve-store"   # ... mounted here in the router and Redis pods

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# A StatefulSet's pods carry `controller-revision-hash: <name>-<hash>`, a label value of 63 characters at most.
MAX_WORKLOAD_NAME = 45


def k8s_base(name: str) -> str:
    """The cluster name as the prefix of its objects' names: lower case, runs of other characters as `-`, and
    starting with a letter (a Service's name must)."""
    base = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return base if base[:1].isalpha() else f"pd-{base}"


def literal(value: str) -> str:
    """A planned value as Kubernetes passes it: `$(NAME)` in a command or env value is a variable reference,
    `$$(` its escape; the plan's values are literal."""
    return value.replace("$(", "$$(")


@dataclass(frozen=True)
class Target:
    spec: ClusterSpec
    plan: ClusterPlan
    namespace: str
    image: str
    fmt: str
    gpus_per_node: int
    memory: dict[str, str] = field(default_factory=dict)   # --memory: role -> quantity

    @property
    def base(self) -> str:
        return k8s_base(self.spec.name)

    def name(self, *parts: str) -> str:
        return "-".join([self.base, *parts])

    @property
    def secret(self) -> str:
        return self.name(SECRET_SUFFIX)

    def selector(self, component: str, process: str | None = None) -> dict[str, str]:
        out = {"app.kubernetes.io/instance": self.base, "app.kubernetes.io/component": component}
        if process:
            out["pdserve/process"] = process
        return out

    def labels(self, component: str, process: str | None = None) -> dict[str, str]:
        out = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/part-of": "pdserve",
               **self.selector(component), "pdserve/process": process or component}
        if component in SERVER_ROLES:
            out["llm-d.ai/role"] = component     # llm-d's P/D convention
        return out

    def scrape_annotations(self, port: int) -> dict[str, str]:
        """Prometheus' pod annotations, and the cluster's own name (a label value could not always hold it)."""
        return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics",
                "pdserve/cluster": self.spec.name}

    def obj(self, api_version: str, kind: str, name: str, component: str, spec: dict[str, Any] | None = None,
            *, process: str | None = None, data: dict[str, str] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"apiVersion": api_version, "kind": kind,
                               "metadata": {"name": name, "namespace": self.namespace,
                                            "labels": self.labels(component, process)}}
        if spec is not None:
            out["spec"] = spec
        if data is not None:
            out["data"] = data
        return out


def _escaped(proc: ProcessPlan) -> ProcessPlan:
    return dataclasses.replace(proc, argv=[literal(a) for a in proc.argv],
                               env={k: literal(v) for k, v in proc.env.items()})


def command_of(proc: ProcessPlan, values: dict[str, str | None]) -> list[str]:
    """The planned argv, literal, with the host-specific values replaced (records.py)."""
    return _escaped(proc).replaced(values)[0]


def container_env(t: Target, proc: ProcessPlan, values: dict[str, str | None]) -> list[dict[str, Any]]:
    """The planned env in its order, literal, host-specific values replaced or left out; the NIXL side-channel
    host from the pod's IP; variables the plan copies from the launching environment (the API key) from the
    cluster's Secret, never written into a manifest."""
    _, env = _escaped(proc).replaced(values)
    side = proc.host_specific.get(SIDE_CHANNEL_HOST)
    out: list[dict[str, Any]] = []
    for name in proc.env:
        if side == env_slot(name):
            out.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        elif name in env:
            out.append({"name": name, "value": env[name]})
    out += [secret_env(t, target, source) for target, source in proc.env_from.items()]
    return out


def secret_env(t: Target, name: str, key: str) -> dict[str, Any]:
    # The control token is optional: on one machine the supervisor makes it; here the user may add it to the
    # Secret (kubernetes.py's notes say how), and pods start without it.
    ref = {"name": t.secret, "key": key, **({"optional": True} if name == CONTROL_TOKEN_ENV else {})}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def pod_spec(t: Target, containers: list[dict], volumes: list[dict], init: list[dict] | None = None,
             *, gpus: int = 0) -> dict[str, Any]:
    """The supervisor's stop window as the pod's grace period; the runtime's default seccomp profile, and no
    privilege escalation or capability in any container (issue 45; IPC_LOCK kept for EFA); GPU pods on the
    platform's nodes, tolerating the usual GPU-node taint."""
    platform = PLATFORMS.get(t.spec.platform or "")
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": math.ceil(t.spec.supervisor.stop_timeout),
                            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}
    # No container escalates or keeps a capability it does not need; EFA's RDMA registration locks memory.
    efa = bool(gpus and platform and platform.efa_devices)
    for c in [*(init or []), *containers]:
        locks = efa and c in containers
        c["securityContext"] = {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if locks else {})}}
    if init:
        spec["initContainers"] = init
    spec["containers"] = containers
    if volumes:
        spec["volumes"] = volumes
    if gpus and platform and platform.instance_type:
        spec["nodeSelector"] = {"node.kubernetes.io/instance-type": platform.instance_type}
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return spec
