"""Learning test: the tiny model, sampled with the real HF generator and trained with StarPO-S
(critic + clip-higher, no KL) through filter_batch and update, learns a toy single-turn task.

Task: after a fixed chat prompt, the first generated token should be one of the "target" tokens
(ids divisible by 4). The random tiny model puts ~25% of its mass there; the reward is 1 when the
first sampled token is a target. Seeds are fixed, so the run is deterministic on one machine.

Run with ``python -m pytest tests/unit/trainer/test_trainer_learning.py -q``.
"""

from __future__ import annotations

import torch
from conftest import make_cfg

from ragen_core.models import load_tokenizer
from ragen_core.rollout.generators import SamplingParams, make_generator
from ragen_core.trainer import filter_batch, init_state, update
from ragen_core.types import TokenBatch

P, N = 4, 8  # prompt groups × responses per group


def _is_target(token: int) -> bool:
    return token % 4 == 0


def _batch(prompt: list[int], gens, rewards: list[float]) -> TokenBatch:
    """Single-turn rows: prompt then the exact sampled ids; loss on the reply, reward on its last token."""
    B, T = len(gens), len(prompt) + max(len(g.token_ids) for g in gens)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn, loss_mask, ends = (torch.zeros(B, T, dtype=torch.bool) for _ in range(3))
    old_logprobs, token_rewards = torch.zeros(B, T), torch.zeros(B, T)
    turn_ids = torch.full((B, T), -1, dtype=torch.long)
    for b, g in enumerate(gens):
        n = len(prompt) + len(g.token_ids)
        ids[b, :n] = torch.tensor(prompt + list(g.token_ids))
        attn[b, :n] = True
        loss_mask[b, len(prompt):n] = True
        old_logprobs[b, len(prompt):n] = torch.tensor(g.logprobs)
        token_rewards[b, n - 1] = rewards[b]
        ends[b, n - 1] = True
        turn_ids[b, :n] = 0
    group_ids = torch.arange(P).repeat_interleave(N)
    return TokenBatch(ids, attn, loss_mask, old_logprobs, token_rewards, turn_ids, ends, group_ids,
                      torch.tensor(rewards))


def test_tiny_model_learns_a_single_turn_task() -> None:
    # filter_value 1.0: every group holds the same prompt here, so the filter has nothing to choose
    # between (it still runs); with 32 rows the run learns within ~5 iterations for model seeds 0-4.
    cfg = make_cfg("starpo-s", "trainer.actor_lr=0.05", "trainer.critic_lr=0.01", "algorithm.filter_value=1.0",
                   "rollout.responses_per_prompt=8", "trainer.micro_batch_size=16")
    state = init_state(cfg)
    tokenizer = load_tokenizer(cfg.model.name)
    generator = make_generator("hf", state.models.actor, tokenizer)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "Say a word."}],
                                                add_generation_prompt=True, return_dict=True)["input_ids"])
    target = torch.tensor([_is_target(t) for t in range(len(tokenizer))])

    def target_mass() -> float:
        with torch.no_grad():
            logits = state.models.actor(input_ids=torch.tensor([prompt])).logits[0, -1]
        return float(torch.softmax(logits, -1)[target].sum())

    success, mass = [], [target_mass()]
    for it in range(8):
        gens = generator.generate([prompt] * (P * N), SamplingParams(temperature=1.0, max_new_tokens=2, seed=it))
        rewards = [float(_is_target(g.token_ids[0])) for g in gens]
        success.append(sum(rewards) / len(rewards))
        kept = filter_batch(_batch(prompt, gens, rewards), torch.tensor(rewards), cfg.algorithm)
        stats = update(state, kept.batch, cfg)
        assert abs(stats.metrics["actor/approx_kl"]) < 1e-4  # generator and trainer log-probs agree
        mass.append(target_mass())

    assert 0.15 < mass[0] < 0.35  # the untrained model: about a quarter of its mass on targets
    assert mass[-1] > 0.8, mass
    assert sum(success[-2:]) / 2 > success[0] + 0.4, success
