"""A corpus of bad experiments through the real `ragen train`: every one exits 2 with exactly one line
that names the offending key (or the file), and writes nothing under $RAGEN_DATA_DIR or the working directory.

The cases: the files in tests/unit/config_corpus/ (each says on its first line what its error must name:
``# expect: <needle>``, ``<file>`` for the file's own path, and on its second why it is bad), files made here
(too big, too deep, a FIFO, a directory), ``--set`` overrides on a good file, bad ``--run-name`` / ``--resume``
values, and a few sweeps (`ragen sweep`). ``flows.train`` and ``flows.sweep`` are replaced by stubs that fail the
test: a case that got past validation would otherwise start Prefect and train. Each case takes milliseconds:
validation never imports Prefect or torch (checked in a fresh interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from ragen_core.config import MAX_CONFIG_BYTES, ConfigError, ExperimentConfig, to_dict

pytestmark = pytest.mark.timeout(60)  # an alias bomb or a deep file must be refused, never expanded: no hangs

CORPUS = Path(__file__).parent / "config_corpus"
FILES = sorted(CORPUS.glob("*.yaml"))
runner = CliRunner()


def expected(path: Path) -> str:
    first = path.read_bytes().split(b"\n", 1)[0].decode("ascii")
    assert first.startswith("# expect: "), f"{path.name}: the first line must say what the error names"
    needle = first.removeprefix("# expect: ")
    return path.name if needle == "<file>" else needle


def snapshot(*roots: Path) -> list[tuple[str, int]]:
    return sorted((p.as_posix(), p.stat().st_size if p.is_file() else -1) for r in roots for p in r.rglob("*"))


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data dir holding one good run (to --resume) and a working dir holding a good experiment; no training."""
    data, work = tmp_path / "data", tmp_path / "work"
    run = data / "runs" / "old-run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(ExperimentConfig(name="old"))))
    work.mkdir()
    (work / "good.yaml").write_text("name: ok\nenv: {name: Bandit}\n")
    monkeypatch.setenv("RAGEN_DATA_DIR", str(data))
    monkeypatch.chdir(work)

    def train(**kwargs: object) -> None:
        raise AssertionError(f"validation let this through to the flow: {kwargs}")

    monkeypatch.setitem(sys.modules, "flows.train", types.SimpleNamespace(train=train))
    return tmp_path


