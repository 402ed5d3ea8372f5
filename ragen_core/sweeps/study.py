"""The Optuna side of a sweep: storage, study, sampler/pruner, the per-trial reporter, and
when a worker should stop.

    from ragen_core.sweeps.study import open_study, trial_spec, trial_reporter
    study = open_study(sweep, grid, storage_url(sweep))          # created, or resumed if it exists
    spec = trial_spec(sweep, storage_url(sweep), trial.number)  # the ``trial`` dict of flows.train.train
    report = trial_reporter(spec)                                 # called by the train flow per evaluation

Storage is any SQLAlchemy URL (``sqlite:///$RAGEN_DATA_DIR/optuna.db`` by default; PostgreSQL
for workers on several machines). A heartbeat marks a trial FAIL when its worker goes silent
for ``heartbeat_seconds``; Optuna's retry callback then queues the same parameters once more
(``retries``), so an ablation table still gets every cell.

Why the reporter opens the storage itself: the trial may run as a Prefect deployment run on
another machine, so everything it reports (intermediate values, the curve, per-env success,
cost, the MLflow run id, "pruned") goes through the shared storage, and the objective reads
it back from there. Optuna has no public handle on a running trial for another process (``Trial(study,
id)`` is internal), so the reporter names the trial by study name and number and writes through the
documented methods of a storage it opens itself; the pruning decision is the study's own
``pruner.prune(study, trial)``. Why ``remaining_trials`` and ``duplicate_of``: Optuna's GridSampler gives
trial number i grid point i (race-free), but once the first pass is over (a retry, a resumed
study) two workers can pick the same point; a trial whose point another trial already ran
or is running is skipped, so each point runs to completion exactly once.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from ragen_core.config import ConfigError, SweepConfig, data_file
from ragen_core.memory import peak_rss_bytes
from ragen_core.sweeps.objective import COST_KEYS, run_cost
from ragen_core.tracking.early_stop import HEALTH_STOP

# optuna takes 0.7 s to import and ragen_core.sweeps is also imported by the train and compare flows, which
# need none of it; so each function imports optuna itself ("lazily: see the note at the top").
if TYPE_CHECKING:
    import optuna  # lazily: see the note at the top

    from ragen_core.session import Session

__all__ = [
    "PEAK_RSS_ATTR",
    "PRUNED_REASON",
    "RESULT_ATTRS",
    "STORAGE_ENV",
    "DuplicateTrial",
    "dashboard_command",
    "duplicate_of",
    "fail_stale",
    "finished_count",
    "make_pruner",
    "make_sampler",
    "open_storage",
    "open_study",
    "redact",
    "remaining_trials",
    "requeue_interrupted",
    "requeue_lost",
    "running_trials",
    "settle",
    "stop_when_done",
    "storage_url",
    "trial_record",
    "trial_reporter",
    "trial_spec",
    "trial_storage",
    "worker_name",
]

log = logging.getLogger("ragen")

PRUNED_REASON = "pruned by optuna"
PEAK_RSS_ATTR = "peak_rss_bytes"
"""The user attribute holding a trial's run's peak resident memory (its process's ``perf/peak_rss_gib``)."""
CRASHED_ATTR = "crashed"
"""The user attribute of a trial whose objective raised (the error's type and message): its configuration fails,
so its grid point is not run again. A FAIL trial with no such mark, no ``interrupted`` and no ``skipped`` lost
its worker."""
RESULT_ATTRS = ("curve", "val", "cost", "pruned_at", "health_stop", "mlflow_run_id", "run_dir", "skipped",
                "interrupted", CRASHED_ATTR, PEAK_RSS_ATTR)
"""User attributes a trial writes; cleared at the start of a trial (a retry inherits the failed one's)."""


class DuplicateTrial(Exception):
    """Raised by a trial whose grid point another trial has run or is running (the trial ends FAIL)."""


STORAGE_ENV = "RAGEN_OPTUNA_STORAGE"
"""The study storage's URL, password included, from the environment: the default of a sweep without ``storage``,
and where a trial's worker finds the password its parameters leave out (:func:`trial_storage`)."""


def storage_url(sweep: SweepConfig) -> str:
    """The sweep's ``storage``, else ``$RAGEN_OPTUNA_STORAGE``, else ``sqlite:///$RAGEN_DATA_DIR/optuna.db``."""
    return sweep.storage or os.environ.get(STORAGE_ENV) or f"sqlite:///{data_file('optuna.db')}"


def trial_storage(url: str, known: Sequence[str | None]) -> str:
    """The storage URL a trial's parameters name (its password hidden by :func:`redact`), with the password: the
    first of ``known`` (this worker's ``$RAGEN_OPTUNA_STORAGE``, a Prefect Secret...) that is the same URL.
    ConfigError when none is (the worker cannot open the study)."""
    from sqlalchemy.engine import make_url  # lazily: as in redact

    if make_url(url).password is None:
        return url
    for candidate in known:
        if candidate and redact(candidate) == url:
            return candidate
    raise ConfigError(f"the trial's study storage {url} needs its password on this worker: set {STORAGE_ENV} to "
                      "the full URL in the worker's environment, or store it in the Prefect Secret block "
                      "ragen-optuna-storage")


def redact(url: str) -> str:
    """The URL without its password, for logs, tags and summaries."""
    from sqlalchemy.engine import make_url  # lazily: 0.3 s, and the CLI redacts URLs before any sweep starts

    return make_url(url).render_as_string(hide_password=True)


def dashboard_command(url: str) -> str:
    return f"optuna-dashboard {redact(url)}"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def open_storage(url: str, heartbeat_seconds: int | None = None, retries: int = 0) -> optuna.storages.RDBStorage:
    """RDBStorage on ``url``; with ``heartbeat_seconds``, silent workers' trials go FAIL (and are retried)."""
    import optuna  # lazily: see the note at the top

    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    db_file = _sqlite_file(url)
    if db_file is not None:
        # several worker processes write one file: wait for the lock instead of failing after 5 s
        engine_kwargs = {"connect_args": {"timeout": 120}}
        db_file.parent.mkdir(parents=True, exist_ok=True)
    beat: dict[str, Any] = {}
    with _creation_lock(url), warnings.catch_warnings():  # heartbeat and retry are "experimental" since Optuna 2.8
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if heartbeat_seconds:
            beat = {"heartbeat_interval": max(1, heartbeat_seconds // 3), "grace_period": heartbeat_seconds}
            if retries:
                beat["heartbeat_stale_trial_callback"] = optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=retries)
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **beat)


def _creation_lock(url: str) -> contextlib.AbstractContextManager[Any]:
    """For a sqlite file, a lock file beside it, held while the schema or a study is created: processes
    creating the same new database at once otherwise collide in Optuna's schema set-up (measured: 1-3 of
    4 simultaneous starts failed with "table studies already exists" or a UNIQUE constraint on
    alembic_version). A database server is shared across machines, where a lock file cannot help."""
    db_file = _sqlite_file(url)
    if db_file is None:
        return contextlib.nullcontext()
    return FileLock(f"{db_file}.lock", timeout=300)


def _sqlite_file(url: str) -> Path | None:
    """The database file of a ``sqlite:///`` URL; None for any other URL."""
    return Path(url[len("sqlite:///"):]).expanduser() if url.startswith("sqlite:///") else None


def make_sampler(sweep: SweepConfig, grid: Mapping[str, Sequence[Any]] | None) -> optuna.samplers.BaseSampler:
    import optuna  # lazily: see the note at the top

    if sweep.sampler == "grid":
        if not grid:
            raise ConfigError("sampler: the grid sampler needs a finite grid (knobs or space lists)")
        return optuna.samplers.GridSampler(dict(grid), seed=sweep.seed)
    if sweep.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=sweep.seed)
    return optuna.samplers.RandomSampler(seed=sweep.seed)


