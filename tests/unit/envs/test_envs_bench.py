"""bench/envs.py runs and its last line is one JSON object with resets/s and steps/s per env (no timing asserted).

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_bench.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "envs.py"


def test_bench_prints_a_json_last_line() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--seconds", "0.01", "--envs", "Bandit", "WebShop"],
                         capture_output=True, text=True, check=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    result = json.loads(lines[-1])
    assert list(result) == ["Bandit", "WebShop"]
    for figures in result.values():
        assert set(figures) == {"resets_per_s", "steps_per_s", "setup_s"}
        assert figures["resets_per_s"] > 0 and figures["steps_per_s"] > 0
