"""CUDA check: ragen_core's own torch code paths on a device, with the tiny in-process model (no hub, no network).

Five checks, each on ``--device`` (default cuda; ``--device cpu`` runs the same code here):

  generator  the hf generator (``make_generator("hf", ...)``) over 3 turns with session ids (cross-turn cache
             reuse, early stops, batch shrinking, prompt groups prefilled once, temperature and top-p
             sampling), plain and under LoRA: the fast decode step (decode_step.py) against ``model.forward``
             (``fast_decode=False``) with the same seeds: the same sampled ids and log-probs within 1e-4; every
             sampled token's log-prob of both within 1e-4 of a full re-prefill with ``model(...)`` on the device;
             and the device's sampled tokens re-scored by the same weights on the CPU, within 1e-4.
  forward    the trainer's chunked log-prob/entropy forward (trainer/forward.py: shared prefixes, packed tails,
             chunks recomputed in backward) on the device against the same on the CPU, plain and under LoRA:
             values within 1e-4, every gradient within 1e-3 of its tensor's largest CPU gradient entry.
  session    a plain training session (ragen_core.session with a NullLogger, as bench/iteration.py) of
             experiments/smoke.yaml with model.device=<device>, rollout.backend=hf, trainer.backend=torch for
             ``--iterations`` iterations, in a temporary RAGEN_DATA_DIR: it completes, the models are on the
             device, losses, grad norms and entropies are finite; seconds per iteration.
  deepspeed  the session check with trainer.backend=deepspeed at ZeRO stages 0-3 in this one process (NCCL on
             CUDA, gloo on a CPU), each against the torch trainer's session: it passes that check, and its first
             iteration's gradient norms equal the torch trainer's within 1e-3 relative. Needs deepspeed (not in
             the default list: ``--only ...,deepspeed``).
  bf16       the bf16 autocast paths: the trainer's fused LoRA layers (trainer/lora_fused.py) against peft's own
             forward under autocast on the device, each output and gradient at most 2x as far from fp32 as
             peft's (or 2e-2 of its largest entry), the fused path taken in every layer;
             losses.logprobs_and_entropy on bf16 logits against log_softmax and the entropy in fp32 (values
             within 1e-4, the bf16 gradient within 1e-2); and its forward and backward timed at Qwen2.5's
             vocabulary, as it runs on the device, in a CPU's pieces and as the plain fp32 path (reported, not
             judged).

Run:  python bench/cuda_check.py [--device cuda] [--iterations 3] [--only generator,forward,session,bf16,deepspeed]
The last line printed is one JSON object: {"pass": bool, "env": {...}, "checks": {name: {"pass": bool, ...}}};
the exit status is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout, with or without the package installed
    sys.path.insert(0, str(ROOT))

TOL = 1e-4
"""Largest |log-prob difference| allowed between two ways of computing the same thing."""
GRAD_TOL = 1e-3
"""Largest gradient difference allowed, relative to the largest CPU gradient entry of the same tensor."""

TEXTS = (
    "You are a helpful assistant. Turn 1: State: P _ O G",
    "short",
    "Instruction: reach the goal without falling into a hole; actions Left, Down, Right, Up",
)
"""First-turn prompts; each is asked twice (a prompt group of 2, prefilled once)."""

Result = dict[str, Any]


# --------------------------------------------------------------------------- helpers


def _lora(model: torch.nn.Module, targets: list[str], seed: int) -> torch.nn.Module:
    """``model`` with LoRA adapters whose B matrices are non-zero (B = 0 at init would hide a missing merge)."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # LoRA A's initialisation
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=generator)
    return peft_model


