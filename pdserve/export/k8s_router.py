"""The router on Kubernetes: its config (router.json, from the planner's own router_config with every server
at its stable DNS name) in a ConfigMap, a Deployment of router.replicas pods and a Service; the managed Redis
as a Deployment and a Service only the router pods may reach; and a Prometheus scrape config whose labels are
the ones `pdserve scrape-config` gives (cluster, process, role, host)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from pdserve.export.k8s_common import (CONFIG_DIR, PYTHON, REDIS_DATA, REDIS_IMAGE, STORE_SECRET_DIR,
                                       STORE_SECRET_SUFFIX, Target, command_of, container_env, pod_spec)
from pdserve.export.k8s_memory import memory_of, with_memory
from pdserve.export.k8s_servers import server_dns
from pdserve.plan.build import router_config
from pdserve.plan.records import BIND, LOOPBACK_ONLY, MARKER, PROGRAM, REPLICA, SECRET, STATE, ProcessPlan
from pdserve.plan.routers import SECRET_FILE, store_url
from pdserve.roles import ROUTER, SERVER_ROLES, STORE
from pdserve.spec.schema import MANAGED_STORE

ROUTER_JSON = "router.json"
SCRAPE_FILE = "prometheus-scrape.yaml"


def store_service_url(t: Target) -> str:
    """router.store as a router pod reaches it: the planner's store_url with the store secret where the pods
    mount it (Secret NAME-store-secret), and the managed Redis at its Service's name."""
    url = store_url(t.spec, Path(STORE_SECRET_DIR))
    if t.spec.router.store != MANAGED_STORE:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{t.name('redis')}.{t.namespace}.svc.cluster.local:{parts.port}"))


def store_secret(t: Target) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the store secret, for the pods that read it: none unless the store names it."""
    if STORE_SECRET_DIR not in store_service_url(t):
        return [], []
    return ([{"name": "store-secret", "secret": {"secretName": t.name(STORE_SECRET_SUFFIX), "defaultMode": 0o440}}],
            [{"name": "store-secret", "mountPath": STORE_SECRET_DIR, "readOnly": True}])


def router_json(t: Target) -> dict[str, Any]:
    """router.json for the router pods: the planner's router_config with each server at its DNS name, the
    store at its Service, and the router bound to all of its pod's addresses (the Service exposes it)."""
    servers = [dataclasses.replace(p, host=server_dns(t, p)) for p in t.plan.processes if p.role in SERVER_ROLES]
    return {**router_config(t.spec, servers, store_service_url(t)), "host": "0.0.0.0"}


