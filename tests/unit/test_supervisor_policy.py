"""The supervisor's whole restart policy, driven tick by tick with a fake launcher, clock, probes and
canary: no process, no socket, no sleep. Each test states one rule of the policy table."""

from __future__ import annotations

import signal

import pytest

from pdserve.state.records import Phase, ProcState
from pdserve.supervise.services import Services
from pdserve.launchers.stop import KILL_GRACE
from pdserve.supervise.process import FAILED_PROBES_BEFORE_UNHEALTHY
from pdserve.supervise.canary import CANARY_TRIES
from pdserve.supervise.supervisor import Supervisor
from tests.kits.supervisor_rig import Rig

S = ProcState
ALL = ("prefill-0", "decode-0", "router")


def test_starts_everything_in_order_and_runs_once_healthy_and_the_canary_passed(tmp_path):
    rig = Rig(tmp_path)
    rig.sup.begin()
    assert rig.launcher.started == list(ALL)
    rig.ticks(4)
    assert {rig.state(n) for n in ALL} == {S.STARTING} and rig.sup.phase == Phase.STARTING
    rig.healthy(*ALL)
    rig.until(lambda: rig.sup.phase == Phase.RUNNING)
    assert {rig.state(n) for n in ALL} == {S.READY} and rig.canary.calls == 1


def test_start_after_holds_a_server_until_the_one_it_names_is_ready(tmp_path):
    rig = Rig(tmp_path)
    object.__setattr__(rig.plan.by_name("decode-0"), "start_after", ["prefill-0"])
    rig.sup.begin()
    rig.ticks(10)
    assert "decode-0" not in rig.launcher.started and rig.state("decode-0") == S.STOPPED
    assert "waiting for prefill-0" in rig.sup.by_name("decode-0").message
    rig.healthy("prefill-0")
    rig.until(lambda: "decode-0" in rig.launcher.started)
    assert rig.launcher.started.index("decode-0") > rig.launcher.started.index("router")


def test_a_restart_after_a_crash_also_waits_for_start_after(tmp_path):
    """P and D on one GPU: when both are down, D's backoff running out must not start it beside a P that
    is still starting (seen on an H200 during a peer reset)."""
    rig = Rig(tmp_path, backoff_initial=0.5)
    object.__setattr__(rig.plan.by_name("decode-0"), "start_after", ["prefill-0"])
    rig.running()
    rig.launcher.crash("prefill-0")
    rig.launcher.crash("decode-0")
    rig.sick("prefill-0", "decode-0")
    rig.until(lambda: rig.state("prefill-0") == S.STARTING)
    rig.ticks(40)                                    # D's 0.5 s backoff is long over
    assert rig.launcher.started.count("decode-0") == 1 and rig.state("decode-0") == S.BACKOFF
    assert "waiting for prefill-0" in rig.sup.by_name("decode-0").message
    rig.healthy("prefill-0")
    rig.until(lambda: rig.launcher.started.count("decode-0") == 2)
    assert rig.sup.by_name("decode-0").restarts == 1


def test_a_crash_stops_the_whole_tree_backs_off_then_restarts(tmp_path):
    rig = Rig(tmp_path, backoff_initial=1.0).running()
    rig.launcher.crash("decode-0")                   # leader SIGKILLed; its engine child lives on
    rig.sick("decode-0")
    dead = rig.launcher.live("decode-0")
    rig.ticks(1)
    assert dead.signals == [signal.SIGTERM] and dead.children == 0   # the orphan got the signal too
    assert rig.state("decode-0") == S.BACKOFF and rig.sup.phase == Phase.DEGRADED
    rig.ticks(3)                                     # 0.75 s < 1 s backoff
    assert rig.launcher.started.count("decode-0") == 1
    rig.ticks(2)
    assert rig.launcher.started.count("decode-0") == 2 and rig.state("decode-0") == S.STARTING
    assert rig.sup.by_name("decode-0").restarts == 1
    rig.healthy("decode-0")
    rig.until(lambda: rig.sup.phase == Phase.RUNNING)


