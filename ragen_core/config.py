"""Experiment configuration: small frozen dataclasses loaded from YAML (STYLE.md rule 5).

    cfg = load_experiment("experiments/bandit-starpo-s.yaml", overrides=["trainer.iterations=3"])

Resolution order (later wins): dataclass defaults ← ``preset`` ← ``extends`` file ←
the file itself ← ``--set`` overrides. Unknown keys, wrong types, bad enum values,
out-of-range or non-finite numbers, unknown envs and bad env parameters (each env is built
once, its constructor checks them) raise :class:`ConfigError` naming the full key path and
what is allowed; so do files that cannot be read as a bounded YAML document (over
``MAX_CONFIG_BYTES``, nested deeper than ``MAX_NESTING``, aliases expanding past
``MAX_EXPANDED``, not UTF-8, not a regular file). Loading raises nothing else, so a caller
can refuse a bad config before it writes anything. Defaults are the reference values of
SPEC.md §4–§5. Derived values are properties, never fields filled in later.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import reprlib
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "PRESETS",
    "AlgorithmConfig",
    "ConfigError",
    "DiagnosticsConfig",
    "EnvConfig",
    "EvalConfig",
    "ExperimentConfig",
    "HealthConfig",
    "ModelConfig",
    "RolloutConfig",
    "SweepConfig",
    "TrackingConfig",
    "TrainerConfig",
    "apply_overrides",
    "build_config",
    "check_run_name",
    "data_dir",
    "load_experiment",
    "load_sweep",
    "to_dict",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the key path and what is allowed."""


def data_dir() -> Path:
    """Where runs, models and databases go: ``$RAGEN_DATA_DIR`` (default ``./data``), absolute."""
    raw = os.environ.get("RAGEN_DATA_DIR", "").strip()  # unset or empty (e.g. a blank job variable): ./data
    return Path(raw or "data").expanduser().resolve()


def data_file(name: str) -> Path:
    """``$RAGEN_DATA_DIR/name``, the folder made if it is not there yet: a default SQLite database (MLflow's,
    Optuna's) goes there, and SQLite does not make the folder of a file it creates."""
    folder = data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


MAX_RUN_NAME = 200
"""Longest run name (a folder name: filesystems stop at 255 bytes)."""
MAX_NAME_PREFIX = 160
"""Longest experiment or sweep ``name``: runs are named ``<name>-<time>`` or ``<sweep>-tNNN-<time>``."""
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_run_name(name: object, key: str = "run name", max_chars: int = MAX_RUN_NAME) -> str:
    """``name`` when it can name a folder under ``$RAGEN_DATA_DIR/runs``, else a ConfigError naming ``key``.

    The one rule for every way a run gets its name (``--run-name``, the flow's ``run_name``, an experiment's or a
    sweep's ``name``, ``--resume``): letters, digits, '.', '_' and '-', starting with a letter or digit, so no name
    is a path ('/', '..'), hidden, an option ('-x') or a character a shell, URL or MLflow tag would mangle.
    """
    if not isinstance(name, str) or len(name) > max_chars or not _RUN_NAME.fullmatch(name):
        raise ConfigError(f"{key}: bad run name {_show(name)}: use a plain directory name (letters, digits, '.', "
                          f"'_' and '-', starting with a letter or digit; at most {max_chars} characters)")
    return name


def F(default: Any, doc: str, **bounds: float) -> Any:
    """A dataclass field with a one-line doc and optional numeric bounds (ge, gt, le, lt)."""
    meta = {"doc": doc, **bounds}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelConfig:
    """Which causal LM is trained and how."""

    name: str = F("smollm2-135m-instruct",
                  "model spec: 'smollm2-135m-instruct', 'tiny-random[:SEED]', a HF id or a local dir")
    dtype: Literal["float32", "bfloat16", "float16"] = F(
        "float32", "dtype of the loaded weights that are not trained (a LoRA base, the reference model); trained "
                   "weights are kept in float32 (trainer.precision sets the compute dtype). Only float32 is fast "
                   "on CPUs without AVX512/AMX")
    device: Literal["auto", "cpu", "cuda"] = F(
        "auto", "where the actor and critic live; auto picks cuda when available")
    warmup: Literal["none", "self_distill"] = F(
        "none", "format warm-up the run starts from (ragen model warmup; made once and cached): none, or "
                "self_distill (the model's own sampled thoughts put in the format)")
    warmup_steps: int = F(30, "supervised steps of the format warm-up (8 first-turn replies each, 4 per state)", ge=1)
    warmup_lr: float = F(2e-4, "AdamW learning rate of the format warm-up (full fine-tuning, decayed linearly to 0)",
                         gt=0.0)
    warmup_rollout: dict[str, Any] = F(
        {}, "rollout settings the format warm-up is built with instead of the run's (for example "
            "{max_actions_per_turn: 5, max_actions_per_episode: 10}: one warmed model shared by every row of an "
            "actions-per-turn sweep, so the rows start from the same weights, as the paper's do); empty: the run's")
    lora_rank: int = F(0, "LoRA rank; 0 means full fine-tuning (reference LoRA: 64)", ge=0)
    lora_alpha: int = F(64, "LoRA alpha", ge=1)
    lora_target: str = F("all-linear", "peft target_modules ('all-linear' or a comma list)")
    gradient_checkpointing: bool = F(False, "recompute activations in backward (~40% less memory)")
    max_length: int | None = F(None, "hard cap on sequence length; None uses the model's own limit", ge=16)


