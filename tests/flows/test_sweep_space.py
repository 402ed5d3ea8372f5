"""Sweep pieces without training: knob -> override translation (golden), sweep checks,
objectives, the results table, and the study bookkeeping that keeps each grid point to one run."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from ragen_core.config import ConfigError, load_experiment, load_sweep
from ragen_core.sweeps import (
    duplicate_of,
    knob_overrides,
    markdown_table,
    objective_value,
    plan_sweep,
    remaining_trials,
    requeue_interrupted,
    requeue_lost,
    run_cost,
    table_rows,
    trial_experiment,
    trial_overrides,
    write_table,
    yaml_value,
)
from ragen_core.trainer.warmup import warmup_key

ROOT = Path(__file__).resolve().parents[2]

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """The paper's batch: P = 8 prompts x N = 16 responses (SPEC §5), StarPO-S filter on."""
    path = tmp_path / "base.yaml"
    path.write_text("name: b\npreset: starpo-s\nmodel: {name: tiny-random}\n"
                    "rollout: {prompts_per_iter: 8, responses_per_prompt: 16}\neval: {every: 1}\n")
    return path


def sweep_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text("name: s\nbase: base.yaml\n" + body)
    return path


# ----------------------------------------------------------------------------- knobs (golden)


def test_responses_per_prompt_keeps_the_total_batch(base: Path) -> None:
    cfg = load_experiment(base)
    # total = 8 x 16 = 128, so N = 4 -> P = 128 / 4 = 32 and N = 32 -> P = 4 (Table 2 rows)
    assert knob_overrides("responses_per_prompt", 4, cfg) == [
        "rollout.prompts_per_iter=32", "rollout.responses_per_prompt=4"]
    assert knob_overrides("responses_per_prompt", 32, cfg) == [
        "rollout.prompts_per_iter=4", "rollout.responses_per_prompt=32"]
    # N = 1 -> P = 128; a group of one has no std, so the StarPO-S filter is switched off
    one = knob_overrides("responses_per_prompt", 1, cfg)
    assert one == ["rollout.prompts_per_iter=128", "rollout.responses_per_prompt=1",
                   "algorithm.filter_strategy=none", "algorithm.filter_value=1.0"]
    built = load_experiment(base, one)
    assert built.rollout.prompts_per_iter * built.rollout.responses_per_prompt == 128
    assert built.algorithm.filter_strategy == "none" and built.algorithm.kl_coef == 0.0  # rest of StarPO-S kept
    with pytest.raises(ConfigError, match="does not divide"):  # 128 % 3 = 2
        knob_overrides("responses_per_prompt", 3, cfg)


def test_actions_per_turn_sets_the_episode_budget_and_online_k_scales_the_prompts(base: Path) -> None:
    cfg = load_experiment(base)
    # Table 3: k actions per turn, 5k per episode (5 turns)
    assert knob_overrides("actions_per_turn", 3, cfg) == [
        "rollout.max_actions_per_turn=3", "rollout.max_actions_per_episode=15"]
    assert knob_overrides("online_k", 5, cfg) == ["trainer.online_k=5"]
    built = load_experiment(base, knob_overrides("online_k", 5, cfg))
    assert built.prompts_per_rollout == 8 * 5  # the config scales P by k (SPEC §5)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="positive integer"):
            knob_overrides("online_k", bad, cfg)


def test_trial_overrides_are_sweep_overrides_then_knobs_then_space_keys(base: Path) -> None:
    cfg = load_experiment(base, ["trainer.iterations=3"])
    params = {"algorithm.filter_value": 0.5, "responses_per_prompt": 8, "trainer.actor_lr": 1e-6,
              "rollout.think": False, "base": "ignored"}
    # sweep overrides first, then knobs, then space keys (later wins in load_experiment)
    assert trial_overrides(params, cfg, ["trainer.iterations=3"]) == [
        "trainer.iterations=3", "rollout.prompts_per_iter=16", "rollout.responses_per_prompt=8",
        "algorithm.filter_value=0.5", "trainer.actor_lr=1.0e-06", "rollout.think=false"]
    built = load_experiment(base, trial_overrides(params, cfg, ["trainer.iterations=3"]))
    assert built.trainer.actor_lr == 1e-6 and built.rollout.think is False and built.algorithm.filter_value == 0.5


@pytest.mark.parametrize("value", [1e-6, 0.25, 3, True, False, "none", "1e-6", None, "a b"])
def test_yaml_value_round_trips(value: object) -> None:
    import yaml

    assert yaml.safe_load(yaml_value(value)) == value


# ----------------------------------------------------------------------------- sweep checks