def refused(args: list[str], needle: str, root: Path) -> None:
    """`ragen ARGS` exits 2 with one line naming ``needle`` and leaves every file as it was."""
    before = snapshot(root)
    res = runner.invoke(app, args)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2, (res.exit_code, res.output[-2000:], res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output[-2000:]
    assert needle in lines[0], lines[0]
    assert snapshot(root) == before


def test_the_corpus_is_big_enough() -> None:
    assert len(FILES) + len(GENERATED) + len(OVERRIDES) + len(RUN_OPTIONS) + len(SWEEPS) >= 40
    assert len(FILES) >= 40


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_bad_experiment_file(sandbox: Path, path: Path) -> None:
    refused(["train", str(path)], expected(path), sandbox)


def _oversize(p: Path) -> str:
    p.write_text("name: big\n" + "#" * (MAX_CONFIG_BYTES + 10) + "\n")
    return p.name


def _deep_flow_list(p: Path) -> str:  # was a RecursionError
    p.write_text("env: {name: Bandit, params: {x: " + "[" * 50_000 + "]" * 50_000 + "}}\n")
    return p.name


def _deep_flow_mapping(p: Path) -> str:
    p.write_text("trainer: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n")
    return p.name


def _long_string_bomb(p: Path) -> str:  # 21 nodes, 1.2 M characters once expanded
    p.write_text(f"a: &a {'x' * 60_000}\nenv: {{name: Bandit, params: {{b: [{', '.join(['*a'] * 20)}]}}}}\n")
    return p.name


def _fifo(p: Path) -> str:  # reading it would wait for a writer for ever
    os.mkfifo(p)
    return p.name


def _directory(p: Path) -> str:
    p.mkdir()
    return p.name


def _extends_fifo(p: Path) -> str:
    os.mkfifo(p.with_suffix(".fifo"))
    p.write_text(f"extends: {p.with_suffix('.fifo').name}\n")
    return "extends"


GENERATED = [_oversize, _deep_flow_list, _deep_flow_mapping, _long_string_bomb, _fifo, _directory, _extends_fifo]


@pytest.mark.parametrize("make", GENERATED, ids=[f.__name__.lstrip("_") for f in GENERATED])
def test_bad_generated_file(sandbox: Path, make) -> None:
    path = sandbox / "work" / "generated.yaml"
    needle = make(path)
    refused(["train", str(path)], needle, sandbox)


OVERRIDES: list[tuple[list[str], str]] = [
    # the cases the checks were written for, as --set
    (["env.name=NoSuchEnv"], "env.name"),
    (["env.name=Sokoban", "env.params.height=-5"], "env.params.height"),
    (["env.params.colour=red"], "env.params.colour"),
    (["preset=[starpo]"], "preset"),
    (["preset={a: 1}"], "preset"),
    (["trainer.actor_lr=.inf"], "trainer.actor_lr"),
    (["trainer.actor_lr=1e400"], "trainer.actor_lr"),
    (["rollout.temperature=.inf"], "rollout.temperature"),
    (["trainer.betas=[.nan, .inf]"], "trainer.betas[0]"),
    (["name=../../../../tmp/x"], "name: bad run name"),
    (["name=/tmp/x"], "name: bad run name"),
    (["env.name=WebShop", "env.params.results_per_page=0"], "env.params.results_per_page"),
    (["env.name=Countdown", "env.params.min_numbers=50"], "env.params.min_numbers"),
    (["env.name=WebShop", "env.params.num_products=0"], "env.params.num_products"),
    (["eval.envs=[{name: Bandit}, {name: NoSuchEnv}]"], "eval.envs[1].name"),
    (["eval.envs=[{name: Sokoban, params: {width: 2}}]"], "eval.envs[0].params.width"),
    # limits on --set values and keys
    (["env.params.x=" + "[" * 10_000 + "]" * 10_000], "env.params.x"),
    (["env.params={a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a], "
      "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c], "
      "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d], f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]}"], "env.params"),
    (["a." * 40 + "b=1"], "override"),
    (["trainer.seed=" + "9" * 5000], "trainer.seed"),
    (["trainer.seed=99999999999999999999"], "trainer.seed"),
    (["trainer.deepspeed={bucket: .nan}"], "trainer.deepspeed.bucket"),
    (["model.warmup_rollout={temperature: -.inf}"], "model.warmup_rollout.temperature"),
    (["algorithm.gamma=.NaN"], "algorithm.gamma"),
    (["rollout=5"], "rollout"),
    (["=5"], "override"),
    (["trainer..iterations=3"], "override"),
    (["env.tag='[/bold]'"], "env.tag: '[/bold]'"),  # printed, not read as Rich markup
    (["name=-rf"], "name: bad run name"),
]


@pytest.mark.parametrize(("sets", "needle"), OVERRIDES, ids=[n for _, n in OVERRIDES])
def test_bad_override(sandbox: Path, sets: list[str], needle: str) -> None:
    refused(["train", "good.yaml", *(a for s in sets for a in ("--set", s))], needle, sandbox)


RUN_OPTIONS: list[tuple[list[str], str]] = [
    (["--run-name", "../../escape"], "--run-name"),
    (["--run-name", "/tmp/abs"], "--run-name"),
    (["--run-name", ""], "--run-name"),
    (["--run-name", ".hidden"], "--run-name"),
    (["--resume", "../../etc"], "--resume"),
    (["--resume", "/tmp"], "--resume"),
    (["--resume", "no-such-run"], "--resume"),
    (["--resume", "a\x00b"], "--resume"),
    (["--resume", "old-run", "--set", "trainer.actor_lr=.inf"], "trainer.actor_lr"),  # the run's own config
]


@pytest.mark.parametrize(("options", "needle"), RUN_OPTIONS, ids=[" ".join(o)[:40] for o, _ in RUN_OPTIONS])
def test_bad_run_name_or_resume(sandbox: Path, options: list[str], needle: str) -> None:
    refused(["train", "good.yaml", *options], needle, sandbox)


SWEEPS: list[tuple[str, str]] = [
    ("name: ../../escape\nbase: good.yaml\n", "name: bad run name"),  # data/sweeps/<name>, trial runs <name>-tNNN
    ("name: s\nbase: good.yaml\noverrides: [env.params.size=3]\nspace: {trainer.seed: [0, 1]}\n", "env.params.size"),
    ("name: s\nbase: good.yaml\nspace: {trainer.actor_lr: [1e-6, .inf]}\n", "space.trainer.actor_lr[1]"),
]


@pytest.mark.parametrize(("text", "needle"), SWEEPS, ids=[n for _, n in SWEEPS])
def test_bad_sweep(sandbox: Path, monkeypatch: pytest.MonkeyPatch, text: str, needle: str) -> None:
    def sweep(**kwargs: object) -> None:
        raise AssertionError(f"validation let this sweep through: {kwargs}")

    monkeypatch.setitem(sys.modules, "flows.sweep", types.SimpleNamespace(sweep=sweep))
    (sandbox / "work" / "sweep.yaml").write_text(text)
    refused(["sweep", "sweep.yaml"], needle, sandbox)


def test_a_resume_path_inside_the_runs_root_is_accepted(sandbox: Path) -> None:
    """The stub flow is reached (exit 1, its AssertionError) only when every check passed."""
    res = runner.invoke(app, ["train", "good.yaml", "--resume", str(sandbox / "data" / "runs" / "old-run")])
    assert isinstance(res.exception, AssertionError) and "old-run" in str(res.exception)


def test_validation_imports_neither_prefect_nor_torch(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: {name: NoSuchEnv}\n")
    code = textwrap.dedent(f"""
        import sys
        from typer.testing import CliRunner
        from flows.cli import app
        res = CliRunner().invoke(app, ["train", {str(bad)!r}])
        heavy = sorted(m for m in ("prefect", "torch", "mlflow", "transformers") if m in sys.modules)
        print(res.exit_code, heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "RAGEN_DATA_DIR": str(tmp_path)})
    assert out.stdout.split("\n")[-2:] == ["2 []", ""], out.stdout + out.stderr


def test_the_flow_applies_the_same_rule_to_its_parameters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_name`` and ``resume`` are parameters of the `ragen-train` deployment too, which bypasses the CLI:
    the flow body checks them before it loads or writes anything (called as a plain function here)."""
    from flows.train import train  # Prefect and torch: imported by this test alone

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    smoke = str(Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml")
    cases = [({"run_name": "/tmp/x"}, "run_name: bad run name"), ({"run_name": "../../x"}, "run_name: bad run name"),
             ({"resume": "../../etc"}, "resume: '../../etc' is not a run folder"),
             ({"resume": "gone"}, "resume: no run 'gone'")]
    for kwargs, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            train.fn(experiment=smoke, **kwargs)
    assert not (tmp_path / "data").exists()
