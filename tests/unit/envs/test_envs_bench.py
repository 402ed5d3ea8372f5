"""bench/envs.py runs and its last line is one JSON object with speed and random-play figures per env (no timing
asserted).

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_bench.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "envs.py"


def test_bench_prints_a_json_last_line() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--seconds", "0.01", "--seeds", "40",
                          "--envs", "Bandit", "WebShop", "LargerSokoban"],
                         capture_output=True, text=True, check=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4
    result = json.loads(lines[-1])
    assert list(result) == ["Bandit", "WebShop", "LargerSokoban"]
    common = {"resets_per_s", "steps_per_s", "setup_s", "random_success", "paper_starpo_s", "reference_random"}
    for name, figures in result.items():
        extra = {"min_moves_le2", "min_moves_median"} if name == "LargerSokoban" else set()
        assert set(figures) == common | extra
        assert figures["resets_per_s"] > 0 and figures["steps_per_s"] > 0
        assert 0.0 <= figures["random_success"] <= 1.0
    assert 0.2 < result["Bandit"]["random_success"] < 0.8  # one random pull picks the better arm about half the time
    assert result["Bandit"]["paper_starpo_s"] == 1.0 and result["WebShop"]["paper_starpo_s"] is None
    assert result["LargerSokoban"]["reference_random"] == [0.02, 0.04]
    assert 1 <= result["LargerSokoban"]["min_moves_median"] <= 30
