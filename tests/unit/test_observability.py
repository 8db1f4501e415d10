"""The scrape-target file, the shipped dashboard's queries and the transfer-rate arithmetic."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdserve.observe import dashboard, transfer
from pdserve.router.telemetry.metrics import RouterMetrics
from pdserve.state.folder import ClusterDir
from pdserve.state.records import ClusterState, Phase, ProcessRecord, ProcState


def state(phase=Phase.RUNNING) -> ClusterState:
    procs = {"prefill-0": ProcessRecord("prefill-0", "prefill", ProcState.READY, "10.0.0.2", 8100,
                                        host_name="gpu-a", url="http://10.0.0.2:8100"),
             "decode-0": ProcessRecord("decode-0", "decode", ProcState.BACKOFF, "127.0.0.1", 8200,
                                       host_name="local", url="http://127.0.0.1:8200"),
             "router": ProcessRecord("router", "router", ProcState.READY, "0.0.0.0", 8000,
                                     host_name="local", url="http://127.0.0.1:8000")}
    return ClusterState("c1", phase, "http://127.0.0.1:8000", procs)


def test_targets_list_every_process_with_its_labels_and_leave_on_down(tmp_path):
    cdir = ClusterDir("c1", tmp_path)
    cdir.write_state(state())
    groups = json.loads((tmp_path / "prometheus" / "c1.json").read_text())
    assert groups == [
        {"targets": ["10.0.0.2:8100"], "labels": {"cluster": "c1", "process": "prefill-0", "role": "prefill",
                                                  "host": "gpu-a"}},
        # a process backing off stays a target: Prometheus' `up` shows it down
        {"targets": ["127.0.0.1:8200"], "labels": {"cluster": "c1", "process": "decode-0", "role": "decode",
                                                   "host": "local"}},
        {"targets": ["127.0.0.1:8000"], "labels": {"cluster": "c1", "process": "router", "role": "router",
                                                   "host": "local"}}]
    assert cdir.targets_path == tmp_path / "prometheus" / "c1.json"
    cdir.write_state(state(Phase.STOPPED))
    assert json.loads(cdir.targets_path.read_text()) == []


def test_the_managed_redis_is_no_scrape_target():
    """It speaks no HTTP, so Prometheus would show it down forever; the routers and servers stay listed."""
    from pdserve.plan.records import ProcessPlan
    from pdserve.state.targets import scrape_targets
    redis = ProcessPlan(name="redis", role="store", argv=["redis-server"], env={}, host="127.0.0.1", port=8002,
                        health_url="redis://127.0.0.1:8002")
    assert redis.url == "redis://127.0.0.1:8002"
    st = state()
    st.processes["redis"] = ProcessRecord("redis", "store", ProcState.READY, "127.0.0.1", 8002,
                                          host_name="local", url=redis.url)
    assert [g["labels"]["process"] for g in scrape_targets(st)] == ["prefill-0", "decode-0", "router"]


def test_targets_file_is_rewritten_only_when_it_changes(tmp_path):
    cdir = ClusterDir("c1", tmp_path)
    cdir.write_state(state())
    inode = cdir.targets_path.stat().st_ino
    cdir.write_state(state())                   # every tick writes state.json; the targets stay put
    assert cdir.targets_path.stat().st_ino == inode
    moved = state()
    moved.processes["decode-0"].url = "http://127.0.0.1:8300"     # e.g. an `up` that changed its port
    cdir.write_state(moved)
    assert cdir.targets_path.stat().st_ino != inode
    assert "127.0.0.1:8300" in cdir.targets_path.read_text()


def test_state_records_keep_host_name_and_url():
    rec = state().processes["prefill-0"]
    assert ProcessRecord.from_dict(rec.to_dict()) == rec


METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=\{|\[)")
VLLM = Path(__import__("vllm").__file__).parent
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def vllm_source_names() -> str:
    return "\n".join(p.read_text(errors="replace") for p in VLLM.rglob("*.py") if "metrics" in p.read_text(errors="replace")
                     and "vllm:" in p.read_text(errors="replace"))


def test_every_dashboard_query_uses_metrics_that_exist():
    """Router names against the router's own exposition; vLLM's against the installed vLLM's source."""
    suffixes = {"counter": ("_total",), "histogram": HISTOGRAM_PARTS, "gauge": ("",)}
    router_names = {family.name + suffix for family in RouterMetrics().registry.collect()
                    for suffix in suffixes.get(family.type, ("",))}
    source = vllm_source_names()
    used = set()
    for title, _legend, expr in dashboard.queries():
        names = METRIC.findall(dashboard.instantiate(expr, "c1"))
        assert names, title
        for name in names:
            used.add(name)
            if name.startswith("vllm:"):
                base = name.removesuffix("_total")
                for part in HISTOGRAM_PARTS:
                    base = base.removesuffix(part)
                assert f'"{base}"' in source, f"{title}: {name} is not a metric of vLLM {VLLM}"
            elif name != "up":
                assert name in router_names, f"{title}: {name} is not exported by the router"
    # what the issue asks the dashboard to show, by its metrics
    for want in ("pdserve_router_ttft_seconds_bucket", "pdserve_router_reuse_decisions_total",
                 "vllm:prompt_tokens_by_source_total", "vllm:nixl_bytes_transferred_sum",
                 "vllm:nixl_xfer_time_seconds_sum", "pdserve_router_backend_breaker_open",
                 "process_start_time_seconds", "pdserve_router_degraded", "up"):
        assert want in used, want


