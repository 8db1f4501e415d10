"""Write a variant of configs/gpu-1p1d.yaml for the GPU runs: the random-weight model, extra vLLM args and env.
  python3 cluster.py OUT.yaml NAME [--shared | --base FILE] [--block N] [--arg ARG ...] [--env K=V ...]
                    [--extra K=V ...] [--top K=V ...] [--no-cost-aware]
--extra sets a kv_transfer.extra_config key (vLLM's kv_connector_extra_config), --top a top-level key (e.g.
gpu_sharing=mps).
--shared starts from configs/gpu-1p1d-shared.yaml (P and D on GPU 0), --base from another shipped config (e.g.
gpu-1p1d-agent-128k.yaml); --arg adds a vLLM argument to both.
Only the model changes unless asked (the random-weight model: no hub there): the rest runs as shipped."""
import argparse
from pathlib import Path

import yaml

here = Path(__file__).resolve().parents[2]
a = argparse.ArgumentParser()
a.add_argument("out")
a.add_argument("name")
a.add_argument("--block", type=int)
a.add_argument("--shared", action="store_true")
a.add_argument("--base", help="a file of pdserve/configs to start from")
a.add_argument("--arg", action="append", default=[])
a.add_argument("--env", action="append", default=[])
a.add_argument("--extra", action="append", default=[])
a.add_argument("--top", action="append", default=[])
a.add_argument("--cost-aware", action="store_true", help="force the cost guard on (it is on as shipped)")
a.add_argument("--no-cost-aware", action="store_true", help="turn the shipped cost guard off")
a.add_argument("--model", default="/tmp/pdserve-model")
args = a.parse_args()
base = args.base or ("gpu-1p1d-shared.yaml" if args.shared else "gpu-1p1d.yaml")
cfg = yaml.safe_load((here / "pdserve/configs" / base).read_text())
cfg["name"], cfg["model"] = args.name, args.model
for role in ("prefill", "decode"):
    r = cfg[role]
    r["vllm_args"] = ["--load-format", "dummy", *r["vllm_args"], *args.arg]
    if args.block:   # replace the shipped block size
        i = r["vllm_args"].index("--block-size")
        r["vllm_args"][i + 1] = str(args.block)
    r["env"].update(dict(kv.split("=", 1) for kv in args.env))
if args.extra:
    cfg["kv_transfer"].setdefault("extra_config", {}).update(dict(kv.split("=", 1) for kv in args.extra))
cfg.update(dict(kv.split("=", 1) for kv in args.top))
if args.cost_aware or args.no_cost_aware:
    cfg["router"]["cost_aware"] = args.cost_aware
Path(args.out).write_text(yaml.safe_dump(cfg))
print(yaml.safe_dump(cfg))