def make_pruner(kind: str, startup_trials: int) -> optuna.pruners.BasePruner:
    """Median of the other trials' intermediate values at the same step (warm-up is counted in
    evaluations by the reporter, so Optuna's own step warm-up is 0)."""
    import optuna  # lazily: see the note at the top

    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    return optuna.pruners.NopPruner()


def open_study(sweep: SweepConfig, grid: Mapping[str, Sequence[Any]] | None, url: str) -> optuna.Study:
    """Create the study, or load it when it exists (an interrupted study resumes)."""
    import optuna  # lazily: see the note at the top

    directions = [sweep.direction] + (["minimize"] if sweep.cost_objective != "none" else [])
    storage = open_storage(url, sweep.heartbeat_seconds, sweep.retries)
    with _creation_lock(url):  # a study's row and its directions are written apart: let no one read between
        study = optuna.create_study(study_name=sweep.name, storage=storage, sampler=make_sampler(sweep, grid),
                                    pruner=make_pruner(sweep.pruner, sweep.pruner_startup_trials),
                                    directions=directions, load_if_exists=True)
    found = [d.name.lower() for d in study.directions]
    if found != directions:
        raise ConfigError(f"name: study {sweep.name!r} in {redact(url)} optimises {found}, this sweep {directions}; "
                          "use another study name")
    return study


