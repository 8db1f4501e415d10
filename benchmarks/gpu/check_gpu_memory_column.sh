#!/usr/bin/env bash
# On a GPU machine: does `pdserve status --watch`'s GPU-memory column see a server's GPU memory?
# Starts a parent process whose child holds 4 GiB on GPU 0 (like vLLM's API server -> worker), then
# prints nvidia-smi's per-process view and what pdserve.observe.resources attributes to the parent's tree.
set -u
python3 - <<'PY'
import subprocess, sys, time
child = "import torch, time; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); print('held', flush=True); time.sleep(60)"
parent = subprocess.Popen([sys.executable, "-c",
    f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}]); p.wait()"])
time.sleep(20)
print(subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                     capture_output=True, text=True).stdout or "(nvidia-smi lists no compute processes)")
try:
    from pdserve.observe.resources import TreeSampler, gpu_memory_by_pid, human_bytes
    by_pid = gpu_memory_by_pid()
    print("gpu_memory_by_pid:", by_pid)
    use = TreeSampler().sample(parent.pid, by_pid)
    print("parent tree:", parent.pid, "gpu memory", human_bytes(use.gpu_bytes), "rss", human_bytes(use.rss))
except Exception as e:
    print("pdserve.observe.resources failed:", type(e).__name__, e)
parent.kill()
subprocess.run(["pkill", "-f", "torch.empty"])
PY
