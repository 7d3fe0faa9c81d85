"""The audit's PNG: relative RMS weight error by layer, one line per scheme, W_UK and W_UV side by side
(matplotlib, imported only here, drawn off-screen with the Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_errors(r: dict[str, Any], file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers = [layer["layer"] for layer in r["layers"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4), sharey=True)
    for ax, half, title in zip(
        axes, ("w_uk", "w_uv"), ("W_UK (q absorption)", "W_UV (V up-projection)"), strict=True
    ):
        for j, scheme in enumerate(r["schemes"]):
            ys = [100 * layer["schemes"][scheme][half]["rel_rms"] for layer in r["layers"]]
            ax.plot(layers, ys, marker=".", color=f"C{j % 10}", label=scheme)
        mtp = [layer["layer"] for layer in r["layers"] if layer["mtp"]]
        if mtp:
            ax.axvspan(min(mtp) - 0.5, max(mtp) + 0.5, color="0.9", label="MTP")
        ax.set_title(title)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative RMS weight error (%)")
    if r.get("suggested_config"):
        for ax in axes:
            ax.axhline(
                100 * r["suggested_config"]["max_error"], color="k", ls="--", lw=0.8, label="--max-error"
            )
    axes[1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"mlaq audit: {Path(r['checkpoint']).name}")
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
