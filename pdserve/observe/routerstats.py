"""What the running router knows, read from its /metrics: turns, reuse outcomes and per-backend health."""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdserve.observe.promtext import Samples, parse, scrape
from pdserve.router.kv.reuse import FIRST, HIT
from pdserve.router.telemetry import metric_names as names
from pdserve.router.wire import DECODE_ONLY

# summary fields that replicas' summaries add up (plain numbers, and counts by label)
ADDED = ("turns", "reuse_hits", "reuse_misses", "reuse_first", "reuse_decode_only", "reuse_tokens_offered",
         "reuse_tokens_pulled", "prefill_tokens_local_cached", "prefill_tokens_tier", "store_errors")
ADDED_BY_LABEL = ("misses_by_reason", "turn_outcomes", "degraded_requests")
HELD_BY_DECODE = {names.HELD_TOKENS: "tokens", names.HELD_BUDGET: "budget", names.HELD_CAPACITY: "capacity",
                  names.HELD_CONTROL: "control", names.HELD_TENANTS: "tenants"}
BACKEND_GAUGES = {names.BACKEND_HEALTHY: "healthy", names.BACKEND_BREAKER_OPEN: "breaker_open",
                  names.BACKEND_IN_FLIGHT: "in_flight"}


def read_router(router_url: str, api_key: str | None = None, timeout: float = 2.0) -> dict[str, Any] | None:
    """Reuse counters and backend health from the router; None when it does not answer."""
    samples = scrape(router_url, timeout, api_key)
    return summarize(samples) if samples is not None else None


def read_routers(replicas: dict[str, str], api_key: str | None = None, timeout: float = 2.0) -> dict[str, Any] | None:
    """Router replicas (name -> own URL) read one by one: their counters added up, backend health as the
    first that answers sees it, and each one's own view under "replicas"; None when none answers."""
    seen = {name: read_router(url, api_key, timeout) for name, url in replicas.items()}
    answers = [s for s in seen.values() if s is not None]
    if not answers:
        return None
    out = dict(answers[0])
    for other in answers[1:]:
        for key in ADDED:
            out[key] += other[key]
        for key in ADDED_BY_LABEL:
            out[key] = dict(Counter(out[key]) + Counter(other[key]))
        out["degraded_missing"] = sorted(set(out["degraded_missing"]) | set(other["degraded_missing"]))
        out["by_api"] = {api: _added(out["by_api"].get(api, {}), other["by_api"].get(api, {}))
                         for api in sorted({*out["by_api"], *other["by_api"]})}
        out["held_kv"] = add_held(out["held_kv"], other["held_kv"])
        if other.get("store") and not other["store"]["up"]:
            out["store"] = other["store"]
    decided = out["reuse_hits"] + out["reuse_misses"]
    out["reuse_hit_rate"] = out["reuse_hits"] / decided if decided else None
    out["entries_unavailable"] = float(out["turn_outcomes"].get("unavailable", 0))
    out["replicas"] = {name: ({"answers": False} if s is None else
                              {"answers": True, "turns": s["turns"], "store_up": (s.get("store") or {}).get("up")})
                       for name, s in seen.items()}
    return out


def parse_metrics(text: str) -> dict[str, Any]:
    return summarize(parse(text))