def trial_spec(sweep: SweepConfig, url: str, number: int) -> dict[str, Any]:
    """The ``trial`` argument of flows.train.train: plain JSON, so it travels to a deployment run, and no
    password in it (Prefect stores and shows a run's parameters): :func:`trial_storage` puts it back."""
    return {"storage": redact(url), "study_name": sweep.name, "trial_number": int(number), "metric": sweep.metric,
            "pruner": sweep.pruner, "pruner_startup_trials": sweep.pruner_startup_trials,
            "pruner_warmup": sweep.pruner_warmup}


def trial_reporter(spec: Mapping[str, Any]) -> Callable[[Session, Mapping[str, float]], None]:
    """A callback for the train flow: report the metric after each evaluation; prune cleanly.

    On pruning it sets ``sess.stop_reason`` (the flow's loop ends and the run finishes
    normally) and stores ``pruned_at``, which the objective turns into ``optuna.TrialPruned``.
    """
    import optuna  # lazily: see the note at the top

    storage = open_storage(str(spec["storage"]))  # no heartbeat here: the worker running the objective beats
    name, number = str(spec["study_name"]), int(spec["trial_number"])
    study = optuna.load_study(study_name=name, storage=storage,
                              pruner=make_pruner(str(spec["pruner"]), int(spec["pruner_startup_trials"])))
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(name), number)
    metric, warmup = str(spec["metric"]), int(spec["pruner_warmup"])
    single = len(study.directions) == 1  # Optuna has no intermediate values for several objectives
    # a retry that continues the lost trial's run starts from the curve that trial reported (trials.py)
    curve: list[list[float]] = list(storage.get_trial(trial_id).user_attrs.get("curve") or [])
    started = time.monotonic()

    def report(sess: Session, val: Mapping[str, float]) -> None:
        if metric not in val:
            raise KeyError(f"sweep metric {metric!r} is not among the validation metrics {sorted(val)}")
        step, value = sess.iteration, float(val[metric])
        curve[:] = [c for c in curve if c[0] < step]  # a resumed run redoes the evaluations after its checkpoint
        curve.append([step, value])
        per_env = {k[len("val/"):-len("/success")]: float(v) for k, v in val.items()
                   if k.startswith("val/") and k.endswith("/success") and k != "val/success"}
        cost = {kind: run_cost(sess.history, kind) for kind in COST_KEYS}
        # this process's share (a resumed run: since resume)
        cost["wall_seconds"] = round(time.monotonic() - started, 3)
        # the run's peak memory, over its parts when resumed: how many runs fit at a time (flows/sweep.py)
        peak = max(int(storage.get_trial(trial_id).user_attrs.get(PEAK_RSS_ATTR) or 0), peak_rss_bytes())
        for key, attr in (("run_dir", str(sess.run_dir)), ("curve", curve), ("val", per_env), ("cost", cost),
                          ("mlflow_run_id", sess.logger.run_id), (PEAK_RSS_ATTR, peak)):
            storage.set_trial_user_attr(trial_id, key, attr)
        if sess.stop_reason and sess.stop_reason.startswith(HEALTH_STOP):  # a health rule ended the run
            storage.set_trial_user_attr(trial_id, "health_stop", sess.stop_reason)
        if not single:
            return
        if step not in storage.get_trial(trial_id).intermediate_values:  # as Trial.report: the first value stays
            storage.set_trial_intermediate_value(trial_id, step, value)
        if (spec["pruner"] != "none" and len(curve) > warmup
                and study.pruner.prune(study, storage.get_trial(trial_id))):
            storage.set_trial_user_attr(trial_id, "pruned_at", step)
            sess.stop_reason = PRUNED_REASON
            sess.say(f"[sweep] trial {number}: {metric} {value:.3f} at iteration {step} is below the "
                     "median of earlier trials; pruned")

    return report


