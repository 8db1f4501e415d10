"""`pdserve export kubernetes`: every object of every shipped config is valid Kubernetes (the OpenAPI schemas of
k8s_common.K8S_VERSION that kubernetes-validate ships; LeaderWorkerSets against the CRD of the LWS release they
target, k8s_common.LWS_RELEASE, vendored whole in tests/unit/schemas/), each server's container runs exactly
what `pdserve plan --json` prints for it with only the host-specific values replaced, and the router's
ConfigMap names every server at a DNS name its workload gives it."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource
from typer.testing import CliRunner

from pdserve.cli.main import app
from pdserve.errors import ConfigError
from pdserve.export.k8s_common import K8S_VERSION, LWS_API, LWS_RELEASE
from pdserve.orchestrate import ops
from pdserve.orchestrate.lookup import plan_from_file
from pdserve.plan.gpu_sharing import LOG_ENV, PIPE_ENV
from pdserve.plan.records import (BIND, CORES, GPUS, MARKER, MEMORY, MODEL, PROGRAM, SIDE_CHANNEL_HOST, ProcessPlan)
from pdserve.router.config import RouterConfig
from pdserve.spec.load import SHIPPED_CONFIGS
from pdserve.state.records import ClusterState, Phase, ProcessRecord, ProcState
from pdserve.state.targets import scrape_targets

CONFIGS = sorted(SHIPPED_CONFIGS.glob("*.yaml"))
FORMATS = ("statefulset", "lws")
# LWS_RELEASE's CRD (v0.10.0: kubernetes-sigs/lws commit 2161f38f), as released; its header says where from
LWS_CRD = Path(__file__).parent / "schemas" / f"leaderworkerset-{LWS_RELEASE}.crd.yaml"
LWS_CRD_SHA256 = "c5dcad8ed943e495490241f00b9a1b45d51203b6d484020db3636d5bf553568e"   # the release's file
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")   # DNS-1123 subdomain
SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")                                 # DNS-1035 label
runner = CliRunner()


@functools.cache
def exported(config: Path, fmt: str = "statefulset", **options) -> list[dict]:
    return ops.export("kubernetes", config, fmt=fmt, **options).documents


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@functools.cache
def planned(config: Path) -> dict[str, ProcessPlan]:
    """The processes as `pdserve plan --json` prints them: its plan (ops.plan's), through JSON. Without its
    machine checks, which would probe the ssh configs' hosts (test_plan_json_prints_this_plan ties the two)."""
    data = json.loads(json.dumps(plan_from_file(config)[1].to_dict()))
    return {p["name"]: ProcessPlan(**p) for p in data["processes"]}


def test_plan_json_prints_this_plan():
    config = SHIPPED_CONFIGS / "local-cpu.yaml"
    result = runner.invoke(app, ["plan", str(config), "--json"])
    assert result.exit_code in (0, 1), result.output          # 1: a machine check failed here: fine
    printed = {p["name"]: ProcessPlan(**p) for p in json.loads(result.stdout)["processes"]}
    assert printed == planned(config) and set(printed) == {"prefill-0", "decode-0", "router"}


# -- schemas --------------------------------------------------------------------------------------------------

@functools.cache
def k8s_registry() -> Registry:
    defs = schema_contents(f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict/_definitions.json", K8S_VERSION)
    return Resource.from_contents(defs) @ Registry()


def _strict(node):
    """The CRD's OpenAPI v3 schema as JSON Schema, as strict as the API server: an object takes no field its
    schema does not name (strict field validation reports them; pruning would drop them) unless the schema
    preserves unknown fields, and a list of type `set` holds no item twice (`map`: _list_map_keys)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: ({name: _strict(v) for name, v in value.items()} if k == "properties" else _strict(value))
           for k, value in node.items()}
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def _list_map_keys(validator, keys, instance, schema):
    """`x-kubernetes-list-type: map`: no two items with the same key fields (the API server refuses them)."""
    if schema.get("x-kubernetes-list-type") != "map" or not validator.is_type(instance, "array"):
        return
    seen = [tuple(json.dumps(item.get(k)) for k in keys) for item in instance if isinstance(item, dict)]
    for key in sorted({s for s in seen if seen.count(s) > 1}):
        yield jsonschema.ValidationError(f"two items with the same {', '.join(keys)}: {', '.join(key)}")


CRDValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                            {"x-kubernetes-list-map-keys": _list_map_keys})


def lws_crd_text() -> str:
    return LWS_CRD.read_text()


@functools.cache
def lws_validator() -> jsonschema.protocols.Validator:
    """LWS_RELEASE's (v0.10.0's) LeaderWorkerSet v1 schema, whole (its pod templates are controller-gen's
    PodSpec), with metadata as Kubernetes' ObjectMeta (the CRD says only `type: object`)."""
    crd = yaml.load(lws_crd_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert f"{crd['spec']['group']}/v1" == LWS_API and crd["spec"]["names"]["kind"] == "LeaderWorkerSet"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"$ref": f"{K8S_DEFS}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return CRDValidator(schema, registry=k8s_registry())


@functools.cache
def pod_spec_validator() -> jsonschema.Draft202012Validator:
    """Kubernetes K8S_VERSION's PodSpec, strict: LWS v0.10.0's CRD renders pod templates from k8s.io/api v0.36, so
    a field newer than the Kubernetes the export targets would pass the CRD but not that cluster."""
    return jsonschema.Draft202012Validator({"$ref": f"{K8S_DEFS}#/$defs/io.k8s.api.core.v1.PodSpec"},
                                           registry=k8s_registry())


def validate(doc: dict) -> None:
    """Raises on an object the API server would refuse (schema-wise)."""
    assert NAME.match(doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
    if doc["kind"] == "Service":
        assert SERVICE_NAME.match(doc["metadata"]["name"]), doc["metadata"]["name"]
    if doc["apiVersion"] == LWS_API:
        lws_validator().validate(doc)
        lwt = doc["spec"]["leaderWorkerTemplate"]
        for pod in (lwt[t] for t in ("leaderTemplate", "workerTemplate") if t in lwt):
            pod_spec_validator().validate(pod["spec"])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_object_of_every_shipped_config_validates(config):
    for fmt in FORMATS:
        docs = exported(config, fmt)
        assert docs and all(d["metadata"]["namespace"] == "default" for d in docs)
        for doc in docs:
            if fmt == "statefulset" or doc["apiVersion"] == LWS_API:     # the rest is the same in both formats
                validate(doc)
        names = [(d["kind"], d["metadata"]["name"]) for d in docs]
        assert len(names) == len(set(names)), names


def test_the_vendored_crd_is_the_release_file():
    text = lws_crd_text()
    body = text[text.index("\n---\n") + 1:]                 # the header comment, then the file as released
    assert hashlib.sha256(body.encode()).hexdigest() == LWS_CRD_SHA256
    assert f"tag {LWS_RELEASE} (commit 2161f38ff333f9e24d3c44adef7cd5d9787cac00" in text
    notes = ops.export("kubernetes", SHIPPED_CONFIGS / "local-cpu.yaml", fmt="lws").notes
    assert any(f"LWS {LWS_RELEASE}" in n for n in notes)            # the user is told which controller to install


def lws_doc() -> dict:
    return json.loads(json.dumps(kinds(exported(SHIPPED_CONFIGS / "local-cpu.yaml", "lws"), "LeaderWorkerSet")[0]))


@pytest.mark.parametrize("change", [
    lambda lws: lws["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"),             # not in the enum
    lambda lws: lws["spec"].update(groupIdentity="Hash"),               # an open LWS PR's field: not in v0.10.0
    lambda lws: lws["spec"]["leaderWorkerTemplate"].update(sizee=1),                            # unknown field
    lambda lws: lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0].update(
        imagePullPolicy2="x"),                                                           # PodSpec, strict
    lambda lws: lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"].append(
        lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]),   # list-map: name twice
    lambda lws: lws["spec"].update(replicas="1"),                                                # a string
], ids=["enum", "groupIdentity", "unknown-field", "podspec-unknown-field", "duplicate-container", "type"])
def test_the_lws_crd_schema_refuses_what_the_api_server_would(change):
    lws = lws_doc()
    lws_validator().validate(lws)
    change(lws)
    with pytest.raises(jsonschema.ValidationError):
        lws_validator().validate(lws)


