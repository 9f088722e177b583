"""Draw a distkit profile's Chrome trace as a PNG (the picture in docs/debugging.md).

    python benchmarks/draw_trace.py trace.json docs/profile-trace.png

Perfetto (ui.perfetto.dev) or chrome://tracing show the same trace interactively; this
draws it where no browser is at hand. Needs matplotlib (not a dependency of distkit).
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.load(open(src))["traceEvents"]
    calls = [e for e in events if e["ph"] == "X"]
    ranks = sorted({e["pid"] for e in calls})
    names = sorted({e["name"] for e in calls})
    colors = dict(zip(names, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(ranks)), dpi=110)
    for e in calls:
        row = ranks.index(e["pid"])
        start, width = e["ts"] / 1e6, max(e["dur"] / 1e6, 0.004)
        ax.broken_barh([(start, width)], (row - 0.35, 0.7), color=colors[e["name"]])
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first call (one clock: offsets between ranks removed)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2)
    ax.set_title("distkit profile trace: a slice per call, a track per rank")
    fig.tight_layout()
    fig.savefig(dst, bbox_inches="tight")


if __name__ == "__main__":
    main(*sys.argv[1:3])
