"""PNG plots of a report (matplotlib, imported only here, drawn off-screen with the Agg backend).

Every variant keeps one colour across the plots; legends sit outside the axes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlaq.validate.report_types import Report


def write_plots(r: dict[str, Any], directory: Path) -> list[str]:
    """Write the plots into ``directory``; returns their file names."""
    r = r if isinstance(r, Report) else Report.from_json(r)  # every plot reads r.rows
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def log_axis(ax: Any) -> None:  # ticks at 1, 2, 5 x 10^n written plainly (0.2, 1, 5)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())

    everyone = list(r.rows)
    colour = {label: f"C{i % 10}" for i, (label, _) in enumerate(everyone)}
    cands = [(label, v) for label, v in everyone if "kl" in v]
    names = []
    centers = [(a + b - 1) / 2 for a, b in r["buckets"]]

    if cands:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
        keys = ("attn_rel_err_by_bucket", "kl_by_bucket", "nll_delta_by_bucket")
        for label, v in cands:
            for ax, key in zip(axes, keys, strict=True):
                ys_ = v.get(key) or [None] * len(centers)  # a server source has no attention error
                pts = [(c, y) for c, y in zip(centers, ys_, strict=True) if y is not None]
                ys = [100 * y if key == "attn_rel_err_by_bucket" else y for _, y in pts]
                ax.plot([c for c, _ in pts], ys, marker="o", color=colour[label], label=label)
        titles = ("attention error (%)", "KL(reference ‖ scheme) (nats)", "ΔNLL (nats)")
        for ax, title in zip(axes, titles, strict=True):
            ax.set_title(title)
            ax.set_xlabel("context position")
            ax.grid(alpha=0.3)
        log_axis(axes[0])
        axes[1].set_yscale("log")
        axes[2].axhline(0.0, color="black", linewidth=0.8)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncols=len(labels), fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        names.append(_save(fig, directory, "error_vs_position.png"))

    k = r["config"]["num_speculative_tokens"]
    if k:
        fig, ax = plt.subplots(figsize=(8.5, 4.2))
        for label, v in everyone:
            per = v.get("per_position_acceptance_rate")
            if per:
                ax.plot(
                    range(len(per)),
                    [100 * (x or 0) for x in per],
                    marker="o",
                    color=colour[label],
                    label=label,
                )
        ax.set_xticks(range(k))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate (%)")
        ax.set_title(f"MTP speculative decoding, k={k}: per-position acceptance")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        names.append(_save(fig, directory, "acceptance_per_position.png"))

    if cands and "attn_rel_err_by_layer" in cands[0][1]:
        fig, ax = plt.subplots(figsize=(9.5, 4.2))
        layers = cands[0][1]["attn_rel_err_by_layer"]
        labels = [f"{x['layer']}{' MTP' if x['mtp'] else ''}" for x in layers]
        width = 0.8 / len(cands)
        for i, (label, v) in enumerate(cands):
            xs = [j + (i - (len(cands) - 1) / 2) * width for j in range(len(labels))]
            errs = [100 * x["rel_err"] for x in v["attn_rel_err_by_layer"]]
            ax.bar(xs, errs, width, color=colour[label], label=label)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("layer")
        ax.set_ylabel("attention error (%)")
        log_axis(ax)
        ax.set_title("attention error by layer (same captured inputs)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        names.append(_save(fig, directory, "per_layer_error.png"))
    from mlaq.validate.plots_tasks import write_task_plots

    return names + write_task_plots(r, directory, plt, colour)


def _save(fig: Any, directory: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(directory / name, dpi=110)
    plt.close(fig)
    return name