def test_the_validators_refuse_what_the_api_server_would():
    docs = exported(SHIPPED_CONFIGS / "local-cpu.yaml")
    sts = json.loads(json.dumps(kinds(docs, "StatefulSet")[0]))
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8100"     # a string
    with pytest.raises(jsonschema.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    lws = lws_doc()
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["schedulingGroup"] = {"podGroupName": "g"}
    lws_validator().validate(lws)         # in the PodSpec of k8s.io/api v0.36 that LWS v0.10.0's CRD renders ...
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)                     # ... not in Kubernetes 1.34's, which the export targets


# -- one source of argv and env -------------------------------------------------------------------------------

def k8s_values(config: Path) -> dict[str, str | None]:
    """docs/kubernetes.md's table: what each host-specific value becomes in a pod (None: left out)."""
    model = yaml.safe_load(config.read_text())["model"]
    return {PROGRAM: "python3", BIND: "0.0.0.0", SIDE_CHANNEL_HOST: None, GPUS: None, CORES: None, MARKER: None,
            MEMORY: "1", MODEL: f"/models/{model.removeprefix('pdserve:')}"}


def server_pods(docs: list[dict]) -> dict[str, dict]:
    """process name -> the pod template that runs it (a StatefulSet's, or a LeaderWorkerSet's leader's)."""
    out = {}
    for d in docs:
        if d["kind"] == "StatefulSet":
            out[d["spec"]["template"]["metadata"]["labels"]["pdserve/process"]] = d["spec"]["template"]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            pod = lwt.get("leaderTemplate", lwt["workerTemplate"])
            out[pod["metadata"]["labels"]["pdserve/process"]] = pod
    return out


