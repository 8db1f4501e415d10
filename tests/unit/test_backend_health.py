"""Router backend health: a refused connection is down at once and loses the server's entries; slow
answers must repeat before the server leaves routing, and never lose its entries."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.router.config import BackendConfig
from pdserve.router.route.backends import FAILED_PROBES_BEFORE_DOWN, Backend, Pool
from pdserve.router.telemetry.metrics import RouterMetrics


def healthy_backend() -> Backend:
    b = Backend("decode-0", "http://x", "decode")
    assert b.record_probe(True) is False and b.healthy
    return b


def test_one_slow_probe_keeps_the_backend_and_its_entries():
    b = healthy_backend()
    for _ in range(FAILED_PROBES_BEFORE_DOWN - 1):
        assert b.record_probe(False) is False
    assert b.healthy and b.generation == 0
    b.record_probe(True)                          # answered again: the count starts over
    assert b.record_probe(False) is False and b.healthy


def test_repeated_failures_take_it_out_of_routing_but_keep_its_entries():
    b = healthy_backend()
    lost = [b.record_probe(False) for _ in range(FAILED_PROBES_BEFORE_DOWN + 2)]
    assert lost.count(True) == 0 and not b.healthy and b.generation == 0
    b.record_probe(True)
    assert b.healthy


def test_refused_connection_is_down_at_once_and_loses_state_once():
    b = healthy_backend()
    assert b.record_probe(False, refused=True) is True
    assert not b.healthy and b.generation == 1
    assert b.record_probe(False, refused=True) is False and b.generation == 1   # still the same outage
    b.record_probe(True)
    assert b.record_probe(False, refused=True) is True and b.generation == 2


def test_never_healthy_backend_is_not_reported_down():
    b = Backend("decode-0", "http://x", "decode")
    assert b.record_probe(False, refused=True) is False and b.generation == 0


def test_a_successful_request_brings_a_restarted_server_back_before_the_next_probe():
    from pdserve.router.telemetry.metrics import RouterMetrics
    from pdserve.router.route.backends import Pool
    from pdserve.router.config import BackendConfig
    pool = Pool("decode", [BackendConfig("decode-0", "http://x")], RouterMetrics())
    b = pool.backends[0]
    b.record_probe(True)
    assert b.record_probe(False, refused=True) and not b.healthy      # killed: down, entries gone
    pool.acquire(b)
    pool.release(b, ok=False)                                        # a failed request proves nothing
    assert not b.healthy
    pool.acquire(b)
    pool.release(b, ok=None)                                         # nor does an outcome not its own
    assert not b.healthy
    pool.acquire(b)
    pool.release(b, ok=True)                                         # the restarted server answered
    assert b.healthy and b.seen_alive
    assert b.record_probe(False, refused=True) is True and b.generation == 2   # a later outage still counts


def test_in_flight_gauge_reads_the_outstanding_requests_at_scrape_time():
    """pdserve_router_backend_in_flight is each backend's outstanding count whenever it is scraped (read then,
    not set on every acquire and release)."""
    metrics = RouterMetrics()
    pool = Pool("decode", [BackendConfig("decode-0", "http://x"), BackendConfig("decode-1", "http://y")], metrics)

    def scraped() -> str:
        return generate_latest(metrics.registry).decode()
    assert 'pdserve_router_backend_in_flight{backend="decode-0"} 0.0' in scraped()
    d0, d1 = pool.backends
    trials = [pool.acquire(d0), pool.acquire(d0), pool.acquire(d1)]
    assert 'pdserve_router_backend_in_flight{backend="decode-0"} 2.0' in scraped()
    assert 'pdserve_router_backend_in_flight{backend="decode-1"} 1.0' in scraped()
    pool.release(d0, True, trials[0])
    pool.release(d1, None, trials[2])
    assert 'pdserve_router_backend_in_flight{backend="decode-0"} 1.0' in scraped()
    assert 'pdserve_router_backend_in_flight{backend="decode-1"} 0.0' in scraped()