def test_a_grid_plan_runs_every_point_unless_n_trials_caps_it(base: Path, tmp_path: Path) -> None:
    plan = plan_sweep(sweep_file(tmp_path, "knobs: {responses_per_prompt: [1, 2, 4]}\n"
                                           "space: {algorithm.filter_value: [0.25, 0.5]}\n"))
    assert plan.grid == {"responses_per_prompt": [1, 2, 4], "algorithm.filter_value": [0.25, 0.5]}
    assert plan.target == 6 and plan.table_keys == ["responses_per_prompt"]
    path, overrides = trial_experiment(plan.sweep, {"responses_per_prompt": 2, "algorithm.filter_value": 0.5},
                                       plan.bases)
    assert Path(path) == base and overrides[-1] == "algorithm.filter_value=0.5"
    capped = plan_sweep(sweep_file(tmp_path, "knobs: {online_k: [1, 2, 5, 10]}\nn_trials: 2\n"))
    assert capped.target == 2


def test_several_bases_are_a_grid_dimension(base: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text("name: o\nextends: base.yaml\nenv: {name: FrozenLake}\n")
    plan = plan_sweep(sweep_file(tmp_path, "bases: [other.yaml]\nknobs: {actions_per_turn: [1, 2]}\n"))
    assert plan.grid == {"base": ["base", "other"], "actions_per_turn": [1, 2]} and plan.target == 4
    path, _ = trial_experiment(plan.sweep, {"base": "other", "actions_per_turn": 2}, plan.bases)
    assert Path(path) == other


@pytest.mark.parametrize(("body", "match"), [
    ("knobs: {responses_per_prompt: [3]}\n", "does not divide"),
    ("knobs: {turns: [1, 2]}\n", "unknown"),
    ("space: {algorithm.filter_value: {low: 0.1, high: 0.5}}\n", "needs a list of values or a range with a step"),
    ("sampler: tpe\nspace: {algorithm.filter_value: {low: 0.1, high: 0.5}}\n", "needs n_trials"),
    ("knobs: {online_k: [1, 2]}\ncost_objective: generated_tokens\n", "cannot prune a two-objective"),
    ("knobs: {responses_per_prompt: [2]}\nspace: {rollout.prompts_per_iter: [4]}\n", "set by the knob"),
    ("knobs: {online_k: [1]}\noverrides: [eval.every=0]\n", "eval.every = 0"),
    ("space: {algorithm.nope: [1, 2]}\n", "unknown key"),
    ("knobs: {online_k: [1, 1]}\n", "repeat"),
    ("\n", "at least one knob"),
])
def test_sweeps_that_cannot_run_are_refused(base: Path, tmp_path: Path, body: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_sweep(sweep_file(tmp_path, body))


def test_every_repository_sweep_file_has_a_header_and_plans() -> None:
    """Every file in sweeps/ is tried, so one that does not plan (a missing base experiment, a bad knob) does not
    hide another: the failure names each file with its reason."""
    files = sorted((ROOT / "sweeps").glob("*.yaml"))
    assert {f.name for f in files} >= {"smoke.yaml", "table2-responses-per-prompt.yaml",
                                       "table3-actions-per-turn.yaml", "online-k.yaml"}
    problems = [f"{f.name}: needs a header comment" for f in files if not f.read_text().startswith("#")]
    for f in files:
        try:
            target = plan_sweep(f).target
        except ConfigError as e:
            problems.append(f"{f.name}: {e}")
            continue
        if target < 1:
            problems.append(f"{f.name}: plans {target} trials")
    assert not problems, "sweep files that do not plan:\n" + "\n".join(problems)
    smoke = load_sweep(ROOT / "sweeps" / "smoke.yaml")
    assert plan_sweep(ROOT / "sweeps" / "smoke.yaml").target == 3 and smoke.sampler == "grid"


def test_the_cpu_actions_per_turn_rows_start_from_one_warmup() -> None:
    """Table 3 on a CPU: k changes the rollout (and the episode budget 5k) but not the warmed start."""
    f = ROOT / "sweeps" / "table3-sokoban-cpu.yaml"
    sweep = load_sweep(f)
    base = load_experiment(f.parent / sweep.base, sweep.overrides)
    rows = [load_experiment(f.parent / sweep.base, trial_overrides({"actions_per_turn": k}, base, sweep.overrides))
            for k in sweep.knobs["actions_per_turn"]]
    assert [(c.rollout.max_actions_per_turn, c.rollout.max_actions_per_episode) for c in rows] == \
           [(1, 5), (3, 15), (5, 25)]
    assert len({warmup_key(c, "fp") for c in rows}) == 1
    plain = load_experiment(f.parent / sweep.base, ["rollout.max_new_tokens=128"])  # the Sokoban experiments' own
    assert warmup_key(rows[0], "fp") == warmup_key(plain, "fp")


# ----------------------------------------------------------------------------- objectives


def test_objective_is_the_final_best_or_mean_area_of_the_validation_curve() -> None:
    curve = [(1, 0.2), (4, 0.3), (2, 0.5)]  # unsorted on purpose
    assert objective_value(curve, "final") == 0.3
    assert objective_value(curve, "best") == 0.5
    assert objective_value(curve, "best", "minimize") == 0.2
    # trapezoids: (2-1)(0.2+0.5)/2 = 0.35, (4-2)(0.5+0.3)/2 = 0.8; area 1.15 over span 3
    assert objective_value(curve, "auc") == pytest.approx(1.15 / 3)
    assert objective_value([(5, 0.7)], "auc") == 0.7
    with pytest.raises(ValueError, match="no validation values"):
        objective_value([], "final")


def test_run_cost_sums_generated_tokens_or_seconds_over_the_history() -> None:
    rows = [{"perf/generated_tokens": 100.0, "timing/rollout_s": 1.0, "timing/update_s": 2.0},
            {"perf/generated_tokens": 50.0, "timing/eval_s": 0.5}]
    assert run_cost(rows, "generated_tokens") == 150.0
    assert run_cost(rows, "seconds") == 3.5  # 1 + 2 + 0.5
    with pytest.raises(ValueError):
        run_cost(rows, "dollars")


# ----------------------------------------------------------------------------- results table


def fake_trial(number: int, state: str, params: dict, val: dict | None, value: float | None) -> SimpleNamespace:
    return SimpleNamespace(number=number, state=SimpleNamespace(name=state), params=params,
                           user_attrs={"val": val} if val is not None else {},
                           values=[value] if value is not None else None)


def test_table_has_a_row_per_knob_value_with_each_bases_success_as_in_table_2(tmp_path: Path) -> None:
    trials = [
        fake_trial(0, "COMPLETE", {"base": "sokoban", "responses_per_prompt": 4},
                   {"Sokoban": 0.207, "SokobanNewVocab": 0.254}, 0.207),
        fake_trial(1, "COMPLETE", {"base": "frozenlake", "responses_per_prompt": 4}, {"FrozenLake": 0.215}, 0.215),
        fake_trial(2, "COMPLETE", {"base": "sokoban", "responses_per_prompt": 1},
                   {"Sokoban": 0.195, "SokobanNewVocab": 0.223}, 0.195),
        fake_trial(3, "FAIL", {"base": "frozenlake", "responses_per_prompt": 1}, None, None),
        fake_trial(4, "COMPLETE", {"base": "frozenlake", "responses_per_prompt": 1}, {"FrozenLake": 0.125}, 0.125),
        fake_trial(5, "RUNNING", {"base": "sokoban", "responses_per_prompt": 8}, None, None),
    ]
    table = table_rows(trials, ["responses_per_prompt"], base_order=["sokoban", "frozenlake"])
    assert table.columns == ["responses_per_prompt", "Sokoban", "SokobanNewVocab", "FrozenLake",
                             "objective", "state", "trials"]
    assert table.success_columns == ["Sokoban", "SokobanNewVocab", "FrozenLake"]
    one, four = table.rows  # rows sorted by knob value; the RUNNING trial is left out
    assert one["responses_per_prompt"] == 1 and one["FrozenLake"] == 0.125 and one["trials"] == "2,4"
    assert one["objective"] == pytest.approx((0.125 + 0.195) / 2)  # mean over the row's bases
    assert four["Sokoban"] == 0.207 and four["state"] == "COMPLETE"
    md = markdown_table(table.rows, table.columns, table.success_columns)
    assert "| 1 | 19.5 | 22.3 | 12.5 |" in md  # percent with one decimal, like Table 2
    paths = write_table(table, tmp_path / "out", "t")
    assert paths["csv"].read_text().splitlines()[0] == ",".join(table.columns)
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_table_picks_the_best_complete_trial_per_row() -> None:
    trials = [fake_trial(0, "COMPLETE", {"online_k": 1, "lr": 1}, {"Bandit": 0.4}, 0.4),
              fake_trial(1, "COMPLETE", {"online_k": 1, "lr": 2}, {"Bandit": 0.9}, 0.9),
              fake_trial(2, "PRUNED", {"online_k": 2, "lr": 1}, {"Bandit": 0.1}, 0.1)]
    table = table_rows(trials, ["online_k"])
    assert [r["Bandit"] for r in table.rows] == [0.9, 0.1] and table.rows[0]["lr"] == "2"
    assert table.rows[1]["state"] == "PRUNED"
    table = table_rows([fake_trial(0, "FAIL", {"online_k": 1}, None, None)], ["online_k"])
    assert math.isnan(table.rows[0]["objective"])


# ----------------------------------------------------------------------------- one run per grid point


def grid_study() -> optuna.Study:
    return optuna.create_study(sampler=optuna.samplers.GridSampler({"k": [1, 2, 3]}, seed=0))


def test_remaining_trials_on_a_grid_count_running_points_and_requeue_a_lost_one() -> None:
    study = grid_study()
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 3
    a, b = study.ask(), study.ask()
    a.suggest_categorical("k", [1, 2, 3])
    b.suggest_categorical("k", [1, 2, 3])
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 1  # running trials cover their points
    study.tell(a, 0.5)
    study.tell(b, state=optuna.trial.TrialState.FAIL)
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 1  # a crashed point is not run again...
    failed = study.trials[1]
    study.add_trial(optuna.trial.create_trial(  # ...but a lost worker's point is queued once more
        state=optuna.trial.TrialState.WAITING, system_attrs={**failed.system_attrs, "failed_trial": 1}))
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 2
    assert remaining_trials(study, 2, grid={"k": [1, 2, 3]}) == 1  # n_trials below the grid size


def test_remaining_trials_counts_a_trial_still_drawing_its_point() -> None:
    """Another worker's trial between its creation and its sampler writing the grid point takes the
    last point: nothing is left to start (else this worker would start a duplicate of it)."""
    study = grid_study()
    for _ in range(2):
        study.ask().suggest_categorical("k", [1, 2, 3])
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 1
    study._storage.create_new_trial(study._study_id)  # what Study.ask does before GridSampler.before_trial
    assert "grid_id" not in study.trials[-1].system_attrs
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 0


def test_remaining_trials_without_a_grid_count_failed_attempts() -> None:
    study = optuna.create_study()
    for state in ("COMPLETE", "FAIL", "PRUNED"):
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState[state], value=0.1
                                                  if state != "FAIL" else None))
    assert remaining_trials(study, 5, grid=None) == 2  # failed attempts count, so a crash loop ends
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING,
                                              system_attrs={"failed_trial": 1}))
    # the queued retry replaces trial 1: 5 - 2 counted (0 and 2) = 3 to start, the retry among them
    assert remaining_trials(study, 5, grid=None) == 3