def test_a_servers_shared_memory_is_removed_once_its_tree_is_gone_before_it_starts_again_and_at_down(tmp_path):
    """engine/shm_names.py: what a dead server left in /dev/shm is unlinked after its stop, never while a
    process of its tree still lives (the orphan below needs its SIGKILL first), and not for the router."""
    rig = Rig(tmp_path, backoff_initial=1.0).running()
    rig.launcher.crash("decode-0")                   # its engine child lives on past SIGTERM
    rig.launcher.live("decode-0").stubborn = True
    rig.sick("decode-0")
    rig.ticks(1)
    assert rig.state("decode-0") == S.STOPPING and rig.cleaned == []
    rig.until(lambda: rig.state("decode-0") == S.BACKOFF)
    assert rig.cleaned == ["decode-0"] and rig.launcher.started.count("decode-0") == 1
    rig.healthy("decode-0")
    rig.until(lambda: rig.sup.phase == Phase.RUNNING)
    assert rig.cleaned == ["decode-0"]
    rig.sup.shutdown()
    assert rig.cleaned == ["decode-0", "decode-0", "prefill-0"]


def test_stopping_is_timed_sigkill_comes_on_a_later_tick_and_others_are_probed_meanwhile(tmp_path):
    rig = Rig(tmp_path, stop_timeout=5.0).running()
    rig.launcher.stubborn.add("decode-0")
    rig.launcher.live("decode-0").stubborn = True
    rig.launcher.crash("prefill-0", leave_children=False)
    rig.sup.restart_queue.append("decode-0")
    rig.ticks(1)
    d = rig.launcher.live("decode-0")
    assert rig.state("decode-0") == S.STOPPING and d.signals == [signal.SIGTERM]
    asked = len(rig.health.asked)
    rig.ticks(8)                                     # 2 s: still within the SIGTERM window
    assert d.signals == [signal.SIGTERM] and rig.state("decode-0") == S.STOPPING
    assert len(rig.health.asked) > asked             # the router kept being probed
    assert rig.launcher.started.count("prefill-0") == 2   # the crashed prefill restarted meanwhile
    rig.ticks(13)                                    # past 5 s
    assert d.signals == [signal.SIGTERM, signal.SIGKILL]
    assert rig.launcher.started.count("decode-0") == 2 and rig.state("decode-0") in (S.STARTING, S.READY)


def test_a_tree_that_never_dies_is_reported_after_the_kill_grace(tmp_path, caplog):
    rig = Rig(tmp_path, stop_timeout=1.0).running()
    immortal = rig.launcher.live("router")
    rig.launcher.signal = lambda h, sig: immortal.signals.append(sig) or 1   # nothing dies, ever
    rig.sup.restart_queue.append("router")
    rig.until(lambda: "would not die" in caplog.text, every=0.5)
    assert immortal.signals.count(signal.SIGKILL) >= 2 and rig.clock.now > 1000 + KILL_GRACE


def test_a_crash_loop_gives_up_and_the_cluster_is_degraded(tmp_path):
    rig = Rig(tmp_path, max_restarts=2, backoff_initial=0.5, backoff_max=4).running()
    for i in range(2):
        rig.launcher.crash("decode-0")
        rig.until(lambda: rig.launcher.started.count("decode-0") == i + 2)
    rig.launcher.crash("decode-0")
    rig.until(lambda: rig.state("decode-0") == S.FATAL)
    assert rig.launcher.started.count("decode-0") == 3
    assert "crash loop" in rig.sup.by_name("decode-0").message and rig.sup.phase == Phase.DEGRADED


def test_backoff_doubles_up_to_its_cap(tmp_path):
    rig = Rig(tmp_path, backoff_initial=1.0, backoff_max=3.0, max_restarts=10).running()
    delays = []
    for _ in range(4):
        rig.launcher.crash("prefill-0")
        rig.ticks(1)
        p = rig.sup.by_name("prefill-0")
        delays.append(round(p.next_start - rig.clock.now, 2))
        rig.until(lambda: rig.state("prefill-0") == S.STARTING)
    assert delays == [1.0, 2.0, 3.0, 3.0]


def test_unhealthy_after_failed_probes_then_restarted_after_the_grace(tmp_path):
    rig = Rig(tmp_path, health_interval=1.0, unhealthy_grace=5.0).running()
    rig.sick("decode-0")
    rig.ticks(4 * (FAILED_PROBES_BEFORE_UNHEALTHY - 1))
    assert rig.state("decode-0") == S.READY
    rig.ticks(4)
    assert rig.state("decode-0") == S.UNHEALTHY and rig.launcher.started.count("decode-0") == 1
    rig.healthy("decode-0")
    rig.ticks(4)
    assert rig.state("decode-0") == S.READY
    rig.sick("decode-0")
    rig.until(lambda: "unhealthy for 5s" in rig.sup.by_name("decode-0").message)
    rig.until(lambda: rig.launcher.started.count("decode-0") == 2)


