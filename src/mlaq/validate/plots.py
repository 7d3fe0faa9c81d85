"""PNG plots of a report (matplotlib, imported only here, drawn off-screen with the Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlaq.validate.summary import variants


def _candidates(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(label, v) for label, v in variants(r) if "kl" in v]


def write_plots(r: dict[str, Any], directory: Path) -> list[str]:
    """Write the plots into ``directory``; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda y, _pos: f"{y:g}")  # 0.2, 1, 5 rather than 2x10^-1 on log axes
    names = []
    centers = [(a + b - 1) / 2 for a, b in r["buckets"]]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, v in _candidates(r):
        for ax, key in zip(
            axes, ("attn_rel_err_by_bucket", "kl_by_bucket", "nll_delta_by_bucket"), strict=True
        ):
            xs = [(c, y) for c, y in zip(centers, v[key], strict=True) if y is not None]
            ys = [100 * y if key == "attn_rel_err_by_bucket" else y for _, y in xs]
            ax.plot([c for c, _ in xs], ys, marker="o", label=label)
    titles = ("attention error (%)", "KL(reference ‖ scheme) (nats)", "ΔNLL (nats)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("context position")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_formatter(plain)
    axes[0].yaxis.set_minor_formatter(plain)
    axes[1].set_yscale("symlog", linthresh=1e-5)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    names.append(_save(fig, directory, "error_vs_position.png"))

    k = r["config"]["num_speculative_tokens"]
    if k:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, v in variants(r):
            per = v.get("per_position_acceptance_rate")
            if per:
                ax.plot(range(len(per)), [100 * (x or 0) for x in per], marker="o", label=label)
        ax.set_xticks(range(k))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate (%)")
        ax.set_title(f"MTP speculative decoding, k={k}: per-position acceptance")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        names.append(_save(fig, directory, "acceptance_per_position.png"))

    cands = _candidates(r)
    if cands:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        layers = cands[0][1]["attn_rel_err_by_layer"]
        labels = [f"{x['layer']}{' MTP' if x['mtp'] else ''}" for x in layers]
        width = 0.8 / len(cands)
        for i, (label, v) in enumerate(cands):
            xs = [j + (i - (len(cands) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, [100 * x["rel_err"] for x in v["attn_rel_err_by_layer"]], width, label=label)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("layer")
        ax.set_ylabel("attention error (%)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_title("attention error by layer (same captured inputs)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        fig.tight_layout()
        names.append(_save(fig, directory, "per_layer_error.png"))
    return names


def _save(fig: Any, directory: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(directory / name, dpi=110)
    plt.close(fig)
    return name
