"""Run programs in a network namespace that reaches only loopback, with one TCP port in it bridged to a server
outside, and every byte either way recorded.

A holder process (`unshare -n`, so root) brings the namespace's `lo` up and listens on 127.0.0.1:PORT inside;
each connection there is carried over a unix socket (a path: the filesystem is shared, the network is not) to
a thread here that connects to the server and pumps both ways, keeping what the client sent and what it got.
Programs join the namespace with `nsenter --net` (`Bridge.argv`): the bridged port is all they can reach.
`requests(conns)` parses the recorded HTTP/1.1 requests (method, path, headers, JSON body).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

INSIDE = r"""
import asyncio, subprocess, sys
port, path = int(sys.argv[1]), sys.argv[2]
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)

async def pump(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        try:
            writer.write_eof()
        except OSError:
            pass

async def serve(reader, writer):
    up_reader, up_writer = await asyncio.open_unix_connection(path)
    await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
    writer.close()
    up_writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def missing_capability() -> str | None:
    """Why a namespace cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (unshare -n, nsenter)"
    for tool in ("unshare", "nsenter", "ip"):
        if not shutil.which(tool):
            return f"needs {tool} (util-linux, iproute2)"
    return None


@dataclass
class Conn:
    sent: bytearray = field(default_factory=bytearray)        # client -> server
    received: bytearray = field(default_factory=bytearray)    # server -> client


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except ValueError:
            return {}


class Bridge:
    def __init__(self, workdir: Path, target_port: int, inside_port: int = 8000):
        self.workdir, self.target, self.port = workdir, target_port, inside_port
        self.sock_path = str(workdir / "bridge.sock")
        self.conns: list[Conn] = []
        self._lock = threading.Lock()
        self._holder: subprocess.Popen | None = None
        self._listener: socket.socket | None = None

    def start(self) -> Bridge:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.sock_path)
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()
        self._holder = subprocess.Popen(["unshare", "-n", sys.executable, "-c", INSIDE, str(self.port),
                                         self.sock_path], stdout=subprocess.PIPE, text=True)
        line = self._holder.stdout.readline()
        assert line.strip() == "ready", f"the namespace's listener did not start: {line!r}"
        return self

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` run inside the namespace."""
        return ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--", *cmd]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mark(self) -> int:
        with self._lock:
            return len(self.conns)

    def since(self, mark: int) -> list[Conn]:
        with self._lock:
            return list(self.conns[mark:])

    def stop(self) -> None:
        if self._holder is not None:
            self._holder.kill()
            self._holder.wait(10)
            self._holder = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            conn = Conn()
            with self._lock:
                self.conns.append(conn)
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=_pump, args=(client, upstream, conn.sent), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client, conn.received), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
    try:
        while data := src.recv(65536):
            record.extend(data)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def requests(conns: list[Conn]) -> list[Request]:
    """The HTTP/1.1 requests the clients sent on these connections (Content-Length or chunked bodies)."""
    out = []
    for conn in conns:
        data, pos = bytes(conn.sent), 0
        while (end := data.find(b"\r\n\r\n", pos)) >= 0:
            head = data[pos:end].decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:] if ":" in h)}
            pos = end + 4
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = bytearray()
                while (eol := data.find(b"\r\n", pos)) >= 0:
                    size = int(data[pos:eol].split(b";")[0], 16)
                    body += data[eol + 2:eol + 2 + size]
                    pos = eol + 2 + size + 2
                    if size == 0:
                        break
            else:
                size = int(headers.get("content-length", 0))
                body, pos = data[pos:pos + size], pos + size
            out.append(Request(method, path, headers, bytes(body)))
    return out
