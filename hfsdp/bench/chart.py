"""PNG chart of a benchmark: step time, tokens/s and peak memory per configuration.

matplotlib is optional for the rest of the package; only this writer needs it and it says so.
The chart is a PNG written at exactly the path given, in one step (missing folders are made):
matplotlib's own ``savefig(path)`` would append ``.png`` to a path without a suffix and write
a file no check of the path had looked at.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

from hfsdp.atomic import write_bytes_atomic
from hfsdp.bench.results import MIB, ConfigSummary


class ChartUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ChartUnavailable(
            "the benchmark chart needs matplotlib (pip install matplotlib); the JSON results "
            "were still written. Re-run with --no-chart to skip the chart."
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_chart(path: str, summaries: Sequence[ConfigSummary], title: str) -> None:
    """Three panels: median step time (with run min..max), tokens/s, peak allocated/reserved; a PNG
    at exactly ``path`` (see the module's docstring)."""
    if not summaries:
        raise ValueError("no configurations to chart")
    plt = _pyplot()
    names = [s.config for s in summaries]
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 4.0))
    step = [s.median_step_s * 1e3 for s in summaries]
    err = [[m - s.min_run_median_s * 1e3 for m, s in zip(step, summaries, strict=True)],
           [s.max_run_median_s * 1e3 - m for m, s in zip(step, summaries, strict=True)]]
    axes[0].bar(x, step, yerr=err, capsize=4, color="tab:blue")
    axes[0].set_ylabel("median step time (ms)")
    axes[1].bar(x, [s.tokens_per_s for s in summaries], color="tab:green")
    axes[1].set_ylabel("tokens / s")
    w = 0.4
    axes[2].bar([i - w / 2 for i in x], [s.peak_allocated_bytes / MIB for s in summaries], w,
                label="peak allocated", color="tab:orange")
    axes[2].bar([i + w / 2 for i in x], [s.peak_reserved_bytes / MIB for s in summaries], w,
                label="peak reserved", color="tab:red")
    axes[2].set_ylabel("MiB")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=20, fontsize=8)
    for i, s in enumerate(summaries):
        if s.step_time_ratio is not None:
            axes[0].annotate(f"{s.step_time_ratio:.3f}x", (i, step[i]), ha="center",
                             va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_bytes_atomic(path, png.getvalue())