def test_duplicate_of_keeps_one_run_per_grid_point() -> None:
    study = grid_study()
    first = study.ask()
    first.suggest_categorical("k", [1, 2, 3])
    point = {key: study.trials[0].system_attrs[key] for key in ("grid_id", "search_space")}

    def same_point() -> int:  # a later trial given the same grid point (as a race would)
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, system_attrs=point))
        return study.trials[-1].number

    second = same_point()
    assert duplicate_of(study, first.number) is None  # the older running trial goes on
    assert duplicate_of(study, second) == 0  # the younger one steps aside
    study.tell(first, state=optuna.trial.TrialState.FAIL)
    assert duplicate_of(study, second) is None  # the old one failed: this one is the retry
    third = same_point()
    study.tell(second, 0.3)
    assert duplicate_of(study, third) == 1  # a finished run of the point always wins


def test_cli_refuses_a_bad_grid_point_before_training(base: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["sweep", str(sweep_file(tmp_path, "knobs: {responses_per_prompt: [4, 3]}\n"))])
    assert result.exit_code == 2
    assert "3 does not divide the fixed total batch" in " ".join(result.output.split())


def test_interrupted_trials_are_queued_again_once_per_interruption() -> None:
    study = grid_study()
    interrupted, crashed = study.ask(), study.ask()
    for t in (interrupted, crashed):
        t.suggest_categorical("k", [1, 2, 3])
    interrupted.set_user_attr("interrupted", "KeyboardInterrupt")
    study.tell(interrupted, state=optuna.trial.TrialState.FAIL)
    study.tell(crashed, state=optuna.trial.TrialState.FAIL)
    assert requeue_interrupted(study) == [0]  # a crash says the configuration fails: not again
    assert requeue_interrupted(study) == []  # queued once only
    waiting = study.trials[-1]
    assert waiting.state.name == "WAITING"
    assert waiting.system_attrs["grid_id"] == study.trials[0].system_attrs["grid_id"]
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 2  # the third point and the queued retry
    # the retry is interrupted too (a long run stopped at the end of two sessions): it is queued again
    retry = study.ask()
    assert retry.number == waiting.number
    retry.set_user_attr("interrupted", "KeyboardInterrupt")
    study.tell(retry, state=optuna.trial.TrialState.FAIL)
    assert requeue_interrupted(study) == [retry.number]
    assert study.trials[-1].system_attrs["retry_history"] == [0, retry.number]
    assert requeue_interrupted(study) == [] and requeue_interrupted(grid_study()) == []


