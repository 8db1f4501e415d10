"""Show each process of a cluster (role, state, pid, address, uptime, restarts, health and load as the router
sees them) and the router's reuse hit rate; with no NAME, list all clusters. `--watch` keeps a live table
with CPU and memory (and GPU memory where nvidia-smi sees GPUs) per server process tree. Exit 3 when the named cluster is not running."""

from __future__ import annotations

import time

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdserve.cli.completion import cluster_names
from pdserve.errors import NotRunningError
from pdserve.orchestrate import ops
from pdserve.ui import console
from pdserve.ui.units import address, human_bytes

NAME = "status"


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def command(
    name: str = typer.Argument(None, help="Cluster name (default: list all clusters).",
                               autocompletion=cluster_names),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="A live table refreshed every second, with CPU, "
                                                          "memory and GPU memory (where nvidia-smi sees GPUs) per "
                                                          "process tree (Ctrl-C stops)."),
    count: int = typer.Option(0, "--count", min=0, help="With --watch: stop after this many refreshes "
                                                        "(0: until Ctrl-C)."),
) -> None:
    if name is None:
        views = ops.status()
        if json_out:
            console.print_json([v.to_json() for v in views])
            return
        table = Table("cluster", "phase", "ready", "router", "supervisor")
        for v in views:
            table.add_row(v.name, v.phase.value or "-", f"{v.ready}/{len(v.processes)}", v.router_url or "-",
                          "alive" if v.supervisor_alive else "gone")
        console.out.print(table if views else "no clusters")
        return
    st = ops.status(name)
    if watch and st.running:
        return _watch(name, count)
    if json_out:
        console.print_json(st.to_json())
    else:
        console.out.print(_view(st))
        _warnings(st)
    if not st.running:
        raise NotRunningError(f"cluster {name} is not running", hint="`pdserve up` to start it")


def _watch(name: str, count: int) -> None:
    sampler = ops.Usage()
    refreshes = 0
    with Live(console=console.out, refresh_per_second=2) as live:
        try:
            while True:
                st = ops.status(name)
                live.update(_view(st, sampler))
                refreshes += 1
                if not st.running or refreshes == count:
                    break
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass


def _routing(backend: dict | None) -> tuple[str, str]:
    """(health as the router sees it, requests in flight) for one backend."""
    if not backend:
        return "-", "-"
    health = "up" if backend.get("healthy") else "down"
    if backend.get("breaker_open"):
        health += ", breaker open"
    return health, str(backend.get("in_flight", 0))


def _view(st: ops.ClusterView, sampler: ops.Usage | None = None) -> Group:
    """The process table and the router line; with a sampler, CPU and memory (and GPU memory where
    nvidia-smi sees GPUs) per process tree too."""
    table = Table(title=f"{st.name}: {st.phase.value}", title_justify="left")
    cols = ["process", "role", "state", "pid", "address", "uptime", "restarts", "routing", "in flight"]
    usage = sampler.sample(st) if sampler else {}
    gpus = bool(sampler and sampler.gpus_seen)
    if sampler:
        cols += ["cpu", "memory"] + (["gpu memory"] if gpus else [])
    for col in cols:
        table.add_column(col)
    backends = (st.router or {}).get("backends") or {}
    for p in st.processes:
        health, load = ("", "") if p.is_router else _routing(backends.get(p.name))
        row = [p.name, p.role, p.state.value, str(p.pid or "-"), address(p.host, p.port),
               _uptime(p.uptime_s), str(p.restarts), health, load]
        if sampler:
            use = usage[p.name]
            row += ["-" if use.cpu_percent is None else f"{use.cpu_percent:.0f}%", human_bytes(use.rss)]
            if gpus:
                row.append(human_bytes(use.gpu_bytes))
        table.add_row(*row)
    parts: list = [table]
    r = st.router
    if st.router_key_missing and not r:
        parts.append(Text(f"router {st.router_url}: turns and reuse need the router's key: export "
                          f"{st.router_key_missing} (router.api_key_env) to read its /metrics", style="yellow"))
    if r:
        parts += _reuse_lines(st.router_url, r)
        if r.get("admission"):
            admitted = ", ".join(f"{k} {v}" for k, v in sorted(r["admission"].items()))
            parts.append(Text(f"admission: {admitted}; queued now {r.get('admission_queue_depth', 0)}"))
        parts += _store_lines(r)
        parts += _held_lines(r)
        if r.get("degraded_missing") or r.get("degraded_requests"):
            now = ", ".join(f"no usable {role} server" for role in r.get("degraded_missing") or []) or "none now"
            served = ", ".join(f"{n} on {role}" for role, n in sorted((r.get("degraded_requests") or {}).items()))
            parts.append(Text(f"degraded mode (requests served whole on one role): {now}; "
                              f"served so far: {served or 'none'}"))
    if st.transfers:
        rates = "; ".join(f"{direction} {_rate(t)}" for direction, t in sorted(st.transfers.items()))
        parts.append(Text(f"KV transfers (bytes over transfer time, servers' NIXL totals): {rates}"))
    if st.cpu_tiers:
        parts.append(_tier_line(st.cpu_tiers))
    return Group(*parts)