def unescape(value: str) -> str:
    return value.replace("$$(", "$(")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_each_server_runs_exactly_what_plan_json_prints(config):
    plan = planned(config)
    servers = {n: p for n, p in plan.items() if p.role in ("prefill", "decode")}
    for fmt in FORMATS:
        pods = server_pods(exported(config, fmt))
        assert set(pods) == set(servers)
        for name, proc in servers.items():
            # the marks name what they say (checked on argv itself, not through them)
            assert proc.host_value(BIND) == proc.argv[proc.argv.index("--host") + 1]
            if MODEL in proc.host_specific:
                assert proc.host_value(MODEL) == proc.argv[proc.argv.index("--model") + 1]
            want_argv, want_env = proc.replaced(k8s_values(config))
            # the one planned difference: a pod has whole GPUs, so no MPS daemon and no client settings for it
            # (gpu-1p1d-shared.yaml ships gpu_sharing: mps; the export's notes say so)
            want_env = {k: v for k, v in want_env.items() if k not in (PIPE_ENV, LOG_ENV)}
            container = pods[name]["spec"]["containers"][0]
            assert [unescape(a) for a in container["command"]] == want_argv, name
            env = container["env"]
            assert {e["name"]: unescape(e["value"]) for e in env if "value" in e} == want_env, name
            side = {e["name"]: e["valueFrom"] for e in env if "valueFrom" in e and "fieldRef" in e["valueFrom"]}
            assert side == {"VLLM_NIXL_SIDE_CHANNEL_HOST": {"fieldRef": {"fieldPath": "status.podIP"}}}
            secrets = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in env
                       if "secretKeyRef" in e.get("valueFrom", {})}
            assert secrets == proc.env_from
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["http"] == proc.port and sorted(ports.values()) == sorted([proc.port, *proc.side_channel_ports])


def test_a_planned_value_holding_a_variable_reference_stays_literal(tmp_path):
    data = yaml.safe_load((SHIPPED_CONFIGS / "local-cpu.yaml").read_text())
    data["decode"]["vllm_args"] += ["--served-model-name-suffix", "$(HOME)"]   # any text vLLM would get verbatim
    data["decode"]["env"]["NOTE"] = "$(HOME)"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    pod = server_pods(exported(tmp_path / "c.yaml"))["decode-0"]["spec"]["containers"][0]
    assert pod["command"][-1] == "$$(HOME)"           # Kubernetes' escape: the server sees `$(HOME)`
    assert {"name": "NOTE", "value": "$$(HOME)"} in pod["env"]


