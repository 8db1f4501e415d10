"""Plot off/on TTFT per context length from measure.py curve results (benchmarks/results/2026-11-30-gpu-2h200/curve-*.json).

  python3 benchmarks/gpu/plot_curve.py OUT.png CURVE.json[:LABEL] ...

Rows that repeat a (length, stream) pair are left out: in the block-64 run the third row per length
re-sent the first pair's "off" request, which then found an entry and pulled (docs/gpu.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def first_rows(path: Path) -> list[dict]:
    seen, rows = set(), []
    for row in json.loads(path.read_text()):
        key = (row["length"], row["stream"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def main(out: str, curves: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec in curves:
        path, _, label = spec.partition(":")
        rows = first_rows(Path(path))
        label = label or Path(path).stem
        for stream, style in ((False, "-"), (True, "--")):
            sel = sorted((r for r in rows if r["stream"] == stream), key=lambda r: r["length"])
            xs = [r["length"] / 1024 for r in sel]
            kind = "streamed" if stream else "non-streamed"
            ttft.plot(xs, [r["on_ms"] for r in sel], style, marker="o", label=f"on, {label}, {kind}")
            ratio.plot(xs, [r["off_ms"] / r["on_ms"] for r in sel], style, marker="o", label=f"{label}, {kind}")
        off = sorted((r for r in rows if not r["stream"]), key=lambda r: r["length"])
        ttft.plot([r["length"] / 1024 for r in off], [r["off_ms"] for r in off], ":", marker="x",
                  label=f"off (recompute), {label}")
    ttft.set(xlabel="context (k tokens)", ylabel="TTFT (ms)", title="TTFT: D->P reuse on vs off (2 x H200)")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    ratio.set(xlabel="context (k tokens)", ylabel="off / on", title="TTFT ratio off/on")
    for ax in (ttft, ratio):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