def test_dying_before_ever_ready_fails_up(tmp_path):
    rig = Rig(tmp_path)
    rig.sup.begin()
    rig.launcher.crash("prefill-0", code=1)
    rig.ticks(1)
    assert rig.sup.phase == Phase.FAILED and rig.sup.stop_requested
    assert "prefill-0 exited with code 1 before it became ready" == rig.sup.error


def test_not_ready_within_the_startup_timeout_fails_up(tmp_path):
    rig = Rig(tmp_path, startup_timeout=10.0)
    rig.sup.begin()
    rig.until(lambda: rig.sup.phase == Phase.FAILED, every=1.0)
    assert "not ready after 10s" in rig.sup.error


def test_a_launcher_that_cannot_start_backs_off_instead_of_killing_the_loop(tmp_path):
    rig = Rig(tmp_path, backoff_initial=1.0).running()
    rig.launcher.fail_start.add("decode-0")
    rig.launcher.crash("decode-0")
    rig.until(lambda: "could not start" in rig.sup.by_name("decode-0").message)
    assert rig.state("decode-0") == S.BACKOFF
    rig.launcher.fail_start.clear()
    rig.until(lambda: rig.state("decode-0") == S.STARTING)


def test_a_canary_in_flight_never_blocks_probes_or_restarts(tmp_path):
    rig = Rig(tmp_path)
    rig.executor.hold.add("Canary")
    rig.sup.begin()
    rig.healthy(*ALL)
    rig.ticks(4)
    assert rig.executor.pending and rig.sup.phase == Phase.STARTING   # the canary runs, for minutes
    rig.launcher.crash("router")
    rig.ticks(1)
    assert rig.state("router") == S.BACKOFF                          # still watched
    rig.until(lambda: rig.state("router") == S.READY)
    rig.executor.release()
    rig.ticks(1)
    assert rig.sup.phase == Phase.RUNNING


def test_start_up_canary_gives_up_after_its_tries(tmp_path):
    rig = Rig(tmp_path, canary=[False] * CANARY_TRIES)
    rig.sup.begin()
    rig.healthy(*ALL)
    rig.until(lambda: rig.sup.phase == Phase.FAILED)
    assert rig.canary.calls == CANARY_TRIES and "no KV" in rig.sup.error


def test_a_failed_canary_waits_before_the_next(tmp_path):
    rig = Rig(tmp_path, canary=[False, True])
    rig.sup.begin()
    rig.healthy(*ALL)
    rig.until(lambda: rig.canary.calls == 1)
    rig.ticks(4)                                     # 1 s < the 2 s pause
    assert rig.canary.calls == 1
    rig.until(lambda: rig.sup.phase == Phase.RUNNING)
    assert rig.canary.calls == 2


@pytest.mark.parametrize("restarted,expect_decode_restart", [("prefill-0", True), ("decode-0", False)])
def test_a_failing_path_after_a_restart_restarts_decode_only_after_a_prefill_restart(
        tmp_path, restarted, expect_decode_restart):
    rig = Rig(tmp_path).running()
    rig.canary.outcomes = [False] * CANARY_TRIES
    rig.launcher.crash(restarted)
    rig.until(lambda: rig.canary.calls == 1 + CANARY_TRIES)
    rig.ticks(2)
    decode_starts = rig.launcher.started.count("decode-0")
    assert decode_starts == (2 if expect_decode_restart else 2 if restarted == "decode-0" else 1)
    if expect_decode_restart:
        assert rig.sup.by_name("decode-0").restarts == 1


def test_a_server_that_keeps_failing_to_start_after_a_crash_gets_its_peers_restarted(tmp_path):
    """A dead D's GPU memory can stay held by P (CUDA IPC import): D's restarts then die before ready."""
    rig = Rig(tmp_path, backoff_initial=0.5, max_restarts=10).running()
    rig.launcher.crash("decode-0")
    for _ in range(2):
        rig.until(lambda: rig.state("decode-0") == S.STARTING)
        rig.launcher.crash("decode-0", code=1)
        rig.ticks(1)
    rig.until(lambda: rig.launcher.started.count("prefill-0") == 2)
    assert rig.sup.by_name("prefill-0").restarts == 1
    # D's next start comes only after P's reset (P's stop frees what it held), not on its own backoff
    rig.until(lambda: rig.launcher.started.count("decode-0") == 4)
    assert rig.launcher.started[-2:] == ["prefill-0", "decode-0"]