def router_objects(t: Target) -> list[dict[str, Any]]:
    """ConfigMap, Deployment and Service of the router. Each pod is one replica (its name the pod's), on
    router.port; with replicas, each also keeps its plan's own port, as on one machine."""
    routers = [p for p in t.plan.processes if p.role == ROUTER]
    proc, r = routers[0], t.spec.router
    values = {PROGRAM: PYTHON, STATE: f"{CONFIG_DIR}/{ROUTER_JSON}", REPLICA: "$(POD_NAME)", MARKER: None}
    env = container_env(t, proc, values)
    if REPLICA in proc.host_specific:
        env.insert(0, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    ports = [{"name": "http", "containerPort": r.port}]
    if proc.port != r.port:
        ports.append({"name": "own", "containerPort": proc.port})
    get = {"path": "/health", "port": "http"}
    container = {
        "name": "router", "image": t.image, "command": command_of(proc, values), **({"env": env} if env else {}),
        "ports": ports, "resources": with_memory({}, memory_of(t.spec, t.memory, proc)),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, *store_secret(t)[1]],
        "readinessProbe": {"httpGet": get, "periodSeconds": max(1, round(t.spec.supervisor.health_interval)),
                           "timeoutSeconds": 5},
        "livenessProbe": {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": max(1, math.ceil(t.spec.supervisor.unhealthy_grace / 10))},
    }
    volumes = [{"name": "config", "configMap": {"name": t.name(ROUTER)}}, *store_secret(t)[0]]
    text = json.dumps(router_json(t), indent=2) + "\n"
    # A changed config changes the pod template, so `kubectl apply` rolls the routers onto it.
    annotations = {**t.scrape_annotations(r.port), "pdserve/config-sha256": hashlib.sha256(text.encode()).hexdigest()}
    spec = pod_spec(t, [container], volumes)
    # the router's drain (router.drain_timeout) and its margin, as the supervisor gives it (plan/routers.py)
    spec["terminationGracePeriodSeconds"] = max(spec["terminationGracePeriodSeconds"], math.ceil(proc.stop_grace))
    template = {"metadata": {"labels": t.labels(ROUTER), "annotations": annotations}, "spec": spec}
    config = t.obj("v1", "ConfigMap", t.name(ROUTER), ROUTER, data={ROUTER_JSON: text})
    deployment = t.obj("apps/v1", "Deployment", t.name(ROUTER), ROUTER, {
        "replicas": r.replicas, "selector": {"matchLabels": t.selector(ROUTER)}, "template": template})
    service = t.obj("v1", "Service", t.name(ROUTER), ROUTER, {
        "type": "ClusterIP", "selector": t.selector(ROUTER),
        "ports": [{"name": "http", "port": r.port, "targetPort": "http", "protocol": "TCP"}]})
    return [config, deployment, service]


def store_objects(t: Target) -> list[dict[str, Any]]:
    """`router.store: managed`: the planned redis-server (same memory bound and eviction, nothing written to
    disk, its password from the store secret) bound to its pod's addresses, so `--protected-mode` is off and a
    NetworkPolicy admits the router pods alone: the store holds where each conversation's KV lies, which no
    other pod should read or write."""
    stores = [p for p in t.plan.processes if p.role == STORE]
    if not stores:
        return []
    proc: ProcessPlan = stores[0]
    values = {PROGRAM: "redis-server", BIND: "0.0.0.0", LOOPBACK_ONLY: "no", STATE: REDIS_DATA,
              SECRET: f"{STORE_SECRET_DIR}/{SECRET_FILE}", MARKER: None}
    volumes, mounts = store_secret(t)
    container = {
        "name": "redis", "image": REDIS_IMAGE, "command": command_of(proc, values),
        "ports": [{"name": "redis", "containerPort": proc.port}],
        "resources": with_memory({}, memory_of(t.spec, t.memory, proc)),
        "volumeMounts": [{"name": "data", "mountPath": REDIS_DATA}, *mounts],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
    }
    env = container_env(t, proc, values)
    if env:
        container["env"] = env
    template = {"metadata": {"labels": t.labels(STORE, proc.name)},
                "spec": pod_spec(t, [container], [{"name": "data", "emptyDir": {}}, *volumes])}
    name = t.name(proc.name)
    return [
        t.obj("apps/v1", "Deployment", name, STORE, {
            "replicas": 1, "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": t.selector(STORE)}, "template": template}, process=proc.name),
        t.obj("v1", "Service", name, STORE, {
            "selector": t.selector(STORE),
            "ports": [{"name": "redis", "port": proc.port, "targetPort": "redis", "protocol": "TCP"}]},
            process=proc.name),
        t.obj("networking.k8s.io/v1", "NetworkPolicy", name, STORE, {
            "podSelector": {"matchLabels": t.selector(STORE)}, "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": t.selector(ROUTER)}}],
                         "ports": [{"port": proc.port, "protocol": "TCP"}]}]}, process=proc.name),
    ]


def scrape_config(t: Target, interval: str = "15s") -> str:
    """A Prometheus scrape config (no ServiceMonitor needed) for the pods this export makes, with the labels
    `pdserve scrape-config`'s targets carry: cluster, process, role, host (the node)."""
    meta = "__meta_kubernetes_pod_"
    relabel = [
        {"source_labels": [f"{meta}annotation_prometheus_io_scrape", f"{meta}label_app_kubernetes_io_instance"],
         "regex": f"true;{t.base}", "action": "keep"},
        {"source_labels": [f"{meta}ip", f"{meta}annotation_prometheus_io_port"], "regex": "(.+);(.+)",
         "replacement": "$1:$2", "target_label": "__address__"},
        {"source_labels": [f"{meta}annotation_pdserve_cluster"], "target_label": "cluster"},
        {"source_labels": [f"{meta}label_pdserve_process"], "target_label": "process"},
        {"source_labels": [f"{meta}label_app_kubernetes_io_component"], "target_label": "role"},
        {"source_labels": [f"{meta}node_name"], "target_label": "host"},
        {"source_labels": [f"{meta}name"], "target_label": "pod"},
    ]
    job = {"job_name": f"pdserve-{t.base}", "metrics_path": "/metrics", "scrape_interval": interval,
           "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [t.namespace]}}],
           "relabel_configs": relabel}
    head = ("# Prometheus scrape config for pdserve cluster " + t.spec.name + " on Kubernetes (`pdserve export "
            "kubernetes`):\n# add this job under scrape_configs. Labels as `pdserve scrape-config`'s: cluster, "
            "process, role, host.\n")
    if t.spec.router.api_key_env:
        head += ("# The router's /metrics wants the API key: give this job\n"
                 "#   authorization: {credentials_file: /path/to/key}\n")
    return head + yaml.safe_dump({"scrape_configs": [job]}, sort_keys=False)


def scrape_objects(t: Target) -> list[dict[str, Any]]:
    return [t.obj("v1", "ConfigMap", t.name("prometheus"), "prometheus", data={SCRAPE_FILE: scrape_config(t)})]
