"""The Redis store over what `router.store` accepts besides plain redis://: a password (AUTH in the
handshake), rediss:// (TLS, a self-signed CA) and unix:// (a socket file), each against a real
redis-server. The per-turn pipe builds its own connection from the URL's settings, so each is checked
through put and take, not only through redis-py's pool (refresh)."""

from __future__ import annotations

import subprocess

import pytest

from pdserve.router.kv.store import open_store
from tests.kits.ports import free_port
from tests.kits.redis_rig import RedisServer

PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "e1", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 40}


def self_signed(folder) -> tuple[str, str]:
    cert, key = folder / "redis.crt", folder / "redis.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return str(cert), str(key)


def transport(kind: str, tmp_path) -> tuple[RedisServer, str]:
    data = tmp_path / "redis"
    data.mkdir()
    if kind == "password":
        server = RedisServer(data, args=("--requirepass", "s3cret"))
        return server, f"redis://:s3cret@127.0.0.1:{server.port}/2"
    if kind == "tls":
        cert, key = self_signed(data)
        port = free_port()
        server = RedisServer(data, port=0, args=("--port", "0", "--tls-port", str(port), "--tls-cert-file", cert,
                                                 "--tls-key-file", key, "--tls-ca-cert-file", cert,
                                                 "--tls-auth-clients", "no"))
        return server, f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    sock = data / "redis.sock"
    server = RedisServer(data, port=0, args=("--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"))
    return server, f"unix://{sock}?db=1"


@pytest.mark.parametrize("kind", ["password", "tls", "unix"])
async def test_put_and_take_over_each_transport(kind, tmp_path):
    server, url = transport(kind, tmp_path)
    server.start()
    errors: list = []
    store = open_store(url, ttl=30, max_entries=100, max_bytes=2**20, cluster="t", decodes=["decode-0"], timeout=2.0,
                       on_evict=lambda r, n: None, on_error=lambda op, why: errors.append((op, why)),
                       on_health=lambda up: None)
    try:
        assert await (await store.put(("t", "c"), PARAMS, "decode-0", 0, [7, 8, 9])) is True
        entry, why = await store.take_first([("t", "c")])
        assert why == "ok" and entry is not None and list(entry.sequence) == [7, 8, 9]
        await store.refresh()                           # redis-py's pool, same URL
        assert len(store) == 0 and errors == []
    finally:
        await store.close()
        server.stop()