def summarize(samples: Samples) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": 0.0, "reuse_hits": 0.0, "reuse_misses": 0.0, "reuse_first": 0.0,
                           "reuse_decode_only": 0.0, "reuse_tokens_offered": 0.0,
                           "reuse_tokens_pulled": 0.0, "prefill_tokens_local_cached": 0.0,
                           "prefill_tokens_tier": 0.0, "store_errors": 0.0,
                           "store": None}
    misses: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    degraded_served: Counter[str] = Counter()
    admission: Counter[str] = Counter()
    plans: Counter[str] = Counter()
    by_api: dict[str, Counter[str]] = {}     # api -> turns, hits (decode_only: on D alone), misses, first
    missing_roles: list[str] = []
    backends: dict[str, dict[str, Any]] = {}
    held: dict[str, Any] = {"tokens": {}, "budget": {}, "capacity": {}, "control": {}, "tenants": {}, "releases": {},
                            "renewals": 0, "failures": {}}
    for (name, label_set), value in samples.items():
        labels = dict(label_set)
        if name == names.TURNS + "_total":
            out["turns"] += value
            outcomes[labels.get("outcome", "")] += int(value)
            by_api.setdefault(labels.get("api", ""), Counter())["turns"] += int(value)
        elif name == names.REUSE_DECISIONS + "_total":
            # hit (decode_only: served on D alone), miss, or first (a first turn: out of the hit rate)
            result = labels.get("result")
            kind = "hits" if result == HIT else "first" if result == FIRST else "misses"
            counts = by_api.setdefault(labels.get("api", ""), Counter())
            counts[kind] += int(value)
            out["reuse_" + kind] += value
            if result == HIT and labels.get("reason") == DECODE_ONLY:
                counts["decode_only"] += int(value)
                out["reuse_decode_only"] += value
            elif kind == "misses":
                misses[labels.get("reason", "")] += int(value)
        elif name == names.REUSE_TOKENS_OFFERED + "_total":
            out["reuse_tokens_offered"] += value
        elif name == names.REUSE_TOKENS_PULLED + "_total":
            out["reuse_tokens_pulled"] += value
        elif name == names.PREFILL_TOKENS_LOCAL + "_total":
            out["prefill_tokens_local_cached"] += value
        elif name == names.REUSE_TOKENS_TIER + "_total":
            out["prefill_tokens_tier"] += value       # P's CPU KV tier
        elif name == names.DEGRADED_REQUESTS + "_total":
            degraded_served[labels.get("served_by", "")] += int(value)
        elif name == names.TURN_PLANS + "_total":
            plans[labels.get("plan", "")] += int(value)
        elif name == names.DEGRADED_NOW and value:
            missing_roles.append(labels.get("missing", ""))
        elif name == names.ADMISSION + "_total":
            admission[labels.get("outcome", "")] += int(value)
        elif name == names.ADMISSION_QUEUE:
            out["admission_queue_depth"] = int(value)
        elif name == names.STORE_UP:       # which store, and whether it answers (redis: down = recomputing)
            out["store"] = {"kind": labels.get("store", ""), "up": bool(value)}
        elif name == names.STORE_ERRORS + "_total":
            out["store_errors"] += value
        elif name in HELD_BY_DECODE:
            held[HELD_BY_DECODE[name]][labels.get("decode", "")] = int(value)
        elif name == names.HELD_RELEASES + "_total":
            held["releases"][labels.get("reason", "")] = int(value)
        elif name == names.HELD_RENEWALS + "_total":
            held["renewals"] += int(value)
        elif name == names.HELD_FAILURES + "_total":
            held["failures"][labels.get("op", "")] = int(value)
        elif name in BACKEND_GAUGES:
            backends.setdefault(labels.get("backend", ""), {})[BACKEND_GAUGES[name]] = int(value)
    decided = out["reuse_hits"] + out["reuse_misses"]
    out["reuse_hit_rate"] = out["reuse_hits"] / decided if decided else None
    out["misses_by_reason"] = {k: v for k, v in misses.items() if v}   # the router exports some at 0
    out["turn_outcomes"] = {k: v for k, v in outcomes.items() if k}   # how each turn ended (pdserve.router.legs.turn.TURN_OUTCOMES)
    out["entries_unavailable"] = float(outcomes["unavailable"])
    out["backends"] = backends
    out["admission"] = {k: v for k, v in admission.items() if v}   # admission outcomes (empty while it is off)
    # per wire format (chat, completions, messages, responses): turns, reuse hits (decode_only of them on D alone),
    # misses, first turns
    out["by_api"] = {api: {k: c[k] for k in ("turns", "hits", "decode_only", "misses", "first")}
                     for api, c in sorted(by_api.items()) if api and c["turns"]}
    out["turn_plans"] = {k: v for k, v in plans.items() if k}   # where turns were routed (router/wire.py PLANS)
    out["decode_only_turns"] = float(plans["decode_only"])      # served on the holder D alone
    out["degraded_requests"] = dict(degraded_served)     # served whole on one role, by that role
    out["degraded_missing"] = sorted(missing_roles)      # roles with no usable server right now
    # D's held KV (router/kv/held.py): tokens and budget per decode server, releases by reason, renewals
    out["held_kv"] = held
    return out


def add_held(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two replicas' held-KV views: each holds its own entries (tokens and counts add up); a decode server's
    capacity and budget are the same for both, its control the same unless one could not reach it."""
    return {"tokens": dict(Counter(a["tokens"]) + Counter(b["tokens"])),
            "budget": {**b["budget"], **a["budget"]}, "capacity": {**b["capacity"], **a["capacity"]},
            # tenants may hold KV through both: the larger count is the one known for certain
            "tenants": {d: max(a.get("tenants", {}).get(d, 0), b.get("tenants", {}).get(d, 0))
                        for d in {*a.get("tenants", {}), *b.get("tenants", {})}},
            "control": {d: min(a["control"].get(d, 1), b["control"].get(d, 1))
                        for d in {*a["control"], *b["control"]}},
            "releases": dict(Counter(a["releases"]) + Counter(b["releases"])),
            "renewals": a["renewals"] + b["renewals"],
            "failures": dict(Counter(a["failures"]) + Counter(b["failures"]))}


def _added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two replicas' counts summed, zeros kept (Counter's + drops them, and status reads every key)."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}
