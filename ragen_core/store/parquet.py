"""Parquet trajectory store: one shard per iteration, hive-partitioned, versioned, written atomically.

    from ragen_core.store import RunDir, write_shard, read_run, read_trajectories
    run = RunDir.named("bandit-starpo-s")                 # or any run folder: a path or a RunDir
    path = write_shard(run, iteration=3, trajectories=trajs, kept=kept)
    df = read_run(run)                                    # pandas, all iterations, column 'iteration'
    trajs = read_trajectories(df[df.iteration == 3])      # back to Trajectory records

Layout: ``$RAGEN_DATA_DIR/runs/<run>/rollouts/iteration=N/part-0.parquet`` (the paths come from
store/run_dir.py, which owns a run folder's layout): the partition is named as the column and unpadded, so
DuckDB, pyarrow datasets and pandas read ``iteration`` as an integer. One row per trajectory
with its turns nested (``list<struct>``: prompt and response ids as ``list<int32>``, sampling
log-probs as ``list<float32>``, the dtype they were sampled in), token counts, and ``kept`` (did
the StarPO-S filter keep the trajectory's group). ``turn_values`` (``list<list<float32>>``, one list per
turn) holds the critic head's values recorded at sampling (``Turn.values``, empty lists when none).
``schema_version`` is a column and is also in the file's schema metadata; a reader refuses shards from a newer
version.

A shard is written to a hidden temp file (``.part-0.parquet.tmp-<pid>``) in the same directory,
fsynced, then renamed over the final name (``os.replace`` is atomic on POSIX): a crash leaves
either the old state or the whole new shard. Hidden files are ignored by pyarrow datasets and by
a ``*.parquet`` glob, so a reader never sees a half-written file.

DuckDB reads a run directly::

    duckdb.sql("select iteration, avg(success::int) from read_parquet('data/runs/R/rollouts/*/*.parquet',"
               " hive_partitioning=true) group by iteration order by iteration")   # iteration is an integer

and so does ``pyarrow.dataset.dataset(root, partitioning="hive")`` or ``pandas.read_parquet(root)``.

Run its tests: ``.venv/bin/python -m pytest tests/unit/store -q``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ragen_core.store.files import fsync_dir, pid_alive
from ragen_core.store.run_dir import PARTITION_KEY, SHARD_FILE, rollouts_dir, shard_path
from ragen_core.types import Trajectory, Turn

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COLUMN_DOCS", "SCHEMA", "SCHEMA_VERSION", "TURN_TYPE", "read_run", "read_shard", "read_trajectories",
    "rollouts_dir", "shard_path", "to_table", "write_shard",
]

SCHEMA_VERSION = 1
"""Bump when the schema changes incompatibly; readers refuse newer shards."""

_META_KEY = b"ragen.schema_version"

TURN_TYPE = pa.struct([
    ("observation", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("response_text", pa.string()),
    ("actions", pa.list_(pa.string())),
    ("reward", pa.float64()),
    ("penalty", pa.float64()),
    ("parse_ok", pa.bool_()),
    ("finish_reason", pa.string()),
    ("think_tokens", pa.int32()),
    ("n_effective_actions", pa.int32()),
    ("state_key", pa.string()),
])
"""One ``types.Turn``; field names are the dataclass's."""

_COLUMNS: list[tuple[str, pa.DataType]] = [  # annotated: a list of mixed DataType subclasses infers as object
    ("schema_version", pa.int32()),
    ("env_tag", pa.string()),
    ("seed", pa.int64()),
    ("group_id", pa.int64()),
    ("success", pa.bool_()),
    ("terminated", pa.bool_()),
    ("truncated", pa.bool_()),
    ("dropped_turns", pa.int32()),
    ("kept", pa.bool_()),
    ("env_return", pa.float64()),
    ("total_return", pa.float64()),
    ("n_turns", pa.int32()),
    ("n_actions", pa.int32()),
    ("prompt_tokens", pa.int32()),
    ("response_tokens", pa.int32()),
    ("meta_json", pa.string()),
    ("turns", pa.list_(TURN_TYPE)),
    ("turn_values", pa.list_(pa.list_(pa.float32()))),
]
SCHEMA = pa.schema(_COLUMNS, metadata={_META_KEY: str(SCHEMA_VERSION).encode()})
"""One row per trajectory (module docstring)."""

