"""Config loading: defaults from SPEC, presets, extends, overrides, and every bad-input case."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ragen_core.config import (
    PRESETS,
    ConfigError,
    ExperimentConfig,
    field_docs,
    load_experiment,
    load_sweep,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_match_spec() -> None:
    cfg = ExperimentConfig()
    # SPEC §5: P=8, N=16, 5 turns, 5 actions/turn, 10/episode, T=1.0 train, 0.5 eval, 256 seeds from 123
    r = cfg.rollout
    assert (r.prompts_per_iter, r.responses_per_prompt, r.max_turns) == (8, 16, 5)
    assert (r.max_actions_per_turn, r.max_actions_per_episode, r.temperature) == (5, 10, 1.0)
    assert (cfg.eval.temperature, cfg.eval.seeds, cfg.eval.seed_start) == (0.5, 256, 123)
    # SPEC §4: gamma = lam = 1, dual clip 3, entropy 0.001, value clip 0.5, AdamW, lrs, grad clip
    a, t = cfg.algorithm, cfg.trainer
    assert (a.gamma, a.lam, a.dual_clip, a.entropy_coef, a.value_clip) == (1.0, 1.0, 3.0, 0.001, 0.5)
    assert (t.actor_lr, t.critic_lr, t.weight_decay, t.betas, t.grad_clip) == (1e-6, 1e-5, 0.01, (0.9, 0.999), 1.0)
    assert cfg.rollout.format_penalty == -0.1


def test_every_field_has_a_doc() -> None:
    docs = field_docs(ExperimentConfig)
    assert "rollout.prompts_per_iter" in docs
    assert all(docs.values()), [k for k, v in docs.items() if not v]


@pytest.mark.parametrize("preset,strategy,value,include_zero,kl,clip_high,algo", [
    ("starpo", "none", 1.0, True, 0.001, 0.2, "starpo"),
    ("starpo-s", "top_k", 0.25, True, 0.0, 0.28, "starpo-s"),
    ("grpo", "none", 1.0, True, 0.001, 0.2, "grpo"),
    ("starpo-s-snr", "top_p", 0.9, False, 0.0, 0.28, "starpo-s"),  # RAGEN-2's recommended filter
])
def test_presets(tmp_path, preset, strategy, value, include_zero, kl, clip_high, algo) -> None:
    cfg = load_experiment(write(tmp_path, f"preset: {preset}\n"))
    a = cfg.algorithm
    assert (a.filter_strategy, a.filter_value, a.filter_include_zero, a.kl_coef, a.clip_low, a.clip_high) == \
           (strategy, value, include_zero, kl, 0.2, clip_high)
    assert a.filter_metric == "reward_std" and a.filter_largest
    assert cfg.algo_tag == algo
    assert cfg.algorithm.uses_reference == (kl > 0)


def test_file_values_win_over_preset_and_overrides_win_over_file(tmp_path) -> None:
    p = write(tmp_path, "preset: starpo-s\nalgorithm: {filter_value: 0.5}\ntrainer: {iterations: 7}\n")
    overrides = ["trainer.iterations=3", "rollout.think=false", "env.name=FrozenLake", "env.params.size=6"]
    cfg = load_experiment(p, overrides)
    assert cfg.algorithm.filter_value == 0.5 and cfg.algorithm.clip_high == 0.28
    assert cfg.trainer.iterations == 3 and cfg.rollout.think is False
    assert cfg.env.params == {"size": 6}


def test_extends_merges_sections(tmp_path) -> None:
    write(tmp_path, "preset: starpo\nrollout: {max_turns: 3, prompts_per_iter: 4}\n", "base.yaml")
    cfg = load_experiment(write(tmp_path, "extends: base.yaml\nrollout: {max_turns: 2}\n"))
    assert cfg.rollout.max_turns == 2 and cfg.rollout.prompts_per_iter == 4 and cfg.preset == "starpo"


def test_extends_cycle_is_an_error(tmp_path) -> None:
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    with pytest.raises(ConfigError, match="cycle"):
        load_experiment(tmp_path / "a.yaml")


def test_derived_values_are_properties(tmp_path) -> None:
    cfg = load_experiment(write(tmp_path,
                                "rollout: {prompts_per_iter: 4, responses_per_prompt: 2}\ntrainer: {online_k: 3}\n"))
    assert cfg.prompts_per_rollout == 12 and cfg.trajectories_per_rollout == 24
    assert "prompts_per_rollout" not in {f.name for f in dataclasses.fields(cfg)}


# ---- every bad-config case names the key path -------------------------------------------

@pytest.mark.parametrize("text,needle", [
    ("rollout: {prompt_per_iter: 3}\n", "rollout.prompt_per_iter: unknown key; did you mean 'prompts_per_iter'?"),
    ("trainer: {iterations: three}\n", "trainer.iterations: expected an integer, got 'three'"),
    ("trainer: {iterations: 2.5}\n", "trainer.iterations: expected an integer"),
    ("rollout: {think: 1}\n", "rollout.think: expected true or false"),
    ("algorithm: {estimator: ppo}\n",
     "algorithm.estimator: 'ppo' is not allowed; choose one of ['gae', 'grpo', 'bilevel_gae', 'gigpo']"),
    ("rollout: {responses_per_prompt: -4}\n", "rollout.responses_per_prompt: -4 is out of range; must be >= 1"),
    ("algorithm: {filter_strategy: top_k, filter_value: 1.5}\n",
     "algorithm.filter_value: 1.5 is out of range for top_k (a fraction); must be <= 1.0"),
    ("algorithm: {keep_ratio: 0.5}\n", "algorithm.keep_ratio: replaced by algorithm.filter_value"),
    ("algorithm: {filter_mode: std_rev}\n", "algorithm.filter_mode: replaced by algorithm.filter_strategy"),
    ("preset: starpo-s\nrollout: {responses_per_prompt: 1}\n", "needs in-group std"),
    ("eval: {envs: [{name: Bandit, colour: red}]}\n", "eval.envs[0].colour: unknown key"),
    ("trainer: {betas: [0.9]}\n", "trainer.betas: expected a list of 2 values"),
    ("rollout: 3\n", "rollout: expected a mapping, got int"),
    ("preset: starpo-z\n", "preset: 'starpo-z' is not one of"),
    ("colour: blue\n", "colour: unknown key"),
    ("- a\n- b\n", "the top level must be a mapping"),
])
def test_bad_values_name_the_key_path(tmp_path, text, needle) -> None:
    with pytest.raises(ConfigError) as e:
        load_experiment(write(tmp_path, text))
    assert needle in str(e.value)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_experiment(tmp_path / "nope.yaml")


def test_malformed_yaml_reports_line(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"malformed YAML at line 3"):
        load_experiment(write(tmp_path, "rollout:\n  max_turns: [1, 2\n"))


@pytest.mark.parametrize("override,needle", [
    ("trainer.iterations", "expected key.path=value"),
    ("trainer..iterations=3", "expected key.path=value"),
    ("trainer.iteration=3", "trainer.iteration: unknown key; did you mean 'iterations'?"),
    ("trainer.iterations=-1", "trainer.iterations: -1 is out of range"),
])
def test_bad_overrides(tmp_path, override, needle) -> None:
    with pytest.raises(ConfigError) as e:
        load_experiment(write(tmp_path, "name: x\n"), [override])
    assert needle in str(e.value)


def test_group_size_one_with_filter_is_refused(tmp_path) -> None:
    # SPEC §4: a group of 1 has no in-group std, so the uncertainty filter is undefined
    with pytest.raises(ConfigError, match="responses_per_prompt"):
        load_experiment(write(tmp_path, "preset: starpo-s\nrollout: {responses_per_prompt: 1}\n"))
    cfg = load_experiment(write(tmp_path, "preset: starpo\nrollout: {responses_per_prompt: 1}\n"))
    assert cfg.rollout.responses_per_prompt == 1


def test_cross_field_checks(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.critic"):
        load_experiment(write(tmp_path, "algorithm: {estimator: gae, critic: none}\n"))
    with pytest.raises(ConfigError, match="max_actions_per_turn"):
        load_experiment(write(tmp_path, "rollout: {max_actions_per_turn: 6, max_actions_per_episode: 5}\n"))


def test_loading_does_not_mutate_presets(tmp_path) -> None:
    before = repr(PRESETS)
    load_experiment(write(tmp_path, "preset: starpo-s\nalgorithm: {filter_value: 0.5}\n"), ["algorithm.clip_high=0.3"])
    assert repr(PRESETS) == before


def test_to_dict_round_trips(tmp_path) -> None:
    cfg = load_experiment(write(tmp_path, "preset: starpo-s\neval: {envs: [{name: BanditRev}]}\n"))
    import yaml
    again = load_experiment(write(tmp_path, yaml.safe_dump(to_dict(cfg)), "again.yaml"))
    assert again == cfg


def test_sweep_loading(tmp_path) -> None:
    write(tmp_path, "preset: starpo-s\n", "base.yaml")
    s = load_sweep(write(tmp_path, "name: s\nbase: base.yaml\nknobs: {responses_per_prompt: [2, 4]}\n", "sw.yaml"))
    assert Path(s.base).exists() and s.knobs == {"responses_per_prompt": [2, 4]}
    with pytest.raises(ConfigError, match="base"):
        load_sweep(write(tmp_path, "name: s\nbase: missing.yaml\n", "bad.yaml"))


def test_shipped_experiments_load() -> None:
    files = sorted((ROOT / "experiments").glob("*.yaml"))
    assert files, "experiments/ must ship YAML files"
    for f in files:
        load_experiment(f)


def test_exponent_numbers_without_a_dot_are_numbers(tmp_path) -> None:
    # PyYAML follows YAML 1.1, where 1e-4 (no dot) is a string; a learning rate written that way is meant
    # as a number, on the command line and in a file alike. Other strings stay errors.
    cfg = load_experiment(write(tmp_path, "trainer: {critic_lr: 3E-5}\n"), ["trainer.actor_lr=1e-4"])
    assert cfg.trainer.actor_lr == 1e-4 and cfg.trainer.critic_lr == 3e-5
    for bad in ("fast", "1e", "e-4", "1e-4x"):
        with pytest.raises(ConfigError, match=r"trainer\.actor_lr: expected a number"):
            load_experiment(write(tmp_path, "name: x\n"), [f"trainer.actor_lr={bad}"])


# ---------------------------------------------------------------- bounded loading (tests/unit/config_corpus)


def test_modest_anchors_and_aliases_still_load(tmp_path) -> None:
    """The limits measure what aliases expand to; they do not forbid them."""
    text = ("x-shared: &lake {name: FrozenLake, params: {size: 5, p_frozen: 0.9}}\n"
            "env: *lake\neval: {envs: [*lake, {name: Bandit}]}\n")
    with pytest.raises(ConfigError, match="x-shared: unknown key"):  # an unknown section stays an error
        load_experiment(write(tmp_path, text))
    cfg = load_experiment(write(tmp_path, text.replace("x-shared: &lake", "env: &lake").replace("env: *lake\n", "")))
    assert cfg.env.params == {"size": 5, "p_frozen": 0.9} and cfg.eval.envs[0] == cfg.env


def test_the_alias_bomb_is_refused_in_milliseconds(tmp_path) -> None:
    import time

    rows = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    rows += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    path = write(tmp_path, "env:\n  name: Bandit\n  params:\n" + "".join(f"    {r}\n" for r in rows))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"aliases expand past 1,000,000"):
        load_experiment(path)
    assert time.perf_counter() - start < 5.0  # 9^9 lists expanded would take minutes and gigabytes


@pytest.mark.parametrize("override,needle", [
    ("trainer.actor_lr=.inf", "trainer.actor_lr: inf is not a finite number"),
    ("trainer.actor_lr=1e400", "trainer.actor_lr: '1e400' is not a finite number"),
    ("trainer.betas=[.nan, 0.9]", "trainer.betas[0]: nan is not a finite number"),
    ("trainer.betas=[0.9, 1.0]", "trainer.betas[1]: 1.0 is out of range"),
    ("trainer.deepspeed={bucket: .inf}", "trainer.deepspeed.bucket: inf is not a finite number"),
    ("trainer.seed=18446744073709551616", "trainer.seed: 18446744073709551616 is out of range"),
    ("env.name=NoSuchEnv", "env.name: unknown env 'NoSuchEnv'"),
    ("env.params.height=-5", "env.params.height: not a parameter of Bandit"),
    ("eval.envs=[{name: Sokoban, params: {height: -5}}]", "eval.envs[0].params.height: -5 is not allowed"),
    ("env.tag=a/b", "env.tag: 'a/b' cannot label metrics"),
    ("preset=[starpo]", "preset: ['starpo'] is not one of"),
    ("name=../../x", "name: bad run name '../../x'"),
    ("env.params.x=" + "[" * 40 + "]" * 40, "env.params.x: nested deeper than 32 levels"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, override, needle) -> None:
    with pytest.raises(ConfigError) as e:
        load_experiment(write(tmp_path, "name: x\n"), [override])
    assert needle in str(e.value)


def test_a_bad_env_parameter_is_refused_with_the_envs_own_check(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"env\.params\.results_per_page: 0 is not allowed"):
        load_experiment(write(tmp_path, "env: {name: WebShop, params: {results_per_page: 0}}\n"))
    with pytest.raises(ConfigError, match=r"env\.params: Countdown: min_numbers \(4\) exceeds max_numbers \(3\)"):
        load_experiment(write(tmp_path, "env: {name: Countdown, params: {min_numbers: 4, max_numbers: 3}}\n"))


def test_file_level_problems_name_the_file(tmp_path) -> None:
    (tmp_path / "bin.yaml").write_bytes(b"name: \xff\n")
    with pytest.raises(ConfigError, match=r"bin\.yaml: not UTF-8 text \(byte 6 is 0xff\)"):
        load_experiment(tmp_path / "bin.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_experiment(tmp_path)
    with pytest.raises(ConfigError, match=r"extends: expected the path of a YAML file, got ''"):
        load_experiment(write(tmp_path, 'extends: ""\n'))
    with pytest.raises(ConfigError, match=r"extends: '\.' is a directory"):
        load_experiment(write(tmp_path, "extends: .\n"))
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        load_experiment(write(tmp_path, "x: " + "[" * 50_000 + "]" * 50_000 + "\n"))
    with pytest.raises(ConfigError, match="at most 1,000,000"):
        load_experiment(write(tmp_path, "#" * 1_000_001))


def test_a_long_extends_chain_is_refused(tmp_path) -> None:
    for i in range(20):
        write(tmp_path, f"extends: e{i + 1}.yaml\n", f"e{i}.yaml")
    write(tmp_path, "name: end\n", "e20.yaml")
    with pytest.raises(ConfigError, match="extends: a chain of more than 16 files"):
        load_experiment(tmp_path / "e0.yaml")
    assert load_experiment(tmp_path / "e10.yaml").name == "end"


def test_a_sweep_name_follows_the_run_name_rule(tmp_path) -> None:
    write(tmp_path, "preset: starpo-s\n", "base.yaml")
    with pytest.raises(ConfigError, match=r"^name: bad run name '\.\./escape'"):
        load_sweep(write(tmp_path, "name: ../escape\nbase: base.yaml\n", "sw.yaml"))


def test_the_paper_scale_qwen_files_hold_the_papers_settings() -> None:
    # Qwen2.5-0.5B-Instruct as the paper trained it: full fine-tuning, actor lr 1e-6, critic lr 1e-5, no warm-up,
    # P x N = 8 x 16, 200 iterations; bf16 mixed precision and vLLM rollouts on the GPU
    from pathlib import Path

    from ragen_core.config import load_experiment
    from ragen_core.sweeps import plan_sweep

    root = Path(__file__).resolve().parents[2]
    for env in ("bandit", "sokoban", "frozenlake"):
        cfg = load_experiment(root / "experiments" / f"qwen-{env}-starpo-s.yaml")
        assert (cfg.model.name, cfg.model.lora_rank, cfg.model.warmup) == ("Qwen/Qwen2.5-0.5B-Instruct", 0, "none")
        assert (cfg.trainer.actor_lr, cfg.trainer.critic_lr, cfg.trainer.iterations) == (1e-6, 1e-5, 200)
        assert (cfg.rollout.prompts_per_iter, cfg.rollout.responses_per_prompt) == (8, 16)
        assert (cfg.trainer.precision, cfg.rollout.backend, cfg.preset) == ("bf16", "vllm", "starpo-s")
    study = plan_sweep(root / "studies" / "echo-trap-qwen.yaml")
    assert study.target == 18 and study.sweep.dispatch == "deployment"
    assert plan_sweep(root / "sweeps" / "table2-qwen.yaml").target == 6


def test_context_window_is_full_or_a_turn_count() -> None:
    smoke = ROOT / "experiments" / "smoke.yaml"
    default = load_experiment(smoke).rollout
    assert default.context_window == "full" and not default.per_turn_rows and default.generation_window is None
    two = load_experiment(smoke, ["rollout.context_window=2"]).rollout
    assert two.context_window == 2 and two.per_turn_rows and two.generation_window == 2
    windowed = load_experiment(smoke, ["rollout.window_turns=3"]).rollout
    assert not windowed.per_turn_rows and windowed.generation_window == 3
    for bad, message in (("0", "out of range; must be >= 1"), ("fulll", "expected 'full' or an integer"),
                         ("true", "expected 'full' or an integer"), ("1.5", "expected 'full' or an integer")):
        with pytest.raises(ConfigError, match=rf"^rollout\.context_window: .*{message}"):
            load_experiment(smoke, [f"rollout.context_window={bad}"])


def test_context_window_refuses_a_second_window_and_turn_level_estimators() -> None:
    smoke = ROOT / "experiments" / "smoke.yaml"
    with pytest.raises(ConfigError, match=r"^rollout\.window_turns: context_window=2 already sets"):
        load_experiment(smoke, ["rollout.context_window=2", "rollout.window_turns=2"])
    for extra in (["algorithm.estimator=gigpo", "algorithm.critic=none"], ["algorithm.estimator=bilevel_gae"],
                  ["rollout.reward_placement=turn"]):
        with pytest.raises(ConfigError, match=r"^rollout\.context_window: per-turn rows"):
            load_experiment(smoke, ["rollout.context_window=1", *extra])
    grpo = load_experiment(smoke, ["rollout.context_window=1", "algorithm.estimator=grpo", "algorithm.critic=none"])
    assert grpo.rollout.per_turn_rows