@dataclass(frozen=True)
class EnvConfig:
    """One environment: a registered name and its constructor parameters."""

    name: str = F("Bandit", "registered env name (see `ragen envs`)")
    params: dict[str, Any] = F({}, "keyword arguments passed to ragen_core.envs.make(name, **params)")
    tag: str | None = F(None, "label in metrics (env/<tag>/...); defaults to the name")

    @property
    def label(self) -> str:
        return self.tag or self.name


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (SPEC §5): fixed seeds, temperature 0.5, success and pass@N."""

    envs: tuple[EnvConfig, ...] = F((), "envs to evaluate; empty means the training env")
    seeds: int = F(256, "number of held-out seeds per env (reference: 256)", ge=1)
    seed_start: int = F(123, "first held-out seed (reference: 123)", ge=0)
    samples: int = F(1, "responses per held-out seed; pass@N uses N = samples", ge=1)
    temperature: float = F(0.5, "sampling temperature for evaluation", gt=0.0)
    every: int = F(10, "evaluate every N iterations (and after the last); 0 disables", ge=0)


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout design (SPEC §3, §5)."""

    prompts_per_iter: int = F(8, "P: prompt groups (initial states) per iteration", ge=1)
    responses_per_prompt: int = F(16, "N: responses (trajectories) per prompt group", ge=1)
    max_turns: int = F(5, "turns per episode", ge=1)
    max_actions_per_turn: int = F(5, "actions the model may give in one reply, separated by ||", ge=1)
    max_actions_per_episode: int = F(10, "action budget of a whole episode", ge=1)
    max_new_tokens: int = F(128, "new tokens per reply", ge=1)
    temperature: float = F(1.0, "sampling temperature for training rollouts", gt=0.0)
    top_p: float = F(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    think: bool = F(True, "ask for <think>..</think><answer>..</answer>; False is the NoThink variant (<answer> only)")
    prefill: bool = F(True, "end every generation prompt with <think> (<answer> in NoThink) as untrained context, "
                            "as the reference does; False lets the model open the tag itself")
    format_penalty: float = F(
        -0.1, "added to a turn's reward when its reply does not parse or names no/unknown actions", le=0.0)
    format_reward: float = F(0.0, "optional partial credit added for a reply that parses (0 disables)", ge=0.0)
    reward_placement: Literal["auto", "last", "turn"] = F(
        "auto", "trajectory reward on the last generated token, or each turn's on that turn's last token; "
                "auto: per turn under algorithm.estimator=bilevel_gae (the reference's), else last")
    group_dynamics: Literal["shared", "independent"] = F(
        "shared", "shared: the N members of a group reset with the same seed and share the env's random draws "
                  "(bandit payouts, ice slips), as the reference; independent: each member draws its own")
    window_turns: int | None = F(None, "keep only the last k turns in the prompt; None keeps all", ge=1)
    context_window: Literal["full"] | int = F(
        "full", "full: one training row per trajectory (all its replies trained); K: one row per turn, its prompt "
                "the system/instruction and the last K turns counting its own (K=1: no history), the loss on that "
                "turn's reply, and generation sees the same K turns (RAGEN-2's limited_multi_turn)", ge=1)
    max_context_tokens: int | None = F(None, "context cap for rollouts; None uses the model's limit", ge=16)
    backend: Literal["hf", "vllm"] = F("hf", "generation backend")
    cache_reuse: bool = F(True, "hf backend: keep each episode's KV cache across turns")
    fast_decode: bool = F(True, "hf backend: prefill and decode Llama-family models with ragen's own step on "
                                "oneDNN-packed weights, LoRA merged (decode ~1.4x faster on CPU at 64 rows; "
                                "log-probs equal model.forward's to float rounding); false: model.forward")
    vllm_gpu_memory: float | None = F(
        None, "vllm backend on CUDA: share of the GPU's memory its engine may take (the trainer needs the rest; "
              "vLLM's own default, 0.9, leaves it none); None: sized from the model and the card (the weights, the "
              "KV cache of one rollout batch at full context, 1 GiB more), at most 0.9", gt=0, le=1)
    vllm_lora: Literal["adapter", "merged"] = F(
        "adapter", "vllm backend with LoRA: serve the trained adapters through vLLM's LoRA support (the base is "
                   "loaded once; each sync sends the adapters), or merge them into a full copy sent every sync")
    vllm_sleep: bool = F(False, "vllm backend on CUDA: put the engine to sleep around each update (its weights "
                                "and KV cache leave the GPU while the trainer runs)")
    system_prompt: str = F(
        "You're a helpful assistant. You always respond by giving your reasoning and then your answer.",
        "system message of every dialogue",
    )

    def __post_init__(self) -> None:
        if self.per_turn_rows and self.window_turns is not None:
            raise ConfigError(f"window_turns: context_window={self.context_window} already sets the generation "
                              "window (the last K turns); leave window_turns unset")

    @property
    def per_turn_rows(self) -> bool:
        """Whether each turn is its own training row (``context_window`` K) rather than each trajectory."""
        return self.context_window != "full"

    @property
    def generation_window(self) -> int | None:
        """The turns a generation prompt keeps (its own included): ``context_window`` K, else ``window_turns``."""
        return self.context_window if isinstance(self.context_window, int) else self.window_turns


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimator, losses, KL and the StarPO-S filter (SPEC §4)."""

    estimator: Literal["gae", "grpo", "bilevel_gae", "gigpo"] = F(
        "gae", "advantage estimator (gigpo: GRPO's episode advantage plus a step advantage over turns that acted on "
               "the same state)")
    gamma: float = F(1.0, "token-level discount (reference 1.0)", ge=0.0, le=1.0)
    lam: float = F(1.0, "token-level GAE lambda (reference 1.0)", ge=0.0, le=1.0)
    turn_gamma: float = F(0.95, "turn-level discount of the bi-level GAE (reference 0.95)", ge=0.0, le=1.0)
    turn_lam: float | None = F(None, "turn-level lambda of the bi-level GAE; None reuses lam (the reference's)",
                               ge=0.0, le=1.0)
    gigpo_omega: float = F(1.0, "gigpo: weight of the step advantage added to the episode advantage", ge=0.0)
    gigpo_gamma: float = F(0.95, "gigpo: discount of the turn rewards in each turn's return-to-go", ge=0.0, le=1.0)
    gigpo_step_norm: Literal["std", "mean"] = F(
        "std", "gigpo: a turn's return-to-go minus its step group's mean, divided by the group's std (std) or not "
               "(mean)")
    whiten_advantages: bool = F(True, "whiten advantages over the loss mask (PPO)")
    clip_low: float = F(0.2, "epsilon_low of ratio clipping", gt=0.0, lt=1.0)
    clip_high: float = F(0.2, "epsilon_high of ratio clipping (0.28 = clip-higher)", gt=0.0)
    dual_clip: float = F(3.0, "dual-clip constant for negative advantages (> 1)", gt=1.0)
    entropy_coef: float = F(0.001, "entropy bonus coefficient", ge=0.0)
    kl_coef: float = F(0.001, "KL-to-reference coefficient; 0 disables the reference model entirely", ge=0.0)
    kl_estimator: Literal["k1", "k3"] = F("k1", "KL estimator")
    kl_in_reward: bool = F(False, "put the KL penalty in the reward instead of the loss")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = F(
        "seq-mean-token-mean", "aggregation of the policy, entropy and value losses: seq-mean-token-mean is the "
                               "paper's objective (mean over a trajectory's tokens, then over trajectories)")
    value_clip: float = F(0.5, "clip range of the value loss", gt=0.0)
    value_coef: float = F(0.5, "weight of the value loss when the critic is a head on the actor (one shared backward)",
                          ge=0.0)
    critic: Literal["separate", "head", "none"] = F(
        "separate", "critic: a separate model, a value head on the actor, or none (grpo, gigpo: a critic beside them "
                    "only learns returns, as a diagnostic)")
    filter_strategy: Literal["none", "top_k", "top_k_abs", "top_p", "min_p"] = F(
        "none", "which prompt groups to train on (algos.filtering.select_groups): none (all), top_k (a fraction "
                "of P: StarPO-S 0.25), top_k_abs (a count), top_p (RAGEN-2's nucleus), min_p")
    filter_value: float = F(1.0, "the strategy's value: top_k fraction, top_k_abs count, top_p mass, min_p factor",
                            gt=0.0)
    filter_metric: Literal["reward_std", "reward_mean", "entropy", "entropy_std", "length"] = F(
        "reward_std", "the group score ranked: in-group reward std (StarPO-S, RAGEN-2), reward mean, mean or std of "
                      "trajectories' entropy (mean -log p of their sampled tokens), mean response length")
    filter_largest: bool = F(True, "keep the highest scores; false keeps the lowest (the paper's std_rev ablation)")
    filter_include_zero: bool = F(True, "false drops zero-score groups first (RAGEN-2); if none is left the "
                                        "iteration skips its update")
    filter_top_p_mode: Literal["linear", "softmax"] = F("linear", "top_p: running sum of scores, or softmax mass")
    filter_eps: float = F(0.01, "top_p linear: the threshold is value x total - eps", ge=0.0)
    filter_adv_scale: Literal["none", "linear", "sqrt"] = F(
        "none", "multiply advantages by the kept fraction of groups (linear) or its square root")
    filter_on: Literal["return", "total"] = F(
        "return", "what the filter's in-group std is taken of: return = raw env return (penalties excluded); "
                  "total = env return + format penalties, group-normalised under grpo and gigpo (the "
                  "reference's)")
    old_logprobs: Literal["rollout", "recompute"] = F(
        "rollout", "PPO's old log-probs: the rollout engine's (as sampled), or the trainer's own, recomputed by one "
                   "forward before the update (vLLM and the trainer differ in kernels and precision)")
    tis_cap: float | None = F(None, "truncated importance sampling: weight each token's policy loss by "
                                    "min(pi_trainer / pi_rollout, cap); needs old_logprobs recompute; None: off",
                              ge=1.0)

    def __post_init__(self) -> None:
        if self.tis_cap is not None and self.old_logprobs != "recompute":
            raise ConfigError("tis_cap: truncated importance sampling weighs the trainer's log-probs against the "
                              "rollout's; set algorithm.old_logprobs=recompute")

    @property
    def filters(self) -> bool:
        """Whether the group filter can drop anything (top_p at 1.0 with zero groups kept keeps all)."""
        keeps_all = self.filter_strategy == "none" or (
            self.filter_strategy == "top_p" and self.filter_value >= 1.0 and self.filter_include_zero)
        return not keeps_all

    @property
    def turn_lambda(self) -> float:
        """The bi-level GAE's turn-level lambda: ``turn_lam``, else ``lam`` (SPEC §4)."""
        return self.lam if self.turn_lam is None else self.turn_lam

    @property
    def uses_reference(self) -> bool:
        """A reference policy forward pass is needed only when KL is on (SPEC §4)."""
        return self.kl_coef > 0.0

    @property
    def gradient_reads_reference(self) -> bool:
        """Whether the update's gradient depends on the reference log-probs: the KL in the reward, or the k3
        estimator in the loss. k1 in the loss, kl_coef·(log π − log π_ref), differentiates to kl_coef·∇log π:
        the reference log-prob is a constant there and only changes the logged ``actor/kl_ref``."""
        return self.uses_reference and (self.kl_in_reward or self.kl_estimator != "k1")


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation and run control (SPEC §4 reference hyper-parameters)."""

    iterations: int = F(200, "training iterations (rollout + update)", ge=1)
    actor_lr: float = F(1e-6, "actor learning rate (LoRA multiplies it by lora_lr_multiplier)", gt=0.0)
    critic_lr: float = F(1e-5, "critic learning rate", gt=0.0)
    lora_lr_multiplier: float = F(10.0, "learning-rate multiplier under LoRA", gt=0.0)
    weight_decay: float = F(0.01, "AdamW weight decay", ge=0.0)
    betas: tuple[float, float] = F((0.9, 0.999), "AdamW betas")
    grad_clip: float = F(1.0, "max global gradient norm", gt=0.0)
    online_k: int = F(1, "Online-k: one rollout of k·P groups feeds k mini-batches (P is scaled by k, SPEC §5)", ge=1)
    mini_batch_rows: int | None = F(32, "trajectories per PPO mini-batch, one optimizer step each (reference 32: "
                                        "vanilla 8x16 takes 4 steps, StarPO-S 1); None: online_k equal mini-batches",
                                    ge=1)
    ppo_epochs: int = F(1, "passes over each mini-batch", ge=1)
    micro_batch_size: int = F(4, "at most this many trajectories per forward/backward (token-mean stays exact)",
                              ge=1)
    micro_batch_tokens: int | None = F(512, "at most this many token positions per forward/backward, padding "
                                            "included and a prompt group's shared prefix counted once: bounds "
                                            "the update's activation memory (a longer row goes alone); None: "
                                            "rows only", ge=1)
    logprob_chunk: int = F(128, "sequence chunk for log-prob/entropy to bound logits memory", ge=1)
    backend: Literal["torch", "deepspeed"] = F("torch", "training backend")
    zero_stage: int = F(0, "DeepSpeed ZeRO stage", ge=0, le=3)
    deepspeed: dict[str, Any] = F({}, "more DeepSpeed config, merged into ragen's (e.g. zero_optimization: "
                                      "{stage3_param_persistence_threshold: 0}); batch, accumulation, clipping, "
                                      "optimizer, precision and the stage come from ragen's own settings")
    seed: int = F(0, "seed for env seeds, sampling and initialisation", ge=0)
    checkpoint_every: int = F(10, "save a checkpoint every N iterations (and at the end); 0 disables", ge=0)
    threads: int | None = F(None, "torch CPU threads; None keeps torch's default", ge=1)
    stall_seconds: int = F(
        3600, "a run whose steps and rollout turns report no progress for this long writes every thread's traceback "
        "to stderr and exits with status 1 (a hung collective or filesystem: a study retries it from its "
        "checkpoint); 0 disables", ge=0)
    precision: Literal["fp32", "bf16", "auto"] = F(
        "fp32", "fp32, or bf16 mixed precision: forwards (and so backwards) under bf16 autocast, while the trained "
                "weights and the optimizer state stay fp32 (master weights), whatever model.dtype is; auto: bf16 "
                "on a CPU that multiplies bf16 natively (AVX512-BF16 or AMX), fp32 elsewhere (on CUDA: fp32 "
                "with trainer.tf32). Rollouts sample in it too: the hf backend, and vLLM on CUDA or on a CPU that "
                "multiplies bf16 natively")
    tf32: bool = F(True, "CUDA: fp32 matmuls on TF32 tensor cores (no effect on the CPU)")

    def __post_init__(self) -> None:
        for i, beta in enumerate(self.betas):  # AdamW refuses others, but only once the run has started
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"betas[{i}]: {beta!r} is out of range; AdamW needs 0 <= beta < 1")


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow tracking."""

    backend: Literal["mlflow", "none"] = F("mlflow", "where metrics go")
    uri: str | None = F(None, "tracking URI; None means sqlite:///$RAGEN_DATA_DIR/mlflow.db")
    experiment: str | None = F(None, "MLflow experiment name; None: one per env family, ragen-<family> "
                                     "(ragen-Bandit, ragen-Sokoban, ...)")
    sample_trajectories: int = F(4, "trajectories logged as readable text each logged iteration", ge=0)
    artifact_every: int = F(10, "log samples and the Parquet shard every N iterations; 0 disables", ge=0)


@dataclass(frozen=True)
class HealthConfig:
    """Echo-Trap (collapse) monitor, RAGEN §4: reward std and entropy fall first, then grad norm spikes."""

    action: Literal["warn", "stop", "off"] = F("warn", "what to do when collapse is detected")
    baseline_iters: int = F(5, "iterations that define the early-run level", ge=1)
    std_drop: float = F(0.3, "warn when in-group reward std falls below this fraction of its early level",
                        gt=0.0, le=1.0)
    entropy_drop: float = F(0.5, "warn when entropy falls below this fraction of its early level", gt=0.0, le=1.0)
    grad_z: float = F(4.0, "a grad-norm z-score above this counts as a spike", gt=0.0)
    patience: int = F(3, "consecutive unhealthy iterations before acting", ge=1)
    level_drop: float | None = F(0.1, "level term: the early signs count only while training success (mean of the "
                                      "last `patience` iterations) is at least this far below its best such mean, "
                                      "so a run converged at its best does not warn; null: at any level",
                                 ge=0.0, le=1.0)
    # RAGEN-2's early-stop rules and the template-collapse rule (tracking/early_stop.py, SPEC §8)
    std_rule: Literal["warn", "stop", "off"] = F("warn", "reward std under std_rule_frac of its early mean for "
                                                         "std_rule_patience iterations")
    std_rule_frac: float = F(0.1, "fraction of the early reward std (RAGEN-2: 10%)", gt=0.0, le=1.0)
    std_rule_baseline: int = F(10, "iterations that define the early reward std (RAGEN-2: 10)", ge=1)
    std_rule_patience: int = F(10, "iterations in a row (RAGEN-2: 10)", ge=1)
    val_rule: Literal["warn", "stop", "off"] = F("warn", "validation success under val_rule_threshold for "
                                                         "val_rule_patience validations")
    val_rule_threshold: float = F(0.01, "validation success threshold (RAGEN-2: 1%)", ge=0.0, le=1.0)
    val_rule_patience: int = F(5, "validations in a row (RAGEN-2: 5)", ge=1)
    empty_rule: Literal["warn", "stop", "off"] = F("warn", "the filter kept nothing for empty_rule_patience iterations")
    empty_rule_patience: int = F(5, "iterations in a row (RAGEN-2: 5)", ge=1)
    template_rule: Literal["warn", "stop", "off"] = F("warn", "template collapse: first-turn MI falls while "
                                                              "entropy holds (needs diagnostics.collapse_every)")
    template_mi_frac: float = F(0.3, "MI under this fraction of its early level is a signal", gt=0.0, le=1.0)
    template_mi_floor: float = F(0.05, "MI under this fraction of log N is a signal", ge=0.0, le=1.0)
    template_entropy_hold: float = F(0.7, "entropy still at this fraction of its early level (it 'holds')",
                                     ge=0.0, le=1.0)
    template_baseline: int = F(3, "MI measurements that define its early level", ge=1)
    template_patience: int = F(2, "MI measurements in a row", ge=1)


@dataclass(frozen=True)
class DiagnosticsConfig:
    """Template-collapse diagnostics (SPEC §8; RAGEN-2): MI between prompts and reasonings, in-batch."""

    collapse_every: int = F(5, "measure every N iterations (and at the first); 0 disables", ge=0)
    collapse_samples: int = F(32, "most first-turn reasonings scored per measurement (a seeded draw)", ge=2)
    collapse_later_samples: int = F(8, "most later-turn reasonings scored (one drawn turn per drawn trajectory); "
                                       "0 skips later turns", ge=0)
    collapse_ema: float = F(0.9, "decay of the EMA of the marginal std that normalises mi_zscore_ema", ge=0.0, lt=1.0)
    kl_every: int = F(5, "with the k1 KL in the loss (vanilla StarPO), whose gradient does not read the reference, "
                         "the reference forward runs only to log actor/kl_ref: every N iterations (and at the "
                         "first); 1 every iteration, 0 never", ge=0)
    grad_buckets_every: int = F(0, "RAGEN-2's gradient analysis: every N iterations (and at the first), the gradient "
                                   "norm of each loss term (task, entropy, kl, value) over the groups of each "
                                   "reward-std bucket of the unfiltered batch, logged as grad/<bucket>/<term>; "
                                   "0 disables", ge=0)
    grad_bucket_edges: tuple[float, ...] = F((0.2,), "in-group reward std edges of the buckets: 'zero' (std 0), "
                                                     "then (0, e1], (e1, e2], ..., (e_last, inf)")
    grad_bucket_rows: int = F(8, "most rows (whole groups, in batch order) per bucket: one forward and one backward "
                                 "per term each", ge=1)

    def __post_init__(self) -> None:
        edges = self.grad_bucket_edges
        if any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
            raise ConfigError(f"grad_bucket_edges: {list(edges)} must be positive and increasing")


PRESET_NAMES = ("starpo", "starpo-s", "grpo", "starpo-s-snr", "custom")


@dataclass(frozen=True)
class ExperimentConfig:
    """One training experiment: everything `ragen train` needs."""

    name: str = F("experiment", "the experiment's name (run tag `name`)")
    preset: Literal["starpo", "starpo-s", "grpo", "starpo-s-snr", "custom"] = F(
        "custom", "algorithm preset applied under the file's values (starpo-s-snr: RAGEN-2's top-p filter)")
    model: ModelConfig = F(ModelConfig(), "model")
    env: EnvConfig = F(EnvConfig(), "training environment")
    eval: EvalConfig = F(EvalConfig(), "held-out evaluation")
    rollout: RolloutConfig = F(RolloutConfig(), "rollout design")
    algorithm: AlgorithmConfig = F(AlgorithmConfig(), "estimator, losses and filter")
    trainer: TrainerConfig = F(TrainerConfig(), "optimisation and run control")
    tracking: TrackingConfig = F(TrackingConfig(), "MLflow tracking")
    health: HealthConfig = F(HealthConfig(), "collapse monitor")
    diagnostics: DiagnosticsConfig = F(DiagnosticsConfig(), "template-collapse diagnostics")

    def __post_init__(self) -> None:
        check_run_name(self.name, "name", MAX_NAME_PREFIX)  # runs are named <name>-<time>
        for key, env in (("env", self.env), *((f"eval.envs[{i}]", e) for i, e in enumerate(self.eval.envs))):
            _check_env(env, key)
        r, a = self.rollout, self.algorithm
        if a.filters and a.filter_metric.endswith("_std") and r.responses_per_prompt < 2:
            raise ConfigError(
                f"algorithm.filter_strategy: ranking groups by {a.filter_metric} needs in-group std, which a group of "
                f"rollout.responses_per_prompt={r.responses_per_prompt} does not have; set "
                "rollout.responses_per_prompt >= 2 or algorithm.filter_strategy=none"
            )
        if a.filter_strategy == "top_k" and a.filter_value > 1.0:
            raise ConfigError(f"algorithm.filter_value: {a.filter_value} is out of range for top_k (a fraction); "
                              "must be <= 1.0 (use top_k_abs for a count)")
        if a.estimator in ("grpo", "gigpo") and r.responses_per_prompt < 2:
            raise ConfigError(f"algorithm.estimator: {a.estimator} normalises within a group; "
                              "rollout.responses_per_prompt must be >= 2")
        if a.estimator in ("gae", "bilevel_gae") and a.critic == "none":
            raise ConfigError(f"algorithm.critic: estimator {a.estimator!r} needs a critic; use 'separate' or 'head'")
        self._check_per_turn_rows()
        if r.max_actions_per_turn > r.max_actions_per_episode:
            raise ConfigError(
                f"rollout.max_actions_per_turn ({r.max_actions_per_turn}) exceeds "
                f"rollout.max_actions_per_episode ({r.max_actions_per_episode})"
            )
        if self.model.warmup_rollout:
            _ = self.warmup_rollout_config  # validates the keys, types and bounds now, not when the warm-up starts
        if self.eval.seed_start + self.eval.seeds > 1_000_000:
            raise ConfigError("eval.seed_start: held-out seeds must stay below 1,000,000, where training seeds start")
        if self.diagnostics.grad_buckets_every and self.trainer.backend != "torch":
            raise ConfigError("diagnostics.grad_buckets_every: the gradient analysis takes each loss term's gradient "
                              "with torch.autograd; it needs trainer.backend=torch (DeepSpeed partitions them)")
        owned = sorted(set(self.trainer.deepspeed) & DEEPSPEED_OWNED_KEYS)
        if "stage" in (self.trainer.deepspeed.get("zero_optimization") or {}):
            owned.append("zero_optimization.stage")
        if owned:
            raise ConfigError(f"trainer.deepspeed: {', '.join(owned)} come from ragen's own settings "
                              "(micro_batch_size, grad_clip, zero_stage; AdamW in fp32); "
                              "remove them from trainer.deepspeed")

    def _check_per_turn_rows(self) -> None:
        """Per-turn rows carry their trajectory's return on their reply's last token (RAGEN-2's); the turn-level
        estimators and per-turn rewards need the whole trajectory in one row."""
        a = self.algorithm
        if self.rollout.per_turn_rows and (a.estimator in ("bilevel_gae", "gigpo") or self.reward_placement == "turn"):
            raise ConfigError(
                f"rollout.context_window: per-turn rows ({self.rollout.context_window}) give each turn its "
                f"trajectory's return; estimator {a.estimator!r} with reward placement {self.reward_placement!r} "
                "needs the whole trajectory in one row: use estimator gae or grpo with reward_placement last, or "
                "context_window full")

    @property
    def warmup_rollout_config(self) -> RolloutConfig:
        """The rollout settings the format warm-up is built with: ``rollout`` under ``model.warmup_rollout``."""
        if not self.model.warmup_rollout:
            return self.rollout
        merged = build_config(RolloutConfig, {**to_dict(self.rollout), **self.model.warmup_rollout},
                              "model.warmup_rollout")
        if merged.max_actions_per_turn > merged.max_actions_per_episode:
            raise ConfigError(f"model.warmup_rollout: max_actions_per_turn ({merged.max_actions_per_turn}) exceeds "
                              f"max_actions_per_episode ({merged.max_actions_per_episode})")
        return merged

    @property
    def algo_tag(self) -> str:
        """starpo | starpo-s | grpo | gigpo, for tracking tags (derived: a custom config is named by what it does)."""
        if self.algorithm.estimator in ("grpo", "gigpo"):
            return self.algorithm.estimator
        starpo_s = self.algorithm.filters and self.algorithm.kl_coef == 0.0
        return "starpo-s" if starpo_s else "starpo"

    @property
    def reward_placement(self) -> str:
        """last | turn: ``rollout.reward_placement``, with auto resolved by the estimator (SPEC §4)."""
        placement = self.rollout.reward_placement
        if placement == "auto":
            return "turn" if self.algorithm.estimator == "bilevel_gae" else "last"
        return placement

    @property
    def prompts_per_rollout(self) -> int:
        """Online-k: k mini-batches of P groups each come from one fresh rollout (SPEC §5)."""
        return self.rollout.prompts_per_iter * self.trainer.online_k

    @property
    def trajectories_per_rollout(self) -> int:
        return self.prompts_per_rollout * self.rollout.responses_per_prompt

    @property
    def eval_envs(self) -> tuple[EnvConfig, ...]:
        return self.eval.envs or (self.env,)


DEEPSPEED_OWNED_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation", "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16",
    "zero_allow_untested_optimizer"})