def _live(t: optuna.trial.FrozenTrial) -> bool:
    from optuna.trial import TrialState  # lazily: see the note at the top

    return t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)


def remaining_trials(study: optuna.Study, target: int, grid: Mapping[str, Sequence[Any]] | None) -> int:
    """Trials still to start (queued retries included) before the study has ``target`` trials.

    Grid: ``target`` points of this grid, each covered by any trial of it (a crashed one too: the same
    configuration would crash again; a lost or interrupted one is covered by its retry, which
    :func:`requeue_lost` and :func:`requeue_interrupted` queue when it is missing). Otherwise: every trial
    counts, failed ones too, except those that were retried.
    """
    from optuna.trial import TrialState  # lazily: see the note at the top

    trials = study.get_trials(deepcopy=False)
    waiting = sum(t.state == TrialState.WAITING for t in trials)
    if grid is not None:
        space = {k: list(v) for k, v in grid.items()}  # what GridSampler stores with each trial
        covered = {t.system_attrs["grid_id"] for t in trials
                   if "grid_id" in t.system_attrs and t.system_attrs.get("search_space") == space}
        # a trial another worker has just created, before its sampler wrote the point: it takes an
        # unstarted point if one is left, so it covers one (narrows the race in which two workers
        # both start the last point; what is left of it, duplicate_of catches)
        drawing = sum(t.state == TrialState.RUNNING and "grid_id" not in t.system_attrs
                      and "fixed_params" not in t.system_attrs for t in trials)
        return max(0, target - len(covered) - drawing) + waiting
    retried = {t.system_attrs["failed_trial"] for t in trials if "failed_trial" in t.system_attrs}
    counted = sum(1 for t in trials if t.state != TrialState.WAITING and t.number not in retried
                  and not t.user_attrs.get("skipped"))
    return max(target - counted, waiting, 0)


def running_trials(study: optuna.Study) -> list[int]:
    from optuna.trial import TrialState  # lazily: see the note at the top

    return [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]


