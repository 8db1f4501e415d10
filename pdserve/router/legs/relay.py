"""Relaying D's stream to the client whatever its wire format: whole lines, with the router-only fields (D's
block handles, token ids) taken out by the format's collector (api/base.py)."""

from __future__ import annotations

import re

from pdserve.router.api.base import Collector
from pdserve.router.buffers import Charge

FEW_MARKED = 8    # a block with more mentions of router-only fields than this is scrubbed line by line


class LineTooLong(ValueError):
    """D sent a line longer than the bound without ending it (an endless body, or not SSE)."""


class StreamRelay:
    """Relays D's SSE bytes as they arrive, whole lines at a time: one write per upstream read instead of
    one per token, and JSON is parsed only for lines that carry router-only fields. The reply text (for
    automatic conversation detection) is rebuilt from the kept lines after the stream, and only if D
    reported blocks worth remembering.

    Bounded by `max_bytes` (router.max_answer_mb): a line longer than that is refused (LineTooLong: the
    stream ends with the format's error event); a stream longer than that is relayed to its end but not
    remembered (`overflow`): neither its lines nor its token ids are kept past the bound. What it keeps is
    charged to the request (`charge`, buffers.py): when the router's buffers are full it overflows the same way."""

    def __init__(self, collector: Collector, keep_lines: bool, max_bytes: int = 32 * 1024 * 1024,
                 charge: Charge | None = None):
        self.collector = collector
        self.keep_lines = keep_lines and collector.reply_from_lines
        self.blocks: list[bytes] = []  # what D sent, split into lines only if the reply is wanted
        self.done = False              # D sent the end of its answer (the format's end marker)
        self.max_bytes = max_bytes
        self.seen = 0                  # bytes D sent
        self.overflow = False          # more than max_bytes: too long to remember
        self._partial: list[bytes] = []   # the start of a line not ended yet
        self._marked = re.compile(b"|".join(re.escape(m) for m in collector.markers)).search
        self._partial_size = 0
        self.charge = charge
        self.charged = 0               # bytes of what it keeps, charged to the request

    def feed(self, data: bytes) -> bytes:
        self.seen += len(data)
        if self.overflow or self.seen > self.max_bytes:
            self._overflow()           # each read: what the collector gathered since is dropped too
        elif self.charge is not None:
            if self.charge.take(len(data)):
                self.charged += len(data)
            else:
                self._overflow()
        cut = data.rfind(b"\n") + 1
        if not cut:
            self._keep_partial(data)
            return b""
        if self._partial:
            cut += self._partial_size
            data = b"".join(self._partial) + data
            self._partial, self._partial_size = [], 0
        if cut < len(data):
            self._keep_partial(data[cut:])
        return self._process(data[:cut])

    def _keep_partial(self, piece: bytes) -> None:
        self._partial.append(piece)
        self._partial_size += len(piece)
        if self._partial_size > self.max_bytes:
            raise LineTooLong(f"a stream line over {self.max_bytes} bytes")

    def _overflow(self) -> None:
        self.overflow, self.keep_lines, self.blocks = True, False, []
        if self.charge is not None:
            self.charge.give(self.charged)
            self.charge, self.charged = None, 0
        self.collector.generated.clear()   # the sequence will not be stored: keep none of it

    def close(self) -> bytes:
        rest, self._partial, self._partial_size = b"".join(self._partial), [], 0
        return self._process(rest) if rest else b""

    def _process(self, block: bytes) -> bytes:
        if not block:
            return b""
        if not self.done and self.collector.ends(block):
            self.done = True
        if self.keep_lines:
            self.blocks.append(block)
        return self._scrub(block)

    def _scrub(self, block: bytes) -> bytes:
        """The block with router-only fields taken out of the lines that mention one; every other line is
        passed on as it came, unparsed (a block is often most of a stream: reads lag behind a fast D). A few
        such lines are found by search; when there are many (chat's token ids, one a chunk), line by line."""
        markers = self.collector.markers
        hits = sum(block.count(m) for m in markers)
        if not hits:
            return block
        scrub = self.collector.scrub_sse_line
        if hits > FEW_MARKED or b"\r" in block:     # (a CR ends a line too, as SSE says: split as ever)
            return self.collector.scrub_block(block, self._marked)
        parts = []
        pos = 0
        hit = _first(block, markers, 0)
        while hit >= 0:
            start = block.rfind(b"\n", pos, hit) + 1 or pos
            end = block.find(b"\n", hit) + 1 or len(block)
            parts += (block[pos:start], scrub(block[start:end], False))
            pos = end
            hit = _first(block, markers, pos)
        parts.append(block[pos:])
        return b"".join(parts)

    def finish(self) -> None:
        if self.keep_lines and self.collector.kv_params is not None:
            self.collector.collect_reply_from_stream(b"".join(self.blocks))


def _first(block: bytes, markers: tuple[bytes, ...], pos: int) -> int:
    """Where the first of `markers` is in block[pos:], or -1."""
    found = [at for at in (block.find(m, pos) for m in markers) if at >= 0]
    return min(found) if found else -1