def _reuse_lines(url: str | None, r: dict) -> list[Text]:
    """Turns, the reuse hit rate over follow-up turns (a hit: P pulled D's KV, or D alone served it from its
    prefix cache; first turns had nothing to reuse and are counted apart), and the same per API."""
    decided = r["reuse_hits"] + r["reuse_misses"]
    rate = f"{100 * r['reuse_hit_rate']:.0f}%" if r["reuse_hit_rate"] is not None else "-"
    misses = ", ".join(f"{k} {v}" for k, v in sorted(r["misses_by_reason"].items())) or "none"
    out = [Text(f"router {url}: turns {r['turns']:.0f}, reuse hit rate {rate} ({r['reuse_hits']:.0f}/{decided:.0f} "
                f"follow-ups, {r.get('reuse_decode_only', 0):.0f} of them on D alone; first turns "
                f"{r.get('reuse_first', 0):.0f}), tokens offered {r['reuse_tokens_offered']:.0f}, pulled from D "
                f"{r['reuse_tokens_pulled']:.0f}, from P's own prefix cache "
                f"{r.get('prefill_tokens_local_cached', 0):.0f}, from P's CPU tier "
                f"{r.get('prefill_tokens_tier', 0):.0f}; misses: {misses}")]
    ended = ", ".join(f"{k} {v}" for k, v in sorted((r.get("turn_outcomes") or {}).items())) or "none yet"
    plans = ", ".join(f"{k} {v}" for k, v in sorted((r.get("turn_plans") or {}).items())) or "none yet"
    out.append(Text(f"turns by outcome: {ended}; by route: {plans} (decode_only: served on D alone)"))
    if r.get("by_api"):
        out.append(Text("by API: " + ", ".join(f"{api} {_api_reuse(c)}" for api, c in r["by_api"].items())))
    return out


def _api_reuse(c: dict) -> str:
    """One API's turns and follow-ups reused, e.g. `messages 3 turns, 2/2 reused (1 on D alone), 1 first`."""
    alone = f" ({c['decode_only']} on D alone)" if c.get("decode_only") else ""
    first = f", {c['first']} first" if c.get("first") else ""
    return f"{c['turns']} turns, {c['hits']}/{c['hits'] + c['misses']} reused{alone}{first}"


def _rate(t: dict) -> str:
    gbps = f"{t['gbps']:.2f} GB/s" if t.get("gbps") is not None else "-"
    return f"{gbps} ({t['reads']:.0f} reads, {t['bytes'] / 1e6:.1f} MB)"


def _store_lines(r: dict) -> list[Text]:
    """The shared reuse store's health, and each router replica's view (nothing for one router in memory)."""
    out = []
    store = r.get("store")
    if store and store["kind"] != "memory":
        if store["up"]:
            out.append(Text(f"reuse store {store['kind']}: up; failed calls so far {r.get('store_errors', 0):.0f}"))
        else:
            out.append(Text(f"reuse store {store['kind']}: UNAVAILABLE: turns are served by recomputing until it "
                            f"is back (failed calls {r.get('store_errors', 0):.0f})", style="bold red"))
    if r.get("replicas"):
        out.append(Text("router replicas: " + ", ".join(
            f"{name} " + (f"{v['turns']:.0f} turns" if v["answers"] else "NOT ANSWERING")
            for name, v in r["replicas"].items())))
    return out


def _held_lines(r: dict) -> list[Text]:
    """The KV the decode servers hold for next turns (router/kv/held.py): per server against its budget,
    releases by reason, renewals; a server without the control routes said in red."""
    held = r.get("held_kv") or {}
    if not held.get("tokens") and not held.get("control"):
        return []       # held_kv off, or no decode server seen yet
    tenants = held.get("tenants") or {}       # more than one: the budget is shared fairly between them

    def server(d: str, t: int) -> str:
        return f"{d} {t}/{held['budget'].get(d) or '-'}" + (f" ({tenants[d]} tenants)" if tenants.get(d, 0) > 1 else "")
    per = ", ".join(server(d, t) for d, t in sorted(held["tokens"].items()))
    released = ", ".join(f"{k} {v}" for k, v in sorted(held.get("releases", {}).items()) if v) or "none"
    failed = sum(held.get("failures", {}).values())
    out = [Text(f"held KV on decode (tokens/budget): {per or '-'}; released: {released}; renewed "
                f"{held.get('renewals', 0)}" + (f"; failed control calls {failed}" if failed else ""))]
    blind = sorted(d for d, ok in (held.get("control") or {}).items() if not ok)
    if blind:
        out.append(Text(f"no held-KV control on {', '.join(blind)}: held blocks wait for decoder_kv_blocks_ttl "
                        "(not budgeted, released or renewed)", style="bold red"))
    return out


def _tier_line(tiers: dict[str, dict]) -> Text:
    """The servers' CPU KV tiers (engine/tier.py): tokens stored of their capacity, those in use by a load or a
    store; why one could not be read."""
    def server(name: str, t: dict) -> str:
        if "capacity_tokens" not in t:
            return f"{name} unread ({t.get('error') or 'no answer'})"
        return f"{name} {t['stored_tokens']}/{t['capacity_tokens']} ({t['in_use_tokens']} in use)"
    return Text("CPU KV tier (tokens stored/capacity): " + ", ".join(server(n, t) for n, t in sorted(tiers.items())))


def _warnings(st: ops.ClusterView) -> None:
    if st.running and not st.supervisor_alive:
        console.error("the supervisor is gone: processes are not restarted if they die",
                      hint="`pdserve up` of the same config re-attaches a new supervisor to the live processes")
    if st.error:
        console.error(st.error)
