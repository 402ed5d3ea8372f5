"""Building the fused CPU decode kernel (cpu_attention.py): a killed build never hangs a later run, the first
build says so on one line, the build belongs to its Python environment, and every fallback (no compiler, a
failed build, RAGEN_CPU_ATTENTION=0, a build held too long by another process) samples what the kernel
samples.

The build tests compile the kernel into a temporary RAGEN_KERNEL_DIR in a subprocess (about 25-40 s each on
two cores); the fallback tests use the environment's own build. Run:
``.venv/bin/python -m pytest tests/unit/rollout/test_cpu_attention_build.py -q``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from filelock import FileLock

from ragen_core.models.tiny import tiny_random
from ragen_core.rollout.generators import cpu_attention, decode_step
from ragen_core.rollout.generators.base import SamplingParams
from ragen_core.rollout.generators.hf import HFGenerator
from tests.conftest import require

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[3]

# Builds the kernel (or loads it) and checks one call against torch's attention; prints "decodes" on success.
DECODE = """
import torch, torch.nn.functional as F
from ragen_core.rollout.generators.cpu_attention import decode_attention
q, k, v = torch.randn(2, 1, 3, 64), torch.randn(2, 1, 5, 64), torch.randn(2, 1, 5, 64)
got = decode_attention(q, k, v, torch.zeros(2, 5), 0.125)
assert got is not None, "no kernel"
assert (got[0] - F.scaled_dot_product_attention(q, k, v, scale=0.125)).abs().max() <= 1e-5
print("decodes")
"""


@pytest.fixture()
def needs_compiler() -> None:
    cxx = os.environ.get("CXX", "c++")
    require(cpu_attention.compiler() is not None, f"no C++ compiler ({cxx}) to build the kernel")


def _env(kernel_dir: Path) -> dict[str, str]:
    return {**os.environ, "RAGEN_KERNEL_DIR": str(kernel_dir), "PYTHONPATH": str(REPO)}


def _compiling(proc: subprocess.Popen[str]) -> bool:
    """Whether the compiler runs under ``proc`` (cc1plus, or whichever child ninja started besides itself)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    return any(c.name() not in ("ninja", "sh") for c in children if c.is_running())


def test_a_build_killed_midway_leaves_the_next_run_decoding(needs_compiler: None, tmp_path: Path) -> None:
    """SIGKILL the building process and its compiler while torch holds its lock file: that file stays behind
    (torch would wait for it forever), and the next run still builds, says so on one line, and decodes."""
    kernel_dir = tmp_path / "kernels"
    first = subprocess.Popen([sys.executable, "-c", DECODE], cwd=REPO, env=_env(kernel_dir), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while not _compiling(first) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, f"the build ended before it could be killed: {first.communicate()}"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    _, err = first.communicate()
    assert err.startswith("ragen: compiling the CPU decode attention kernel") and "built" not in err
    build = next(kernel_dir.iterdir())
    assert (build / "lock").exists()  # torch's lock of the killed build: no owner, nothing ever removes it

    second = subprocess.run([sys.executable, "-c", DECODE], cwd=REPO, env=_env(kernel_dir), text=True,
                            capture_output=True, timeout=600, check=False)
    assert second.returncode == 0 and second.stdout.strip() == "decodes", second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ragen: compiling the CPU decode attention kernel"), lines
    assert lines[0].endswith(" s") and " built in " in lines[0], lines

    third = subprocess.run([sys.executable, "-c", DECODE], cwd=REPO, env=_env(kernel_dir), text=True,
                           capture_output=True, timeout=300, check=False)
    assert (third.returncode, third.stdout.strip(), third.stderr) == (0, "decodes", "")  # built: quiet


def test_the_build_lives_in_the_python_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RAGEN_KERNEL_DIR", raising=False)
    assert cpu_attention.build_root().is_relative_to(sys.prefix)
    monkeypatch.setenv("RAGEN_KERNEL_DIR", str(tmp_path))
    assert cpu_attention.build_root() == tmp_path


def test_cxx_names_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", sys.executable)  # any executable stands for a compiler here
    assert cpu_attention.compiler() == sys.executable
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert cpu_attention.compiler() is None


# The tiny model's generation of _generate in a fresh process whose kernel source does not compile: its ids,
# log-probs and kernel calls as JSON.
GENERATE_WITH_A_BROKEN_SOURCE = """
import json
from ragen_core.rollout.generators import cpu_attention
cpu_attention._SOURCE += "\\n#error broken on purpose\\n"
from tests.unit.rollout.test_cpu_attention_build import _generate
print(json.dumps(_generate()))
"""


def _generate() -> tuple[list[list[int]], list[list[float]], int]:
    """Token ids and log-probs of a tiny model's batch (two prompt groups sharing a prompt, so cascade attention
    runs, and one single row), and how many decode calls the fused kernel answered."""
    model, tok = tiny_random(seed=4)
    groups = [[5, 9, 13, 2, 7, 30, 12, 3], [11, 4]]
    prompts = [p for p in groups for _ in range(3)] + [[8, 8, 8, 1, 40]]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    answered = []
    real = decode_step.decode_attention

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        answered.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_step, "decode_attention", counting)
        out = HFGenerator(model, tok, fast_decode=True).generate(prompts, params)
    return [list(g.token_ids) for g in out], [list(g.logprobs) for g in out], sum(answered)