"""DeepSpeed config keys the engine sets itself (``trainer.deepspeed`` may not): its update math depends on them."""

# SPEC §4 presets: applied under the experiment file's own values.
PRESETS: dict[str, dict[str, Any]] = {
    "starpo": {"algorithm": {"estimator": "gae", "critic": "separate", "filter_strategy": "none", "filter_value": 1.0,
                             "kl_coef": 0.001, "clip_low": 0.2, "clip_high": 0.2}},
    "starpo-s": {"algorithm": {"estimator": "gae", "critic": "separate", "filter_strategy": "top_k",
                               "filter_value": 0.25, "filter_include_zero": True,
                               "kl_coef": 0.0, "clip_low": 0.2, "clip_high": 0.28}},
    "grpo": {"algorithm": {"estimator": "grpo", "critic": "none", "filter_strategy": "none", "filter_value": 1.0,
                           "kl_coef": 0.001, "clip_low": 0.2, "clip_high": 0.2}},
    # RAGEN-2's recommended SNR-aware filter (SPEC §8) on StarPO-S's other settings: top-p linear 0.9
    # over in-group reward std, zero-std groups dropped first.
    "starpo-s-snr": {"algorithm": {"estimator": "gae", "critic": "separate", "filter_strategy": "top_p",
                                   "filter_value": 0.9, "filter_top_p_mode": "linear", "filter_include_zero": False,
                                   "kl_coef": 0.0, "clip_low": 0.2, "clip_high": 0.28}},
    "custom": {},
}

