"""The trajectory viewer: `ragen show` in the terminal and the per-iteration HTML page (tracking/viewer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.models import load_tokenizer
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.store import parquet as store
from ragen_core.tracking import viewer

REPLIES = ["<think>box is left of me</think><answer>Left || Up</answer>", "<script>alert(1)</script> junk"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with two iterations of Sokoban shards: 2 groups x 2 members, the second group dropped."""
    root = tmp_path_factory.mktemp("runs") / "viewer-run"
    (root / "config.yaml").parent.mkdir(parents=True)
    (root / "config.yaml").write_text("name: viewer-run\n")
    tok = load_tokenizer("tiny-random")
    gen = ScriptedGenerator(tok, lambda c, r, p: REPLIES[(c + r) % 2])
    trajs = run_rollouts(EnvConfig(name="Sokoban"), gen, tok, RolloutConfig(max_turns=2, max_new_tokens=24),
                         seeds=[3, 4], n_per_group=2)
    for it in (0, 1):
        store.write_shard(root, it, trajs, [True, True, False, False])
    return root


def test_select_defaults_to_the_last_iteration_and_filters(run: Path) -> None:
    sel = viewer.select(run)
    assert sel.iteration == 1 and len(sel.trajectories) == 4 and sel.kept == [True, True, False, False]
    assert {t.group_id for t in viewer.select(run, 0, group=1).trajectories} == {1}
    assert viewer.select(run, kept=True).kept == [True, True]
    assert viewer.select(run, kept=False).kept == [False, False]
    with pytest.raises(ValueError, match="no iteration 7"):
        viewer.select(run, 7)
    with pytest.raises(ValueError, match="no group 9"):
        viewer.select(run, 0, group=9)
    with pytest.raises(ValueError, match="no trajectory shards"):
        viewer.select(run.parent / "missing")


def test_terminal_view_draws_states_replies_and_the_kept_flag(run: Path) -> None:
    console = Console(record=True, width=140)
    viewer.show(viewer.select(run, 0, group=0), console)
    out = console.export_text()
    sel = viewer.select(run, 0, group=0)
    first_state = sel.trajectories[0].turns[0].observation.splitlines()[0]
    assert first_state in out  # the grid, as `ragen play` draws it
    assert "KEPT" in out and "dropped" not in out
    assert "box is left of me" in out and "actions: Left || Up" in out


def test_html_page_escapes_model_text_and_shows_every_turn(run: Path) -> None:
    sel = viewer.select(run, 1)
    page = viewer.iteration_html(sel)
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    kept_turns = sum(len(t.turns) for t, k in zip(sel.trajectories, sel.kept, strict=True) if k)
    assert page.count("<tr class='kept'>") == kept_turns
    assert "box is left of me" in page and "2 kept by the filter" in page
    assert "<pre>" + sel.trajectories[0].turns[0].observation.splitlines()[0] in page.replace("&#x27;", "'")


def test_ragen_show_command(run: Path, tmp_path: Path) -> None:
    from flows.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["show", str(run), "--iter", "0", "--group", "1"])
    assert res.exit_code == 0, res.output
    assert "group 1" in res.output and "dropped" in res.output
    page = tmp_path / "it0.html"
    res = runner.invoke(app, ["show", str(run), "--iter", "0", "--html", str(page)])
    assert res.exit_code == 0 and page.read_text().startswith("<!doctype html>")
    res = runner.invoke(app, ["show", str(run), "--iter", "5"])
    assert res.exit_code == 1 and "no iteration 5" in res.output
