"""MetricLogger protocol, metric-name check, NullLogger, run params/tags/text helpers, outbox file."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ragen_core.tracking import (
    MetricLogger,
    NullLogger,
    check_metric_names,
    config_yaml,
    flatten_config,
    git_commit,
    log_config,
    run_tags,
    trajectories_text,
)
from ragen_core.tracking.outbox import Outbox
from ragen_core.types import Trajectory, Turn


def test_importing_tracking_loads_neither_mlflow_nor_matplotlib() -> None:
    code = (
        "import sys, ragen_core.tracking\n"
        "bad = [m for m in ('mlflow', 'matplotlib', 'torch', 'prefect') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["env/success", "env/Bandit/success", "actor/grad_norm", "health/entropy_ratio",
                                  "val/BanditRev/pass_at_8", "timing/update s", "perf/tokens-per-s"])
def test_good_metric_names_pass(name: str) -> None:
    check_metric_names([name])


@pytest.mark.parametrize("name", ["success", "actr/loss", "env/", "/env", "Env/success", "env//x", "env/./x", "env/a:b",
                                  "env/pass@8", "env/" + "x" * 250])
def test_bad_metric_names_raise(name: str) -> None:
    with pytest.raises(ValueError, match="metric name"):
        check_metric_names([name])


def test_null_logger_records_and_follows_the_protocol(tmp_path: Path) -> None:
    log = NullLogger()
    assert isinstance(log, MetricLogger) and log.run_id is None
    log.log_params({"a": 1})
    log.set_tags({"algo": "starpo"})
    log.log_metrics({"env/success": 0.25, "actor/loss": 1}, step=1)
    log.log_metrics({"env/success": 0.5}, step=2)
    log.log_artifact(tmp_path / "f.txt", "files")
    log.log_text("hi", "samples/a.txt")
    log.flush()
    log.close("FAILED")
    assert log.history("env/success") == [(1, 0.25), (2, 0.5)]
    assert log.params == {"a": 1} and log.tags == {"algo": "starpo"}
    assert log.artifacts == [(tmp_path / "f.txt", "files")] and log.texts == {"samples/a.txt": "hi"}
    assert log.status == "FAILED"
    with pytest.raises(ValueError):
        log.log_metrics({"loss": 1.0}, step=3)
    with pytest.raises(ValueError):
        log.close("DONE")
    quiet = NullLogger(record=False)
    quiet.log_metrics({"env/success": 1.0}, step=0)
    assert quiet.metrics == []


@dataclasses.dataclass(frozen=True)
class _Inner:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class _Cfg:
    name: str = "bandit"
    inner: _Inner = _Inner()
    path: Path = Path("/tmp/d")
    extra: dict = dataclasses.field(default_factory=lambda: {"k": {"deep": None}, "empty": {}})


def test_flatten_config_dotted_keys_and_reprs() -> None:
    cfg = _Cfg()
    flat = flatten_config(cfg)
    assert flat == {
        "name": "bandit",  # strings as they are
        "inner.lr": "1e-06",  # repr(1e-6)
        "inner.betas": "[0.9, 0.999]",  # a sequence stays one value
        "inner.note": "x",
        "path": "/tmp/d",
        "extra.k.deep": "None",
        "extra.empty": "{}",
    }
    assert cfg == _Cfg()  # not modified
    long = flatten_config({"a": "y" * 7000})["a"]
    assert len(long) == 6000 and long.endswith("...")  # MLflow's param value limit
    with pytest.raises(TypeError):
        flatten_config(3)


def test_flatten_config_on_the_real_experiment_config() -> None:
    from ragen_core.config import ExperimentConfig

    flat = flatten_config(ExperimentConfig())
    assert flat["health.std_drop"] == "0.3" and flat["preset"] == "custom"
    assert all(isinstance(v, str) for v in flat.values())


def test_log_config_writes_params_and_a_yaml_that_reads_back() -> None:
    log = NullLogger()
    log_config(log, _Cfg())
    assert log.params["inner.lr"] == "1e-06"
    back = yaml.safe_load(log.texts["config.yaml"])
    assert back["inner"] == {"lr": 1e-6, "betas": [0.9, 0.999], "note": "x"}
    assert list(back) == ["name", "inner", "path", "extra"]  # declaration order
    assert config_yaml({"a": 1}) == "a: 1\n"


def test_run_tags() -> None:
    tags = run_tags("starpo-s", "Bandit", "gae", "starpo-s", "tiny-random", git_commit="abc", flow_run_id="f1")
    assert tags == {"algo": "starpo-s", "env": "Bandit", "estimator": "gae", "preset": "starpo-s",
                    "model": "tiny-random", "mlflow.source.git.commit": "abc", "prefect.flow_run_id": "f1"}
    assert "prefect.flow_run_id" not in run_tags("grpo", "Bandit", "grpo", "grpo", "m")
    with pytest.raises(ValueError):
        run_tags("ppo", "Bandit", "gae", "custom", "m")


def test_git_commit_is_a_hash_or_none(tmp_path: Path) -> None:
    commit = git_commit()
    assert commit is None or (len(commit) == 40 and int(commit, 16) >= 0)
    assert git_commit(tmp_path) is None  # not a repository


def test_trajectories_text_is_readable() -> None:
    turn = Turn(observation="#P_O#", prompt_ids=(1,), response_ids=(2, 3), logprobs=(-0.1, -0.2),
                response_text="<think>go</think><answer>Left</answer>", actions=("Left",), reward=1.0,
                penalty=0.0, parse_ok=True)
    bad = dataclasses.replace(turn, response_text="??", actions=(), reward=0.0, penalty=-0.1, parse_ok=False)
    traj = Trajectory(env_tag="FrozenLake", seed=7, group_id=2, turns=(bad, turn), success=True,
                      terminated=True, truncated=False)
    text = trajectories_text([traj])
    assert "env=FrozenLake seed=7 group=2 success=True return=0.900 (env 1.000)" in text
    assert "--- turn 1" in text and "--- turn 2" in text and "#P_O#" in text
    assert "actions: (none)  reward: 0  penalty: -0.1  parsed: False" in text
    assert "actions: Left  reward: 1" in text


def test_outbox_persists_offsets_and_drops_a_torn_last_line(tmp_path: Path) -> None:
    box = Outbox(tmp_path)
    for i in range(3):
        box.append({"kind": "metrics", "step": i})
    box.mark_delivered(2)
    box.set_run_id("r1")
    with open(box.path, "ab") as f:
        f.write(b'{"kind": "metr')  # a crash in the middle of a write
    again = Outbox(tmp_path)
    assert again.run_id == "r1" and again.pending() == [{"kind": "metrics", "step": 2}]
    again.append({"kind": "metrics", "step": 3})
    third = Outbox(tmp_path)
    assert [e["step"] for e in third.pending()] == [2, 3]
    assert all(json.loads(line) for line in third.path.read_text().splitlines())
    third.reject(1, "refused")
    assert [e["step"] for e in Outbox(tmp_path).pending()] == [3]
    assert json.loads(third.rejected_path.read_text()) == {"error": "refused", "entry": {"kind": "metrics", "step": 2}}


def test_outbox_survives_corrupt_lines_and_state_and_loses_nothing(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Damage in the outbox never stops a run and never drops an entry."""
    from ragen_core.tracking.outbox import CORRUPT_FILE, STATE_FILE

    box = Outbox(tmp_path)
    for i in range(3):
        box.append({"kind": "metrics", "step": i})
    box.set_run_id("r1")
    box.mark_delivered(1)
    # a corrupt line in the middle of the undelivered part
    with open(box.path, "ab") as f:
        f.write(b"\x00\xffnot json\n")
    box2 = Outbox(tmp_path)
    box2.append({"kind": "metrics", "step": 3})
    assert [e["step"] for e in Outbox(tmp_path).pending()] == [1, 2, 3]
    assert (tmp_path / CORRUPT_FILE).read_bytes().startswith(b"\x00\xffnot json")
    # an emptied state file: the backup written just before it has the run and the offset
    (tmp_path / STATE_FILE).write_text("")
    box3 = Outbox(tmp_path)
    assert box3.run_id == "r1" and [e["step"] for e in box3.pending()] == [1, 2, 3]
    assert list(tmp_path.glob(STATE_FILE + ".corrupt-*"))  # moved aside, not deleted
    # both state files damaged: start delivery over (re-sending is idempotent in MLflow's store)
    (tmp_path / STATE_FILE).write_text("{")
    (tmp_path / (STATE_FILE + ".bak")).write_text("[")
    box4 = Outbox(tmp_path)
    assert box4.run_id is None and [e["step"] for e in box4.pending()] == [0, 1, 2, 3]
    assert "damaged" in caplog.text


def test_an_emptied_outbox_file_does_not_swallow_the_next_entry(tmp_path: Path) -> None:
    box = Outbox(tmp_path)
    for i in range(5):
        box.append({"kind": "metrics", "step": i})
    box.mark_delivered(5)
    box.path.write_bytes(b"")  # emptied (by hand, or a copy that replaced it)
    with open(box.path, "ab") as f:
        f.write(b'{"kind":"metrics","step":5}\n')  # then a new entry
    assert [e["step"] for e in Outbox(tmp_path).pending()] == [5]
