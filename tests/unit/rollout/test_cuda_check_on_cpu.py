"""bench/cuda_check.py, the check run on a lent GPU machine, runs here with --device cpu and passes: the script
cannot rot unseen between GPU loans (its generator, forward and bf16 checks; the session check is the smoke run
that other tests cover).

Run: .venv/bin/python -m pytest tests/unit/rollout/test_cuda_check_on_cpu.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "cuda_check.py"


def test_cuda_check_passes_on_the_cpu() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "generator,forward,bf16"],
                         capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["pass"] is True
    assert set(result["checks"]) == {"generator", "forward", "bf16"}
    generator = result["checks"]["generator"]
    for case in ("plain", "lora"):
        assert generator[case]["fast_step_active"] and generator[case]["sampled_tokens"] > 0
        assert generator[case]["reprefill_max_logprob_diff_fast"] <= 1e-4
    bf16 = result["checks"]["bf16"]
    assert bf16["fused_lora"]["fused_calls"] == bf16["fused_lora"]["lora_layers"] > 0
    assert bf16["logprobs_entropy"]["grad_max_rel_diff"] <= 1e-2


def test_cuda_check_deepspeed_passes_on_the_cpu() -> None:
    """Its deepspeed check: a one-rank group over gloo, ZeRO stages 0-3 against the torch trainer."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "deepspeed", "--iterations", "1"],
                         capture_output=True, text=True, check=False, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    check = json.loads(out.stdout.strip().splitlines()[-1])["checks"]["deepspeed"]
    assert check["pass"] is True
    assert {f"zero{stage}" for stage in (0, 1, 2, 3)} <= set(check)
    for stage in (0, 1, 2, 3):
        assert check[f"zero{stage}"]["first_grad_norm_rel_diff"]["actor/grad_norm"] <= 1e-3