def test_a_crashed_server_whose_gpu_stays_held_gets_its_peers_reset_before_it_starts_again(tmp_path):
    """Seen on two H200: a SIGKILLed D's GPU kept 117 GB with no process (P's CUDA-IPC import), and two
    restarts of D died for want of memory before the peer reset freed it (~100 s)."""
    asked = []

    def held(dead, others):
        asked.append((dead.name, sorted(o.name for o in others)))
        return dead.name == "decode-0"
    rig = Rig(tmp_path, memory_held=held, backoff_initial=0.5).running()
    rig.launcher.crash("decode-0")
    rig.until(lambda: rig.launcher.started.count("decode-0") == 2)
    assert asked == [("decode-0", ["prefill-0"])]
    assert rig.launcher.started[-2:] == ["prefill-0", "decode-0"]       # P reset first, then D: no doomed start
    assert rig.sup.by_name("prefill-0").restarts == 1 and rig.sup.by_name("decode-0").failed_starts == 0
    rig.healthy("decode-0")
    rig.until(lambda: rig.sup.phase == Phase.RUNNING)


def test_a_requested_restart_that_keeps_failing_does_not_block_its_own_peer_reset(tmp_path):
    """`pdserve restart decode-0`, and the new D dies before ready twice: the queue must move on to P's
    reset (D waits for it), not wait for D to be ready first."""
    rig = Rig(tmp_path, backoff_initial=0.5, max_restarts=10).running()
    rig.sick("decode-0")                                       # the new D never answers before it dies
    rig.sup.restart_queue.append("decode-0")
    for _ in range(2):
        rig.until(lambda: rig.state("decode-0") == S.STARTING)
        rig.launcher.crash("decode-0", code=1)
        rig.ticks(1)
    rig.until(lambda: rig.launcher.started.count("decode-0") == 4, limit=400)
    assert rig.sup.by_name("prefill-0").restarts == 1
    assert rig.launcher.started[-2:] == ["prefill-0", "decode-0"]


def test_a_gpu_check_in_flight_holds_the_restart_and_a_freed_gpu_resets_nobody(tmp_path):
    def memory_held(dead, others):
        return False
    rig = Rig(tmp_path, memory_held=memory_held, backoff_initial=0.5).running()
    rig.executor.hold.add("memory_held")
    rig.launcher.crash("decode-0")
    rig.ticks(40)                                             # far past the backoff: still waiting for the check
    assert rig.state("decode-0") == S.BACKOFF and rig.launcher.started.count("decode-0") == 1
    rig.executor.release()
    rig.until(lambda: rig.launcher.started.count("decode-0") == 2)
    assert rig.launcher.started.count("prefill-0") == 1 and rig.sup.by_name("prefill-0").restarts == 0


def test_degraded_while_a_role_has_no_ready_server_then_running_again(tmp_path):
    rig = Rig(tmp_path, health_interval=1.0, unhealthy_grace=600).running()
    rig.sick("prefill-0")
    rig.until(lambda: rig.state("prefill-0") == S.UNHEALTHY)
    assert rig.sup.phase == Phase.DEGRADED and rig.sup.roles_without_ready_server() == ["prefill"]
    rig.healthy("prefill-0")
    rig.until(lambda: rig.sup.phase == Phase.RUNNING)


def test_shutdown_stops_router_then_decode_then_prefill_each_by_its_tree(tmp_path):
    rig = Rig(tmp_path).running()
    order = []
    real_signal = rig.launcher.signal
    rig.launcher.signal = lambda h, sig: order.append(rig.launcher.procs[h.pid].name) or real_signal(h, sig)
    rig.sup.shutdown()
    assert order == ["router", "decode-0", "prefill-0"] and rig.sup.phase == Phase.STOPPED
    assert all(rig.launcher.tree_alive(p.handle) == 0 for p in [] ) and {rig.state(n) for n in ALL} == {S.STOPPED}


