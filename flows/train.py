"""The training flow: per iteration (evaluate ->) rollout -> filter -> update -> record (-> checkpoint), each step a
Prefect task (tasks/train_steps.py) run by the one loop of ``ragen_core.session.run_to_end``.

    ragen train experiments/bandit-starpo-s.yaml --set trainer.iterations=20
    python -c "from flows.train import train; train('experiments/smoke.yaml')"

Runs in Prefect's ephemeral mode with nothing to start; with PREFECT_API_URL set it reports
to that server. Every run is one MLflow run (a resumed run continues it), which ends FINISHED,
FAILED (an exception) or KILLED (Ctrl-C, SIGTERM: a cancelled flow run) as the flow ends
(``closes_runs``, ragen_core/tracking/run_end.py). The same flow is the `ragen-train` deployment
of prefect.yaml; ``train_trial`` (flow and deployment `ragen-train-trial`) is the same run as a sweep trial.

Several processes (``nproc`` > 1, or under torchrun; trainer.backend deepspeed): this flow is rank 0, the
only one that logs and writes; flows/ranks.py starts (or joins) the others, which run the same loop
with the plain steps, without Prefect (ragen_core/session.py says how the steps share the work).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from prefect import flow
from prefect.exceptions import TerminationSignal
from prefect.runtime import deployment, flow_run

from flows import ranks
from flows._ui import Reporter, RunArtifacts
from ragen_core import cpu_share, distributed, gpus, session
from ragen_core.config import ConfigError, ExperimentConfig, check_run_name, load_experiment
from ragen_core.store.run_dir import RunDir
from ragen_core.tracking.factory import open_logger, tracking_uri
from ragen_core.tracking.run_end import closes_runs
from ragen_core.trainer.models import resolve_device
from tasks import train_steps as steps


@flow(name="ragen-train")
@closes_runs  # the logger opened below ends FINISHED, FAILED or KILLED as this flow does
def train(
    experiment: str | None = None,
    overrides: list[str] | None = None,
    resume: str | None = None,
    run_name: str | None = None,
    nproc: int = 1,
) -> session.TrainResult:
    """Train one experiment; ``resume`` continues a run (its saved config plus ``overrides``).

    ``nproc`` > 1: data-parallel processes on this machine, this one rank 0 (flows/ranks.py; ignored under
    torchrun, which says how many). A sweep's trials run :func:`train_trial`, which takes the sweep's own
    parameters too, so this flow's deployment form holds only what a person sets.
    """
    return _start(experiment, list(overrides or []), resume, run_name, nproc)


@flow(name="ragen-train-trial")
@closes_runs
def train_trial(
    experiment: str,
    overrides: list[str] | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    trial: dict[str, Any] | None = None,
    resume: str | None = None,
) -> session.TrainResult:
    """One sweep trial: :func:`train` in one process, its MLflow run nested under ``parent_run_id`` with
    ``tags``, reporting validation success to the Optuna ``trial`` (storage, study, number), which may prune
    it. Sweeps call it in-process or as the ``ragen-train-trial`` deployment (``dispatch: deployment``).
    ``resume``: the run of an interrupted trial, which this retry continues from its last checkpoint (its saved
    config, so ``overrides`` and ``run_name`` are not applied again)."""
    if resume:
        return _start(experiment, [], resume, None, 1, parent_run_id, tags, trial)
    return _start(experiment, list(overrides or []), None, run_name, 1, parent_run_id, tags, trial)


def _start(experiment: str | None, overrides: list[str], resume: str | None, run_name: str | None, nproc: int,
           parent_run_id: str | None = None, tags: dict[str, str] | None = None,
           trial: dict[str, Any] | None = None) -> session.TrainResult:
    """Resolve the run's config and folder, check the world size, join or start the ranks, run."""
    if run_name is not None:
        check_run_name(run_name, "run_name")  # a deployment parameter too: checked before anything is written
    if resume:
        cfg, folder = session.resume_config(resume, overrides)
    elif not experiment:
        raise ConfigError("experiment: give an experiment file, or resume a run")
    else:
        cfg = load_experiment(experiment, overrides)
        folder = RunDir.named(run_name or session.new_run_name(cfg))
    size = ranks.planned_world(nproc)
    session.check_world(cfg, size)
    if trial and size > 1:
        raise ConfigError("a sweep trial reports to Optuna from one process: run sweeps with nproc 1")
    if deployment.id and not os.environ.get("RAGEN_DATA_DIR", "").strip():
        raise ConfigError("this deployment run has no RAGEN_DATA_DIR, so its run would land in ./data of this "
                          "worker: export RAGEN_DATA_DIR (the folder the workers share) before `prefect deploy`, "
                          "or in the worker's environment")
    # under torchrun the launcher placed the ranks; otherwise this run holds a GPU per rank (CUDA starts after)
    devices = contextlib.nullcontext(()) if distributed.launched() else gpus.holding(size, say=print)
    with devices as held, ranks.world(nproc, resolve_device(cfg.model.device)):  # rank 0 (starting the others)
        cfg, folder = session.agree_run(cfg, folder)  # the other ranks take this run's config and folder
        return _train(cfg, folder, parent_run_id, {**(tags or {}), **({"gpus": ",".join(held)} if held else {})},
                      trial, experiment)


