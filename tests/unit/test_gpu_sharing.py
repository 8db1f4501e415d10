"""gpu_sharing: mps: the planned MPS control daemon, its clients, its health probe, its refusals and where it
does not go (Kubernetes). The daemon is a stand-in here (tests/kits/fake_mps.py); real MPS runs on the H200."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml

from pdserve.checks.preflight import check_mps
from pdserve.export.kubernetes import export_kubernetes
from pdserve.plan.build import build_plan
from pdserve.plan.gpu_sharing import LOG_ENV, MPS_NAME, PIPE_ENV, mps_dirs
from pdserve.roles import MPS
from pdserve.spec.load import SpecErrors, parse_spec
from pdserve.supervise.health import probe
from tests.kits.fake_mps import install_fake_mps

SHARED = Path(__file__).resolve().parents[2] / "configs" / "gpu-1p1d-shared.yaml"
CLUSTER_DIR = Path("/h/clusters/t")


def shared(**top) -> dict:
    return {**yaml.safe_load(SHARED.read_text()), **top}


def plan_of(data: dict):
    return build_plan(parse_spec(data), python="/py", cluster_dir=CLUSTER_DIR, models_dir=Path("/h/models"))


def test_mps_plans_the_daemon_first_and_makes_each_server_on_the_gpu_its_client():
    plan = plan_of(shared(gpu_sharing="mps"))
    pipe, log = mps_dirs(CLUSTER_DIR)
    daemon = plan.by_name(MPS_NAME)
    assert plan.processes[0] is daemon and daemon.role == MPS
    assert daemon.argv[:2] == ["/bin/sh", "-c"] and daemon.argv[3].endswith("nvidia-cuda-mps-control")
    assert (daemon.env[PIPE_ENV], daemon.env[LOG_ENV], daemon.health_url) == (pipe, log, f"mps://{pipe}")
    assert len(f"{pipe}/control") < 108                     # a Unix socket's path limit
    p, d = plan.by_name("prefill-0"), plan.by_name("decode-0")
    for server in (p, d):
        assert (server.env[PIPE_ENV], server.env[LOG_ENV]) == (pipe, log)
        assert "gpu_sharing: mps" in server.defaults[PIPE_ENV]          # `pdserve plan` says why
    assert (p.start_after, d.start_after) == ([MPS_NAME], [MPS_NAME, "prefill-0"])
    assert [x.name for x in plan.stop_order()][-1] == MPS_NAME       # after every server it serves


def test_time_slice_plans_no_daemon_and_a_users_own_mps_env_wins():
    plan = plan_of(shared(gpu_sharing="time_slice"))
    assert MPS_NAME not in [p.name for p in plan.processes]
    assert PIPE_ENV not in plan.by_name("prefill-0").env
    data = shared(gpu_sharing="mps")
    data["decode"]["env"] = {**data["decode"]["env"], PIPE_ENV: "/srv/mps"}
    d = plan_of(data).by_name("decode-0")
    assert d.env[PIPE_ENV] == "/srv/mps" and PIPE_ENV not in d.defaults


@pytest.mark.parametrize("change, field", [
    ({"share_gpus": False, "decode": {"gpus": [1]}}, "gpu_sharing: mps is for servers sharing a GPU"),
    ({"launcher": "ssh", "hosts": [{"name": "a", "address": "10.0.0.2"}]}, "gpu_sharing: mps runs its daemon"),
])
def test_mps_refusals_name_the_field(change, field):
    data = shared(gpu_sharing="mps")
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    if "hosts" in change:
        data["prefill"]["host"] = data["decode"]["host"] = "a"
    with pytest.raises(SpecErrors, match=field):
        parse_spec(data)
    with pytest.raises(SpecErrors, match="gpu_sharing"):
        parse_spec(shared(gpu_sharing="spatial"))


def test_preflight_fails_without_the_mps_control_program():
    spec = parse_spec(shared(gpu_sharing="mps"))
    [missing] = check_mps(spec, which=lambda name: None)
    assert missing.level == "fail" and "nvidia-cuda-mps-control" in missing.message
    assert check_mps(spec, which=lambda name: f"/usr/bin/{name}")[0].level == "ok"
    assert check_mps(parse_spec(shared(gpu_sharing="time_slice")), which=lambda name: None) == []


def test_the_planned_daemon_starts_answers_its_probe_and_stops(tmp_path, monkeypatch):
    fake = install_fake_mps(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    daemon = build_plan(parse_spec(shared(gpu_sharing="mps")), python="/py", cluster_dir=tmp_path / "c",
                        models_dir=Path("/h/models")).by_name(MPS_NAME)
    assert daemon.argv[3] == str(fake)                        # the program found on PATH at plan time
    assert not probe(daemon.health_url)                         # no daemon yet: its client exits 1
    proc = subprocess.Popen(daemon.argv, env={**os.environ, **daemon.env}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("control daemon up")   # its folders made by the start script
        assert probe(daemon.health_url)
        assert Path(daemon.env[LOG_ENV]).is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)                          # the supervisor's stop
        assert proc.wait(timeout=10) == 0
    assert proc.stdout.read() == "quit\n"                       # asked to quit, as NVIDIA documents
    assert not probe(daemon.health_url)
    # A daemon that dies by itself (the OOM killer's SIGKILL) ends the process the supervisor watches.
    proc = subprocess.Popen(daemon.argv, env={**os.environ, **daemon.env}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("control daemon up")
    [child] = psutil.Process(proc.pid).children()
    child.kill()
    assert proc.wait(timeout=10) == 128 + signal.SIGKILL
    shutil.rmtree(Path(daemon.env[PIPE_ENV]).parent)


def test_kubernetes_gets_no_daemon_each_server_has_its_gpus():
    out = export_kubernetes(parse_spec(shared(gpu_sharing="mps")))
    text = yaml.safe_dump_all(out.documents)
    assert PIPE_ENV not in text and "nvidia-cuda-mps-control" not in text
    assert any("gpu_sharing mps: no MPS daemon" in note for note in out.notes)
