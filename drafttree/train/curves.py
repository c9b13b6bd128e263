"""The training curve: loss, and the drafter's accuracy at each block position, against steps,
drawn from the trainer's history (`Trainer.history`) into OUT/train_curve.png."""
from __future__ import annotations

from pathlib import Path
from typing import Any

CURVE = "train_curve.png"
POSITIONS = 8   # block positions drawn (the first ones: a drafter is right there or nowhere)


def plot_history(history: list[dict[str, Any]], path: Path) -> Path | None:
    """Draw `history` (records with step, loss, acc per block position) to `path`; None when it
    holds no record yet."""
    if not history:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in history])
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    for pos in range(min(POSITIONS, len(history[-1]["acc"]))):
        ax_acc.plot(steps, [r["acc"][pos] for r in history], label=f"position {pos + 1}")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title="accuracy per block position")
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_tau_curve(rows: list[dict[str, Any]], path: Path) -> Path:
    """τ of each cell (`evaluate.tau_curve` rows) against the response tokens trained on, to `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["tokens"] / 1e6 for r in rows]
    for label in rows[0]["cells"]:
        ax.plot(x, [r["cells"][label] for r in rows], marker="o", label=label)
    ax.set(xlabel="response tokens trained on (M)", ylabel="τ (accepted tokens per round)",
           title="held-out τ against training tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
