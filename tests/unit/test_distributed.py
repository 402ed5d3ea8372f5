"""ragen_core.distributed in one process: the shares of a split cover everything once, in order, and every
collective is a no-op that returns its input (so one-process runs are unchanged). The multi-process side
runs in tests/flows/test_train_ranks.py and tests/unit/trainer/test_deepspeed_engine.py."""

from __future__ import annotations

import itertools

import pytest

from ragen_core import distributed


@pytest.mark.parametrize(("n", "world"), [(8, 2), (7, 2), (5, 3), (1, 2), (0, 2), (12, 1)])
def test_shares_are_contiguous_in_rank_order_and_cover_every_item_once(n: int, world: int) -> None:
    parts = [distributed.share(n, r, world) for r in range(world)]
    assert [i for part in parts for i in part] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # near-equal: the first n % world one longer
    assert all(len(a) >= len(b) for a, b in itertools.pairwise(parts))


def test_a_rank_outside_the_world_is_an_error() -> None:
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        distributed.share(4, 2, 2)


def test_without_a_group_this_is_rank_0_of_1_and_collectives_return_their_input() -> None:
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    assert distributed.share(5) == range(5)
    assert distributed.all_gather({"a": 1}) == [{"a": 1}]
    assert distributed.gather_lists([3, 1, 2]) == [3, 1, 2]
    assert distributed.broadcast(("run", 7)) == ("run", 7)
    assert distributed.sum_values({"x": 1.5}) == {"x": 1.5}
    distributed.barrier()
    distributed.leave()  # nothing to leave


def test_split_map_runs_the_whole_range_in_one_process() -> None:
    seen = []

    def play(part: range) -> list[int]:
        seen.append(part)
        return [10 * i for i in part]

    assert distributed.split_map(4, play) == [0, 10, 20, 30]
    assert distributed.split_map(3, play, split=False) == [0, 10, 20]
    assert seen == [range(4), range(3)]


def test_main_first_runs_the_block_here(tmp_path) -> None:
    with distributed.main_first():
        (tmp_path / "built").write_text("x")
    assert (tmp_path / "built").exists()


def test_rank_env_names_a_local_rank_of_the_hosted_group(monkeypatch: pytest.MonkeyPatch) -> None:
    env = distributed.rank_env(1, 2, 29500)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert set(env) == set(distributed.ENV_KEYS)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert not distributed.launched()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.launched()