RENAMED_KEYS: dict[str, str] = {
    "algorithm.filter_mode": "algorithm.filter_strategy (std -> top_k; std_rev -> top_k with "
                             "algorithm.filter_largest=false; none -> none)",
    "algorithm.keep_ratio": "algorithm.filter_value (the fraction kept under filter_strategy top_k)",
}
"""Keys a user is likely to write that this config says another way: the filter's parameter as docs/SPEC.md and
``algos.filtering.uncertainty_filter`` name it (``keep_ratio``, ``mode`` std / std_rev, the paper's
filter types). Each gets an error naming the key that sets it here, instead of a bare "unknown key"."""


@dataclass(frozen=True)
class SweepConfig:
    """An Optuna study over an experiment (flows/sweep.py)."""

    name: str = F("sweep", "study name")
    base: str = F("", "path of the base experiment YAML (relative to the sweep file)")
    overrides: tuple[str, ...] = F((), "key=value overrides applied to the base for every trial")
    space: dict[str, Any] = F({}, "search space: key -> list of choices, or {low, high, log, step}")
    knobs: dict[str, Any] = F(
        {}, "named paper knobs: responses_per_prompt, actions_per_turn, online_k -> list of values")
    objective: Literal["final", "best", "auc"] = F(
        "final", "validation success to optimise: final, best, or area under the curve")
    cost_objective: Literal["none", "generated_tokens", "seconds"] = F("none", "optional second objective (minimised)")
    direction: Literal["maximize", "minimize"] = F("maximize", "direction of the main objective")
    n_trials: int | None = F(None, "trials; None means the full grid for the grid sampler", ge=1)
    sampler: Literal["grid", "tpe", "random"] = F("grid", "Optuna sampler")
    pruner: Literal["median", "none"] = F("median", "prune on intermediate validation success")
    pruner_warmup: int = F(1, "evaluations before pruning may start", ge=0)
    storage: str | None = F(None, "SQLAlchemy URL; None means sqlite:///$RAGEN_DATA_DIR/optuna.db")
    heartbeat_seconds: int = F(30, "a trial whose worker is silent this long is marked FAIL", ge=1)
    seed: int = F(0, "sampler seed", ge=0)
    bases: tuple[str, ...] = F((), "further base experiments (relative to the sweep file): each setting runs on every "
                                   "base, a grid dimension named 'base'")
    metric: str = F("val/success",
                    "validation metric reported to Optuna per evaluation and optimised (a key of history.jsonl)")
    pruner_startup_trials: int = F(5, "finished trials before the pruner may stop one (Optuna's n_startup_trials)",
                                   ge=0)
    retries: int = F(1, "times a trial whose worker died (heartbeat lost) runs again as a new trial; an "
                        "interrupted trial (Ctrl-C, a termination signal) runs again each time. A retry continues "
                        "the lost trial's run from its last checkpoint when that run's folder is here", ge=0)
    prune_on_health: bool = F(True, "prune a trial whose run a health check stopped (health.* rules with "
                                    "action stop: Echo Trap, RAGEN-2's early stops, template collapse)")
    dispatch: Literal["local", "deployment"] = F(
        "local", "run trials in the sweep's worker processes, or as runs of a Prefect deployment")
    deployment: str = F("ragen-train-trial/ragen-train-trial",
                        "deployment (flow/deployment) of the trial flow (flows/train.py train_trial) used when "
                        "dispatch is deployment")
    pickup_timeout_s: int = F(900, "dispatch deployment: seconds a trial may wait for a worker while no run of the "
                                   "deployment is running anywhere; then the sweep stops and says so", ge=1)
    group_by: str | None = F(None, "a study (ragen study): aggregate the trials' runs by this parameter or tag "
                                   "(preset): mean and band over seeds, a table per group, the monitor judged")
    collapse_drop: float = F(0.15, "a study: a run collapsed when its validation success ended this far below "
                                   "its peak", gt=0.0, le=1.0)
    run_memory_gib: float | None = F(None, "a study on a CPU (ragen study without --workers): memory one run needs, "
                                           "GiB, to decide whether two run at a time; a larger peak its runs "
                                           "measured (perf/peak_rss_gib) wins; None: that peak, else 4", gt=0.0)
    carry: str | None = F(None, "a JSON Lines file (relative to the sweep file) that carries the study's finished "
                                "trials and their runs' tracking to another machine: rewritten after each trial, "
                                "read when the study starts (ragen_core/sweeps/carry.py); commit it to resume a "
                                "study elsewhere")

    def __post_init__(self) -> None:
        check_run_name(self.name, "name", MAX_NAME_PREFIX)  # data/sweeps/<name>, trials' runs <name>-tNNN-<time>