def _to(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` on ``device`` (as nn.Module: transformers' wrapped ``.to`` confuses mypy, see models/tiny.py)."""
    return model.to(device)


def _rescored(model: torch.nn.Module, prompt: list[int], reply: tuple[int, ...], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``reply`` after ``prompt`` from one plain full forward on the model's device,
    as [len(reply)] float64 on the CPU."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt, *reply]], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [N, V] predicts reply[i]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(reply, device=device)[:, None]).squeeze(1).double().cpu()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max()) if a.numel() else 0.0


def _finite(x: float) -> float | str:
    """A number JSON can hold ('nan', 'inf' as strings)."""
    return x if math.isfinite(x) else str(x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- a. the hf generator


def _turn_params(turn: int, stop: tuple[int, ...]) -> Any:
    from ragen_core.rollout.generators import SamplingParams

    # turn 2 samples at temperature 0.7 with top-p 0.9 (the sort/searchsorted branch), the others at 1.0
    # (the two-level inverse CDF); the stop ids end about 3 rows in 4 early (rows drop out of the batch)
    temperature, top_p = (0.7, 0.9) if turn == 1 else (1.0, 1.0)
    return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=16, seed=11 + turn,
                          stop_token_ids=stop)


def _three_turns(gen: Any, tokenizer: Any, stop: tuple[int, ...]) -> list[tuple[list[list[int]], list[Any], Any]]:
    """Three turns of 6 episodes (session ids ep0..ep5); [(contexts, generations, params)] per turn. Each turn's
    context is the last one, the reply and a fake user message of a length that differs by row."""
    contexts = [list(tokenizer.encode(t)) for t in TEXTS for _ in range(2)]
    sessions = [f"ep{i}" for i in range(len(contexts))]
    history = []
    for turn in range(3):
        params = _turn_params(turn, stop)
        out = gen.generate(contexts, params, session_ids=sessions)
        history.append((contexts, out, params))
        user = list(tokenizer.encode(f"<|im_end|>\nTurn {turn + 2}: reward 0.0. State: P _ O G"))
        contexts = [c + list(g.token_ids) + user[: 4 + 3 * i]
                    for i, (c, g) in enumerate(zip(contexts, out, strict=True))]
    return history


def _generator_case(model: torch.nn.Module, tokenizer: Any, stop: tuple[int, ...]) -> Result:
    """Fast step vs model.forward, both vs a full re-prefill, and the device's tokens re-scored on the CPU."""
    from ragen_core.rollout.generators import make_generator

    fast_gen = make_generator("hf", model, tokenizer, fast_decode=True)
    slow_gen = make_generator("hf", model, tokenizer, fast_decode=False)
    fast, slow = _three_turns(fast_gen, tokenizer, stop), _three_turns(slow_gen, tokenizer, stop)
    compared = flips = rows_skipped = 0
    fast_vs_slow = 0.0
    finish_mismatch = 0
    for (ctx_f, out_f, _), (ctx_s, out_s, _) in zip(fast, slow, strict=True):
        for pf, ps, f, s in zip(ctx_f, ctx_s, out_f, out_s, strict=True):
            if pf != ps:  # an earlier turn of this row flipped a token: another dialogue from there
                rows_skipped += 1
                continue
            n = 0
            while n < min(len(f.token_ids), len(s.token_ids)) and f.token_ids[n] == s.token_ids[n]:
                n += 1
            if f.token_ids != s.token_ids:
                flips += 1
            elif f.finish_reason != s.finish_reason:
                finish_mismatch += 1
            compared += n
            if n:
                fast_vs_slow = max(fast_vs_slow, _max_abs(torch.tensor(f.logprobs[:n]), torch.tensor(s.logprobs[:n])))
    cpu_model = copy.deepcopy(model).to("cpu").eval()
    reprefill = {"fast": 0.0, "slow": 0.0}
    cpu_rescore = 0.0
    tokens = 0
    for label, history in (("fast", fast), ("slow", slow)):
        for contexts, out, params in history:
            temperature = params.temperature or 1.0
            for prompt, g in zip(contexts, out, strict=True):
                sampled = torch.tensor(g.logprobs, dtype=torch.float64)
                reprefill[label] = max(reprefill[label], _max_abs(sampled, _rescored(model, prompt, g.token_ids,
                                                                                     temperature)))
                if label == "fast":
                    tokens += len(g.token_ids)
                    cpu_rescore = max(cpu_rescore, _max_abs(sampled, _rescored(cpu_model, prompt, g.token_ids,
                                                                               temperature)))
    stops = sum(g.finish_reason == "stop" for _, out, _ in fast for g in out)
    result: Result = {
        "fast_step_active": getattr(fast_gen, "_step", None) is not None,  # HFGenerator's decode step, or None
        "fast_step_packed": bool(getattr(getattr(fast_gen, "_step", None), "packed", False)),
        "sampled_tokens": tokens, "stopped_rows": stops, "rows": sum(len(out) for _, out, _ in fast),
        "fast_vs_slow_compared_tokens": compared, "fast_vs_slow_id_flips": flips,
        "fast_vs_slow_finish_mismatches": finish_mismatch, "rows_skipped_after_flip": rows_skipped,
        "fast_vs_slow_max_logprob_diff": fast_vs_slow,
        "reprefill_max_logprob_diff_fast": reprefill["fast"], "reprefill_max_logprob_diff_slow": reprefill["slow"],
        "cpu_rescore_max_logprob_diff": cpu_rescore,
        "reused_tokens_fast": fast_gen.stats["reused_tokens"], "reused_tokens_slow": slow_gen.stats["reused_tokens"],
        "shared_prompt_tokens": fast_gen.stats["shared_prompt_tokens"],
    }
    result["pass"] = bool(
        result["fast_step_active"] and flips == 0 and finish_mismatch == 0 and compared > 0
        and fast_vs_slow <= TOL and reprefill["fast"] <= TOL and reprefill["slow"] <= TOL and cpu_rescore <= TOL
        and result["reused_tokens_fast"] > 0 and result["reused_tokens_slow"] > 0
    )
    return result


def check_generator(device: torch.device) -> Result:
    from ragen_core.models.tiny import tiny_random

    model, tokenizer = tiny_random(1)
    stop = (int(tokenizer.eos_token_id), *range(40, 130))
    out: Result = {"plain": _generator_case(_to(model, device), tokenizer, stop)}
    lora_base, lora_tok = tiny_random(1)
    lora_model = _lora(_to(lora_base, device), ["q_proj", "v_proj", "up_proj"], seed=5)
    out["lora"] = _generator_case(lora_model, lora_tok, stop)
    out["pass"] = all(v["pass"] for v in out.values())
    return out


# --------------------------------------------------------------------------- b. the trainer's forward


def _grouped_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seven right-padded rows: three share a 20-token prompt, three an 18-token one (two identical), one shares
    nothing, interleaved (as tests/unit/trainer/test_trainer_forward.py builds them)."""
    g = torch.Generator().manual_seed(seed)
    p1, p2 = torch.randint(0, 500, (20,), generator=g), torch.randint(0, 500, (18,), generator=g)
    rows = [torch.cat([p1, torch.randint(0, 500, (k,), generator=g)]) for k in (3, 5, 1)]
    tail = torch.randint(0, 500, (4,), generator=g)
    rows += [torch.cat([p2, tail]), torch.cat([p2, tail]), torch.cat([p2, torch.randint(0, 500, (9,), generator=g)])]
    rows.append(torch.randint(600, 700, (9,), generator=g))
    rows = [rows[i] for i in (3, 0, 6, 1, 4, 2, 5)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = r, True
    return ids, attn


VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("chunked_t0.7", {"temperature": 0.7, "chunk": 3, "one_piece_bytes": 0}),
    ("one_piece_start4", {"temperature": 1.0, "chunk": 128, "start": 4}),
    ("chunked_entropy_detached", {"temperature": 1.0, "chunk": 4, "one_piece_bytes": 0, "entropy_grad": False}),
)
"""policy_forward settings compared: chunks recomputed in backward, logits in one piece from a later start,
and the entropy as a diagnostic only."""


def _forward_case(cpu_model: torch.nn.Module, device: torch.device) -> Result:
    from ragen_core.trainer.forward import decoder_and_head, policy_forward, shared_prefix_groups

    dev_model = copy.deepcopy(cpu_model).to(device)
    ids, attn = _grouped_batch(0)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))  # a loss mixing both outputs
    groups = [g for g in shared_prefix_groups(ids, attn) if g[1] > 0]
    out: Result = {"shared_prefix_groups": len(groups),
                   "attn_implementation": str(getattr(getattr(decoder_and_head(dev_model)[0], "config", None),
                                                      "_attn_implementation", None))}
    ok = True
    for name, kw in VARIANTS:
        per: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        for side, model, dev in (("cpu", cpu_model, torch.device("cpu")), ("dev", dev_model, device)):
            model.train()
            model.zero_grad(set_to_none=True)
            res = policy_forward(model, ids.to(dev), attn.to(dev), **kw)
            w = weights.to(dev)
            ((res.logprobs * w).sum() + (res.entropy * w).sum()).backward()
            per[side + "_lp"], per[side + "_ent"] = res.logprobs.detach(), res.entropy.detach()
            per[side + "_grads"] = [p.grad.detach().clone() for p in model.parameters()
                                    if p.requires_grad and p.grad is not None]
        lp_diff = _max_abs(per["cpu_lp"], per["dev_lp"])  # type: ignore[arg-type]
        ent_diff = _max_abs(per["cpu_ent"], per["dev_ent"])  # type: ignore[arg-type]
        cpu_grads, dev_grads = per["cpu_grads"], per["dev_grads"]
        assert isinstance(cpu_grads, list) and isinstance(dev_grads, list)
        grad_rel = max((_max_abs(c, d) / (float(c.abs().max()) + 1e-12) for c, d in zip(cpu_grads, dev_grads,
                                                                                       strict=True)), default=0.0)
        passed = (lp_diff <= TOL and ent_diff <= TOL and grad_rel <= GRAD_TOL and len(cpu_grads) == len(dev_grads) > 0)
        out[name] = {"logprob_max_diff": lp_diff, "entropy_max_diff": ent_diff, "grad_max_rel_diff": grad_rel,
                     "grad_tensors": len(dev_grads), "pass": passed}
        ok = ok and passed
    out["pass"] = ok and len(groups) > 0
    return out


def check_forward(device: torch.device) -> Result:
    from ragen_core.models.tiny import tiny_random

    plain, _ = tiny_random(0)
    out: Result = {"plain": _forward_case(plain, device)}
    lora_base, _ = tiny_random(0)
    out["lora"] = _forward_case(_lora(lora_base, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"], seed=3), device)
    out["pass"] = out["plain"]["pass"] and out["lora"]["pass"]
    return out


# --------------------------------------------------------------------------- c. a training session


TRAINING_KEYS = ("loss", "grad_norm", "entropy")
"""History keys containing one of these must be finite."""
WATCHED = ("actor/pg_loss", "critic/value_loss", "actor/entropy", "actor/grad_norm", "critic/grad_norm")
"""Per-iteration values reported."""


def check_session(device: torch.device, iterations: int, *extra: str) -> Result:
    """A plain training session of experiments/smoke.yaml on the device (torch trainer, or ``extra`` overrides)."""
    from ragen_core import session
    from ragen_core.config import load_experiment
    from ragen_core.tracking import NullLogger

    overrides = [f"model.device={device.type}", "rollout.backend=hf", "trainer.backend=torch",
                 f"trainer.iterations={iterations}", *extra]
    cfg = load_experiment(ROOT / "experiments" / "smoke.yaml", overrides)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(f"  [session] {line}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        sess = session.open_session(cfg, NullLogger(), Path(tmp) / "run", say=say)
        actor_device = next(sess.state.models.actor.parameters()).device
        seconds: list[float] = []
        while not sess.done:
            _sync(device)
            t0 = time.perf_counter()
            session.run_iteration(sess)
            _sync(device)
            seconds.append(time.perf_counter() - t0)
        if session.final_eval_due(sess):
            session.record_final_eval(sess, session.evaluate_policy(sess))
        result = session.finish(sess)
        final_saved = any(sess.folder.final_model.glob("*.safetensors"))
        rows = [r for r in sess.history if "timing/iteration_s" in r]
        nonfinite = sorted({k for r in sess.history for k, v in r.items()
                            if isinstance(v, float) and not math.isfinite(v)})
        bad = [k for k in nonfinite if any(t in k for t in TRAINING_KEYS)]
        watched = {k: [_finite(float(r[k])) for r in rows if k in r] for k in WATCHED}
    later = seconds[1:] or seconds
    out: Result = {
        "iterations_done": len(rows), "iterations_asked": iterations, "actor_device": str(actor_device),
        "seconds_per_iteration": [round(s, 3) for s in seconds],
        "mean_s_after_first": round(sum(later) / len(later), 3) if later else None,
        "metrics": watched, "nonfinite_keys": nonfinite, "nonfinite_training_keys": bad,
        "stop_reason": sess.stop_reason, "final_model_saved": final_saved, "summary": lines[-1] if lines else "",
    }
    # a health rule may stop a run early (reported as stop_reason); every recorded iteration must have trained
    out["pass"] = bool((len(rows) == iterations or sess.stop_reason) and rows and not bad
                       and actor_device.type == device.type and len(watched["actor/pg_loss"]) == len(rows)
                       and final_saved and result.iterations == len(rows))
    return out


ZERO_STAGES = (0, 1, 2, 3)
"""The DeepSpeed ZeRO stages the deepspeed check trains with."""


def check_deepspeed(device: torch.device, iterations: int) -> Result:
    """The session check with ``trainer.backend=deepspeed`` at each ZeRO stage (one process: a one-rank group,
    NCCL on CUDA, gloo on a CPU), against the torch trainer's session: each passes the session check, and the
    first iteration's gradient norms (same seed, same weights, same rollout, before any step) are the torch
    trainer's within 1e-3 relative."""
    out: Result = {"torch": check_session(device, iterations)}
    reference = out["torch"]["metrics"]
    ok = out["torch"]["pass"]
    for stage in ZERO_STAGES:
        name = f"zero{stage}"
        try:
            res = check_session(device, iterations, "trainer.backend=deepspeed", f"trainer.zero_stage={stage}")
        except Exception as exc:  # noqa: BLE001  # one stage's failure must not hide the others'
            traceback.print_exc()
            res = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
        if res.get("metrics"):
            diffs = {}
            for key in ("actor/grad_norm", "critic/grad_norm"):
                want, got = reference.get(key) or [], res["metrics"].get(key) or []
                if want and got and isinstance(want[0], float) and isinstance(got[0], float):
                    diffs[key] = abs(got[0] - want[0]) / max(abs(want[0]), 1e-12)
            res["first_grad_norm_rel_diff"] = diffs
            res["pass"] = bool(res["pass"] and diffs and all(v <= 1e-3 for v in diffs.values()))
        out[name] = res
        ok = ok and res["pass"]
    out["pass"] = ok
    return out


# --------------------------------------------------------------------------- d. bf16 autocast paths


def _autocast_outputs(model: torch.nn.Module, ids: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    """[logits, *trained gradients] of mean(logits²), under bf16 autocast on ids' device or in fp32."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids).logits  # [B, T, V]
    logits.float().pow(2).mean().backward()
    grads = [p.grad.detach().float().clone() for p in model.parameters() if p.requires_grad and p.grad is not None]
    return [logits.detach().float(), *grads]


def _fused_lora_case(device: torch.device) -> Result:
    """The trainer's fused LoRA layers (trainer/lora_fused.py) against peft's own forward, both under bf16
    autocast on the device: each output's and gradient's error against fp32 (relative to its largest entry) at
    most 2x peft's (or 2e-2), and the fused path taken in every LoRA layer."""
    from ragen_core.models.tiny import tiny_random
    from ragen_core.trainer.lora_fused import fuse_lora_linears

    base, _ = tiny_random(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    plain = _to(_lora(base, targets, seed=5), device)
    fused = copy.deepcopy(plain)
    layers = fuse_lora_linears(fused)
    ids = torch.randint(0, 200, (3, 11), generator=torch.Generator().manual_seed(0)).to(device)
    exact = _autocast_outputs(copy.deepcopy(plain), ids, bf16=False)
    want = _autocast_outputs(plain, ids, bf16=True)
    calls = [0]
    original = torch.Tensor.addmm_

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(self, *args, **kwargs)

    torch.Tensor.addmm_ = counted  # type: ignore[method-assign]
    try:
        got = _autocast_outputs(fused, ids, bf16=True)
    finally:
        torch.Tensor.addmm_ = original  # type: ignore[method-assign]
    errors = []
    for g, w, e in zip(got, want, exact, strict=True):
        scale = float(e.abs().max()) + 1e-12
        errors.append((_max_abs(g, e) / scale, _max_abs(w, e) / scale))
    worst = max(errors, key=lambda pair: pair[0] / max(2 * pair[1], 2e-2))
    passed = (layers > 0 and calls[0] == layers and len(got) == len(want) > 1
              and all(fe <= max(2 * pe, 2e-2) for fe, pe in errors))
    return {"lora_layers": layers, "fused_calls": calls[0], "tensors": len(got),
            "worst_fused_err": worst[0], "its_peft_err": worst[1], "pass": passed}


def _logprobs_case(device: torch.device) -> Result:
    """losses.logprobs_and_entropy on bf16 logits on the device against log_softmax and the entropy of the same
    logits in fp32 (autograd): values within TOL, the gradient in bf16 within 1e-2 of the largest entry."""
    from ragen_core.algos import losses

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 75, 49152, generator=g)).to(torch.bfloat16).to(device)  # 300 positions
    labels = torch.randint(0, 49152, (4, 75), generator=g).to(device)
    w_lp, w_h = torch.randn(2, 4, 75, generator=g).to(device)
    ours = logits.clone().requires_grad_(True)
    lp, ent = losses.logprobs_and_entropy(ours, labels)
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    ref = logits.float().requires_grad_(True)
    logp = torch.log_softmax(ref, dim=-1)
    ref_lp = logp.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ((ref_lp * w_lp).sum() + (ref_ent * w_h).sum()).backward()
    assert ours.grad is not None and ref.grad is not None
    lp_diff, ent_diff = _max_abs(lp, ref_lp), _max_abs(ent, ref_ent)
    grad_rel = _max_abs(ours.grad.float(), ref.grad) / float(ref.grad.abs().max())
    passed = (lp.dtype == ent.dtype == torch.float32 and ours.grad.dtype == torch.bfloat16
              and lp_diff <= TOL and ent_diff <= TOL and grad_rel <= 1e-2)
    return {"logprob_max_diff": lp_diff, "entropy_max_diff": ent_diff, "grad_max_rel_diff": grad_rel,
            "pass": passed}


def _logprobs_timing(device: torch.device) -> Result:
    """Milliseconds of one forward and backward of losses.logprobs_and_entropy on bf16 logits at Qwen2.5's
    vocabulary (151,936), median of 5 after 2 warm-ups: as it runs on the device (in one piece off a CPU), in the
    pieces it takes on a CPU, and the plain autograd path on fp32 logits (log_softmax and the entropy). Reported,
    not judged."""
    from ragen_core.algos import losses

    positions = 2048 if device.type == "cuda" else 128
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(1, positions, 151936, generator=g)).to(torch.bfloat16).to(device)
    labels = torch.randint(0, 151936, (1, positions), generator=g).to(device)

    def ours() -> None:
        x = logits.clone().requires_grad_(True)
        lp, ent = losses.logprobs_and_entropy(x, labels)
        (lp.sum() + ent.sum()).backward()

    def plain() -> None:
        x = logits.clone().requires_grad_(True)
        logp = torch.log_softmax(x.float(), dim=-1)
        lp, ent = logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        (lp.sum() + ent.sum()).backward()

    def median_ms(fn: Callable[[], None]) -> float:
        times = []
        for i in range(7):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        return round(sorted(times)[len(times) // 2], 2)

    def cpu_pieces(x: torch.Tensor) -> list[slice]:  # the pieces a CPU works in, for x on any device
        return kept(torch.empty(()).expand(x.shape))  # a CPU tensor of x's shape that allocates nothing

    kept = losses._pieces
    out: Result = {"positions": positions, "vocab": 151936, "pieces_here": len(kept(logits)),
                   "as_is_ms": median_ms(ours)}
    losses._pieces = cpu_pieces  # type: ignore[assignment]
    try:
        out["cpu_pieces"] = len(cpu_pieces(logits))
        out["cpu_pieces_ms"] = median_ms(ours)
    finally:
        losses._pieces = kept  # type: ignore[assignment]
    out["plain_fp32_ms"] = median_ms(plain)
    return out


def check_bf16(device: torch.device) -> Result:
    out: Result = {"fused_lora": _fused_lora_case(device), "logprobs_entropy": _logprobs_case(device),
                   "logprobs_entropy_timing": _logprobs_timing(device)}
    out["pass"] = out["fused_lora"]["pass"] and out["logprobs_entropy"]["pass"]
    return out


# --------------------------------------------------------------------------- main


def _environment(device: torch.device) -> Result:
    env: Result = {"python": sys.version.split()[0], "torch": torch.__version__, "device": str(device),
                   "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    for name in ("transformers", "peft", "tokenizers", "numpy", "pydantic", "gymnasium"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001  # a missing package is reported, the checks that need it fail
            env[name] = f"missing: {type(exc).__name__}: {exc}"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device to check (default cuda; cpu runs it here)")
    parser.add_argument("--iterations", type=int, default=3, help="training iterations of the session check")
    parser.add_argument("--only", default="generator,forward,session,bf16", help="comma list of checks to run")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"pass": False, "error": "torch sees no CUDA device"}))
        return 1
    checks: dict[str, Callable[[], Result]] = {
        "generator": lambda: check_generator(device),
        "forward": lambda: check_forward(device),
        "session": lambda: check_session(device, args.iterations),
        "bf16": lambda: check_bf16(device),
        "deepspeed": lambda: check_deepspeed(device, args.iterations),
    }
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(checks))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {sorted(checks)}")
    results: Result = {}
    with tempfile.TemporaryDirectory() as data:
        os.environ["RAGEN_DATA_DIR"] = data  # models, runs: nothing outside this folder
        env = _environment(device)
        print(f"cuda_check: {json.dumps(env)}", flush=True)
        for name in wanted:
            started = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                results[name] = checks[name]()
            except Exception as exc:  # noqa: BLE001  # one broken check must not hide the others' results
                traceback.print_exc()
                results[name] = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
            results[name]["seconds"] = round(time.perf_counter() - started, 2)
            print(f"== {name}: {'pass' if results[name]['pass'] else 'FAIL'} "
                  f"({results[name]['seconds']} s)", flush=True)
        if device.type == "cuda":
            env["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    passed = all(r["pass"] for r in results.values())
    print(json.dumps({"pass": passed, "env": env, "checks": results}, default=str))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
