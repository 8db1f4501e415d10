"""The memory store kept across a drained router restart (pdserve/router/kv/store_file.py): written with wall-clock
expiry, read back without what expired meanwhile, what D no longer holds or holds from another engine; a
corrupt, foreign or oversized file ignored with a log line."""

from __future__ import annotations

import asyncio
import json
import logging

from pdserve.router.kv import store_file
from pdserve.router.kv.store_memory import MemoryTable

DECODES = ["decode-0", "decode-1"]


def params(rid: str, engine: str = "e0") -> dict:
    return {"remote_block_ids": [1, 2, 3], "remote_request_id": rid, "remote_engine_id": engine,
            "remote_num_tokens": 48, "remote_host": "127.0.0.1", "remote_port": 5600}


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def written(tmp_path, ttl: float = 100.0) -> tuple:
    mono, wall = Clock(1000.0), Clock(1_700_000_000.0)
    table = MemoryTable(ttl, clock=mono)
    table.put(("t", "a"), params("ra"), "decode-0", 3, [1, 2, 3, 4], alias=("t", "pa"))
    mono.t += 50                                       # "a" expires 50 s after the write, "b" 100 s after
    table.put(("t", "b"), params("rb"), "decode-1", 1, None)
    path = tmp_path / "reuse-store.json"
    used = {"ra": mono.t - 45}                         # "a" last used 45 s before the write ("b": not known)
    assert store_file.save(table, path, "c1", lambda e: used.get(e.params["remote_request_id"]),
                           clock=mono, wall=wall) == 2
    return path, wall


def test_a_drained_table_comes_back_with_its_expiry_and_the_file_is_consumed(tmp_path):
    path, wall = written(tmp_path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    wall.t += 10                                       # the router was down 10 s
    saved, expired = store_file.load(path, "c1", 1 << 20, DECODES, wall=wall)
    assert expired == 0 and {s.key for s in saved} == {("t", "a"), ("t", "b")} and not path.exists()
    a = next(s for s in saved if s.key == ("t", "a"))
    assert a.alias == ("t", "pa") and a.sequence == [1, 2, 3, 4] and a.decode == "decode-0"

    seen = []

    class Watcher:
        def put(self, key, entry):
            seen.append((key, entry.expires))

        def dropped(self, key, entry, reason):
            pass

    fresh = MemoryTable(432.0, clock=Clock(5.0))
    fresh.watcher = Watcher()                          # held.py's ledger learns restored entries as new ones
    last_use = {}
    assert store_file.restore(fresh, saved, lambda d: 7, lambda e, t: last_use.update({e.decode: t}),
                              clock=Clock(5.0), wall=wall) == 2
    assert last_use == {"decode-0": 5.0 - 45 - 10}     # its last use kept (the lease counts from it), not now
    assert [k for k, _ in seen] == [("t", "a"), ("t", "b")]                  # soonest expiry first
    assert dict(seen) == {("t", "a"): 5.0 + 40, ("t", "b"): 5.0 + 90}       # 50 and 100 s, less the 10 s down
    entry, why = fresh.take_first([("t", "pa")])                            # the alias came back too
    assert why == "ok" and entry.generation == 7 and entry.params["remote_request_id"] == "ra"


def test_entries_whose_expiry_passed_while_no_router_ran_are_not_restored(tmp_path):
    path, wall = written(tmp_path)
    wall.t += 60                                       # "a" (50 s left) expired, "b" (100 s) did not
    saved, expired = store_file.load(path, "c1", 1 << 20, DECODES, wall=wall)
    assert [s.key for s in saved] == [("t", "b")] and expired == 1


def test_a_corrupt_foreign_or_oversized_file_is_ignored_with_a_log_line(tmp_path, caplog):
    path = tmp_path / "reuse-store.json"
    caplog.set_level(logging.WARNING, "pdserve.router")
    cases = {
        "corrupt": b'{"format": "pdserve-reuse-store", "entr',
        "binary": b"\xff\xfe\x00garbage",
        "foreign format": json.dumps({"format": "something-else", "version": 1, "cluster": "c1",
                                      "entries": []}).encode(),
        "another cluster": json.dumps({"format": store_file.FORMAT, "version": 1, "cluster": "other",
                                       "entries": []}).encode(),
        "newer version": json.dumps({"format": store_file.FORMAT, "version": 99, "cluster": "c1",
                                     "entries": []}).encode(),
        "oversized": b" " * (store_file.MAX_FILE_FACTOR * 1000 + (1 << 20) + 1),
    }
    for name, data in cases.items():
        caplog.clear()
        path.write_bytes(data)
        assert store_file.load(path, "c1", 1000, DECODES) == ([], 0), name
        assert "ignored" in caplog.text, name
        assert not path.exists(), name
    # entries that are not entries (wrong types, a decode server this config lacks) are left out one by one
    good = {"key": ["t", "a"], "decode": "decode-0", "params": params("ra"), "alias": None, "sequence": None,
            "expires": 2e9}
    bad = [{**good, "decode": "decode-9"}, {**good, "params": {"remote_block_ids": "x"}}, {**good, "key": ["t"]},
           {**good, "sequence": ["a"]}, {**good, "expires": True}, "nope"]
    path.write_text(json.dumps({"format": store_file.FORMAT, "version": 1, "cluster": "c1", "entries": [good, *bad]}))
    saved, _ = store_file.load(path, "c1", 1 << 20, DECODES, wall=lambda: 1e9)
    assert [s.key for s in saved] == [("t", "a")]
    assert store_file.load(tmp_path / "absent.json", "c1", 1000, DECODES) == ([], 0)


def test_only_what_d_still_holds_from_the_same_engine_comes_back(tmp_path):
    saved = [store_file.Saved(("t", k), d, params(rid, engine), None, None, 2e9)
             for k, d, rid, engine in [("a", "decode-0", "ra", "e0"), ("b", "decode-0", "rb", "e0"),
                                       ("c", "decode-0", "rc", "old"), ("d", "decode-1", "rd", "e1")]]

    async def ask(decode: str):
        if decode == "decode-1":
            return 503, None                                   # down or without the control routes
        return 200, {"engine_id": "e0", "held": [{"request_id": "ra", "remaining_s": 30},
                                                 {"request_id": "rc", "remaining_s": 30},
                                                 {"request_id": "rb", "remaining_s": 0}]}

    kept = asyncio.run(store_file.still_held(saved, ask))
    # rb: D's timer ran out; rc: another engine's (D restarted); rd: its D did not list what it holds
    assert [s.key for s in kept] == [("t", "a")]
