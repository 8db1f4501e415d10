"""The shared store's parts that need no Redis (issue 35): the entry schema accepts what D really returns, the
store URL's own parameters leave redis-py's alone, and the cluster's store secret is made once, private."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor

from pdserve.router.kv.store_entry import decode_entry, encode, readable
from pdserve.router.kv.store_redis import deployment_id, own_params, read_secret
from pdserve.state.secret import ensure_secret

# D's kv_transfer_params as vLLM's NIXL connector returns them (0.26 and later: one block list per KV-cache
# group; older: a flat list), with pdserve's held-KV deadline; and as the tests' fake D does.
VLLM = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[0, 1, 2], [3, 4, 5]],
        "remote_engine_id": "5e8d2c0a-2b7f-4c3e-9a51-0b6f3c2d1e7a", "remote_request_id": "chatcmpl-abc-0",
        "remote_host": "10.0.0.7", "remote_port": 5601, "tp_size": 1, "remote_num_tokens": 48,
        "remote_blocks_expiry_time": 18234.5}
OLDER = {**VLLM, "remote_block_ids": [0, 1, 2]}
FAKE = {**VLLM, "transfer_mode": "pull", "fake_d_url": "http://127.0.0.1:1"}


def test_what_d_returns_is_read_back_whole():
    for params in (VLLM, OLDER, FAKE, {"remote_block_ids": [7]}):
        assert readable(params), params
        entry = decode_entry(encode(params, "decode-0", [1, 2, 3]))
        assert entry is not None and entry.params == params and list(entry.sequence) == [1, 2, 3]
    entry = decode_entry(encode(VLLM, "decode-1", None))
    assert entry.sequence is None and entry.decode == "decode-1"


def test_the_store_urls_own_parameters_are_taken_out_and_the_rest_left_as_written():
    assert own_params("redis://h:6379/0") == ("redis://h:6379/0", {})
    assert own_params("rediss://h:6379/0?ssl_ca_certs=/a%20b/ca.crt&deployment_file=/x%20y/s.conf") == \
        ("rediss://h:6379/0?ssl_ca_certs=/a%20b/ca.crt", {"deployment_file": "/x y/s.conf"})
    assert own_params("unix:///run/r.sock?deployment=d1&db=2&password_file=/p") == \
        ("unix:///run/r.sock?db=2", {"deployment": "d1", "password_file": "/p"})


def test_the_secret_is_made_once_private_and_its_hash_is_the_deployment_id(tmp_path):
    path = tmp_path / "t" / "store-secret.conf"
    with ThreadPoolExecutor(8) as pool:                  # eight `up`s at once agree on one secret
        list(pool.map(lambda _: ensure_secret(path), range(8)))
    token = read_secret(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(token) == 64
    assert sorted(os.listdir(path.parent)) == ["store-secret.conf"]     # no temporary left behind
    ensure_secret(path)
    assert read_secret(str(path)) == token
    assert deployment_id(token) == deployment_id(token) and token not in deployment_id(token)
    other = tmp_path / "u" / "store-secret.conf"
    ensure_secret(other)
    assert deployment_id(read_secret(str(other))) != deployment_id(token)
