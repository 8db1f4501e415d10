"""pdserve.engine.entry: the fixes it applies inside vLLM's processes, checked in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.engine.entry import CORES_ENV, DELAY_ENV, own_cores


@pytest.mark.parametrize("bind, cores", [
    ("0", [0]), ("2,3", [2, 3]), ("4-6", [4, 5, 6]), ("0,2-3", [0, 2, 3]),
    ("auto", []), ("nobind", []), ("", []), (None, []), ("0-1|2-3", []), ("x", []), ("1-y", []),
])
def test_own_cores(bind, cores):
    assert own_cores(bind) == cores


# What multiprocessing's spawn does in vLLM's engine core and workers with the parent's main module.
AS_SPAWNED_CHILD = "import runpy; runpy.run_module('pdserve.engine.entry', run_name='__mp_main__', alter_sys=True)\n"


def run_python(code: str, **env) -> str:
    full_env = {k: v for k, v in os.environ.items() if k not in (DELAY_ENV, CORES_ENV)}
    full_env.update(env)
    res = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


def test_pins_the_process_and_nixls_kv_core_to_its_own_cores():
    first = min(os.sched_getaffinity(0))
    out = run_python("import os\n" + AS_SPAWNED_CHILD +
                     "from vllm.platforms.cpu import CpuPlatform\n"
                     "print(sorted(os.sched_getaffinity(0)), CpuPlatform.discover_numa_topology())",
                     **{CORES_ENV: str(first)})
    assert out == f"[{first}] [[{first}]]"


IDLE_CPU = AS_SPAWNED_CHILD + """
import resource, time
import nixl._api as api
agent = api.nixl_agent("idle-test", api.nixl_agent_config(num_threads=1))
time.sleep(0.5)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep(2)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(round(100 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (time.monotonic() - t0)))
"""


def test_nixl_progress_thread_sleeps_instead_of_spinning():
    spinning = int(run_python(IDLE_CPU))                       # NIXL's own delay of 0: one core busy
    patched = int(run_python(IDLE_CPU, **{DELAY_ENV: "1000"}))
    # The control only has to show spinning is visible: on a loaded 2-core machine it gets well under a core.
    assert patched < 30 and spinning > max(25, 3 * patched), (spinning, patched)


def test_importing_it_for_its_constants_changes_nothing():
    # pdserve.plan.build imports its names in the CLI and the supervisor, whose environment may hold a server's variables
    first = min(os.sched_getaffinity(0))
    out = run_python("import os, sys, pdserve.plan.build\n"
                     "print(sorted(os.sched_getaffinity(0)) == sorted(os.sched_getaffinity(os.getppid())), "
                     "'vllm' in sys.modules, 'nixl' in sys.modules)",
                     **{CORES_ENV: str(first), DELAY_ENV: "1000"})
    assert out == "True False False"