def test_down_timeout_reaches_the_supervisor(tmp_path):
    from pdserve.state.folder import write_json_atomic
    rig = Rig(tmp_path, stop_timeout=20.0).running()
    rig.launcher.live("decode-0").stubborn = True
    write_json_atomic(rig.sup.cdir.requests_dir / "1.json", {"stop_timeout": 2.0})
    start = rig.clock.now
    rig.sup.shutdown()
    assert rig.launcher.live("decode-0").signals == [signal.SIGTERM, signal.SIGKILL]
    assert rig.clock.now - start < 5.0


def test_the_router_gets_its_drain_whatever_stop_timeout_and_down_timeout_say(tmp_path):
    """Issue 42: a router turn longer than stop_timeout was killed at stop_timeout (20 s) without a word. The
    router's plan asks for router.drain_timeout + its margin, and neither stop_timeout nor `down --timeout`
    cuts that short; the servers keep the shorter window."""
    from pdserve.plan.routers import ROUTER_STOP_MARGIN_S
    from pdserve.state.folder import write_json_atomic
    rig = Rig(tmp_path, stop_timeout=20.0).running()
    grace = rig.plan.by_name("router").stop_grace
    assert grace == 120.0 + ROUTER_STOP_MARGIN_S         # router.drain_timeout's default, and the margin
    for name in ("router", "decode-0"):
        rig.launcher.live(name).stubborn = True          # still draining / not yet gone
    write_json_atomic(rig.sup.cdir.requests_dir / "1.json", {"stop_timeout": 2.0})
    start = rig.clock.now
    rig.sup.shutdown()
    assert rig.launcher.live("router").signals == [signal.SIGTERM, signal.SIGKILL]
    assert rig.launcher.live("decode-0").signals == [signal.SIGTERM, signal.SIGKILL]
    assert grace <= rig.clock.now - start < grace + 2.0 + 1.0     # the router's window, then decode's 2 s


def test_adopts_live_processes_of_a_dead_supervisor(tmp_path):
    first = Rig(tmp_path).running()
    first.sup.write_state()
    second = Rig(tmp_path)
    second.launcher = first.launcher
    second.sup = Supervisor(second.plan, first.sup.cdir, Services(
        launcher_for=lambda plan, proc: first.launcher, probe=first.health, canary=second.canary,
        clock=second.clock, executor=second.executor), adopt=True)
    first.launcher.crash("router", leave_children=False)
    started_before = len(first.launcher.started)
    second.sup.begin()
    assert first.launcher.started[started_before:] == ["router"]        # only the dead one
    assert second.sup.by_name("prefill-0").handle.pid == first.sup.by_name("prefill-0").handle.pid
    assert "adopted" in second.sup.by_name("decode-0").message


def test_orphans_of_a_dead_leader_get_a_short_grace_not_the_full_stop_timeout(tmp_path):
    from pdserve.supervise.process import ORPHAN_GRACE
    rig = Rig(tmp_path, stop_timeout=20.0).running()
    rig.launcher.live("decode-0").stubborn = True          # its engine ignores SIGTERM
    rig.launcher.crash("decode-0")
    start = rig.clock.now
    rig.until(lambda: signal.SIGKILL in rig.launcher.live("decode-0").signals)
    assert rig.clock.now - start <= ORPHAN_GRACE + 0.5 <= 1.5


def test_an_unreachable_host_is_reported_not_restarted_and_shutdown_does_not_hang(tmp_path):
    from pdserve.launchers.base import HostUnreachable
    rig = Rig(tmp_path).running()
    real_alive, real_signal = rig.launcher.is_alive, rig.launcher.signal
    down = {"yes": True}

    def alive(h):
        if down["yes"] and rig.launcher.procs[h.pid].name == "decode-0":
            raise HostUnreachable("gpu-b", "ssh: connect timed out")
        return real_alive(h)
    rig.launcher.is_alive = alive
    rig.ticks(8)
    d = rig.sup.by_name("decode-0")
    assert "host gpu-b is unreachable" in d.message and rig.launcher.started.count("decode-0") == 1
    assert rig.state("prefill-0") == S.READY                       # the others are still watched
    down["yes"] = False
    rig.ticks(2)
    assert rig.launcher.started.count("decode-0") == 1
    rig.launcher.signal = lambda h, sig: (_ for _ in ()).throw(HostUnreachable("gpu-b", "gone")) \
        if rig.launcher.procs[h.pid].name == "decode-0" else real_signal(h, sig)
    rig.sup.shutdown()
    assert rig.state("decode-0") == S.STOPPED and "may still run there" in rig.sup.by_name("decode-0").message
    assert rig.sup.phase == Phase.STOPPED