def test_a_two_objective_table_has_a_cost_column() -> None:
    trials = [fake_trial(0, "COMPLETE", {"online_k": 1}, {"Bandit": 0.5}, 0.5),
              fake_trial(1, "COMPLETE", {"online_k": 2}, {"Bandit": 0.25}, 0.25)]
    trials[0].values, trials[1].values = [0.5, 1200.0], [0.25, 300.0]  # (success, generated tokens)
    table = table_rows(trials, ["online_k"], cost=True)
    assert table.columns == ["online_k", "Bandit", "objective", "cost", "state", "trials"]
    assert [(r["objective"], r["cost"]) for r in table.rows] == [(0.5, 1200.0), (0.25, 300.0)]


def test_every_row_says_what_it_cost(tmp_path: Path) -> None:
    trials = [fake_trial(0, "COMPLETE", {"online_k": 1}, {"Bandit": 0.5}, 0.5),
              fake_trial(1, "COMPLETE", {"online_k": 2}, {"Bandit": 0.25}, 0.25)]
    trials[0].user_attrs["cost"] = {"generated_tokens": 1000.0, "update_seconds": 3.0, "wall_seconds": 10.0}
    trials[1].user_attrs["cost"] = {"generated_tokens": 4000.0, "update_seconds": 9.0, "wall_seconds": 30.0}
    table = table_rows(trials, ["online_k"])
    assert table.columns == ["online_k", "Bandit", "objective", "tokens", "update_s", "wall_s", "state", "trials"]
    assert [(r["tokens"], r["update_s"], r["wall_s"]) for r in table.rows] == [(1000.0, 3.0, 10.0), (4000.0, 9.0, 30.0)]
    paths = write_table(table, tmp_path, "t")
    assert paths["cost_png"].read_bytes()[:4] == b"\x89PNG"  # success against generated tokens


