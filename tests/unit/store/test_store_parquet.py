"""Parquet trajectory store: round trip, layout, DuckDB, versioning, and crash safety of the write.

Run: .venv/bin/python -m pytest tests/unit/store -q
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.models import load_tokenizer
from ragen_core.rollout.batch import build_token_batch
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.store import parquet as store
from ragen_core.store.files import pid_alive
from ragen_core.store.run_dir import RunDir
from ragen_core.types import Trajectory, Turn


def _hand() -> Trajectory:
    turn = Turn("état √ 日本\n#P#", (1, 2, 3), (7, 8, 2), (-0.5, -0.25, -1.125), "réponse 🙂", ("Up", "Left"),
                -0.2, -0.1, False, "stop", 4, 1, (0.5, -1.25, 3.0), '["Sokoban","#P#"]')
    cut = Turn("s", (9,), (10,) * 5, (-2.0,) * 5, "", (), 0.0, -0.1, False, "length", 0, 0)
    return Trajectory("SokobanNewVocab", 2**40, 7, (turn, cut), success=False, terminated=False, truncated=True,
                      dropped_turns=1, meta={"member": 3, "user_texts": ["a", "b"], "nested": {"x": [1, 2]}})


@pytest.fixture(scope="module")
def rollouts() -> tuple[list[Trajectory], RolloutConfig]:
    tok = load_tokenizer("tiny-random")
    cfg = RolloutConfig(max_turns=3, max_new_tokens=24)
    gen = ScriptedGenerator(tok, lambda c, r, p: ["<think>a</think><answer>Up || Jump</answer>",
                                                  "junk " * 9][(c + r) % 2])
    return run_rollouts(EnvConfig(name="Sokoban"), gen, tok, cfg, seeds=[3, 4], n_per_group=2), cfg


def test_round_trip_is_exact(tmp_path: Path, rollouts: tuple[list[Trajectory], RolloutConfig]) -> None:
    trajs, cfg = rollouts
    everything = [*trajs, _hand()]
    kept = [True, False, True, True, False]
    path = store.write_shard(tmp_path, 0, everything, kept)
    assert path == tmp_path / "rollouts" / "iteration=0" / "part-0.parquet"
    frame = store.read_run(tmp_path)
    assert frame["kept"].tolist() == kept and frame["iteration"].tolist() == [0] * 5
    assert frame["schema_version"].tolist() == [store.SCHEMA_VERSION] * 5
    back = store.read_trajectories(frame)
    assert back == everything  # frozen dataclasses compare field by field (ids, logprobs, texts, meta)
    assert all(turn.state_key for t in trajs for turn in t.turns)  # the rollout recorded each turn's state key
    assert store.read_trajectories(path) == everything and store.read_trajectories(tmp_path) == everything
    # Parquet -> Trajectory -> TokenBatch gives the very same tensors
    tok = load_tokenizer("tiny-random")
    a, b = build_token_batch(trajs, tok, cfg), build_token_batch(back[:4], tok, cfg)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x is None and y is None) or torch.equal(x, y), f.name
    row = frame.iloc[4]
    assert (row["n_turns"], row["n_actions"], row["prompt_tokens"], row["response_tokens"]) == (2, 2, 4, 8)
    assert row["total_return"] == pytest.approx(-0.4) and row["env_return"] == pytest.approx(-0.2)


def test_schema_covers_every_turn_field_and_is_what_files_carry(tmp_path: Path) -> None:
    # Turn.values is the turn_values column, beside the turns struct rather than in it
    assert set(store.TURN_TYPE.names) | {"values"} == {f.name for f in dataclasses.fields(Turn)}
    schema = pq.read_schema(store.write_shard(tmp_path, 0, [_hand()]))
    assert schema.equals(store.SCHEMA, check_metadata=False)
    assert schema.metadata[b"ragen.schema_version"] == str(store.SCHEMA_VERSION).encode()


def test_several_iterations_pandas_and_duckdb(tmp_path: Path, rollouts: tuple[list[Trajectory], RolloutConfig]) -> None:
    trajs, _ = rollouts
    for it, kept in ((12, [True] * 4), (1, [False, False, True, True]), (0, [True, False, True, False])):
        store.write_shard(tmp_path, it, trajs, kept)
    frame = store.read_run(tmp_path)
    assert frame["iteration"].tolist() == [0] * 4 + [1] * 4 + [12] * 4
    assert frame.groupby("iteration")["kept"].sum().to_dict() == {0: 2, 1: 2, 12: 4}
    glob = f"{tmp_path}/rollouts/*/*.parquet"
    query = (f"select iteration, count(*), sum(kept::int), sum(len(turns)) "
             f"from read_parquet('{glob}', hive_partitioning=true) group by iteration order by iteration")
    rows = duckdb.sql(query).fetchall()  # the key is the column's name and an integer: no cast, numeric order
    n_turns = sum(len(t.turns) for t in trajs)
    assert rows == [(0, 4, 2, n_turns), (1, 4, 2, n_turns), (12, 4, 4, n_turns)]
    assert duckdb.sql(f"select typeof(iteration) from read_parquet('{glob}', hive_partitioning=true) limit 1"
                      ).fetchall() == [("BIGINT",)]
    # pyarrow datasets and pandas infer the same integer key from the folder names
    import pandas as pd
    import pyarrow.dataset as ds

    table = ds.dataset(tmp_path / "rollouts", format="parquet", partitioning="hive").to_table()
    assert pa.types.is_integer(table.schema.field("iteration").type)
    assert sorted(set(pd.read_parquet(tmp_path / "rollouts")["iteration"].astype(int))) == [0, 1, 12]
    # rewriting an iteration replaces its shard whole
    store.write_shard(tmp_path, 1, trajs[:1], [True])
    assert store.read_run(tmp_path)["iteration"].tolist() == [0] * 4 + [1] + [12] * 4


def test_empty_run_reads_as_an_empty_frame(tmp_path: Path) -> None:
    frame = store.read_run(tmp_path / "nothing")
    assert len(frame) == 0 and {"iteration", "turns", "kept", "schema_version"} <= set(frame.columns)
    assert store.read_trajectories(frame) == []


def test_writer_and_reader_take_a_run_dir(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    path = store.write_shard(run, 7, [_hand()])
    assert path == run.shard_path(7) == tmp_path / "r/rollouts/iteration=7/part-0.parquet"
    assert store.read_trajectories(run.read_rollouts()) == [_hand()]
    assert run.write_shard(8, [_hand()], [False]) == run.shard_path(8)
    assert store.read_run(run).iteration.tolist() == [7, 8]


def test_kept_must_match(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kept"):
        store.write_shard(tmp_path, 0, [_hand()], [True, False])


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    table = store.to_table([_hand()])
    table = table.replace_schema_metadata({b"ragen.schema_version": b"99"})
    folder = tmp_path / "rollouts" / "iteration=0"
    folder.mkdir(parents=True)
    pq.write_table(table, folder / "part-0.parquet")
    with pytest.raises(ValueError, match="upgrade ragen"):
        store.read_run(tmp_path)


def test_writer_failing_midway_leaves_old_shard_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store.write_shard(tmp_path, 2, [_hand()])

    def half_write(table: pa.Table, where: object, **kw: object) -> None:
        where.write(b"PAR1 half a file")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(store.pq, "write_table", half_write)
    with pytest.raises(OSError, match="disk full"):
        store.write_shard(tmp_path, 2, [_hand(), _hand()])
    folder = tmp_path / "rollouts" / "iteration=2"
    assert [p.name for p in folder.iterdir()] == ["part-0.parquet"]
    assert store.read_trajectories(tmp_path) == [_hand()]


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    from ragen_core.store import parquet as store
    from ragen_core.types import Trajectory, Turn
    turn = Turn("obs", tuple(range(2000)), tuple(range(500)), (-1.0,) * 500, "r", ("Up",), 1.0, 0.0, True)
    trajs = [Trajectory("Sokoban", s, s, (turn,) * 5, success=True, terminated=True, truncated=False)
             for s in range(200)]
    def stuck(src, dst):  # the data is on disk, the rename has not happened: kill lands here
        print("written", flush=True)
        time.sleep(600)
    store.os.replace = stuck
    store.write_shard(sys.argv[1], 5, trajs)
""")


