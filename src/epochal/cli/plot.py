"""``epochal stats --plot``: save/load durations and throughput per node and epoch, as a PNG.

Needs matplotlib (the ``plot`` extra); uses the non-interactive Agg backend.
"""

from __future__ import annotations

from typing import Any

from .problems import Problem


def plot_stats(stats: dict[str, Any], path: str) -> None:
    """Draw ``stats`` (from :func:`epochal.cli.records.stats_prefix`) into the PNG file ``path``:
    seconds per epoch (top) and MB/s per epoch (bottom), one line per (action, node)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise Problem("--plot needs matplotlib: pip install 'epochal[plot]'") from None
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in stats["records"]:
        if isinstance(r.get("epoch"), int):
            series.setdefault((r["action"], str(r["node"])), []).append(r)
    longest = max((r["seconds"] for rows in series.values() for r in rows), default=0.0)
    scale, unit = (1e3, "ms") if longest < 1 else (1.0, "seconds")
    fig, (ax_t, ax_r) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    try:
        for (action, node), rows in sorted(series.items()):
            rows = sorted(rows, key=lambda r: r["epoch"])
            label = f"{action.replace('checkpoint_', '')} {node}"
            marker = "o" if action == "checkpoint_save" else "s"
            style = "-" if action == "checkpoint_save" else "none"
            epochs = [r["epoch"] for r in rows]
            ax_t.plot(epochs, [r["seconds"] * scale for r in rows], marker=marker, linestyle=style, label=label)
            rated = [r for r in rows if r["mb_per_s"]]
            if rated:
                ax_r.plot([r["epoch"] for r in rated], [r["mb_per_s"] for r in rated],
                          marker=marker, linestyle=style, label=label)
        ax_t.set_ylabel(unit)
        ax_t.set_title(f"checkpoint I/O: {stats['prefix']}")
        ax_r.set_ylabel("MB/s")
        ax_r.set_xlabel("epoch")
        from matplotlib.ticker import MaxNLocator

        ax_r.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in (ax_t, ax_r):
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small", loc="best")
        fig.tight_layout()
        try:
            fig.savefig(path, format="png", dpi=100)
        except OSError as e:
            raise Problem(f"{path}: cannot write the plot: {e.strerror or e}") from None
    finally:
        plt.close(fig)