COLUMN_DOCS: dict[str, str] = {
    "schema_version": "version of this schema the shard was written with (also in the file's metadata)",
    "env_tag": "label of the env the trajectory was played in (env.tag, else its name)",
    "seed": "env seed of the episode's initial state",
    "group_id": "prompt group: the N trajectories sharing one initial state",
    "success": "the episode solved the task",
    "terminated": "the env reached a terminal state (gymnasium meaning)",
    "truncated": "the episode was cut by a turn or action budget (gymnasium meaning)",
    "dropped_turns": "older turns the context guard removed from the training sequence",
    "kept": "the StarPO-S filter kept the trajectory's group for the update",
    "env_return": "env reward, format penalties excluded (what the filter ranks by default)",
    "total_return": "env reward plus format penalties: the trajectory's training reward",
    "n_turns": "turns played",
    "n_actions": "actions executed",
    "prompt_tokens": "tokens of env and template text added before the replies, over all turns",
    "response_tokens": "tokens the model sampled, over all turns",
    "meta_json": "JSON of the rollout's rendering and diagnostic facts (types.TrajectoryMeta)",
    "turns": "the turns, in order (fields below)",
    "turn_values": "per turn, the critic head's value before each sampled token (empty lists without a head)",
    "turns.observation": "the state text shown to the model at this turn",
    "turns.prompt_ids": "token ids added to the context before this reply (env text and template tokens)",
    "turns.response_ids": "exactly the sampled token ids, with the end-of-turn token when it was sampled",
    "turns.logprobs": "log-probabilities of response_ids under the sampling distribution, in the dtype sampled in",
    "turns.response_text": "the reply as it reads (the prefilled tag, then the decoded reply); training uses the ids",
    "turns.actions": "the reply's actions that were valid and executed, in order",
    "turns.reward": "sum of the env rewards of the executed actions",
    "turns.penalty": "format penalty of the turn (0.0 or rollout.format_penalty), plus any format reward",
    "turns.parse_ok": "the reply parsed and named only valid actions",
    "turns.finish_reason": "'stop' (end-of-turn sampled) or 'length' (rollout.max_new_tokens reached)",
    "turns.think_tokens": "tokens inside <think>...</think> (0 in NoThink mode)",
    "turns.n_effective_actions": "executed actions that changed the env state",
    "turns.state_key": "key of the env state the turn acted on (env.state_key before its actions): equal keys, "
                       "equal states; '' when unknown. GiGPO's step groups",
}
"""Column (and ``turns.<field>``) -> one-line meaning: the docs' Parquet reference is made from it."""


# ---------------------------------------------------------------------- writing


def to_table(trajectories: Sequence[Trajectory], kept: Sequence[bool] | None = None) -> pa.Table:
    """The Arrow table of ``trajectories`` (``kept`` defaults to all True)."""
    kept = [True] * len(trajectories) if kept is None else list(kept)
    if len(kept) != len(trajectories):
        raise ValueError(f"kept has {len(kept)} flags for {len(trajectories)} trajectories")
    rows = [_row(t, bool(k)) for t, k in zip(trajectories, kept, strict=True)]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def _row(t: Trajectory, kept: bool) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "env_tag": t.env_tag,
        "seed": t.seed,
        "group_id": t.group_id,
        "success": t.success,
        "terminated": t.terminated,
        "truncated": t.truncated,
        "dropped_turns": t.dropped_turns,
        "kept": kept,
        "env_return": t.env_return,
        "total_return": t.total_return,
        "n_turns": len(t.turns),
        "n_actions": t.n_actions,
        "prompt_tokens": sum(len(x.prompt_ids) for x in t.turns),
        "response_tokens": t.response_tokens,
        "meta_json": json.dumps(t.meta, sort_keys=True, ensure_ascii=False),
        "turns": [{name: getattr(x, name) for name in TURN_TYPE.names} for x in t.turns],
        "turn_values": [list(x.values) for x in t.turns],
    }