def test_a_default_kv_cache_sized_from_this_machine_is_1_gib_in_a_pod(tmp_path):
    data = yaml.safe_load((SHIPPED_CONFIGS / "local-cpu.yaml").read_text())
    del data["decode"]["env"]["VLLM_CPU_KVCACHE_SPACE"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    proc = planned(tmp_path / "c.yaml")["decode-0"]
    assert proc.host_value(MEMORY) == proc.env["VLLM_CPU_KVCACHE_SPACE"]      # sized from this machine's memory
    env = server_pods(exported(tmp_path / "c.yaml"))["decode-0"]["spec"]["containers"][0]["env"]
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"} in env
    assert {e["name"]: e["value"] for e in env if "value" in e} == proc.replaced(k8s_values(tmp_path / "c.yaml"))[1]


def test_replacing_an_argv_value_by_nothing_is_refused():
    proc = planned(SHIPPED_CONFIGS / "local-cpu.yaml")["decode-0"]
    with pytest.raises(ValueError):
        proc.replaced({BIND: None})
    assert proc.replaced({}) == (proc.argv, proc.env)


# -- the router -----------------------------------------------------------------------------------------------

def dns_names(docs: list[dict], fmt: str) -> dict[str, str]:
    """process -> the DNS name Kubernetes gives its server pod, derived from the objects themselves."""
    out = {}
    headless = {d["metadata"]["name"]: d for d in kinds(docs, "Service") if d["spec"].get("clusterIP") == "None"}
    for d in docs:
        ns, name = d["metadata"]["namespace"], d["metadata"]["name"]
        if d["kind"] == "StatefulSet":
            service = headless[d["spec"]["serviceName"]]
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert service["spec"]["selector"].items() <= labels.items()       # the Service governs this pod
            out[labels["pdserve/process"]] = f"{name}-0.{d['spec']['serviceName']}.{ns}.svc.cluster.local"
        elif d["kind"] == "LeaderWorkerSet":          # LWS's own headless Service is named after the LWS
            labels = server_pods([d]).popitem()[1]["metadata"]["labels"]
            out[labels["pdserve/process"]] = f"{name}-0.{name}.{ns}.svc.cluster.local"
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_router_configmap_lists_every_server_by_stable_dns(config):
    plan = planned(config)
    for fmt in FORMATS:
        docs = exported(config, fmt)
        cm = next(d for d in kinds(docs, "ConfigMap") if "router.json" in d["data"])
        cfg = RouterConfig.from_dict(json.loads(cm["data"]["router.json"]))     # the router's own reader
        dns = dns_names(docs, fmt)
        for role in ("prefill", "decode"):
            want = {n: f"http://{dns[n]}:{p.port}" for n, p in plan.items() if p.role == role}
            assert {b.name: b.url for b in getattr(cfg, role)} == want
        assert cfg.host == "0.0.0.0"
        deployment = next(d for d in kinds(docs, "Deployment") if d["metadata"]["name"].endswith("-router"))
        volume = deployment["spec"]["template"]["spec"]["volumes"][0]
        assert volume["configMap"]["name"] == cm["metadata"]["name"]
        router = deployment["spec"]["template"]["spec"]["containers"][0]
        mount = router["volumeMounts"][0]["mountPath"]
        assert router["command"][router["command"].index("--config") + 1] == f"{mount}/router.json"


def test_managed_store_replicas_and_api_key(tmp_path):
    data = yaml.safe_load((SHIPPED_CONFIGS / "p5en-2p2d-4hosts.yaml").read_text())
    data["router"].update({"store": "managed", "replicas": 2})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    docs = exported(tmp_path / "c.yaml", namespace="serving")
    for d in docs:
        validate(d)
    redis_plan = planned(tmp_path / "c.yaml")["redis"]
    redis = next(d for d in kinds(docs, "Deployment") if d["metadata"]["name"] == "p5en-2p2d-redis")
    command = redis["spec"]["template"]["spec"]["containers"][0]["command"]
    secret = "/etc/pdserve-store/store-secret.conf"          # Secret p5en-2p2d-store-secret, mounted
    assert command == redis_plan.replaced({PROGRAM: "redis-server", BIND: "0.0.0.0", "loopback_only": "no",
                                           "state": "/data", "secret": secret})[0]
    assert command[command.index("--maxmemory") + 1] == "256mb" and command[-2:] == ["--include", secret]
    service = next(d for d in kinds(docs, "Service") if d["metadata"]["name"] == "p5en-2p2d-redis")
    policy = next(d for d in kinds(docs, "NetworkPolicy") if d["metadata"]["name"] == "p5en-2p2d-redis")
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    cm = next(d for d in kinds(docs, "ConfigMap") if "router.json" in d["data"])
    store = json.loads(cm["data"]["router.json"])["store"]
    assert store == (f"redis://p5en-2p2d-redis.serving.svc.cluster.local:{redis_plan.port}/0"
                     f"?deployment_file={secret}&password_file={secret}")
    router = next(d for d in kinds(docs, "Deployment") if d["metadata"]["name"] == "p5en-2p2d-router")
    assert router["spec"]["replicas"] == 2
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][container["command"].index("--replica") + 1] == "$(POD_NAME)"
    for pod in (router["spec"]["template"]["spec"], redis["spec"]["template"]["spec"]):
        volume = next(v for v in pod["volumes"] if "secret" in v)
        assert volume["secret"]["secretName"] == "p5en-2p2d-store-secret"
        mount = next(m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == volume["name"])
        assert mount["mountPath"] == "/etc/pdserve-store"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "p5en-2p2d-api-key", "key": "PDSERVE_API_KEY"}
    assert not kinds(docs, "Secret")                    # a reference only: the key is never in a manifest
    assert "serving.svc.cluster.local" in json.dumps(json.loads(cm["data"]["router.json"])["prefill"])