def test_dashboard_transfer_panel_divides_the_same_sums_as_status():
    exprs = [e for t, _l, e in dashboard.queries() if "transfer rate" in t]
    assert exprs and all(transfer.XFER_BYTES in e and transfer.XFER_SECONDS in e for e in exprs)


def test_transfer_rate_is_bytes_over_transfer_time_per_direction():
    a, b = transfer.Transfers(4e9, 2.0, 3), transfer.Transfers(1e9, 0.5, 1)
    assert (a + b).gbps == 5e9 / 2.5 / 1e9
    assert (a - b).gbps == 3e9 / 1.5 / 1e9
    assert transfer.NONE.gbps is None
    out = transfer.by_direction([("prefill", a), ("prefill", b), ("decode", None)])
    assert out == {"D->P": {"gbps": 2.0, "bytes": 5e9, "seconds": 2.5, "reads": 4}}


def test_scrape_config_reads_the_targets_folder(tmp_path):
    text = dashboard.scrape_config(tmp_path / "prometheus", "2s")
    import yaml
    cfg = yaml.safe_load(text)
    assert cfg["global"]["scrape_interval"] == "2s"
    assert cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] == [f"{tmp_path}/prometheus/*.json"]


def test_tracing_reaches_the_router_config_and_every_vllm_server():
    from pdserve.router.config import RouterConfig
    from tests.kits.spec_data import GOOD, arg, plan_of, with_
    off = plan_of(GOOD)
    assert all("--otlp-traces-endpoint" not in p.argv for p in off.processes)
    assert off.router_config["otlp_endpoint"] is None and off.router_config["json_logs"] is False
    url = "http://10.0.0.9:4318/v1/traces"
    on = plan_of(with_("observability", {"otlp_endpoint": url, "trace_sample_ratio": 0.25, "json_logs": True}))
    for name in ("prefill-0", "decode-0"):
        p = on.by_name(name)
        assert arg(p.argv, "--otlp-traces-endpoint") == url
        assert p.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert p.env["OTEL_SERVICE_NAME"] == f"vllm-{name}"
    cfg = RouterConfig.from_dict(on.router_config)
    assert (cfg.otlp_endpoint, cfg.trace_sample_ratio, cfg.json_logs) == (url, 0.25, True)
    mine = plan_of(with_("observability", {"otlp_endpoint": url})
                   | {"decode": {**GOOD["decode"], "vllm_args": ["--otlp-traces-endpoint=http://other:4318/v1/traces"]}})
    assert mine.by_name("decode-0").argv.count("--otlp-traces-endpoint=http://other:4318/v1/traces") == 1
    assert "--otlp-traces-endpoint" not in mine.by_name("decode-0").argv


def test_bad_observability_settings_name_the_field():
    import pytest

    from pdserve.errors import ConfigError
    from pdserve.spec.load import parse_spec
    from tests.kits.spec_data import with_
    for value, field in (({"otlp_endpoint": "localhost:4318"}, "observability.otlp_endpoint"),
                         ({"trace_sample_ratio": 2}, "observability.trace_sample_ratio"),
                         ({"tracing": True}, "observability.tracing")):
        with pytest.raises(ConfigError) as exc:
            parse_spec(with_("observability", value))
        assert field in str(exc.value)


def test_a_fresh_router_exports_hit_and_first_turn_reuse_series_at_zero():
    """Prometheus' rate() of a series born at its first increments reads 0, so the dashboard's hit rate was
    0/0 (NaN) after a router (re)start until later turns moved series that already existed."""
    from prometheus_client import generate_latest

    from pdserve.router.api import APIS
    from pdserve.router.config import RouterConfig
    from pdserve.router.front.app import METRICS, build_app
    from pdserve.router.kv.reuse import HIT_REASONS

    app = build_app(RouterConfig(prefill=[], decode=[], model="m"), api_key="")
    text = generate_latest(app[METRICS].registry).decode()
    for api in APIS:
        for reason in HIT_REASONS:
            assert (f'pdserve_router_reuse_decisions_total{{api="{api}",reason="{reason}",result="hit"}} 0.0'
                    in text), (api, reason)
        assert f'pdserve_router_reuse_decisions_total{{api="{api}",reason="no_entry",result="miss"}} 0.0' in text
        assert f'pdserve_router_reuse_decisions_total{{api="{api}",reason="no_entry",result="first"}} 0.0' in text
