"""Rollout diagnostics (SPEC §6) from a list of trajectories, as flat namespaced metrics.

    from ragen_core.rollout.metrics import rollout_metrics
    logger.log_metrics(rollout_metrics(trajs), step=it)

Keys: ``env/<tag>/success``, ``env/<tag>/return`` (env reward, penalties excluded),
``env/<tag>/total_return`` (with penalties); ``rollout/pass_at_N`` (share of prompt groups where any
of their N trajectories succeeded), ``rollout/reward_std_groups_mean`` (in-group std of the raw
return, unbiased as in the StarPO-S filter, averaged over groups of 2 or more),
``rollout/actions_per_episode``, ``rollout/turns_per_episode``, ``rollout/valid_action_ratio``
(recognised / named actions), ``rollout/effective_action_ratio`` (state-changing / executed),
``rollout/format_ok_ratio`` (turns whose reply parsed with only valid actions),
``rollout/truncated_ratio``, ``rollout/dropped_turns_mean`` (context guard),
``response/length_mean`` and ``response/think_length_mean`` (tokens per reply),
``response/clip_ratio`` (replies cut at max_new_tokens). Under GiGPO the session adds
``rollout/step_group_share`` (:func:`step_group_share`).

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_metrics.py -q``.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence

from ragen_core.rollout.batch import turn_state_ids
from ragen_core.types import Trajectory

__all__ = ["group_reward_std", "pass_at_n", "rollout_metrics", "step_group_share"]


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _by_group(trajectories: Sequence[Trajectory]) -> dict[tuple[str, int], list[Trajectory]]:
    groups: dict[tuple[str, int], list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        groups[(t.env_tag, t.group_id)].append(t)
    return groups


def pass_at_n(trajectories: Sequence[Trajectory]) -> float:
    """Share of prompt groups (env tag, group id) in which at least one trajectory succeeded."""
    groups = _by_group(trajectories)
    return _mean([float(any(t.success for t in g)) for g in groups.values()])


def group_reward_std(trajectories: Sequence[Trajectory]) -> float:
    """Mean over groups of the unbiased std of ``env_return`` (groups of one are skipped)."""
    stds = [statistics.stdev([t.env_return for t in g]) for g in _by_group(trajectories).values() if len(g) > 1]
    return _mean(stds)


def step_group_share(trajectories: Sequence[Trajectory]) -> float:
    """Share of turns whose GiGPO step group has 2 or more turns: how often a prompt group's turns met again in one
    state (``advantages.step_groups``: same group id, same ``Turn.state_key``; a turn without a key is alone)."""
    ids = turn_state_ids(trajectories)
    sizes = Counter((t.group_id, i) for t, row in zip(trajectories, ids, strict=True) for i in row)
    n_turns = sum(sizes.values())
    return sum(n for n in sizes.values() if n >= 2) / n_turns if n_turns else 0.0


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The SPEC §6 rollout diagnostics (module docstring); an empty list gives an empty dict."""
    if not trajectories:
        return {}
    out: dict[str, float] = {}
    by_tag: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_tag[t.env_tag].append(t)
    for tag, ts in sorted(by_tag.items()):
        out[f"env/{tag}/success"] = _mean([float(t.success) for t in ts])
        out[f"env/{tag}/return"] = _mean([t.env_return for t in ts])
        out[f"env/{tag}/total_return"] = _mean([t.total_return for t in ts])
    sizes = {len(g) for g in _by_group(trajectories).values()}
    n = max(sizes)
    turns = [turn for t in trajectories for turn in t.turns]
    named = sum(sum(t.meta.get("named_actions", [len(x.actions) for x in t.turns])) for t in trajectories)
    executed = sum(t.n_actions for t in trajectories)
    recognised = named - sum(sum(t.meta.get("unknown_actions", [])) for t in trajectories)
    out.update({
        f"rollout/pass_at_{n}": pass_at_n(trajectories),
        "rollout/reward_std_groups_mean": group_reward_std(trajectories),
        "rollout/return_mean": _mean([t.total_return for t in trajectories]),
        "rollout/success": _mean([float(t.success) for t in trajectories]),
        "rollout/actions_per_episode": _mean([float(t.n_actions) for t in trajectories]),
        "rollout/turns_per_episode": _mean([float(len(t.turns)) for t in trajectories]),
        "rollout/valid_action_ratio": recognised / named if named else 0.0,
        "rollout/effective_action_ratio": (sum(t.n_effective_actions for t in trajectories) / executed
                                           if executed else 0.0),
        "rollout/format_ok_ratio": _mean([float(x.parse_ok) for x in turns]),
        "rollout/truncated_ratio": _mean([float(t.truncated) for t in trajectories]),
        "rollout/dropped_turns_mean": _mean([float(t.dropped_turns) for t in trajectories]),
        "response/length_mean": _mean([float(len(x.response_ids)) for x in turns]),
        "response/think_length_mean": _mean([float(x.think_tokens) for x in turns]),
        "response/clip_ratio": _mean([float(x.finish_reason == "length") for x in turns]),
    })
    return out