def _train(cfg: ExperimentConfig, folder: RunDir, parent_run_id: str | None, tags: dict[str, str] | None,
           trial: dict[str, Any] | None, experiment: str | None) -> session.TrainResult:
    """The run itself, in this process (rank 0 of several, or alone)."""
    folder.create()
    ui_url = flow_run.ui_url  # the flow run's page in the Prefect UI, as a tag of the MLflow run
    with _Termination() as termination:
        logger = open_logger(cfg, folder.path, flow_run_id=flow_run.id, parent_run_id=parent_run_id,
                             extra_tags={**(tags or {}), **({"prefect.flow_run_url": ui_url} if ui_url else {})},
                             experiment_file=experiment)
        pruner = _trial_reporter(trial) if trial else None
        artifacts = RunArtifacts(folder.name, cfg.trainer.iterations)
        with Reporter(cfg.trainer.iterations) as ui:

            def say(line: str) -> None:  # the terminal, and the flow run's Logs tab
                ui.say(line)
                artifacts.say(line)

            def final(sess: session.Session, val: dict[str, float]) -> None:
                artifacts.markdown("evaluation", "| metric | value |\n|---|---|\n" + "".join(
                    f"| {k} | {v:.4f} |\n" for k, v in sorted(val.items()) if k.startswith("val/")),
                    f"held-out evaluation after {sess.iteration} iterations")
                if pruner:
                    pruner(sess, val)

            sess = session.open_session(cfg, logger, folder, say=say, progress=ui.progress)
            run_url = getattr(logger, "run_url", None)
            artifacts.link(run_url() if callable(run_url) else None, tracking_uri(cfg), logger.run_id)

            def after_iteration(s: session.Session, metrics: dict[str, float]) -> None:
                artifacts.iteration(s.iteration, cfg.env.label, metrics)
                # a study's worker takes up the cores its round's ended workers left (ragen_core/cpu_share.py); a run
                # of several ranks, or with its own trainer.threads, keeps its count
                if cfg.trainer.threads is None and distributed.world_size() == 1:
                    if (threads := cpu_share.follow()) is not None:
                        say(f"torch threads: {threads} from iteration {s.iteration + 1} on (a worker of the study "
                            "ended)")

            hooks = session.Hooks(
                after_eval=pruner,  # a pruned trial ends with this evaluation as its last
                after_iteration=after_iteration,
                after_final_eval=final)
            session.run_to_end(sess, termination.guard(steps.STEPS), hooks)
        termination.check()
        return session.finish(sess, tracking_uri(cfg))


class _Termination:
    """Prefect cancels a flow run with SIGTERM, and its handler raises TerminationSignal wherever the main thread
    is. Raised inside a garbage-collection callback (SQLAlchemy's, while MLflow opens its store), Python prints it as
    "Exception ignored" and drops it, and the run went on to its end. Within this block a handler records the
    signal before Prefect's raises; each step of the loop (:meth:`guard`) raises it again when it was lost."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: Any = None

    def __enter__(self) -> _Termination:
        self._previous = signal.getsignal(signal.SIGTERM)

        def handler(signum: int, frame: Any) -> None:
            self.received = signum
            if callable(self._previous):
                self._previous(signum, frame)
            else:
                raise TerminationSignal(signal=signum)

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread() is threading.main_thread() and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def check(self) -> None:
        if self.received is not None:
            raise TerminationSignal(signal=self.received)

    def guard(self, steps: session.Steps) -> session.Steps:
        """``steps``, each checking first for a signal that was received and lost."""

        def checked(step: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                self.check()
                return step(*args, **kwargs)

            return run

        return session.Steps(*(checked(getattr(steps, f.name)) for f in dataclasses.fields(steps)))


def _trial_reporter(trial: dict[str, Any]) -> Any:
    from ragen_core.sweeps import trial_reporter  # optuna only for sweep trials

    return trial_reporter({**trial, "storage": _trial_storage(str(trial["storage"]))})


STORAGE_SECRET = "ragen-optuna-storage"
"""The Prefect Secret block a worker may read the study storage's full URL from (docs/how-to/gpu-pool.md)."""


def _trial_storage(url: str) -> str:
    """The trial's storage URL with its password (its parameters carry none): this worker's
    ``RAGEN_OPTUNA_STORAGE``, else the Prefect Secret block ``ragen-optuna-storage``."""
    from ragen_core.sweeps.study import STORAGE_ENV, trial_storage

    def secret() -> str | None:
        from prefect.blocks.system import Secret

        try:
            return str(Secret.load(STORAGE_SECRET).get())
        except ValueError:  # no such block
            return None

    env = os.environ.get(STORAGE_ENV)
    try:
        return trial_storage(url, [env])
    except ConfigError:
        return trial_storage(url, [secret()])
