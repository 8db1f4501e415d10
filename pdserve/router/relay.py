"""Relaying D's stream to the client whatever its wire format: whole lines, with the router-only fields (D's
block handles, token ids) taken out by the format's collector (api/base.py)."""

from __future__ import annotations

from pdserve.router.api.base import Collector


class StreamRelay:
    """Relays D's SSE bytes as they arrive, whole lines at a time: one write per upstream read instead of
    one per token, and JSON is parsed only for lines that carry router-only fields. The reply text (for
    automatic conversation detection) is rebuilt from the kept lines after the stream, and only if D
    reported blocks worth remembering."""

    def __init__(self, collector: Collector, keep_lines: bool):
        self.collector = collector
        self.keep_lines = keep_lines and collector.reply_from_lines
        self.blocks: list[bytes] = []  # what D sent, split into lines only if the reply is wanted
        self.done = False              # D sent the end of its answer (the format's end marker)
        self._partial = b""

    def feed(self, data: bytes) -> bytes:
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        return self._process(data[:cut])

    def close(self) -> bytes:
        rest, self._partial = self._partial, b""
        return self._process(rest) if rest else b""

    def _process(self, block: bytes) -> bytes:
        if not block:
            return b""
        if not self.done and self.collector.ends(block):
            self.done = True
        if self.keep_lines:
            self.blocks.append(block)
        if not any(marker in block for marker in self.collector.markers):
            return block
        return b"".join(self.collector.scrub_sse_line(line, collect_reply=False)
                        for line in block.splitlines(keepends=True))

    def finish(self) -> None:
        if self.keep_lines and self.collector.kv_params is not None:
            self.collector.collect_reply_from([line for line in b"".join(self.blocks).split(b"\n")
                                               if line.startswith(b"data: {")])