def write_shard(run: str | os.PathLike[str], iteration: int, trajectories: Sequence[Trajectory],
                kept: Sequence[bool] | None = None) -> Path:
    """Write iteration ``iteration`` of ``run`` atomically (module docstring); returns the shard path.

    Rewriting an iteration replaces its shard whole. Temp files left by killed writers are removed.
    """
    final = shard_path(run, iteration)
    final.parent.mkdir(parents=True, exist_ok=True)
    table = to_table(trajectories, kept)
    _remove_stale_temps(final.parent)
    tmp = final.parent / f".{SHARD_FILE}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            pq.write_table(table, handle, compression="zstd")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return final


def _remove_stale_temps(folder: Path) -> None:
    """Delete temp shards whose writer process no longer exists."""
    for path in folder.glob(f".{SHARD_FILE}.tmp-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


# ---------------------------------------------------------------------- reading


def _check_version(schema: pa.Schema, where: str) -> None:
    raw = (schema.metadata or {}).get(_META_KEY)
    if raw is not None and int(raw) > SCHEMA_VERSION:
        raise ValueError(f"{where} was written with trajectory schema v{int(raw)}; this ragen reads up to "
                         f"v{SCHEMA_VERSION}: upgrade ragen")


def read_shard(path: str | os.PathLike[str]) -> pd.DataFrame:
    """One shard as a DataFrame."""
    table = pq.read_table(Path(path))  # pyarrow takes any path-like; its stubs list str and Path only
    _check_version(table.schema, str(path))
    return table.to_pandas()


_PARTITION = re.compile(rf"^{PARTITION_KEY}=(\d+)$")
"""A shard folder's name: ``iteration=N``."""


def read_run(run: str | os.PathLike[str]) -> pd.DataFrame:
    """All shards of a run as one DataFrame, with an ``iteration`` column, ordered by iteration.

    Empty (with the schema's columns) when the run has no complete shard yet.
    """
    root = rollouts_dir(run)
    shards = sorted((int(m.group(1)), folder / SHARD_FILE) for folder in (root.iterdir() if root.is_dir() else [])
                    if (m := _PARTITION.match(folder.name)) and (folder / SHARD_FILE).is_file())
    if not shards:
        return _empty_frame()
    tables = []
    for iteration, path in shards:
        table = pq.read_table(path)
        _check_version(table.schema, str(path))
        tables.append(table.append_column(PARTITION_KEY, pa.array([iteration] * table.num_rows, pa.int32())))
    frame = pa.concat_tables(tables).to_pandas()
    return frame.sort_values(PARTITION_KEY, kind="stable").reset_index(drop=True)


def _empty_frame() -> pd.DataFrame:
    return SCHEMA.append(pa.field("iteration", pa.int32())).empty_table().to_pandas()


def read_trajectories(source: str | os.PathLike[str] | pd.DataFrame) -> list[Trajectory]:
    """Trajectories back from a DataFrame of ``read_run``/``read_shard``, a shard file or a run directory."""
    # lazily: pandas is slow to import and only DataFrame input needs it
    import pandas as pd

    if isinstance(source, pd.DataFrame):
        frame = source
    else:
        path = Path(source)
        frame = read_run(path) if path.is_dir() else read_shard(path)
    return [_trajectory(row) for row in frame.to_dict("records")]


def _trajectory(row: Mapping[Hashable, Any]) -> Trajectory:
    values = [tuple(float(x) for x in v) for v in row["turn_values"]]
    turns = tuple(
        Turn(
            observation=t["observation"],
            prompt_ids=tuple(int(i) for i in t["prompt_ids"]),
            response_ids=tuple(int(i) for i in t["response_ids"]),
            logprobs=tuple(float(x) for x in t["logprobs"]),
            response_text=t["response_text"],
            actions=tuple(str(a) for a in t["actions"]),
            reward=float(t["reward"]),
            penalty=float(t["penalty"]),
            parse_ok=bool(t["parse_ok"]),
            finish_reason=t["finish_reason"],
            think_tokens=int(t["think_tokens"]),
            n_effective_actions=int(t["n_effective_actions"]),
            values=v,
            state_key=str(t["state_key"]),
        )
        for t, v in zip(row["turns"], values, strict=True)
    )
    return Trajectory(
        env_tag=row["env_tag"], seed=int(row["seed"]), group_id=int(row["group_id"]), turns=turns,
        success=bool(row["success"]), terminated=bool(row["terminated"]), truncated=bool(row["truncated"]),
        dropped_turns=int(row["dropped_turns"]), meta=json.loads(row["meta_json"]),
    )
