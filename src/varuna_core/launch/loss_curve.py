"""The loss curve of a launched run, drawn from ``RUN_DIR/metrics.jsonl`` to a PNG."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_metrics", "draw_loss_curve"]


def read_metrics(path: str | Path) -> tuple[list[int], list[float], list[int]]:
    """``(steps, losses, attempts)`` in step order, the first report of each step."""
    seen: dict[int, tuple[float, int]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            seen.setdefault(int(record["step"]), (float(record["loss"]), int(record.get("attempt", 1))))
    steps = sorted(seen)
    return steps, [seen[s][0] for s in steps], [seen[s][1] for s in steps]


def draw_loss_curve(metrics: str | Path, out: str | Path, title: str = "") -> bool:
    """Draw loss against step (each attempt of the run in its own colour, so restarts and morphs show);
    False if there are fewer than two steps to draw."""
    steps, losses, attempts = read_metrics(metrics)
    if len(steps) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for attempt in sorted(set(attempts)):
        xs = [s for s, a in zip(steps, attempts, strict=True) if a == attempt]
        ys = [v for v, a in zip(losses, attempts, strict=True) if a == attempt]
        ax.plot(xs, ys, linewidth=1.2, label=f"attempt {attempt}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    if len(set(attempts)) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True
