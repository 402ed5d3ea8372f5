"""RunDir: a run folder's layout, name checks, history, checkpoints and finding a run by name or path.

Run: .venv/bin/python -m pytest tests/unit/store/test_run_dir.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ragen_core.config import ConfigError
from ragen_core.store import parquet
from ragen_core.store.run_dir import RunDir, check_run_name, checkpoint_problem


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    return tmp_path.resolve()


def _checkpoint(run: RunDir, iteration: int) -> Path:
    """A hand-made checkpoint folder with one file in it (what the trainer writes is not needed here)."""
    path = run.checkpoint_path(iteration)
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"iteration": iteration, "files": {}}))
    return path


# ---------------------------------------------------------------------- names and paths


def test_named_follows_ragen_data_dir_and_creates_nothing(data: Path) -> None:
    run = RunDir.named("exp-1")
    assert run.path == data / "runs" / "exp-1" and run.name == "exp-1"
    assert not run.path.exists()
    assert run.shard_path(7).parts[-3:] == ("rollouts", "iteration=7", "part-0.parquet")
    assert run.shard_path(7) == parquet.shard_path(run.path, 7)  # the Parquet store uses the same layout


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", "/abs", ".hidden", "-rf", "a b", "a\nb", "a\x00b",
                                 "caf\u00e9", "~", "x" * 201])
def test_bad_names_are_refused_with_a_clear_error(data: Path, bad: str) -> None:
    with pytest.raises(ValueError, match=r"bad run name .*plain directory name"):
        RunDir.named(bad)
    with pytest.raises(ValueError, match="bad run name"):
        RunDir.new(bad)
    assert not (data / "runs").exists()  # nothing made on the way to the error


def test_check_run_name_returns_a_good_name() -> None:
    assert check_run_name("bandit-starpo-s-20260101-120000") == "bandit-starpo-s-20260101-120000"
    assert check_run_name("x" * 200) == "x" * 200 and check_run_name("v1.2_run") == "v1.2_run"


def test_a_bad_run_name_is_a_config_error_naming_the_key() -> None:
    """One rule, one error type for every entry point (the CLI turns a ConfigError into exit 2)."""
    with pytest.raises(ConfigError, match=r"^--run-name: bad run name '\.\./x'"):
        check_run_name("../x", "--run-name")
    with pytest.raises(ConfigError, match="at most 160"):
        check_run_name("x" * 161, "name", max_chars=160)


def test_new_creates_the_folder_and_reuses_an_existing_one(data: Path) -> None:
    run = RunDir.new("r")
    assert run.path.is_dir()
    (run.path / "keep.txt").write_text("x")
    assert RunDir.new("r") == run and (run.path / "keep.txt").read_text() == "x"


def test_a_run_dir_is_path_like(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    assert Path(run) == tmp_path / "r" and os.fspath(run) == str(tmp_path / "r")


def test_layout_names(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.config_path == tmp_path / "config.yaml"
    assert run.history_path == tmp_path / "history.jsonl"
    assert run.checkpoint_path(12) == tmp_path / "checkpoints" / "iter=000012"
    assert run.rollouts_dir == tmp_path / "rollouts"
    assert run.final_model == tmp_path / "final-model"
    assert run.curves_png == tmp_path / "curves.png"


def test_shard_path_refuses_a_negative_iteration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="iteration must be >= 0"):
        RunDir(tmp_path).shard_path(-1)


# ---------------------------------------------------------------------- config and history


def test_config_round_trip_keeps_key_order_and_unicode(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    data = {"name": "é-run", "trainer": {"iterations": 3, "lr": 1e-06}, "alpha": [1, 2]}
    run.write_config(data)
    # yaml.safe_dump(sort_keys=False, allow_unicode=True): declaration order, unicode kept as is
    assert run.config_path.read_text() == ("name: é-run\ntrainer:\n  iterations: 3\n  lr: 1.0e-06\nalpha:\n- 1\n- 2\n"
                                          "# ragen: end of config\n")
    assert run.read_config() == data
    run.config_path.write_text("")
    assert run.read_config() == {}


def test_history_append_and_read_round_trip(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.read_history() == []  # no file yet
    rows = [{"iteration": 0, "val/success": 0.25, "actor/entropy": 1.5}, {"iteration": 1, "note": "√"}]
    for row in rows:
        run.append_history(row)
    assert run.read_history() == rows
    # one json.dumps line per row, appended: the exact bytes a reader of history.jsonl sees
    assert run.history_path.read_text() == "".join(json.dumps(r) + "\n" for r in rows)


def test_history_skips_blank_lines(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.history_path.write_text('{"iteration": 0}\n\n  \n{"iteration": 1}\n')
    assert run.read_history() == [{"iteration": 0}, {"iteration": 1}]


# ---------------------------------------------------------------------- checkpoints


def test_checkpoints_list_latest_and_prune(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.checkpoints() == [] and run.latest_checkpoint() is None  # no checkpoints/ folder at all
    made = [_checkpoint(run, i) for i in (10, 2, 100, 4)]
    (run.checkpoints_dir / "notes.txt").write_text("not a checkpoint")
    by_iteration = sorted(made, key=lambda p: int(p.name.split("=")[1]))
    assert run.checkpoints() == by_iteration  # zero-padded names sort by iteration (100 after 10)
    assert run.latest_checkpoint() == run.checkpoint_path(100)
    deleted = run.prune_checkpoints(keep=2)
    assert deleted == by_iteration[:2]
    assert run.checkpoints() == [run.checkpoint_path(10), run.checkpoint_path(100)]
    assert (run.checkpoints_dir / "notes.txt").exists()
    assert run.prune_checkpoints(keep=2) == []  # nothing more to delete


def test_prune_needs_to_keep_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        RunDir(tmp_path).prune_checkpoints(keep=0)


def test_of_checkpoint_is_the_run_two_levels_up(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    ckpt = _checkpoint(run, 3)
    assert RunDir.of_checkpoint(ckpt) == RunDir((tmp_path / "r").resolve())


# ---------------------------------------------------------------------- finding a run


def test_find_by_name_and_by_path(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = RunDir.new("exp-2")
    named.write_config({"name": "exp"})
    assert RunDir.find("exp-2") == named
    elsewhere = RunDir(tmp_path / "elsewhere" / "exp-3").create()
    elsewhere.write_config({"name": "exp"})
    assert RunDir.find(str(elsewhere.path)) == elsewhere
    assert RunDir.find(elsewhere.path) == elsewhere
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert RunDir.find("exp-3") == RunDir(Path("exp-3"))  # a relative path wins over a name


def test_resumable_is_a_run_under_the_runs_root(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir.new("exp-4")
    run.write_config({"name": "exp"})
    assert RunDir.resumable("exp-4") == run
    assert RunDir.resumable(str(run.path)) == run and RunDir.resumable(run.path) == run
    monkeypatch.chdir(data)
    assert RunDir.resumable("runs/exp-4/") == run  # a relative path that lands in the runs root


@pytest.mark.parametrize(("run", "message"), [
    ("../../etc", "is not a run folder under"), ("/tmp", "is not a run folder under"),
    ("runs/exp-5/checkpoints", "is not a run folder under"), ("missing", "no run 'missing'"),
    ("..", "bad run name"), ("a\x00/b", "is no path"), ("exp-5-no-config", "no run"),
])
def test_resumable_refuses_anything_else(data: Path, monkeypatch: pytest.MonkeyPatch, run: str, message: str) -> None:
    RunDir.new("exp-5").write_config({"name": "exp"})
    RunDir.new("exp-5-no-config")
    (data / "runs" / "exp-5" / "checkpoints").mkdir()
    monkeypatch.chdir(data)
    with pytest.raises(ConfigError, match=message):
        RunDir.resumable(run, "--resume")


def test_find_says_where_it_looked(data: Path, tmp_path: Path) -> None:
    RunDir.new("no-config")  # a folder without config.yaml is not a run
    with pytest.raises(FileNotFoundError, match=r"no run 'no-config': neither no-config nor .*runs/no-config holds"):
        RunDir.find("no-config")
    with pytest.raises(FileNotFoundError, match="no run"):
        RunDir.find(str(tmp_path / "missing"))


# ---------------------------------------------------------------- what a kill leaves behind


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(proc.stdout)


def test_a_torn_last_history_line_is_dropped_then_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = RunDir(tmp_path)
    run.append_history({"iteration": 0, "x": 1.0})
    with open(run.history_path, "a") as fh:
        fh.write('{"iteration": 1, "x": 2.')  # killed mid-write
    assert run.read_history() == [{"iteration": 0, "x": 1.0}]
    assert "torn last line" in caplog.text
    run.append_history({"iteration": 1, "x": 3.0})  # the resumed run goes on
    assert run.read_history() == [{"iteration": 0, "x": 1.0}, {"iteration": 1, "x": 3.0}]
    assert (tmp_path / "history.jsonl.torn").read_text() == '{"iteration": 1, "x": 2.\n'  # nothing deleted


def test_a_corrupt_middle_history_line_is_skipped_and_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = RunDir(tmp_path)
    run.history_path.write_text('{"iteration": 0}\n\x00\x00garbage\n[1, 2]\n{"iteration": 1}\n')
    assert run.read_history() == [{"iteration": 0}, {"iteration": 1}]
    assert "2 corrupt line(s)" in caplog.text
    assert (tmp_path / "history.jsonl.corrupt").read_bytes() == b"\x00\x00garbage\n[1, 2]\n"
    assert run.history_path.read_text().count("\n") == 4  # the file itself is left as it was


def test_config_is_written_whole_and_a_cut_one_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ragen_core.config import ConfigError, load_experiment, to_dict
    from ragen_core.session import resume_config

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    run = RunDir.new("r")
    cfg = load_experiment(Path(__file__).parents[3] / "experiments" / "smoke.yaml")
    run.write_config(to_dict(cfg))
    assert run.config_problem() is None and not list(run.path.glob(".config*"))
    assert load_experiment(run.config_path) == cfg
    text = run.config_path.read_text()
    run.config_path.write_text(text[: len(text) // 2].rsplit("\n", 1)[0] + "\n")  # cut at a line end: parses
    assert "cut short" in (run.config_problem() or "")
    with pytest.raises(ConfigError, match="cut short"):
        resume_config("r", [])


def _whole_checkpoint(path: Path, iteration: int) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({"w": torch.full((64,), float(iteration))}, path / "actor.safetensors")
    torch.save({"step": iteration}, path / "optimizer.pt")
    # no sizes listed: the files' own checks (safetensors header, torch zip CRCs) must catch a cut one
    (path / "state.json").write_text(json.dumps({"iteration": iteration, "files": {}}))


def test_checkpoints_recover_from_a_kill_between_renames_and_fall_back_past_a_cut_one(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    dead = _dead_pid()
    _whole_checkpoint(run.checkpoint_path(1), 1)
    # a re-save of iteration 2 killed between its renames: only the set-aside old folder is left
    _whole_checkpoint(run.checkpoints_dir / f".old-iter=000002-{dead}", 2)
    _whole_checkpoint(run.checkpoints_dir / f".tmp-iter=000003-{dead}", 3)  # a save killed before its rename
    assert run.latest_checkpoint() == run.checkpoint_path(2)
    assert sorted(p.name for p in run.checkpoints_dir.iterdir()) == ["iter=000001", "iter=000002"]
    # the newest checkpoint cut short (a full disk, a copy that stopped): the one before it is used
    _whole_checkpoint(run.checkpoint_path(3), 3)
    weights = run.checkpoint_path(3) / "actor.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert run.latest_checkpoint() == run.checkpoint_path(2)
    optimizer = run.checkpoint_path(2) / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:-40])
    assert run.latest_checkpoint() == run.checkpoint_path(1)
    assert run.checkpoint_path(3).exists()  # left for a person to look at


def test_a_checkpoint_whose_state_lists_no_files_is_not_whole(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    path = _checkpoint(run, 1)
    (path / "state.json").write_text(json.dumps({"iteration": 1}))
    assert checkpoint_problem(path) == "state.json lists no files"
    assert run.latest_checkpoint() is None


def test_resume_supersedes_the_history_rows_it_redoes(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for it in range(4):
        run.append_history({"iteration": it})
    with open(run.history_path, "a") as fh:
        fh.write('{"iteration": 4')  # killed mid-write
    assert run.supersede_history(2) == [{"iteration": 0}, {"iteration": 1}]
    assert run.read_history() == [{"iteration": 0}, {"iteration": 1}]
    superseded = (tmp_path / "history.jsonl.superseded").read_text().splitlines()
    assert [json.loads(x) for x in superseded] == [{"iteration": 2}, {"iteration": 3}]
    assert (tmp_path / "history.jsonl.torn").read_text() == '{"iteration": 4\n'
    assert run.supersede_history(2) == [{"iteration": 0}, {"iteration": 1}]  # nothing more to move