def trial_record(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    """Trial ``number`` as stored now: what other processes (the trial's reporter, a retry callback)
    wrote to it included, which a live ``Trial`` object does not see."""
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


def duplicate_of(study: optuna.Study, number: int) -> int | None:
    """The number of another trial of the same grid point that wins over trial ``number``, if any.

    A finished (COMPLETE/PRUNED) one always wins; a running or queued one wins when it is older
    (numbers are unique in a study and grow with age).
    """
    trials = study.get_trials(deepcopy=False)
    me = next(t for t in trials if t.number == number)
    gid, space = me.system_attrs.get("grid_id"), me.system_attrs.get("search_space")
    if gid is None:
        return None
    for t in trials:
        if t.number == number or t.system_attrs.get("grid_id") != gid or t.system_attrs.get("search_space") != space:
            continue
        finished = t.state.name in ("COMPLETE", "PRUNED")
        if finished or (_live(t) and t.number < number):
            return t.number
    return None


def fail_stale(study: optuna.Study) -> None:
    """Mark trials whose worker stopped beating FAIL (their retry is queued by the storage's callback)."""
    import optuna  # lazily: see the note at the top

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def finished_count(study: optuna.Study) -> int:
    """Trials in a final state (COMPLETE, PRUNED, FAIL): a round of trials made progress when this grew."""
    return sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))


def settle(study: optuna.Study, poll_seconds: float = 2.0, say: Callable[[str], None] = print) -> None:
    """Wait until no trial is RUNNING: live workers finish theirs, lost workers' trials go FAIL by heartbeat."""
    announced: set[int] = set()
    while running := running_trials(study):
        if set(running) - announced:
            say(f"[sweep] waiting for running trials {running} (finished, or failed when their heartbeat stops)")
            announced |= set(running)
        fail_stale(study)
        time.sleep(poll_seconds)


def stop_when_done(
    target: int, grid: Mapping[str, Sequence[Any]] | None
) -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """An ``optimize`` callback: fail lost workers' trials, then stop once nothing is left to start."""

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        fail_stale(study)
        if remaining_trials(study, target, grid) == 0:
            study.stop()

    return callback


def requeue_lost(study: optuna.Study, retries: int) -> list[int]:
    """Queue the retry of each lost worker's trial whose retry was never written, at most ``retries`` retries a
    grid point, as the storage's heartbeat callback would have. Returns the numbers of the trials queued again.

    The heartbeat marks a silent worker's trial FAIL and then writes its retry in a second step; when that write
    fails (a sqlite database locked while the machine thrashed), the trial is left FAIL with no retry and would
    count as a crash that covers its grid point. A lost trial is told apart by what it lacks: a crash is marked
    ``crashed``, an interruption ``interrupted``, a skipped duplicate ``skipped``.
    """

    def lost(t: optuna.trial.FrozenTrial) -> bool:
        return not any(t.user_attrs.get(key) for key in ("interrupted", CRASHED_ATTR, "skipped"))

    return _requeue(study, lost, retries)


def requeue_interrupted(study: optuna.Study) -> list[int]:
    """Queue once more the trials that ended FAIL because their run was interrupted (Ctrl-C, SIGTERM).

    Optuna marks such a trial FAIL like a crash; unlike a crash it says nothing about the configuration, so a
    resumed study runs it again, each time it was interrupted (a long run may be stopped at the end of several
    sessions; the retry continues its run from the last checkpoint, trials.py). A lost worker's trial is
    retried by the storage's heartbeat callback instead, at most ``retries`` times. Returns the numbers of the
    trials queued again.
    """

    return _requeue(study, lambda t: bool(t.user_attrs.get("interrupted")), None)


def _requeue(study: optuna.Study, pick: Callable[[optuna.trial.FrozenTrial], bool], max_retry: int | None
             ) -> list[int]:
    """Optuna's own retry (same params and grid point, ``retry_history`` kept; none past ``max_retry``) of each
    FAIL trial ``pick`` chooses that has no retry yet; the numbers of the trials queued again."""
    import optuna  # lazily: see the note at the top
    from optuna.trial import TrialState  # lazily: see the note at the top

    trials = study.get_trials(deepcopy=False)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)
        for t in trials:
            if t.state == TrialState.FAIL and t.number not in retried and pick(t):
                before = len(study.get_trials(deepcopy=False))
                retry(study, copy.deepcopy(t))  # a copy: the callback appends to the trial's own retry_history
                if len(study.get_trials(deepcopy=False)) > before:
                    out.append(t.number)
    return out