@pytest.fixture(scope="module")
def kernel_samples() -> tuple[list[list[int]], list[list[float]], int]:
    require(cpu_attention.kernel_available(), "the fused kernel did not build here")
    ids, logprobs, answered = _generate()
    assert answered > 0
    return ids, logprobs, answered


def _without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh ``_op`` for this test (the module's cached one comes back afterwards)."""
    monkeypatch.setattr(cpu_attention, "_op", functools.cache(cpu_attention._op.__wrapped__))


@pytest.mark.parametrize("fallback", ["no-compiler", "failed-build", "switched-off", "lock-held"])
def test_each_fallback_samples_what_the_kernel_samples(fallback: str, kernel_samples, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the kernel, decode attention is torch's: the same ids, and log-probs within 1e-4. A failed
    build (the real compiler on a source that does not compile) runs in a process of its own, since a
    process that loaded the kernel keeps it; it says so on one line with the compiler's error."""
    _without_kernel(monkeypatch)
    monkeypatch.setenv("RAGEN_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(cpu_attention, "_loaded", lambda: None)  # as in a process that never loaded it
    held = None
    if fallback == "no-compiler":
        monkeypatch.setenv("CXX", "/nonexistent/g++")
    elif fallback == "switched-off":
        monkeypatch.setenv("RAGEN_CPU_ATTENTION", "0")
    elif fallback == "lock-held":  # another (live) process holds the build for longer than a process waits
        monkeypatch.setattr(cpu_attention, "LOCK_TIMEOUT_S", 0.5)
        name = f"ragen_cpu_attention_{cpu_attention._capability().lower()}"
        (tmp_path / "kernels" / name).mkdir(parents=True)
        held = FileLock(tmp_path / "kernels" / name / "ragen.lock")
        held.acquire()
    try:
        if fallback == "failed-build":
            require(cpu_attention.compiler() is not None, "no C++ compiler for a build to fail in")
            out = subprocess.run([sys.executable, "-c", GENERATE_WITH_A_BROKEN_SOURCE], cwd=REPO,
                                 env=_env(tmp_path / "kernels"), capture_output=True, text=True, timeout=600,
                                 check=True)
            ids, logprobs, answered = json.loads(out.stdout)
            err = out.stderr.strip().splitlines()
            assert len(err) == 1 and "error: #error broken on purpose" in err[0], err
            assert err[0].endswith("decode attention uses torch's flash kernel"), err
        else:
            ids, logprobs, answered = _generate()
    finally:
        if held is not None:
            held.release()
    assert answered == 0
    want_ids, want_logprobs, _ = kernel_samples
    assert ids == want_ids
    for got, want in zip(logprobs, want_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)