# --------------------------------------------------------------------------- loading

MAX_CONFIG_BYTES = 1_000_000
"""Largest experiment or sweep file (ours are ~1 kB): a bigger one is refused unread."""
MAX_NESTING = 32
"""Deepest nesting of mappings and lists in a file or ``--set`` value (ours: 4). PyYAML composes recursively, and
to_dict, _deep_merge and flatten_config recurse too: 50,000 levels were a RecursionError."""
MAX_EXPANDED = 1_000_000
"""Most YAML nodes plus scalar characters a document may hold with its aliases expanded. An alias is a second
reference to a node, so a 'billion laughs' file of 1 kB loads at once and only blows up (time, memory) when
to_dict, flatten_config or yaml.safe_dump walk it; counted on the node graph, it is refused before it is built."""
MAX_EXTENDS = 16
"""Longest chain of ``extends`` files."""


def load_experiment(path: str | os.PathLike[str], overrides: typing.Sequence[str] = ()) -> ExperimentConfig:
    """Read an experiment YAML (with ``preset`` and ``extends``) and apply ``a.b=c`` overrides.

    Every problem is a ConfigError naming the key or the file (module docstring); nothing is written.
    """
    raw = _read_with_extends(Path(path), seen=())
    raw = apply_overrides(raw, overrides)
    _check_finite(raw, "")
    preset = raw.get("preset", "custom")
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"preset: {_show(preset)} is not one of {list(PRESETS)}")
    return build_config(ExperimentConfig, _deep_merge(PRESETS[preset], raw))


