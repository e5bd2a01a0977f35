"""PNG plots of a benchmark run: a per-request timeline and latency distributions.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global state),
so it works in a headless process and in threads.

Timeline: one horizontal bar per request (y = dataset index, x = seconds since the start):
- grey: waiting in the client for a concurrency slot (arrival → send; empty without
  `--max-concurrency`);
- orange: send → first token (the TTFT: the server's queue, prefill and transport);
- blue, alternating shades: each gap between consecutive token chunks (decode);
- red: a failed request, from send to its failure.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from llmfleet.cli.benchserve.stats import RequestRecord

logger = logging.getLogger(__name__)

MAX_TIMELINE_REQUESTS = 2000  # beyond this a timeline is unreadable; the first ones are drawn
_QUEUE, _TTFT, _FAILED = "#b0b0b0", "#f28e2b", "#d62728"
_DECODE = ("#4e79a7", "#a0cbe8")


def _figure(width: float, height: float):  # -> matplotlib.figure.Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def segments(record: RequestRecord) -> list[tuple[float, float, str]]:
    """(start, width, color) of each piece of one request's timeline bar, left to right."""
    out: list[tuple[float, float, str]] = []
    if record.start_s > record.scheduled_s:
        out.append((record.scheduled_s, record.start_s - record.scheduled_s, _QUEUE))
    if not record.success:
        return [*out, (record.start_s, max(record.latency_s, 1e-6), _FAILED)]
    t = record.start_s + record.ttft_s
    out.append((record.start_s, record.ttft_s, _TTFT))
    for i, gap in enumerate(record.itl_s):
        out.append((t, gap, _DECODE[i % 2]))
        t += gap
    if record.end_s > t:  # the tail after the last chunk (usage, end of stream)
        out.append((t, record.end_s - t, _DECODE[len(record.itl_s) % 2]))
    return out


def plot_timeline(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    """The per-request timeline (see the module docstring) as a PNG at `path`."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    shown = sorted(records, key=lambda r: r.index)[:MAX_TIMELINE_REQUESTS]
    if len(records) > len(shown):
        logger.info("timeline: drawing the first %d of %d requests", len(shown), len(records))
    fig = _figure(12.0, min(2.0 + 0.18 * len(shown), 40.0))
    ax = fig.add_subplot()
    for row, r in enumerate(shown):
        segs = segments(r)
        ax.broken_barh(
            [(s, w) for s, w, _ in segs], (row - 0.4, 0.8), facecolors=[c for *_, c in segs]
        )
    ax.set_ylim(-1, max(len(shown), 1))
    ax.invert_yaxis()  # request 0 at the top
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("seconds since the benchmark start")
    ax.set_ylabel("request")
    ax.set_title(title or "Per-request timeline")
    fig.legend(
        handles=[
            Patch(color=_QUEUE, label="waiting for a concurrency slot"),
            Patch(color=_TTFT, label="time to first token"),
            Patch(color=_DECODE[0], label="decode (one shade per token chunk)"),
            Patch(color=_FAILED, label="failed"),
        ],
        loc="outside lower center",
        ncols=4,
        fontsize="small",
    )
    fig.savefig(path)
    return path


def plot_distributions(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    """Histograms (top) and empirical CDFs (bottom) of TTFT, ITL and E2EL in ms, as a PNG."""
    ok = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft_s * 1e3 for r in ok],
        "ITL": [g * 1e3 for r in ok for g in r.itl_s],
        "E2EL": [r.latency_s * 1e3 for r in ok],
    }
    fig = _figure(14.0, 7.0)
    axes = fig.subplots(2, len(series))
    for col, (name, values) in enumerate(series.items()):
        hist, cdf = axes[0][col], axes[1][col]
        hist.set_title(f"{name} (n={len(values)})")
        cdf.set_xlabel(f"{name} (ms)")
        if not values:
            hist.text(0.5, 0.5, "no data", ha="center", va="center", transform=hist.transAxes)
            continue
        hist.hist(values, bins=min(50, max(5, len(values) // 2)), color=_DECODE[0])
        hist.set_ylabel("requests" if name != "ITL" else "token gaps")
        ordered = sorted(values)
        n = len(ordered)
        cdf.step(ordered, [(i + 1) / n for i in range(n)], where="post", color=_TTFT)
        cdf.set_ylim(0, 1.02)
        cdf.set_ylabel("fraction ≤ x")
        cdf.grid(alpha=0.3)
    fig.suptitle(title or "Latency distributions")
    fig.savefig(path)
    return path
