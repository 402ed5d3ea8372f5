"""The loop with the real HF generator on the tiny random model: masks hold for sampled (random) replies,
and the rollout's log-probs are what the model gives on the training row, so every context the model
saw is exactly a prefix of the row it is trained on.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_hf.py -q
"""

from __future__ import annotations

import pytest
import torch

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.models import tiny_random
from ragen_core.rollout.batch import build_token_batch, mask_problems
from ragen_core.rollout.generators import make_generator
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.metrics import rollout_metrics


@pytest.mark.parametrize("window", [None, 2])
def test_hf_rollouts_masks_and_logprobs(window: int | None) -> None:
    model, tok = tiny_random(0)
    gen = make_generator("hf", model, tok)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=12, window_turns=window)
    trajs = run_rollouts(EnvConfig(name="Sokoban"), gen, tok, cfg, seeds=[3, 4], n_per_group=2, sampling_seed=0)
    assert len(trajs) == 4 and all(len(t.turns) == 3 for t in trajs)  # random replies never parse: no early end
    batch = build_token_batch(trajs, tok, cfg)
    assert mask_problems(batch, trajs, tok) == []
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
    # log p(input_ids[t] | input_ids[:t]) sits at position t (types.py alignment)
    logp = torch.log_softmax(logits[:, :-1].float() / cfg.temperature, -1)
    logp = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    if window is None:  # every context was a prefix of the row: the sampler's log-probs are reproduced
        torch.testing.assert_close(logp[mask], batch.old_logprobs[:, 1:][mask], atol=1e-4, rtol=0)
    else:  # with a window only the last reply's context is the row's (context.py caveat)
        last = batch.turn_ids[:, 1:] == torch.tensor([len(t.turns) - 1 for t in trajs])[:, None]
        torch.testing.assert_close(logp[mask & last], batch.old_logprobs[:, 1:][mask & last], atol=1e-4, rtol=0)
    metrics = rollout_metrics(trajs)
    assert metrics["rollout/format_ok_ratio"] == 0.0 and metrics["response/length_mean"] > 0


def test_hf_rollouts_are_reproducible_with_a_sampling_seed() -> None:
    model, tok = tiny_random(0)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=8)
    runs = [run_rollouts(EnvConfig(name="Bandit"), make_generator("hf", model, tok), tok, cfg, seeds=[1],
                         n_per_group=3, sampling_seed=5) for _ in range(2)]
    assert [t.turns for t in runs[0]] == [t.turns for t in runs[1]]


def test_a_share_of_the_groups_plays_as_in_the_whole_call() -> None:
    # A multi-process run gives each process some of the groups (group_offset = the first one's index):
    # each episode samples from its own stream (group id, member), so the pieces equal the whole call.
    model, tok = tiny_random(0)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=8)
    seeds = [3, 4, 5]

    def play(first: int, last: int) -> list:
        return run_rollouts(EnvConfig(name="Sokoban"), make_generator("hf", model, tok), tok, cfg, seeds[first:last],
                            n_per_group=2, sampling_seed=9, group_offset=first)

    whole, pieces = play(0, 3), play(0, 1) + play(1, 3)
    assert [t.group_id for t in pieces] == [t.group_id for t in whole] == [0, 0, 1, 1, 2, 2]
    assert [[u.response_ids for u in t.turns] for t in pieces] == [[u.response_ids for u in t.turns] for t in whole]
    for a, b in zip(pieces, whole, strict=True):
        for u, v in zip(a.turns, b.turns, strict=True):
            assert u.logprobs == pytest.approx(v.logprobs, abs=1e-4)