def test_scrape_config_labels_are_pdserve_scrape_configs():
    docs = exported(SHIPPED_CONFIGS / "bench-cpu-2p1d.yaml")
    cm = next(d for d in kinds(docs, "ConfigMap") if "prometheus-scrape.yaml" in d["data"])
    job = yaml.safe_load(cm["data"]["prometheus-scrape.yaml"])["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    made = {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}
    record = ProcessRecord(name="router", role="router", state=ProcState.READY, host="h", port=1, url="http://h:1")
    state = ClusterState(cluster="c", phase=Phase.RUNNING, router_url="http://h:1", processes={"router": record})
    assert set(scrape_targets(state)[0]["labels"]) <= made        # cluster, process, role, host
    pods = [d["spec"]["template"] for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    for pod in pods:
        notes = pod["metadata"]["annotations"]
        http = next(p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "http")
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == str(http["containerPort"])
        assert notes["pdserve/cluster"] == "bench-cpu-2p1d"


# -- presets, layouts, refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_p5en_two_hosts_exports_efa_and_tp8_on_one_8_gpu_node(fmt):
    config = SHIPPED_CONFIGS / "p5en-1p1d-2hosts.yaml"
    pods = server_pods(exported(config, fmt))
    assert set(pods) == {"prefill-0", "decode-0"}
    for pod in pods.values():
        container = pod["spec"]["containers"][0]
        assert container["command"][container["command"].index("--tensor-parallel-size") + 1] == "8"
        want = {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 16}
        assert container["resources"] == {"requests": want, "limits": want}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert '"backends":["LIBFABRIC"]' in container["command"][container["command"].index("--kv-transfer-config") + 1]
        assert pod["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5en.48xlarge"}
        assert any(v["emptyDir"] == {"medium": "Memory"} for v in pod["spec"]["volumes"])
    for lws in kinds(exported(config, fmt), "LeaderWorkerSet"):
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1          # TP8 fits one node: no workers


def tp16(tmp_path) -> Path:
    data = yaml.safe_load((SHIPPED_CONFIGS / "p5en-1p1d-2hosts.yaml").read_text())
    for role in ("prefill", "decode"):
        data[role].update({"tensor_parallel_size": 16})
        del data[role]["gpus"]
    (tmp_path / "tp16.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "tp16.yaml"


def test_tensor_parallel_across_nodes_is_a_leader_and_workers_in_lws(tmp_path):
    config = tp16(tmp_path)
    docs = exported(config, "lws")
    plan = planned(config)
    for lws in kinds(docs, "LeaderWorkerSet"):
        validate(lws)
        lwt = lws["spec"]["leaderWorkerTemplate"]
        assert lwt["size"] == 2
        leader, worker = lwt["leaderTemplate"]["spec"]["containers"][0], lwt["workerTemplate"]["spec"]["containers"][0]
        proc = plan[lwt["leaderTemplate"]["metadata"]["labels"]["pdserve/process"]]
        argv = proc.replaced(k8s_values(config))[0]
        multi = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "$(LWS_LEADER_ADDRESS)"]
        assert leader["command"] == [*argv, *multi]
        assert worker["command"] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", *argv[3:],
                                     "--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)",
                                     "--master-addr", "$(LWS_LEADER_ADDRESS)", "--headless"]
        for c in (leader, worker):
            assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 16}
        assert "startupProbe" in leader and "startupProbe" not in worker


