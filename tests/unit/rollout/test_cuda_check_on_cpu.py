"""bench/cuda_check.py, the check run on a lent GPU machine, runs here with --device cpu and passes: the script
cannot rot unseen between GPU loans (its generator and forward checks; the session check is the smoke run that
other tests cover).

Run: .venv/bin/python -m pytest tests/unit/rollout/test_cuda_check_on_cpu.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "cuda_check.py"


def test_cuda_check_passes_on_the_cpu() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "generator,forward"],
                         capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["pass"] is True
    assert set(result["checks"]) == {"generator", "forward"}
    generator = result["checks"]["generator"]
    for case in ("plain", "lora"):
        assert generator[case]["fast_step_active"] and generator[case]["sampled_tokens"] > 0
        assert generator[case]["reprefill_max_logprob_diff_fast"] <= 1e-4
