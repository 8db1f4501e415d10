"""Log rotation (copy-truncate, so O_APPEND writers keep going), tails, and following across a rotation."""

from __future__ import annotations

import threading
import time

from pdserve.observe.logfiles import follow, last_lines, rotate_if_large, rotated


def test_rotation_keeps_n_files_and_the_writer_keeps_appending(tmp_path):
    log = tmp_path / "decode-0.log"
    writer = open(log, "ab", buffering=0)           # like a server's stdout
    for generation in range(4):
        writer.write(f"gen {generation} ".encode() * 100 + b"\n")
        assert rotate_if_large(log, max_bytes=100, keep=2)
    writer.write(b"after\n")
    assert log.read_bytes() == b"after\n"           # appended at the start of the emptied file
    assert rotated(log, 1).read_text().startswith("gen 3")
    assert rotated(log, 2).read_text().startswith("gen 2")
    assert not rotated(log, 3).exists()
    assert not rotate_if_large(log, max_bytes=100, keep=2)   # small: left alone


def test_last_lines_reads_backwards_over_chunks(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i} " + "x" * 200 + "\n" for i in range(2000)))
    tail = last_lines(log, 3)
    assert [t.split()[1] for t in tail] == ["1997", "1998", "1999"]
    assert last_lines(tmp_path / "missing.log", 3) == []


def test_follow_survives_truncation(tmp_path):
    log = tmp_path / "r.log"
    log.write_text("old\n")
    got: list[str] = []
    done = threading.Event()

    def reader():
        for line in follow(log, poll=0.01, stop=done.is_set):
            got.append(line)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    with open(log, "ab") as f:
        f.write(b"one\ntw")
        f.flush()
        time.sleep(0.05)
        f.write(b"o\n")
        f.flush()
        time.sleep(0.05)
        rotate_if_large(log, 0, 1)
        f.write(b"three\n")
        f.flush()
    time.sleep(0.1)
    done.set()
    t.join(2)
    assert got == ["one", "two", "three"]


VLLM_FAILED_START = """\
(EngineCore pid=812) Process EngineCore:
(EngineCore pid=812) Traceback (most recent call last):
(EngineCore pid=812)   File "/venv/lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py", line 83, in init_device
(EngineCore pid=812)     raise ValueError(
(EngineCore pid=812) ValueError: Available memory on node 0 (9.56/12.21 GiB) on startup is less than desired CPU memory utilization (0.92, 11.24 GiB). On the CPU backend ...
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1433, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_root_cause_is_the_exception_before_vllm_s_wrapper():
    from pdserve.observe.logfiles import root_cause
    cause = root_cause(VLLM_FAILED_START.splitlines())
    assert cause.startswith("ValueError: Available memory on node 0 (9.56/12.21 GiB)"), cause
    assert root_cause(["INFO all fine", "zmq.error.ZMQError: Address already in use (addr='tcp://*:5601')"]) \
        == "zmq.error.ZMQError: Address already in use (addr='tcp://*:5601')"
    assert root_cause(["nothing went wrong here"]) is None
