"""Hosts: which server runs where, per-host ports, the address everyone reaches it at, and the presets."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.errors import ConfigError
from pdserve.plan.build import build_plan
from pdserve.plan.records import LOCAL_HOST, ClusterPlan
from pdserve.spec.load import load_spec, parse_spec
from tests.kits.spec_data import GOOD, TWO_HOSTS, plan_of, with_

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def problem(data) -> str:
    with pytest.raises(ConfigError) as err:
        parse_spec(data)
    return str(err.value)


def test_without_hosts_everything_is_local_as_before():
    plan = plan_of(GOOD)
    assert plan.launcher == "local" and plan.hosts == []
    assert {p.host_name for p in plan.processes} == {LOCAL_HOST}
    assert not any(plan.is_remote(p) for p in plan.processes)


def test_servers_bind_and_are_reached_at_their_hosts_address():
    plan = plan_of(TWO_HOSTS)
    p, d = plan.by_name("prefill-0"), plan.by_name("decode-0")
    assert (p.host_name, p.host, p.url) == ("a", "10.77.0.2", "http://10.77.0.2:8100")
    assert (d.host_name, d.host, d.url) == ("b", "10.77.0.3", "http://10.77.0.3:8100")
    assert p.argv[p.argv.index("--host") + 1] == "10.77.0.2"
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.77.0.2" and d.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.77.0.3"
    assert p.env["PYTHONPATH"] == "/src" and "PYTHONPATH" not in d.env      # per-host env
    assert d.argv[0] == "/venv/bin/python" and p.argv[0] == "/py"           # per-host python
    assert [b["url"] for b in plan.router_config["decode"]] == ["http://10.77.0.3:8100"]
    assert plan.router.host_name == LOCAL_HOST and not plan.is_remote(plan.router)
    assert plan.is_remote(p) and plan.is_remote(d)
    host_a = plan.host("a")
    assert (host_a.user, host_a.port, host_a.ssh_options, host_a.python) == ("root", 2222, ["UserKnownHostsFile=/k"], "/py")


def test_plan_round_trips_and_old_plans_still_load():
    plan = plan_of(TWO_HOSTS)
    assert ClusterPlan.from_dict(plan.to_dict()) == plan
    old = plan_of(GOOD).to_dict()
    for key in ("launcher", "hosts", "launcher_settings"):
        del old[key]
    for proc in old["processes"]:
        del proc["host_name"]
    loaded = ClusterPlan.from_dict(old)
    assert loaded.launcher == "local" and loaded.by_name("decode-0").host_name == LOCAL_HOST


def test_replicas_name_their_hosts_and_ports_repeat_across_hosts():
    data = with_("decode", {"replicas": 2, "host": ["a", "b"], "port": 8200, "nixl_side_channel_port": 5700,
                            "cpus": [1, 1]}, TWO_HOSTS)
    plan = plan_of(data)
    assert [(p.name, p.host_name) for p in plan.processes if p.role == "decode"] == [("decode-0", "a"), ("decode-1", "b")]


BROKEN = [
    (with_("prefill.host", "nowhere", TWO_HOSTS), "prefill.host: unknown host 'nowhere' (hosts: a, b)"),
    (with_("decode.host", "a", TWO_HOSTS), "decode.port: 8100 is already used by prefill[0]"),
    (with_("decode", {"host": "a", "port": 8200, "nixl_side_channel_port": 5700, "cpus": [0]}, TWO_HOSTS),
     "decode.cpus: CPU 0 is already used by prefill[0]"),
    (with_("decode.host", ["a", "b"], TWO_HOSTS), "decode.host: 2 hosts given for 1 replicas"),
    (with_("prefill.host", ["a"]), "prefill.host: a list of hosts needs a hosts: list"),
    (with_("hosts", [{"name": "a", "address": "127.0.0.1"}, {"name": "b", "address": "10.77.0.3"}], TWO_HOSTS),
     "hosts[0].address: 127.0.0.1 is loopback, but servers on other hosts must reach it"),
    (with_("hosts", [{"name": "a", "address": "10.0.0.1"}, {"name": "a", "address": "10.0.0.2"}], TWO_HOSTS),
     "hosts[1].name: 'a' is already used by hosts[0]"),
    (with_("hosts", [{"name": "a", "address": "0.0.0.0"}, {"name": "b", "address": "10.0.0.2"}], TWO_HOSTS),
     "hosts[0].address: 0.0.0.0 is not an address other hosts can reach"),
    (with_("launcher", "ssh"), "hosts: launcher ssh needs a hosts: list"),
    (with_("launcher", "local", TWO_HOSTS), "launcher: local runs every server on this machine; 2 hosts need ssh"),
    (with_("launcher", "pbs", TWO_HOSTS), "launcher: Input should be 'local', 'ssh' or 'slurm'"),
    (with_("hosts", [{"name": "a"}], TWO_HOSTS), "hosts[0].address: required field is missing"),
    (with_("platform", "p5en-efa", with_("prefill.gpus", [8], TWO_HOSTS)),
     "prefill.gpus: GPU 8 does not exist on a p5en-efa host (8 GPUs)"),
]


@pytest.mark.parametrize("data,expected", BROKEN, ids=[e.split(":")[0] + str(i) for i, (_, e) in enumerate(BROKEN)])
def test_topology_errors_name_the_field(data, expected):
    assert expected in problem(data)


def test_one_host_may_be_loopback_for_ssh_to_this_machine_or_a_one_node_slurm():
    one = with_("decode", {"host": "a", "port": 8200, "nixl_side_channel_port": 5700, "cpus": [1]},
                with_("hosts", [{"name": "a", "address": "127.0.0.1"}], with_("launcher", "slurm", TWO_HOSTS)))
    assert plan_of(one).by_name("decode-0").url == "http://127.0.0.1:8200"


def test_p5en_preset_sets_efa_and_libfabric_and_yields_to_explicit_settings():
    data = with_("platform", "p5en-efa", TWO_HOSTS)
    plan = plan_of(data)
    p = plan.by_name("prefill-0")
    assert p.env["FI_PROVIDER"] == "efa" and p.env["FI_EFA_FORK_SAFE"] == "1"
    assert '"backends":["LIBFABRIC"]' in p.argv[p.argv.index("--kv-transfer-config") + 1]
    explicit = with_("kv_transfer.backends", ["UCX"], with_("prefill.env", {"FI_PROVIDER": "tcp"}, data))
    plan = plan_of(explicit)
    p = plan.by_name("prefill-0")
    assert p.env["FI_PROVIDER"] == "tcp" and plan.by_name("decode-0").env["FI_PROVIDER"] == "efa"
    assert '"backends":["UCX"]' in p.argv[p.argv.index("--kv-transfer-config") + 1]


def _shipped(name: str) -> ClusterPlan:
    return build_plan(load_spec(CONFIGS / name), python="/py", cluster_dir=Path("/h/clusters/t"),
                      models_dir=Path("/h/models"))


def test_shipped_p5en_two_hosts():
    plan = _shipped("p5en-1p1d-2hosts.yaml")
    p, d = plan.by_name("prefill-0"), plan.by_name("decode-0")
    assert plan.launcher == "ssh" and (p.host_name, d.host_name) == ("p5en-a", "p5en-b")
    assert p.env["CUDA_VISIBLE_DEVICES"] == d.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert p.env["FI_PROVIDER"] == "efa" and "Qwen/Qwen3-32B" in p.argv
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] != d.env["VLLM_NIXL_SIDE_CHANNEL_HOST"]


def test_shipped_gpu8_one_host():
    plan = _shipped("gpu8-1p1d.yaml")
    p, d = plan.by_name("prefill-0"), plan.by_name("decode-0")
    assert plan.launcher == "local" and (p.env["CUDA_VISIBLE_DEVICES"], d.env["CUDA_VISIBLE_DEVICES"]) == ("0,1,2,3", "4,5,6,7")
    assert p.argv[p.argv.index("--tensor-parallel-size") + 1] == "4" == d.argv[d.argv.index("--tensor-parallel-size") + 1]


def test_shipped_2p2d_four_hosts():
    plan = _shipped("p5en-2p2d-4hosts.yaml")
    servers = [p for p in plan.processes if p.role != "router"]
    assert [p.host_name for p in servers] == ["p5en-a", "p5en-b", "p5en-c", "p5en-d"]
    assert [p.port for p in servers] == [8100, 8101, 8100, 8101] and len({p.url for p in servers}) == 4
    assert len(plan.router_config["prefill"]) == len(plan.router_config["decode"]) == 2


def test_host_preflight_runs_per_host_and_compares_versions():
    from pdserve.checks.preflight import machine_findings
    from pdserve.orchestrate.lookup import busy_ports
    data = with_("platform", "p5en-efa", with_("prefill.gpus", [7], with_("decode.gpus", [0], with_(
        "prefill.cpus", None, with_("decode.cpus", None, with_("kv_transfer.kv_buffer_device", "cuda", TWO_HOSTS))))))
    data["prefill"].pop("cpus"), data["decode"].pop("cpus")
    spec = parse_spec(data)
    plan = plan_of(data)
    asked = []

    def probe(host, address, ports, efa):
        asked.append((host, address, ports, efa))
        return {"a": {"vllm": ["vllm", "0.26.0"], "nixl": ["nixl", "1.5.1"], "gpus": 4, "efa_rc": 1,
                      "busy": [[5600, "Address already in use"]]},
                "b": {"vllm": ["vllm", "0.27.0"], "nixl": ["nixl", "1.5.1"], "gpus": 8, "efa_rc": 0, "busy": []}}[host]
    found = {(f.check, f.message) for f in machine_findings(spec, plan, [], probe) if f.level == "fail"}
    assert asked == [("a", "10.77.0.2", [5600, 8100], True), ("b", "10.77.0.3", [5600, 8100], True)]
    assert found == {("host a", "GPU 7 does not exist there (nvidia-smi lists 4)"),
                     ("host a", "fi_info -p efa finds no EFA provider there"),
                     ("host a", "port 5600 on 10.77.0.2: Address already in use"),
                     ("vllm", "versions differ across hosts: vllm 0.26.0 on a, vllm 0.27.0 on b")}
    # Only the router runs here (its port may be taken by someone else's router): no remote address is bound.
    assert all(b.startswith("router:") for b in busy_ports(plan))

    def unreachable(host, *_):
        from pdserve.launchers.ssh import HostUnreachable
        raise HostUnreachable(host, "Connection timed out")
    out = machine_findings(spec, plan, None, unreachable)
    assert [(f.level, f.message) for f in out][0] == ("fail", "host a is unreachable: Connection timed out")


def test_host_preflight_leaves_the_ports_of_adopted_processes_alone():
    from pdserve.checks.hosts import host_findings
    plan = plan_of(TWO_HOSTS)
    asked = {}

    def probe(host, address, ports, efa):
        asked[host] = ports
        return {"vllm": ["vllm", "1"], "nixl": ["nixl", "1"], "gpus": None, "efa_rc": None, "busy": []}
    assert all(f.level == "ok" for f in host_findings(plan, probe, skip=frozenset({"decode-0"})))
    assert asked == {"a": [5600, 8100], "b": []}