def test_a_lost_trial_whose_retry_was_never_written_is_queued_once() -> None:
    """The heartbeat fails a silent worker's trial and writes its retry in a second step; when that write is
    lost, the trial has no mark and no retry: it is queued then, up to ``retries`` retries. Crashed, interrupted
    and skipped trials are not."""
    study = grid_study()
    lost, crashed = study.ask(), study.ask()
    for t in (lost, crashed):
        t.suggest_categorical("k", [1, 2, 3])
    crashed.set_user_attr("crashed", "RuntimeError: update exploded")
    study.tell(lost, state=optuna.trial.TrialState.FAIL)
    study.tell(crashed, state=optuna.trial.TrialState.FAIL)
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 1  # before: the lost point looks done
    assert requeue_lost(study, retries=0) == []  # a study without retries keeps it failed
    assert requeue_lost(study, retries=1) == [0]
    assert requeue_lost(study, retries=1) == []  # queued once
    waiting = study.trials[-1]
    assert waiting.state.name == "WAITING" and waiting.system_attrs["failed_trial"] == 0
    assert waiting.system_attrs["grid_id"] == study.trials[0].system_attrs["grid_id"]
    assert remaining_trials(study, 3, grid={"k": [1, 2, 3]}) == 2  # the third point and the retry
    retry = study.ask()  # the retry is lost the same way: it has had its one retry
    assert retry.number == waiting.number
    study.tell(retry, state=optuna.trial.TrialState.FAIL)
    assert requeue_lost(study, retries=1) == []
    assert requeue_lost(study, retries=2) == [retry.number]


def test_a_trial_that_raises_is_marked_crashed_and_not_queued_again(base: Path, tmp_path: Path) -> None:
    from ragen_core.sweeps.trials import run_worker

    plan = plan_sweep(sweep_file(tmp_path, f"knobs: {{responses_per_prompt: [4, 8]}}\nstorage: sqlite:///{tmp_path}/o.db\n"))
    url = f"sqlite:///{tmp_path}/o.db"

    def explode(parameters: dict) -> None:
        raise RuntimeError("update exploded")

    run_worker(plan, url, None, explode)
    study = optuna.load_study(study_name=plan.sweep.name, storage=url)
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    assert all(t.user_attrs["crashed"] == "RuntimeError: update exploded" for t in study.trials)
    assert requeue_lost(study, retries=3) == [] and remaining_trials(study, plan.target, plan.grid) == 0
