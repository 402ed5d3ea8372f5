"""plot_curves writes a real PNG with one subplot per metric and one line per run."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_core.tracking.plots import plot_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_curves_writes_a_png(tmp_path: Path) -> None:
    histories = {
        "starpo": {
            "env/success": [(i, min(0.84, 0.05 * i)) if i < 30 else (i, 0.84 - 0.04 * (i - 30)) for i in range(50)],
            "rollout/reward_std": [(i, 0.5 * 0.95**i) for i in range(50)],
            "actor/grad_norm": [(i, 1.0 + (4.0 if i == 35 else 0.0)) for i in range(50)],
        },
        "starpo-s": {
            "env/success": [(i, min(1.0, 0.02 * i)) for i in range(50)],
            "rollout/reward_std": [(i, 0.45) for i in range(50)],
            # no grad norm for this run: its line is simply missing in that subplot
        },
    }
    metrics = ["env/success", "rollout/reward_std", "actor/grad_norm", "actor/entropy"]
    out = plot_curves(histories, metrics, tmp_path / "plots" / "curves.png", "Bandit: StarPO vs StarPO-S")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_plot_curves_needs_a_metric(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plot_curves({}, [], tmp_path / "x.png", "empty")