def test_tensor_parallel_across_nodes_is_refused_as_statefulset(tmp_path):
    config = tp16(tmp_path)
    with pytest.raises(ConfigError, match=r"^prefill\.tensor_parallel_size: 16 GPUs per server do not fit one node of 8"):
        exported(config, "statefulset")
    result = runner.invoke(app, ["export", "kubernetes", str(config)])
    assert result.exit_code == 2 and "prefill.tensor_parallel_size" in result.stderr
    result = runner.invoke(app, ["export", "kubernetes", str(config), "--format", "lws", "--gpus-per-node", "12"])
    assert result.exit_code == 2 and "do not split into whole nodes of 12" in result.stderr


@pytest.mark.parametrize("change, field", [
    ({"router": {"store": "redis://127.0.0.1:6379/0"}}, "router.store"),
    ({"observability": {"otlp_endpoint": "http://localhost:4318/v1/traces"}}, "observability.otlp_endpoint"),
    ({"name": "a-very-long-cluster-name-that-kubernetes-cannot-hold"}, "name"),
])
def test_what_cannot_run_in_pods_exits_2_naming_the_field(tmp_path, change, field):
    data = yaml.safe_load((SHIPPED_CONFIGS / "local-cpu.yaml").read_text())
    for key, value in change.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["export", "kubernetes", str(tmp_path / "c.yaml")])
    assert result.exit_code == 2, result.output
    assert f": {field}: " in result.stderr and "hint:" in result.stderr


def test_bad_options_exit_2():
    for args in (["kubernetes", "--namespace", "Bad_NS"], ["kubernetes", "--format", "deployment"],
                 ["kubernetes", "--gpus-per-node", "0"], ["nomad"]):
        result = runner.invoke(app, ["export", *args])
        assert result.exit_code == 2, (args, result.output)


def test_cli_prints_the_documents_and_the_rules_it_applied_and_writes_a_folder(tmp_path):
    config = SHIPPED_CONFIGS / "local-cpu.yaml"
    result = runner.invoke(app, ["export", "kubernetes", str(config), "--namespace", "pd", "--image", "reg/pd:1"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert docs == exported(config, namespace="pd", image="reg/pd:1")
    assert "note: cpus" in result.stderr and "note: model pdserve:tiny" in result.stderr
    assert {c["image"] for d in kinds(docs, "StatefulSet") for c in d["spec"]["template"]["spec"]["containers"]} == {"reg/pd:1"}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.yaml").write_text("{}")
    result = runner.invoke(app, ["export", "kubernetes", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    written = result.stdout.split()
    assert [yaml.safe_load(Path(p).read_text()) for p in written] == exported(config)
    assert written == sorted(written)                  # numbered in apply order
    assert "mine.yaml" in result.stderr                # another file there would be applied too: said