def test_write_killed_midway_leaves_no_shard(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        folder = tmp_path / "rollouts" / "iteration=5"
        temps = list(folder.glob(".part-0.parquet.tmp-*"))
        assert len(temps) == 1 and temps[0].stat().st_size > 1_000  # the unpublished file exists
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert not (folder / "part-0.parquet").exists()
    assert len(store.read_run(tmp_path)) == 0  # readers never see the temp file
    assert duckdb.sql(f"select count(*) from glob('{tmp_path}/rollouts/*/*.parquet')").fetchall() == [(0,)]
    # the next write of that iteration cleans the dead writer's temp file up
    deadline = time.time() + 5
    while time.time() < deadline and pid_alive(proc.pid):
        time.sleep(0.05)
    store.write_shard(tmp_path, 5, [_hand()])
    assert [p.name for p in folder.iterdir()] == ["part-0.parquet"]
    assert store.read_trajectories(tmp_path) == [_hand()]


def test_every_column_and_turn_field_has_a_doc() -> None:
    # the docs' Parquet reference is made from COLUMN_DOCS: a new column without a meaning fails here
    from ragen_core.store.parquet import COLUMN_DOCS, SCHEMA, TURN_TYPE

    expected = {*SCHEMA.names, *(f"turns.{name}" for name in TURN_TYPE.names)}
    assert set(COLUMN_DOCS) == expected
    assert all(doc.strip() and "\n" not in doc for doc in COLUMN_DOCS.values())
