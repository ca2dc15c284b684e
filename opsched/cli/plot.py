"""Pictures: the benchmark chart and a timeline of a trace file (matplotlib, optional).

matplotlib is the ``opsched[plot]`` extra; :func:`require_matplotlib` says how to get it.
"""

from __future__ import annotations

import collections
import os
from typing import Any

__all__ = ["PLOT_HINT", "plot_bench", "plot_trace", "require_matplotlib"]

PLOT_HINT = "pip install 'opsched[plot]'"


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError as exc:
        msg = f"plotting needs matplotlib, which is not installed; install it with {PLOT_HINT}"
        raise ImportError(msg) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bench(results: dict[str, Any], path: str | os.PathLike[str]) -> int:
    """Chart what ``results`` (benchmark name -> result) holds; return the panels drawn.

    Kernels: bandwidth against size per operator and dtype, with the copy bandwidth (and
    torch's where measured). Scheduler sweeps: throughput against concurrent clients and
    against the fused batch cap, with one-request-at-a-time as the baseline.
    """
    plt = require_matplotlib()
    panels: list[Any] = []
    if "kernels" in results:
        panels.append(("kernels", results["kernels"]))
    sweeps = results.get("scheduler", {}).get("sweeps")
    if sweeps:
        panels.append(("clients", sweeps))
        panels.append(("batch", sweeps))
    if not panels:
        msg = "nothing to plot: run the kernels benchmark or the scheduler sweeps"
        raise ValueError(msg)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (kind, data) in zip(axes[0], panels, strict=True):
        if kind == "kernels":
            _kernel_panel(ax, data)
        else:
            _sweep_panel(ax, data, kind)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(panels)


def _kernel_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    series: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    copy: dict[int, list[float]] = collections.defaultdict(list)
    torch: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for r in rows:
        label = f"{r['op']} {r['dtype']}"
        series[label].append((r["elements"], r["fast_gbps"]))
        copy[r["elements"]].append(r["copy_gbps"])
        if "torch_gbps" in r:
            torch[f"torch {label}"].append((r["elements"], r["torch_gbps"]))
    for label, points in series.items():
        ax.plot(*zip(*sorted(points), strict=True), marker="o", label=label)
    for label, points in torch.items():
        ax.plot(*zip(*sorted(points), strict=True), linestyle=":", marker=".", label=label)
    sizes = sorted(copy)
    ax.plot(
        sizes,
        [sorted(copy[s])[len(copy[s]) // 2] for s in sizes],
        "k--",
        linewidth=2,
        label="numpy copy (memory limit)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("elements per launch")
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title("Kernel bandwidth, one core")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2, loc="upper left")


def _sweep_panel(ax: Any, sweeps: dict[str, Any], kind: str) -> None:
    if kind == "clients":
        points = sweeps["by_clients"]
        xs = [p["clients"] for p in points]
        ax.set_xlabel("concurrent clients")
        ax.set_title("GLU 8x64 throughput against concurrency")
    else:
        points = sweeps["by_batch"]
        xs = [p["max_batch_requests"] for p in points]
        ax.set_xlabel("max_batch_requests (256 clients)")
        ax.set_title("GLU 8x64 throughput against fused batch size")
    ax.plot(xs, [p["rps"] for p in points], marker="o", label="scheduler")
    for x, p in zip(xs, points, strict=True):
        ax.annotate(f"{p['requests_per_launch']:.0f}/launch", (x, p["rps"]), fontsize=7)
    ax.axhline(sweeps["direct_rps"], color="k", linestyle="--", label="direct, one at a time")
    ax.set_xscale("log", base=2)
    ax.set_ylabel("requests / s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def plot_trace(events: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Draw a trace's timeline: a row per stream with its launches, the queue depth below,
    and the graph edges as arrows (for machines without a browser to open Perfetto in)."""
    plt = require_matplotlib()
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"]
    queue = sorted(
        (e["ts"], e["args"]["requests"]) for e in events if e.get("name") == "queued requests"
    )
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(12, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    colors = {
        "GluBackward": "tab:blue",
        "GroupNormalizationGrad": "tab:orange",
        "GroupNormBackward": "tab:purple",
    }
    tids = sorted(t for t in names if t > 0)
    for row, tid in enumerate(tids):
        mine = [e for e in slices if e["tid"] == tid]
        bars = [(e["ts"] / 1e3, e["dur"] / 1e3) for e in mine]
        facecolors = [colors.get(e["args"].get("operator", ""), "tab:gray") for e in mine]
        # solid, however thin: anti-aliased, a launch under a pixel wide would be drawn
        # lighter, as if it meant something
        top.broken_barh(bars, (row - 0.4, 0.8), facecolors=facecolors, antialiased=False)
    row_of = {tid: row for row, tid in enumerate(tids)}
    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    for f in (e for e in events if e.get("ph") == "f"):
        s = starts.get(f["id"])
        if s is not None:
            top.annotate(
                "",
                xy=(f["ts"] / 1e3, row_of[f["tid"]]),
                xytext=(s["ts"] / 1e3, row_of[s["tid"]]),
                arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.6},
            )
    top.set_yticks(range(len(tids)), [names[t] for t in tids])
    top.set_ylim(-0.6, len(tids) - 0.4)
    top.invert_yaxis()
    seen = {e["args"].get("operator", "") for e in slices}
    for op, color in colors.items():
        if op in seen:
            top.plot([], [], color=color, linewidth=8, label=f"a launch of {op}")
    if starts:
        edge = "graph edge, producer's launch -> consumer's (a lone '>': same stream)"
        top.plot([], [], color="black", linewidth=0.6, marker=">", markersize=4, label=edge)
    top.legend(loc="upper right", fontsize=8)
    top.set_title("opsched trace: launches per stream (bar width = run time)")
    if queue:
        bottom.step(
            [t / 1e3 for t, _ in queue],
            [q for _, q in queue],
            where="post",
            label="requests waiting in the queue",
        )
        bottom.legend(loc="upper right", fontsize=8)
    bottom.set_ylabel("queued")
    bottom.set_xlabel("ms since the scheduler opened")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
