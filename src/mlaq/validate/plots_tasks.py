"""PNG plots of the long-context evidence: accuracy vs length with Wilson bands, answer
log-prob delta vs length with bootstrap bands, needle accuracy by depth x length, flip rate vs keys.
Called by ``plots.write_plots`` with matplotlib already imported; each plot only when its data exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_task_plots(r: dict[str, Any], directory: Path, plt: Any, colour: dict[str, str]) -> list[str]:
    names = []
    rows = [(label, v) for label, v in r.rows if v.get("tasks")]
    if rows:
        tasks = list(rows[0][1]["tasks"])
        names.append(_accuracy(rows, tasks, directory, plt, colour))
        paired = [(label, v) for label, v in rows if v is not r["reference"]]
        if paired:
            names.append(_logprob(paired, tasks, directory, plt, colour))
    needle = [(label, v["needle_by_depth"]) for label, v in r.rows if v.get("needle_by_depth")]
    if needle:
        names.append(_needle(needle, directory, plt))
    flips = [(label, v["flip_rate"]) for label, v in r.rows if v.get("flip_rate")]
    if flips:
        names.append(_flips(flips, directory, plt, colour))
    return names


def _grid(plt: Any, n: int, height: float = 3.8) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n + 1.5, height), squeeze=False)
    return fig, list(axes[0])


def _save(fig: Any, plt: Any, directory: Path, name: str) -> str:
    fig.savefig(directory / name, dpi=110)
    plt.close(fig)
    return name


def _legend(fig: Any, ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.82, 1))


def _banded(
    rows: list,
    tasks: list[str],
    plt: Any,
    colour: dict[str, str],
    value: Any,
    band: Any,
    title: str,
    ylabel: str,
) -> tuple[Any, list]:
    """One panel per task: value(cell) by length per scheme, with its interval band(cell) -> (lo, hi)."""
    fig, axes = _grid(plt, len(tasks))
    for ax, task in zip(axes, tasks, strict=True):
        for label, v in rows:
            cells = [c for _, c in sorted((v["tasks"].get(task) or {}).items(), key=lambda kv: int(kv[0]))]
            xs = sorted(int(n) for n in (v["tasks"].get(task) or {}))
            ax.plot(xs, [value(c) for c in cells], marker="o", color=colour[label], label=label)
            ax.fill_between(
                xs, [band(c)[0] for c in cells], [band(c)[1] for c in cells], color=colour[label], alpha=0.12
            )
        ax.set_title(title.format(task=task))
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _legend(fig, axes[0])
    return fig, axes


def _accuracy(rows: list, tasks: list[str], directory: Path, plt: Any, colour: dict[str, str]) -> str:
    fig, axes = _banded(
        rows, tasks, plt, colour, lambda c: 100 * c["accuracy"], lambda c: (100 * c["ci_low"], 100 * c["ci_high"]),
        "{task}: accuracy (Wilson 95 % band)", "accuracy (%)",
    )  # fmt: skip
    for ax in axes:
        ax.set_ylim(-2, 102)
    return _save(fig, plt, directory, "task_accuracy.png")


def _logprob(rows: list, tasks: list[str], directory: Path, plt: Any, colour: dict[str, str]) -> str:
    fig, axes = _banded(
        rows, tasks, plt, colour, lambda c: c["logprob_delta"], lambda c: tuple(c["logprob_delta_ci"]),
        "{task}: Δ answer log-prob vs bf16 (95 % band)", "nats",
    )  # fmt: skip
    for ax in axes:
        ax.axhline(0.0, color="black", linewidth=0.8)
    return _save(fig, plt, directory, "task_logprob_delta.png")


def _needle(rows: list, directory: Path, plt: Any) -> str:
    fig, grid_axes = plt.subplots(
        1, len(rows), figsize=(4.2 * len(rows) + 1.2, 3.6), squeeze=False, layout="constrained"
    )
    axes = list(grid_axes[0])
    for ax, (label, by_len) in zip(axes, rows, strict=True):
        lengths = sorted(by_len, key=int)
        depths = sorted({d for cells in by_len.values() for d in cells}, key=float)
        grid = [
            [100 * by_len[n][d]["accuracy"] if d in by_len[n] else float("nan") for d in depths]
            for n in lengths
        ]
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="lower")
        for i, n in enumerate(lengths):  # the value and sample count in each cell
            for j, d in enumerate(depths):
                c = by_len[n].get(d)
                if c is not None:
                    text = f"{100 * c['accuracy']:.0f}\n({c['n']})"
                    ax.text(
                        j,
                        i,
                        text,
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if c["accuracy"] < 0.6 else "black",
                    )
        ax.set_xticks(range(len(depths)), depths)
        ax.set_yticks(range(len(lengths)), lengths)
        ax.set_xlabel("needle depth")
        ax.set_ylabel("length (tokens)")
        ax.set_title(f"{label}: needle accuracy (%)")
    fig.colorbar(im, ax=axes, shrink=0.9)
    return _save(fig, plt, directory, "needle_depth_length.png")


def _flips(rows: list, directory: Path, plt: Any, colour: dict[str, str]) -> str:
    layers = list(rows[0][1])
    fig, axes = _grid(plt, len(layers))
    for ax, layer in zip(axes, layers, strict=True):
        for label, flips in rows:
            pts = sorted((int(k), x) for k, x in (flips.get(layer) or {}).items() if x is not None)
            ax.plot(
                [k for k, _ in pts], [100 * x for _, x in pts], marker="o", color=colour[label], label=label
            )
        ax.set_title(f"layer {layer}: top-key flip rate")
        ax.set_xlabel("keys competing (up to)")
        ax.set_ylabel("flip rate (%)")
        ax.grid(alpha=0.3)
    _legend(fig, axes[0])
    return _save(fig, plt, directory, "flip_rate_vs_keys.png")
