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
