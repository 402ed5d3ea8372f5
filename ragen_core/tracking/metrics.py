"""Every metric a run, a sweep or a study logs, with its meaning: the catalogue the docs' metric reference is
made from.

    from ragen_core.tracking.metrics import METRICS, describe
    describe("env/Bandit/success")        # 'share of the iteration's training episodes ...'

Keys are name patterns: ``<tag>`` (an env's label), ``<bucket>`` (a reward-std bucket), ``<term>`` (a loss
term), ``<scope>`` (``first_turn`` or ``later_turns``), ``<rule>``, ``<group>`` stand for one path segment
each, ``<N>`` and ``<k>`` for a whole number. ``tests/unit/tracking/test_metric_catalogue.py`` runs every
preset on the tiny model and fails on a logged name the catalogue does not describe.
"""

from __future__ import annotations

import re
from functools import cache

__all__ = ["METRICS", "describe", "pattern_of"]

METRICS: dict[str, str] = {
    # env/: training episodes of this iteration, per env
    "env/<tag>/success": "share of the iteration's training episodes that solved the task",
    "env/<tag>/return": "mean env return of the training episodes (format penalties excluded)",
    "env/<tag>/total_return": "mean return with the format penalties and rewards added (what the update trains on)",
    # rollout/: the rollout batch and the group filter
    "rollout/success": "share of all training episodes that succeeded (every env)",
    "rollout/return_mean": "mean env return over all training episodes",
    "rollout/pass_at_<N>": "share of prompt groups in which any of the N members succeeded",
    "rollout/reward_std": "mean in-group std of the returns the filter ranks (algorithm.filter_on)",
    "rollout/reward_std_all": "mean in-group std of env returns over all groups: falls towards 0 in the Echo Trap",
    "rollout/reward_std_kept": "the same over the groups the filter kept",
    "rollout/reward_std_groups_mean": "in-group std of the raw return (unbiased), averaged over groups of 2 or more",
    "rollout/zero_std_frac": "share of groups whose members all got the same return (no learning signal)",
    "rollout/kept_groups": "prompt groups the filter kept for the update",
    "rollout/kept_ratio": "kept groups over all groups",
    "rollout/filter_score_mean": "mean filter score (algorithm.filter_metric) over all groups",
    "rollout/filter_score_kept": "mean filter score over the kept groups",
    "rollout/update_skipped": "1 when the filter kept nothing and the iteration skipped its update",
    "rollout/format_ok_ratio": "share of turns whose reply parsed and named only valid actions",
    "rollout/valid_action_ratio": "recognised actions over named actions",
    "rollout/effective_action_ratio": "actions that changed the state over actions executed",
    "rollout/actions_per_episode": "mean actions executed per episode",
    "rollout/turns_per_episode": "mean turns per episode",
    "rollout/truncated_ratio": "share of episodes cut by the turn or action budget",
    "rollout/dropped_turns_mean": "mean turns dropped from the prompt to fit the context (the context guard)",
    "rollout/first_empty_think": "share of first-turn replies with no reasoning tokens (an empty or missing think)",
    "rollout/first_distinct": "distinct first-turn reply texts / first-turn replies",
    "rollout/first_top_share": "the most common first-turn reply's share of first-turn replies",
    "rollout/first_action_mi": "plug-in I(prompt group; first action), nats: how much the first move depends on "
                               "the state (an unparsed reply counts as one more action)",
    "rollout/first_action_mi_shuffled": "rollout/first_action_mi with the actions shuffled across the batch (mean "
                                        "of 20): its level with no dependence at this sample size",
    "rollout/step_group_share": "share of turns whose step group (same prompt group, same state) has 2 or more "
                                "turns; under gigpo only these get a step advantage (envs with state keys)",
    "rollout/step_group_share_later": "rollout/step_group_share over the turns after the first (a group's first "
                                      "turns all act on its initial state)",
    "rollout/logprob_gap_mean": "mean |trainer - rollout| log-prob over the generated tokens (engine mismatch)",
    "rollout/logprob_gap_max": "largest |trainer - rollout| log-prob over the generated tokens",
    # response/: reply lengths
    "response/length_mean": "mean reply length in tokens",
    "response/length_max": "longest reply in tokens",
    "response/think_length_mean": "mean <think> tokens per reply: shrinks to a few tokens when reasoning collapses",
    "response/clip_ratio": "share of replies cut at rollout.max_new_tokens",
    # actor/: the policy update
    "actor/pg_loss": "policy-gradient loss (clipped surrogate), mean over mini-batches",
    "actor/entropy": "mean token entropy of the policy on its own replies: falls in the Echo Trap",
    "actor/approx_kl": "approximate KL between the old and the new policy on the trained tokens",
    "actor/clipfrac_upper": "share of tokens whose ratio was clipped above (A > 0, r > 1 + clip_high)",
    "actor/clipfrac_lower": "share of tokens whose ratio was clipped below (A < 0, r < 1 - clip_low)",
    "actor/dual_clipfrac": "share of tokens where the dual clip bound (A < 0, r > dual_clip)",
    "actor/grad_norm": "actor gradient norm before clipping, mean over optimizer steps: spikes confirm the Echo Trap",
    "actor/grad_norm_max": "largest actor gradient norm of the update's optimizer steps",
    "actor/kl_ref": "KL of the policy to the reference model (every diagnostics.kl_every iterations when k1 is in "
                    "the loss; every update when the KL is in the reward)",
    "actor/tis_weight_mean": "mean truncated importance-sampling weight (algorithm.tis_cap)",
    "actor/lr": "actor learning rate",
    "actor/advantages_mean": "mean advantage over the trained tokens",
    "actor/advantages_std": "std of the advantages over the trained tokens",
    "actor/advantages_min": "smallest advantage",
    "actor/advantages_max": "largest advantage",
    # critic/: the value function
    "critic/value_loss": "clipped value loss",
    "critic/vf_clipfrac": "share of tokens whose value was clipped",
    "critic/explained_var": "1 - Var(returns - values) / Var(returns); NaN when the returns do not vary",
    "critic/grad_norm": "critic gradient norm before clipping, mean over optimizer steps",
    "critic/grad_norm_max": "largest critic gradient norm of the update",
    "critic/lr": "critic learning rate",
    "critic/values_mean": "mean old value over the trained tokens",
    "critic/returns_mean": "mean value target over the trained tokens",
    # val/: held-out evaluation at eval.temperature
    "val/success": "held-out success, mean over the eval envs",
    "val/<tag>/success": "held-out success on one eval env",
    "val/<tag>/return": "mean held-out env return",
    "val/<tag>/total_return": "mean held-out return with format penalties",
    "val/<tag>/pass_at_<N>": "share of held-out seeds solved by any of eval.samples replies",
    "val/final/success": "the final evaluation's success, mean over envs (`ragen eval`, end of a run)",
    "val/final/<tag>/success": "the final evaluation's success on one env",
    "val/final/<tag>/return": "the final evaluation's mean env return on one env",
    "val/final/<tag>/total_return": "the final evaluation's mean return with penalties on one env",
    "val/final/<tag>/pass_at_<N>": "the final evaluation's pass@N on one env",
    "val/objective": "a sweep's parent run: each trial's objective, at the trial's number",
    "val/best_objective": "a sweep's parent run: the best trial's objective",
    "val/study/<group>/final_success_mean": "a study's parent run: final validation success, mean over seeds",
    "val/study/<group>/final_success_std": "a study's parent run: its std over seeds",
    "val/study/<group>/peak_success_mean": "a study's parent run: peak validation success, mean over seeds",
    "val/study/<group>/peak_success_std": "a study's parent run: its std over seeds",
    "val/study/<group>/seeds": "a study's parent run: finished runs in the group",
    # timing/ and perf/
    "timing/iteration_s": "wall seconds of the whole iteration, tracking and flow overhead included",
    "timing/rollout_s": "seconds of the training rollout",
    "timing/update_s": "seconds of the update",
    "timing/update_recompute_s": "seconds of the update's old log-prob recompute (algorithm.old_logprobs)",
    "timing/update_prepass_s": "seconds of the update's passes before the first step (reference, old values)",
    "timing/eval_s": "seconds of the held-out evaluation",
    "timing/grad_buckets_s": "seconds of the gradient analysis (diagnostics.grad_buckets_every)",
    "timing/study/<group>/update_s": "a study's parent run: update seconds per iteration, mean over seeds",
    "perf/peak_rss_gib": "peak resident memory of the run's process so far, GiB (on Linux since the run opened, a "
                         "resumed run since it resumed; elsewhere since the process started)",
    "perf/peak_rss_gib/rollout": "peak resident memory during this iteration's training rollout, GiB (Linux only: "
                                 "each step resets the process's peak)",
    "perf/peak_rss_gib/diagnose": "peak resident memory during the template-collapse diagnostics, GiB (Linux only)",
    "perf/peak_rss_gib/grad_buckets": "peak resident memory during the gradient analysis, GiB (Linux only)",
    "perf/peak_rss_gib/update": "peak resident memory during the update, GiB (Linux only)",
    "perf/peak_rss_gib/eval": "peak resident memory during the held-out evaluation, GiB (Linux only)",
    "perf/generated_tokens": "tokens generated by the training rollout",
    "perf/rollout_tokens_per_s": "generated tokens per rollout second",
    "perf/update_rows": "trajectories trained on",
    "perf/update_tokens": "token positions the update ran (padding excluded)",
    "perf/update_tokens_per_s": "update token positions per second (times ppo_epochs)",
    # health/: the collapse monitor and RAGEN-2's rules
    "health/reward_std_ratio": "reward std over its early-run level: below health.std_drop is an Echo-Trap sign",
    "health/entropy_ratio": "entropy over its early-run level: below health.entropy_drop is an Echo-Trap sign",
    "health/grad_norm_z": "z-score of the grad norm against its recent history: above health.grad_z is a spike",
    "health/collapse_score": "how many Echo-Trap signs hold this iteration",
    "health/early_warning": "1 while the Echo-Trap signs have lasted health.patience iterations",
    "health/level_gap": "best mean training success so far minus the current one: the signs count only above "
                        "health.level_drop",
    "health/<rule>_streak": "iterations (or validations) in a row that one of RAGEN-2's rules (reward_std, "
                            "val_success, empty_filter) or the template rule has held",
    "health/rules_fired": "how many of the rules have fired so far",
    "health/study/<group>/collapsed_seeds": "a study's parent run: seeds that ended collapse_drop under their peak",
    # collapse/: template-collapse diagnostics (diagnostics.collapse_every)
    "collapse/<scope>/mi": "I(X;Z) in nats between the prompt and the reasoning (in-batch estimate): falls towards "
                           "0 while entropy holds in template collapse",
    "collapse/<scope>/mi_per_token": "the same from length-normalised log-probs (the reference's headline estimate)",
    "collapse/<scope>/mi_upper_bound": "log N, the largest MI the batch can show",
    "collapse/<scope>/cond_entropy": "H(Z|X) in nats: how varied the reasoning is for one input",
    "collapse/<scope>/marginal_entropy": "H(Z) in nats",
    "collapse/<scope>/marginal_std": "population std of log p_mix(z) over the reasonings",
    "collapse/<scope>/marginal_std_ema": "its EMA (diagnostics.collapse_ema)",
    "collapse/<scope>/mi_zscore": "MI in units of the batch std of log p_mix(z) (the reference's scale-free MI)",
    "collapse/<scope>/mi_zscore_ema": "MI in units of the EMA of that std",
    "collapse/<scope>/retrieval_acc": "share of reasonings whose most likely prompt is their own",
    "collapse/<scope>/retrieval_chance": "1/N: the retrieval accuracy of a reasoning that ignores its prompt",
    "collapse/<scope>/retrieval_acc_top<k>": "share of reasonings whose own prompt is among their k most likely",
    "collapse/<scope>/retrieval_chance_top<k>": "k/N",
    "collapse/<scope>/n_first_turns": "turns sampled for the measurement",
    "collapse/<scope>/n_reasonings": "reasonings scored (turns with a closed, non-empty think block)",
    "collapse/<scope>/n_prompts": "distinct prompts among them",
    "collapse/<scope>/valid_share": "share of sampled turns with a closed, non-empty think block",
    "collapse/<scope>/distinct_reasonings": "distinct reasoning texts",
    "collapse/<scope>/reasoning_tokens": "mean reasoning length in tokens",
    "collapse/<scope>/seconds": "seconds the measurement took",
    # grad/: RAGEN-2's gradient analysis (diagnostics.grad_buckets_every)
    "grad/<bucket>/<term>": "gradient norm of one loss term (task, entropy, kl, value) over the groups of one "
                            "in-group reward-std bucket (zero, le_<edge>, gt_<edge>) of the unfiltered batch",
    "grad/<bucket>/rows": "rows (whole groups) the bucket's gradients were taken over",
}
"""Name pattern -> one-line meaning."""

_SEGMENT = {"<N>": r"\d+", "<k>": r"\d+"}


@cache
def _compiled() -> list[tuple[re.Pattern[str], str]]:
    out = []
    for pattern in METRICS:
        parts = re.split(r"(<\w+>)", pattern)
        regex = "".join(_SEGMENT.get(p, r"[^/]+") if p.startswith("<") else re.escape(p) for p in parts)
        out.append((re.compile(regex + r"\Z"), pattern))
    # A literal name wins over a pattern it also matches (val/final/success over val/<tag>/success).
    out.sort(key=lambda item: item[1].count("<"))
    return out


def pattern_of(name: str) -> str | None:
    """The catalogue pattern that describes a logged metric name; None when none does."""
    for regex, pattern in _compiled():
        if regex.match(name):
            return pattern
    return None


def describe(name: str) -> str | None:
    """The meaning of a logged metric name; None when the catalogue does not describe it."""
    pattern = pattern_of(name)
    return None if pattern is None else METRICS[pattern]
