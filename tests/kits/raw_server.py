"""A backend or proxy that misbehaves (issue 35 item 4): a raw asyncio server, one scripted answer per request."""

from __future__ import annotations

import asyncio


async def raw_server(answer) -> tuple[asyncio.AbstractServer, str, list]:
    """Reads each request (head and Content-Length body) and calls `answer(writer, n, body, head)`, n counting
    requests on that connection from 0; returns the server, its URL and the peers seen."""
    peers: list = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername"))
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                if await answer(writer, n, body, head) is False:
                    writer.close()
                    return
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", peers