def load_sweep(path: str | os.PathLike[str], overrides: typing.Sequence[str] = ()) -> SweepConfig:
    """Read a sweep YAML; ``base`` and ``carry`` are resolved relative to the sweep file."""
    p = Path(path)
    raw = apply_overrides(_read_yaml(p), overrides)
    _check_finite(raw, "")
    cfg = build_config(SweepConfig, raw)
    if not cfg.base:
        raise ConfigError("base: a sweep must name its base experiment YAML")
    base = (p.parent / cfg.base) if not Path(cfg.base).is_absolute() else Path(cfg.base)
    if not base.exists():
        base = Path(cfg.base)  # also accept a path relative to the working directory
    if not base.exists():
        raise ConfigError(f"base: experiment file {cfg.base!r} not found "
                          f"(looked beside {p} and in the working directory)")
    carry = None if cfg.carry is None else str(p.parent / cfg.carry) if not Path(cfg.carry).is_absolute() \
        else cfg.carry
    return dataclasses.replace(cfg, base=str(base), carry=carry)


class _YAMLLimit(Exception):
    """A document over one of :class:`_BoundedLoader`'s limits (the caller names the file or key)."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader with the document's shape bounded before any Python data is built from it.

    Nesting deeper than MAX_NESTING is refused while composing, before the composer's recursion gets deep;
    the composed node graph is then measured with its aliases expanded (:func:`_check_expanded`).
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                line = self.peek_event().start_mark.line + 1
                raise _YAMLLimit(f"nested deeper than {MAX_NESTING} levels (line {line})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _check_expanded(node)
        return node


def _check_expanded(root: yaml.Node) -> None:
    """_YAMLLimit when ``root`` with its aliases expanded exceeds MAX_EXPANDED or MAX_NESTING, or contains itself.

    Each distinct node is measured once (memoized by identity), so a bomb of nine aliases nine deep costs
    81 steps here instead of 9^9 later. Iterative: an alias chain can be deeper than Python's recursion limit.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()  # entered, children not finished: the ancestors of the node at hand
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        kids = _yaml_children(node)
        if finished:
            open_nodes.discard(key)
            chars = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            size[key] = 1 + chars + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            if size[key] > MAX_EXPANDED:
                raise _YAMLLimit(f"its aliases expand past {MAX_EXPANDED:,} nodes and characters "
                                 f"(line {node.start_mark.line + 1})")
            if depth[key] > MAX_NESTING:
                raise _YAMLLimit(f"its aliases nest deeper than {MAX_NESTING} levels (line {node.start_mark.line + 1})")
        elif key not in size:
            if key in open_nodes:
                raise _YAMLLimit(f"an alias refers to a node that contains it (line {node.start_mark.line + 1})")
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in kids)


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _parse_yaml(text: str) -> Any:
    """``text`` as bounded YAML; _YAMLLimit, yaml.YAMLError, or ValueError for a scalar PyYAML cannot build."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader: plain data only
    except OverflowError as e:  # e.g. a timestamp past year 9999
        raise ValueError(str(e)) from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line for a YAML error: what and where (PyYAML's own text spans lines and quotes the input)."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:  # a ReaderError (a control character): its own text says which and where
        return f"malformed YAML: {_one_line(str(e))}"
    problem = getattr(e, "problem", None) or type(e).__name__
    return f"malformed YAML at line {mark.line + 1}, column {mark.column + 1}: {_one_line(str(problem))}"


def _read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping; every way it can fail is a ConfigError naming the file."""
    text = _read_text(path)
    try:
        data = _parse_yaml(text)
    except _YAMLLimit as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_problem(e)}") from None
    except ValueError as e:  # a scalar PyYAML cannot build: a 5,000-digit integer, 2024-13-45
        raise ConfigError(f"{path}: {_one_line(str(e))}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _read_text(path: Path) -> str:
    """A config file's text: a regular file of at most MAX_CONFIG_BYTES of UTF-8, else a ConfigError naming it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise ConfigError(f"{path}: cannot read it ({_one_line(str(e))})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path}: is a directory, not a YAML file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO, a device: reading may never end
        raise ConfigError(f"{path}: not a regular file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {st.st_size:,} bytes; a config file may have at most {MAX_CONFIG_BYTES:,}")
    try:
        with path.open("rb") as fh:
            blob = fh.read(MAX_CONFIG_BYTES + 1)  # the size may have changed since stat
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({_one_line(str(e))})") from None
    if len(blob) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: more than {MAX_CONFIG_BYTES:,} bytes")
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is {blob[e.start]:#04x})") from None


def _read_with_extends(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve() if path.exists() else path
    if path in seen:
        raise ConfigError(f"extends: cycle through {path}")
    if len(seen) > MAX_EXTENDS:
        raise ConfigError(f"extends: a chain of more than {MAX_EXTENDS} files ({path})")
    data = _read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent.strip():
        raise ConfigError(f"extends: expected the path of a YAML file, got {_show(parent)} (in {path})")
    target = path.parent / parent
    if not target.is_file():  # said here, so the message names the key as well as the file
        why = "is a directory" if target.is_dir() else "is not a regular file" if target.exists() else "not found"
        raise ConfigError(f"extends: {_show(parent)} {why} (looked for {target}, from {path})")
    base = _read_with_extends(target, seen + (path,))
    return _deep_merge(base, data)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "params" else v
    return out


def _check_finite(data: Any, path: str) -> None:
    """ConfigError at the first inf or nan anywhere in ``data``, typed fields or not (``trainer.deepspeed``...)."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ConfigError(f"{path or '<root>'}: {data!r} is not a finite number")
    if isinstance(data, dict):
        for k, v in data.items():
            _check_finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            _check_finite(v, f"{path}[{i}]")


def apply_overrides(raw: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings (values parsed as YAML scalars/lists); returns a new dict."""
    out = _deep_merge({}, raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {_show(item)}: expected key.path=value")
        parts = key.split(".")
        if len(parts) > MAX_NESTING:
            raise ConfigError(f"override {_show(key)}: a key path of more than {MAX_NESTING} parts")
        try:
            value = _parse_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text  # not YAML: the text itself, a string
        except (_YAMLLimit, ValueError) as e:
            raise ConfigError(f"{key}: {_one_line(str(e))}") from None
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _check_env(env: EnvConfig, key: str) -> None:
    """ConfigError unless ``env`` names a registered env and its params build it (the env checks them).

    Building is cheap (envs make levels and catalogues lazily) and runs the env's own checks: its signature is
    its schema (envs/base.py), so a parameter is refused here as it would be at ``make``, before a run exists.
    """
    from pydantic import ValidationError

    from ragen_core.envs import env_spec, make  # lazily: `ragen --help` and the flows' imports stay light

    try:
        spec = env_spec(env.name)
    except KeyError as e:
        raise ConfigError(f"{key}.name: {e.args[0]}") from None
    if env.tag is not None and not _TAG.fullmatch(env.tag):
        raise ConfigError(f"{key}.tag: {_show(env.tag)} cannot label metrics (env/<tag>/...); use 1-64 letters, "
                          "digits, '.', '_' and '-'")
    for name in env.params:
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{key}.params: {_show(name)} is not a parameter name")
    try:
        make(env.name, **env.params)
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else "?"
        if first["type"] == "unexpected_keyword_argument":
            raise ConfigError(f"{key}.params.{param}: not a parameter of {spec.name} (it takes: "
                              f"{', '.join(_env_parameters(spec.entry_point))})") from None
        raise ConfigError(f"{key}.params.{param}: {_show(first.get('input'))} is not allowed: "
                          f"{first['msg'][:1].lower()}{first['msg'][1:]}") from None
    except (ValueError, TypeError) as e:  # the constructor's own cross-parameter checks
        raise ConfigError(f"{key}.params: {spec.name}: {_one_line(str(e))}") from None


_TAG = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _env_parameters(entry_point: str) -> list[str]:
    """The keyword parameters an env class takes (its signature), for error messages."""
    import importlib
    import inspect

    module, cls = entry_point.split(":")
    init = getattr(importlib.import_module(module), cls).__init__
    return [n for n, p in inspect.signature(init).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def build_config(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from plain data, checking keys, types and bounds."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<root>'}: expected a mapping, got {_tname(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        kpath = f"{path}.{key}" if path else str(key)
        if key not in fields:
            if cls is ExperimentConfig and key == "extends":
                continue
            if kpath in RENAMED_KEYS:
                raise ConfigError(f"{kpath}: replaced by {RENAMED_KEYS[kpath]}")
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{_show_key(kpath)}: unknown key{hint} (allowed: {', '.join(fields)})")
        kwargs[key] = _check_bounds(_coerce(hints[key], value, kpath), fields[key].metadata, kpath)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own checks name keys relative to it
        raise ConfigError(f"{path + '.' if path else ''}{e}") from None


_EXPONENT_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, path)
        return _coerce_either(inner, value, path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {_show(value)} is not allowed; choose one of {list(args)}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a schema names classes, never instances
        return build_config(tp, value, path)
    if origin is tuple:
        return _coerce_tuple(args, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_tname(value)}")
        return dict(value)
    return _coerce_scalar(tp, value, path)


def _coerce_either(members: list[Any], value: Any, path: str) -> Any:
    """``value`` as the first of a union's ``members`` that takes it (``"full" | int``), else one error naming them
    all."""
    for member in members:
        try:
            return _coerce(member, value, path)
        except ConfigError:
            continue
    allowed = " or ".join(_describe(m) for m in members)
    raise ConfigError(f"{path}: {_show(value)} is not allowed; expected {allowed}")


def _describe(tp: Any) -> str:
    """A union member as an error message names it: a literal's values, else the type's name."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce_tuple(args: tuple[Any, ...], value: Any, path: str) -> tuple[Any, ...]:
    """A YAML list as a tuple[X, ...] or a fixed-length tuple[X, Y], each item coerced."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list, got {_tname(value)}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"{path}: expected a list of {len(args)} values, got {len(value)}")
    return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))


def _coerce_scalar(tp: Any, value: Any, path: str) -> Any:
    """bool, int, float or str, checked strictly (a YAML true is no integer, 1 is no bool); numbers finite and
    integers within 64 bits (torch, numpy and SQLite take no more)."""
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_show(value)}")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"{path}: {_show(value)} is out of range; an integer must fit in 64 bits")
        return value
    if tp is float:
        return _coerce_float(value, path)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_show(value)}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")  # pragma: no cover - a schema bug


def _coerce_float(value: Any, path: str) -> float:
    """A finite float from a YAML number (or an exponent string: PyYAML, YAML 1.1, reads 1e-4 as one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{path}: expected a number, got {_show(value)}")
    if isinstance(value, str) and not _EXPONENT_NUMBER.fullmatch(value.strip()):
        raise ConfigError(f"{path}: expected a number, got {_show(value)}")
    try:
        number = float(value)  # an exponent string: 1e400 becomes inf, refused below
    except OverflowError:  # an integer of 309 digits or more
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{path}: {_show(value)} is not a finite number")
    return number


def _check_bounds(value: Any, meta: typing.Mapping[str, Any], path: str) -> Any:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    checks = {"ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"),
              "le": (lambda v, b: v <= b, "<="), "lt": (lambda v, b: v < b, "<")}
    for key, (ok, sym) in checks.items():
        if key in meta and not ok(value, meta[key]):
            raise ConfigError(f"{path}: {value!r} is out of range; must be {sym} {meta[key]}")
    return value


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


_SHORT = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 60, 60, 40
_SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxlevel = 6, 6, 4, 2


def _show(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut short (a message stays one readable line)."""
    try:
        return _one_line(_SHORT.repr(value))
    except ValueError:  # an integer of more than 4,300 digits has no repr
        return f"<{type(value).__name__}>"


def _show_key(path: str) -> str:
    """A key path as an error message names it, cut short when a file makes keys of kilobytes."""
    return _one_line(path if len(path) <= 120 else f"{path[:117]}...")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (tuples as lists), e.g. for YAML artifacts and params."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(cfg)


def field_docs(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted key -> one-line doc, for `ragen config` help and error messages."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_docs(hints[f.name], key + "."))
        else:
            out[key] = f.metadata.get("doc", "")
    return out


def documented_yaml(cfg: ExperimentConfig) -> str:
    """The resolved config as YAML, every field followed by its one-line doc as a comment (`ragen config show`).

    Sections are nested as in an experiment file; list and mapping values are written inline (flow style), so
    each field stays one line and its doc sits beside it. The output loads back with ``load_experiment``.
    """
    docs = field_docs(ExperimentConfig)

    def scalar(value: Any) -> str:
        text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10_000).strip()
        return text.removesuffix("\n...").removesuffix("...").strip()

    lines: list[str] = []

    def walk(data: dict[str, Any], prefix: str, indent: int) -> None:
        for key, value in data.items():
            path = f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, dict) and path not in docs:  # a section
                lines.append(f"{pad}{key}:")
                walk(value, path + ".", indent + 1)
                continue
            doc = docs.get(path, "")
            lines.append(f"{pad}{key}: {scalar(value)}" + (f"  # {doc}" if doc else ""))

    walk(to_dict(cfg), "", 0)
    return "\n".join(lines) + "\n"
