"""Real browsers on real servers: what a person sees when browsing a StarPO and a StarPO-S run.

A StarPO and a StarPO-S smoke run on Sokoban (the tiny random model, 2 iterations each, same seeds) are
trained with the ``ragen`` command, as a user runs it, against a real ``mlflow server`` and the session's
real ``prefect server`` (UI on) on 127.0.0.1. Then Debian's headless chromium opens:

1. MLflow's chart view of the experiment: the comparison section comes first and draws both runs' curves;
2. MLflow's evaluation view of the ``replies.json`` table, grouped by seed: both runs' replies to one seed;
3. the training flow run's page in the Prefect UI: the per-iteration lines under Logs, the artifacts under
   Artifacts;
4. the trajectory page ``ragen show --html`` writes: a Sokoban grid per turn;
5. ``optuna-dashboard`` on the storage of a two-trial ``ragen sweep``: the study, its trials and its knob.

Each test saves a screenshot (in its tmp dir; also into ``$RAGEN_SCREENSHOTS`` when set, which is how the
pictures under docs/img/ on docs/how-to/browse.md are made) and asserts on the page's text, not only on a status code.
Run alone: ``.venv/bin/python -m pytest tests/integration/test_browser.py`` (~2-3 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.integration.conftest import MlflowServer, ServerProcess, base_env, free_port

if TYPE_CHECKING:  # fixtures of tests/integration/conftest.py
    from tests.integration.conftest import PrefectServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SMOKE = REPO / "experiments" / "smoke.yaml"
PRESETS = ("starpo", "starpo-s")
RUN_COLOURS = {"#c83243": "rgb(200, 50, 67)", "#137dae": "rgb(19, 125, 174)"}  # MLflow's palette: coral, turquoise


@dataclass
class Run:
    preset: str
    run_id: str
    name: str
    flow_run_id: str
    replies: Any  # the run's replies.json as a DataFrame, read back through MLflow


@dataclass
class Studied:
    mlflow: MlflowServer
    prefect_ui: str
    data: Path
    experiment_id: str
    runs: dict[str, Run]


def ragen(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The ``ragen`` console script, as a user runs it; a failure shows its output."""
    done = subprocess.run([str(BIN / "ragen"), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"ragen {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def studied(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Studied]:
    """The two smoke runs on Sokoban, on a real MLflow server and the session's Prefect server."""
    import pandas as pd
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("browser")
    server = MlflowServer(root / "mlflow-server", free_port())
    server.make_schema()
    server.start()
    try:
        data = root / "data"
        env = prefect_server.client_env(RAGEN_DATA_DIR=str(data))
        for preset in PRESETS:
            ragen("train", str(SMOKE), "--set", f"preset={preset}", "--set", "env.name=Sokoban",
                  "--set", f"tracking.uri={server.uri}", env=env)
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name("ragen-Sokoban")
        assert experiment is not None
        runs = {}
        for r in client.search_runs([experiment.experiment_id]):
            preset = r.data.params["preset"]
            flow_run_url = r.data.tags["prefect.flow_run_url"]
            # (client.load_table would search runs at the process-wide tracking URI, not the client's)
            replies = pd.read_json(client.download_artifacts(r.info.run_id, "replies.json", str(root)),
                                   orient="split")
            runs[preset] = Run(preset, r.info.run_id, r.info.run_name or "", flow_run_url.rstrip("/").split("/")[-1],
                               replies)
        assert sorted(runs) == sorted(PRESETS)
        # MLflow's UI colours a run by a hash of its id into its palette, so two runs can share a colour (and
        # the charts then show one); its run-colour tag pins one colour a run
        for run, colour in zip(runs.values(), RUN_COLOURS, strict=True):
            client.set_tag(run.run_id, "mlflow.runColor", colour)
        yield Studied(server, f"http://127.0.0.1:{prefect_server.port}", data, experiment.experiment_id, runs)
    finally:
        server.stop()


def body_text(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)


def wait_for(driver: Any, what: Callable[[str], bool], explain: str, timeout_s: float = 60.0) -> str:
    """Poll the page's visible text until ``what(text)``; on time-out, fail with the text the page had."""
    from selenium.common.exceptions import WebDriverException

    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            text = body_text(driver)
        except WebDriverException:  # the page is being replaced
            text = ""
        if what(text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"the page never showed {explain}; it showed:\n{text[-3000:]}")


def click(driver: Any, xpath: str) -> None:
    """Click the element at ``xpath`` once it exists and takes clicks (pages render in steps)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + 30
    while True:
        try:
            driver.find_element(By.XPATH, xpath).click()
            return
        except WebDriverException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def screenshot(driver: Any, tmp_path: Path, name: str) -> Path:
    """Save the page as ``<name>.png`` (and into $RAGEN_SCREENSHOTS when set); assert it is a real picture."""
    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    if os.environ.get("RAGEN_SCREENSHOTS"):
        out = Path(os.environ["RAGEN_SCREENSHOTS"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / path.name)
    return path


def close_mlflow_assistant(driver: Any) -> None:
    """MLflow 3.17 opens an assistant panel beside every page; close it so the page has the width."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.XPATH, "//button[@aria-label='Close']"):
        if button.is_displayed():
            button.click()
            return


def words(text: str) -> str:
    """A stretch of a reply that survives rendering: its longest run of plain words (the tiny model's replies
    are random tokens, some of them bytes a browser shows as replacement characters)."""
    runs = re.findall(r"[A-Za-z][A-Za-z ]{5,}[A-Za-z]", text)
    assert runs, f"no plain words in {text!r}"
    return " ".join(max(runs, key=len).split())


def test_mlflow_chart_view_compares_both_runs_first(chrome: Any, studied: Studied, tmp_path: Path) -> None:
    """The experiment's chart view opens on the 0_compare section, with a curve of each run in every chart."""
    chrome.get(f"{studied.mlflow.uri}/#/experiments/{studied.experiment_id}/runs"
               "?compareRunsMode=CHART&workflowType=machine_learning")
    names = [run.name for run in studied.runs.values()]
    metrics = ["0_compare/1_val_success", "0_compare/2_reward_std", "0_compare/3_entropy", "0_compare/4_grad_norm"]
    # each chart's legend names both runs with the metric: "<run name> (<metric>)"
    legends = [f"{name} ({metric})" for name in names for metric in metrics]
    text = wait_for(chrome, lambda t: all(x in t for x in legends), "a legend entry per run and comparison chart")
    close_mlflow_assistant(chrome)
    # the comparison section is the first the view shows: before the 14 actor/* charts and all the others
    assert text.index("0_compare") < text.index("actor\n")
    assert text.index("0_compare/4_grad_norm") < text.index("collapse/first_turn")
    # every comparison chart is drawn: a plot with a line in each run's colour. The legends can show before
    # plotly has drawn every line, so the charts get the same 60 s the text gets
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    def colours() -> list[set[str]]:
        try:
            plots = chrome.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")[:4]
            return [{line.value_of_css_property("stroke") for line in plot.find_elements(By.CSS_SELECTOR,
                                                                                           "path.js-line")}
                    for plot in plots]
        except WebDriverException:  # a plot redrawn while read
            return []

    expected = [set(RUN_COLOURS.values())] * 4  # each run's line in its pinned colour (the studied fixture)
    deadline, drawn = time.monotonic() + 60, colours()
    while drawn != expected and time.monotonic() < deadline:
        time.sleep(0.5)
        drawn = colours()
    assert len(drawn) >= 4, drawn  # the four comparison charts exist
    assert drawn == expected, drawn
    screenshot(chrome, tmp_path, "mlflow-compare")


def test_mlflow_replies_table_shows_both_runs_replies_to_one_seed(chrome: Any, studied: Studied,
                                                                  tmp_path: Path) -> None:
    """The evaluation view of replies.json, grouped by env seed and member, compares the reply column."""
    runs = list(studied.runs.values())
    seed = int(runs[0].replies["env_seed"].iloc[0])
    for run in runs:  # the same seeds in both runs: training seeds depend on the iteration, not the preset
        assert seed in set(run.replies["env_seed"])
    chrome.get(f"{studied.mlflow.uri}/#/experiments/{studied.experiment_id}/runs"
               "?compareRunsMode=ARTIFACT&workflowType=machine_learning")
    wait_for(chrome, lambda t: "replies.json" in t and "Group by" in t, "the replies table")
    close_mlflow_assistant(chrome)
    click(chrome, "//button[@aria-label='Select \"group by\" columns']")
    for column in ("iteration", "env_seed", "member"):  # iteration off; env_seed and member on
        click(chrome, f"//*[@role='option'][normalize-space()='{column}']")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    chrome.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    click(chrome, "//button[starts-with(normalize-space(), 'Compare')]")
    click(chrome, "//*[@role='option'][normalize-space()='reply']")
    chrome.find_element(By.XPATH, "//input[starts-with(@placeholder, 'Filter by')]").send_keys(str(seed))
    expected = []
    for run in runs:
        rows = run.replies[(run.replies["env_seed"] == seed) & (run.replies["member"] == 0)]
        expected.append(words(str(rows["reply"].iloc[0])))
    other = {int(s) for run in runs for s in run.replies["env_seed"]} - {seed}
    # both runs' columns hold their reply to the seed, and the filter has left no other seed on the page
    text = wait_for(chrome, lambda t: all(run.name in t for run in runs)
                    and all(e in " ".join(t.split()) for e in expected)
                    and not any(f"\n{s}\n" in t for s in other),
                    f"both runs' replies to seed {seed} and no other seed: {expected}")
    assert "reply" in text and f"\n{seed}\n" in text
    screenshot(chrome, tmp_path, "mlflow-replies")


def test_prefect_flow_run_page_shows_logs_and_artifacts(chrome: Any, studied: Studied, tmp_path: Path) -> None:
    """The StarPO-S flow run: per-iteration summary lines in Logs, readable task names, the artifacts."""
    run = studied.runs["starpo-s"]
    chrome.get(f"{studied.prefect_ui}/runs/flow-run/{run.flow_run_id}")
    text = wait_for(chrome, lambda t: "iter 2/2 | success" in t and "final evaluation after 2 iterations" in t,
                    "the per-iteration summary lines in the Logs tab")
    assert "iter 1/2 | success" in text
    assert "ragen-train" in text and "Completed" in text
    from selenium.webdriver.common.by import By

    line = chrome.find_element(By.XPATH, "//*[starts-with(normalize-space(), 'iter 1/2 | success')]")
    chrome.execute_script("arguments[0].scrollIntoView({block: 'center'});", line)
    screenshot(chrome, tmp_path, "prefect-run-logs")
    # the Task Runs tab names each step with its iteration (the log list draws only the lines in view)
    click(chrome, "//li[contains(@class, 'p-tab')][normalize-space()='Task Runs']")
    wait_for(chrome, lambda t: all(f"{step}-it0001" in t for step in ("rollout", "filter", "update")),
             "task runs named by step and iteration")
    click(chrome, "//li[contains(@class, 'p-tab')][normalize-space()='Artifacts']")
    key = re.sub(r"[^a-z0-9-]+", "-", run.name.lower())
    wanted = [f"iterations-{key}", f"progress-{key}", f"evaluation-{key}", f"mlflow-{key}",
              "per-iteration metrics", "held-out evaluation after 2 iterations"]
    wait_for(chrome, lambda t: all(w in t for w in wanted), f"the run's artifacts {wanted}")
    screenshot(chrome, tmp_path, "prefect-run-artifacts")
    # the table artifact's own page: the comparison curves' metrics, a row per iteration so far
    click(chrome, f"//*[normalize-space()='iterations-{key}']")
    columns = ["iteration", "val/success", "rollout/reward_std_all", "actor/entropy", "actor/grad_norm"]
    wait_for(chrome, lambda t: all(c in t for c in columns) and re.search(r"\b[12] Items?\b", t) is not None,
             "the per-iteration table")


def test_trajectory_page_renders_a_sokoban_grid(chrome: Any, studied: Studied, tmp_path: Path) -> None:
    """``ragen show RUN --html`` for iteration 1: a section per trajectory with the grid the model saw."""
    from selenium.webdriver.common.by import By

    run = studied.runs["starpo-s"]
    page = tmp_path / "trajectories.html"
    env = base_env(RAGEN_DATA_DIR=str(studied.data))
    ragen("show", run.name, "--iter", "1", "--html", str(page), env=env)
    chrome.get(page.as_uri())
    text = wait_for(chrome, lambda t: "Sokoban seed" in t, "the trajectories")
    assert f"{run.name}: iteration 1" in text
    grids = [pre.text for pre in chrome.find_elements(By.CSS_SELECTOR, "td pre")
             if pre.text.lstrip().startswith("#")]
    assert grids, "no grid drawn"
    first = grids[0].splitlines()
    # a Sokoban room: rows of equal width, walled all round, one player, boxes and as many targets
    assert len(first) >= 5 and len({len(row) for row in first}) == 1
    assert set(first[0]) == {"#"} and set(first[-1]) == {"#"}
    cells = "".join(first)
    assert cells.count("P") + cells.count("S") == 1  # the player (S: on a target)
    assert "X" in cells or "√" in cells
    screenshot(chrome, tmp_path, "trajectory-page")


def test_optuna_dashboard_shows_the_sweep(chrome: Any, prefect_server: PrefectServer, tmp_path: Path,
                                          background: Any) -> None:
    """A two-trial ``ragen sweep`` on the tiny model; optuna-dashboard on its storage lists the study and
    its trials with the swept knob."""
    data = tmp_path / "data"
    sweep = tmp_path / "browser-sweep.yaml"
    fast = ["trainer.iterations=1", "eval.seeds=2", "rollout.max_new_tokens=8", "trainer.checkpoint_every=0",
            "tracking.artifact_every=0", "tracking.sample_trajectories=0"]
    sweep.write_text(f"name: browser-sweep\nbase: {SMOKE}\noverrides: {json.dumps(fast)}\n"
                     "knobs: {responses_per_prompt: [1, 2]}\nsampler: grid\npruner: none\n")
    ragen("sweep", str(sweep), env=prefect_server.client_env(RAGEN_DATA_DIR=str(data)))
    storage = f"sqlite:///{data}/optuna.db"
    port = free_port()
    dashboard = ServerProcess("optuna-dashboard", [str(BIN / "optuna-dashboard"), storage, "--host", "127.0.0.1",
                                                   "--port", str(port), "--quiet"],
                              base_env(), f"http://127.0.0.1:{port}/api/studies", tmp_path / "dashboard.log")
    dashboard.start(timeout_s=120)
    import optuna

    study = optuna.load_study(study_name="browser-sweep", storage=storage)
    assert sorted(t.params["responses_per_prompt"] for t in study.trials) == [1, 2]
    try:
        chrome.get(f"http://127.0.0.1:{port}/dashboard")
        wait_for(chrome, lambda t: "browser-sweep" in t, "the study in the list")
        screenshot(chrome, tmp_path, "optuna-studies")
        study_id = study._study_id  # the dashboard's address of a study is its storage id
        chrome.get(f"http://127.0.0.1:{port}/dashboard/studies/{study_id}")
        text = wait_for(chrome, lambda t: "responses_per_prompt" in t and "trial #1" in t, "the trials and the knob")
        screenshot(chrome, tmp_path, "optuna-study")
        # the history of both trials, the best one with its knob, and the link back to the MLflow parent run
        assert "trial #0" in text and "Best Trial (number=" in text and "Params = [responses_per_prompt: " in text
        assert "mlflow_parent_run_id" in text
    finally:
        dashboard.stop()
