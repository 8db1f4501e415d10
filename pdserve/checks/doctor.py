"""`pdserve doctor`: the machine checks of preflight.py, plus, for a running cluster, live checks: the
router answers, a canary really moves KV from P to D and back at a rate above the floor, and the NIXL
transfer rate each server measured over its life."""

from __future__ import annotations

from pdserve.plan.records import ClusterPlan
from pdserve.checks.findings import Finding
from pdserve.observe import transfer
from pdserve.observe.promtext import api_key_of
from pdserve.observe.routerstats import read_router
from pdserve.roles import ROUTER, SERVER_ROLES
from pdserve.supervise.canary import canary_of_plan
from pdserve.supervise.health import probe


def store_findings(plan: ClusterPlan) -> list[Finding]:
    """Each router replica answers on its own port, and the shared reuse store answers each of them."""
    routers = [p for p in plan.processes if p.role == ROUTER]
    out = []
    for proc in routers:
        stats = read_router(proc.url, api_key_of(plan.router_config))
        store = (stats or {}).get("store") or {}
        if stats is None:
            out.append(Finding("fail", proc.name, f"{proc.url} does not answer /metrics",
                               f"`pdserve logs {plan.name} {proc.name}`"))
        elif store.get("kind", "memory") != "memory":
            kind = store["kind"]
            out.append(Finding("ok", f"{proc.name} store", f"reuse store {kind} answers") if store.get("up") else
                       Finding("fail", f"{proc.name} store", f"reuse store {kind} unavailable: turns are served by "
                               f"recomputing ({stats.get('store_errors', 0):.0f} failed calls)",
                               f"is the Redis of router.store running? `pdserve status {plan.name}`; "
                               f"`pdserve logs {plan.name} {proc.name}`"))
    return out


def live_findings(plan: ClusterPlan, min_gbps: float | None) -> list[Finding]:
    """`min_gbps`: the floor for the canary's transfers and the servers' rates (None: the plan's own)."""
    if not probe(plan.router_url + "/health"):
        return [Finding("fail", "router", f"{plan.router_url} does not answer /health",
                        f"`pdserve status {plan.name}`; `pdserve logs {plan.name} router`")]
    out = [Finding("ok", "router", f"{plan.router_url} answers"), *store_findings(plan)]
    floor = plan.transfer_floor_gbps if min_gbps is None else min_gbps
    result = canary_of_plan(plan, floor)
    hint = "" if result.ok else ("" if result.slow else f"`pdserve logs {plan.name} decode-0` for NIXL errors")
    out.append(Finding("ok" if result.ok else "fail", "canary", result.detail, hint))
    min_gbps = floor or None
    for proc in plan.processes:
        if proc.role not in SERVER_ROLES:
            continue
        rate = transfer.read(proc.url)
        direction = f"{transfer.DIRECTION[proc.role]} reads"
        if rate is None or rate.gbps is None:
            out.append(Finding("ok", f"{proc.name} transfers", f"no {direction} recorded yet"))
            continue
        gbps = rate.gbps
        message = f"{direction}: {rate.reads:.0f} transfers, {rate.moved / 1e6:.1f} MB at {gbps:.2f} GB/s"
        if min_gbps is not None and gbps < min_gbps:
            out.append(Finding("warn", f"{proc.name} transfers", message + f", below the expected {min_gbps:g} GB/s",
                               "a rate far below the link usually means UCX fell back to TCP: check "
                               "UCX_CUDA_IPC_ENABLE_GET_ZCOPY, UCX_TLS and the NIXL backend (LIBFABRIC on EFA)"))
        else:
            out.append(Finding("ok", f"{proc.name} transfers", message))
    return out
