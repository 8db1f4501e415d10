"""Render a cluster.yaml for another place to run it; starts nothing. `kubernetes`: YAML documents on stdout
(one file per object in a folder with --out): per server a StatefulSet (or a LeaderWorkerSet) running exactly
the argv and env `pdserve plan` prints, host-specific values replaced (bind 0.0.0.0, the NIXL side-channel
host from the pod's IP, GPUs and cores as resource requests); memory limits from the plan's bounds or
--memory; the router's config in a ConfigMap naming every server by stable DNS, its Deployment and Service;
the managed Redis; a Prometheus scrape config. The mapping rules this config needed go to stderr
(docs/kubernetes.md). Exit 2 for what cannot run there, naming the field."""

from __future__ import annotations

from pathlib import Path

import typer

from pdserve.orchestrate import ops
from pdserve.ui import console

NAME = "export"


def command(
    target: str = typer.Argument(..., help=f"Where it runs: {', '.join(ops.EXPORT_TARGETS)}."),
    config: Path = typer.Argument(None, help="cluster.yaml (default: the embedded configs/local-cpu.yaml)"),
    namespace: str = typer.Option("default", "--namespace", help="Namespace of every object (and of the "
                                                                  "servers' DNS names in the router's config)."),
    image: str = typer.Option(None, "--image", help="Image with vLLM and this pdserve, for servers and router "
                                                    "(default: pdserve:VERSION, built as docs/kubernetes.md says)."),
    fmt: str = typer.Option("statefulset", "--format",
                            help="statefulset: one StatefulSet of one pod per server; lws: one LeaderWorkerSet "
                                 "per server, a leader and workers when its GPUs span nodes."),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", min=1,
                                      help="GPUs of one node (default: the platform's, else 8): a server with more "
                                           "spans nodes (lws) or is refused (statefulset)."),
    memory: list[str] = typer.Option(None, "--memory", metavar="ROLE=QUANTITY",
                                     help="Memory request = limit of a role's containers (prefill, decode, "
                                          "router, store), e.g. prefill=64Gi; repeatable. Default: derived from "
                                          "the plan's bounds (router, Redis, CPU servers of a built-in model), "
                                          "else none (docs/kubernetes.md)."),
    out: Path = typer.Option(None, "--out", help="Write one file per object into this folder (for `kubectl apply "
                                                 "-f DIR`) instead of printing them; prints the paths."),
) -> None:
    result = ops.export(target, config, namespace=namespace, image=image, fmt=fmt, gpus_per_node=gpus_per_node,
                        memory=memory)
    for note in result.notes:
        console.info(f"note: {note}")
    if out is None:
        console.print_text(result.yaml())
        return
    out.mkdir(parents=True, exist_ok=True)
    files = result.files()
    for name, text in files.items():
        (out / name).write_text(text)
        console.print_text(f"{out / name}\n")
    others = sorted(p.name for p in out.glob("*.y*ml") if p.name not in files)
    if others:
        console.info(f"note: {out} also holds {', '.join(others)}, not from this export: "
                     f"`kubectl apply -f {out}` would apply them too")
