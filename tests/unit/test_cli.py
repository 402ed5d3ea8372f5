"""The `ragen` command: --help everywhere, clear non-zero exits, bad configs write nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()
SUBCOMMANDS = [["train"], ["eval"], ["sweep"], ["compare"], ["envs"], ["play"], ["demo"],
               ["model"], ["model", "fetch"], ["model", "warmup"], ["model", "register"]]


@pytest.mark.parametrize("cmd", SUBCOMMANDS, ids=" ".join)
def test_help_on_every_subcommand(cmd) -> None:
    res = runner.invoke(app, [*cmd, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


def test_unknown_subcommand_and_bad_option_exit_2() -> None:
    assert runner.invoke(app, ["bogus"]).exit_code == 2
    assert runner.invoke(app, ["train", "--no-such-option"]).exit_code == 2


@pytest.mark.parametrize("text,overrides,needle", [
    ("rollout: {prompt_per_iter: 3}\n", [], "rollout.prompt_per_iter: unknown key"),
    ("trainer: {iterations: x}\n", [], "trainer.iterations: expected an integer"),
    ("algorithm: {estimator: ppo}\n", [], "algorithm.estimator"),
    ("rollout: {max_turns: -2}\n", [], "rollout.max_turns: -2 is out of range"),
    ("rollout: [1, 2\n", [], "malformed YAML"),
    ("name: ok\n", ["trainer.iterations=-3"], "trainer.iterations"),
])
def test_bad_config_exits_2_and_writes_nothing(tmp_path, monkeypatch, text, overrides, needle) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("RAGEN_DATA_DIR", str(data))
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "exp.yaml"
    exp.write_text(text)
    args = ["train", str(exp)] + [a for o in overrides for a in ("--set", o)]
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert needle in " ".join(res.output.split())
    assert not data.exists()
    assert sorted(os.listdir(tmp_path)) == ["exp.yaml"]


def test_missing_experiment_file_exits_2(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    res = runner.invoke(app, ["train", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "file not found" in res.output
    assert not Path(tmp_path / "data").exists()


def test_config_show_prints_the_resolved_config_with_docs_and_loads_back(tmp_path) -> None:
    from ragen_core.config import load_experiment

    res = runner.invoke(app, ["config", "show", "experiments/smoke.yaml", "--set", "trainer.iterations=5"])
    assert res.exit_code == 0, res.output
    assert "  iterations: 5  # " in res.output and "preset: starpo-s  # algorithm preset" in res.output
    saved = tmp_path / "resolved.yaml"
    saved.write_text(res.output)
    assert load_experiment(saved) == load_experiment("experiments/smoke.yaml", ["trainer.iterations=5"])
    bad = runner.invoke(app, ["config", "show", "experiments/smoke.yaml", "--set", "trainer.iterationz=5"])
    assert bad.exit_code == 2 and "iterationz" in bad.output


def test_nproc_without_deepspeed_exits_2_and_writes_nothing(tmp_path, monkeypatch) -> None:
    # several processes with the torch engine would each train their own copy: refused before any is started
    data = tmp_path / "data"
    monkeypatch.setenv("RAGEN_DATA_DIR", str(data))
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    res = runner.invoke(app, ["train", str(smoke), "--nproc", "2"])
    assert res.exit_code == 2
    assert "2 processes need trainer.backend=deepspeed" in " ".join(res.output.split())
    assert not data.exists()


def test_nproc_under_torchrun_must_match_its_world(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    res = runner.invoke(app, ["train", str(smoke), "--set", "trainer.backend=deepspeed", "--nproc", "3"])
    assert res.exit_code == 2 and "torchrun" in res.output
    assert not (tmp_path / "data").exists()


def test_resume_needs_no_experiment_file_and_runtime_errors_are_one_line(tmp_path, monkeypatch) -> None:
    """`ragen train --resume RUN` works alone; an unknown run is exit 2; an error while running is one line
    and exit 1 from the installed command (main), its traceback only with RAGEN_DEBUG=1."""
    import subprocess
    import sys

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    res = runner.invoke(app, ["train", "--resume", "no-such-run"])
    assert res.exit_code == 2 and "no-such-run" in res.output
    res = runner.invoke(app, ["train"])
    assert res.exit_code == 2 and "--resume" in res.output
    code = ("import flows.cli as c\n"
            "@c.app.command('boom')\n"
            "def boom() -> None:\n"
            "    raise RuntimeError('disk on fire\\nsecond line')\n"
            "c.main()\n")
    out = subprocess.run([sys.executable, "-c", code, "boom"], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "RuntimeError: disk on fire second line" in lines[0] and "Traceback" not in out.stderr
