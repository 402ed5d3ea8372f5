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
``response/clip_ratio`` (replies cut at max_new_tokens). Where the env keys its states the session adds how
often they recurred within a prompt group (GiGPO's step groups, :func:`step_group_metrics`):
``rollout/step_group_share`` over every turn and ``rollout/step_group_share_later`` over the turns after the first.

Template collapse read from the replies themselves (:func:`first_turn_metrics`, over each trajectory's first
turn, where every member of a prompt group sees the same state): ``rollout/first_empty_think`` (share with no
reasoning tokens), ``rollout/first_distinct`` (distinct reply texts / replies), ``rollout/first_top_share`` (the
most common reply's share), ``rollout/first_action_mi`` (plug-in I(prompt group; first action) in nats, an
unparsed reply counting as one more action) and ``rollout/first_action_mi_shuffled`` (the same with the actions
shuffled across the batch, mean of :data:`MI_SHUFFLES`: what the estimator gives with no dependence at this
sample size). A policy whose first move depends on the board keeps the MI above its shuffled level; a template
brings the two together.

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_metrics.py -q``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

from ragen_core.rollout.batch import turn_state_ids
from ragen_core.types import Trajectory

__all__ = ["MI_SHUFFLES", "first_turn_metrics", "group_reward_std", "pass_at_n", "plugin_mi", "rollout_metrics",
           "step_group_metrics", "step_group_share"]

MI_SHUFFLES = 20
"""Shuffles behind ``rollout/first_action_mi_shuffled`` (seeded: the metric is a function of the batch)."""
UNPARSED = "(unparsed)"
"""The first action of a reply that did not parse."""


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


def step_group_share(trajectories: Sequence[Trajectory], first_turn: int = 0) -> float:
    """Share of turns whose GiGPO step group has 2 or more turns: how often a prompt group's turns met again in one
    state (``advantages.step_groups``: same group id, same ``Turn.state_key``; a turn without a key is alone).

    The step groups are formed from every turn; the share counts the turns from index ``first_turn`` on. Every
    group's first turns act on the one initial state, so ``first_turn=1`` gives the share among the turns whose
    states the trajectories reached by their own moves."""
    ids = turn_state_ids(trajectories)
    sizes = Counter((t.group_id, i) for t, row in zip(trajectories, ids, strict=True) for i in row)
    counted = [sizes[(t.group_id, i)] for t, row in zip(trajectories, ids, strict=True) for i in row[first_turn:]]
    return sum(n >= 2 for n in counted) / len(counted) if counted else 0.0


def step_group_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``rollout/step_group_share`` over every turn and ``rollout/step_group_share_later`` over the turns after the
    first (:func:`step_group_share`; absent when no episode had a second turn); empty when no turn has a state key
    (an env without ``state_key``)."""
    if not any(turn.state_key for t in trajectories for turn in t.turns):
        return {}
    metrics = {"rollout/step_group_share": step_group_share(trajectories)}
    if any(len(t.turns) > 1 for t in trajectories):
        metrics["rollout/step_group_share_later"] = step_group_share(trajectories, first_turn=1)
    return metrics


def plugin_mi(xs: Sequence[Hashable], ys: Sequence[Hashable]) -> float:
    """The plug-in mutual information of paired samples, in nats: sum over (x, y) of p(x, y) log p(x, y) / p(x) p(y)
    with every p a count share."""
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"plugin_mi needs paired samples, got {n} and {len(ys)}")
    cx, cy, cxy = Counter(xs), Counter(ys), Counter(zip(xs, ys, strict=True))
    return sum(c / n * math.log(c * n / (cx[x] * cy[y])) for (x, y), c in cxy.items())


def first_turn_metrics(trajectories: Sequence[Trajectory], shuffles: int = MI_SHUFFLES) -> dict[str, float]:
    """The first-turn reply metrics of the module docstring; empty when no trajectory has a turn."""
    firsts = [(t.env_tag, t.group_id, t.turns[0]) for t in trajectories if t.turns]
    if not firsts:
        return {}
    groups = [(tag, g) for tag, g, _ in firsts]
    actions = [x.actions[0] if x.parse_ok and x.actions else UNPARSED for _, _, x in firsts]
    texts = Counter(x.response_text for _, _, x in firsts)
    rng = np.random.default_rng(0)
    shuffled = [plugin_mi(groups, [actions[i] for i in rng.permutation(len(actions))]) for _ in range(shuffles)]
    return {
        "rollout/first_empty_think": _mean([float(x.think_tokens == 0) for _, _, x in firsts]),
        "rollout/first_distinct": len(texts) / len(firsts),
        "rollout/first_top_share": texts.most_common(1)[0][1] / len(firsts),
        "rollout/first_action_mi": plugin_mi(groups, actions),
        "rollout/first_action_mi_shuffled": _mean(shuffled),
    }


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
    out.update(first_turn_metrics(trajectories))
    return out
