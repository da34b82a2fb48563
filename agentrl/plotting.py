"""`agentrl plot RUN_DIR`: PNG curves of a run's metrics.jsonl (success, return, throughput, idle, staleness)."""

from __future__ import annotations

from pathlib import Path

from agentrl.metrics import read_jsonl

PANELS = [
    ("held-out success", ["val/success"]),
    ("training success", ["episode/success"]),
    ("episode return", ["episode/return"]),
    ("tokens/s", ["throughput/tokens_per_s"]),
    ("idle fraction", ["idle/trainer", "idle/rollout"]),
    ("staleness", ["staleness/mean", "staleness/max"]),
]


def plot_run(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
