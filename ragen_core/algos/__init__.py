"""Core RL math of StarPO / StarPO-S as pure tensor functions (STYLE rule 1, DESIGN §3).

    from ragen_core.algos import advantages, losses, filtering, masked
    adv, ret = advantages.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    adv = advantages.grpo(returns, group_ids)
    loss, stats = losses.policy_loss(logprobs, old_logprobs, adv, mask, clip_low=0.2, clip_high=0.28)
    keep = filtering.uncertainty_filter(returns_by_group, keep_ratio=0.25, mode="std")

Importing this package imports torch and nothing else heavy; no work happens at import time.
Tests: ``python -m pytest tests/unit/algos -q``.
"""

from ragen_core.algos import advantages, filtering, losses, masked

__all__ = ["advantages", "filtering", "losses", "masked"]
