"""tests/conftest.py's rule for a component a test needs but the machine lacks: outside CI the test skips with
the reason, under CI (``CI`` is ``true`` or ``1``, in any case) it fails with the reason.

The rule is checked on the outcome exceptions pytest raises (``pytest.skip.Exception``,
``pytest.fail.Exception``), with ``CI`` set by monkeypatch. Run:
``.venv/bin/python -m pytest tests/unit/test_require.py -q``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import in_ci, require, require_module

NO_SUCH_MODULE = "ragen_no_such_module"  # a module no environment installs
REASON = "needs Debian's chromium (apt-get install chromium)"


@pytest.mark.parametrize("value", ["true", "TRUE", "True", "1", " true\n"])
def test_ci_true_or_1_in_any_case_is_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci()


@pytest.mark.parametrize("value", [None, "", "false", "0", "yes", "on"])
def test_ci_unset_or_anything_else_is_not_ci(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()


@pytest.mark.parametrize("ci", [None, "true"], ids=["local", "ci"])
def test_an_available_component_neither_skips_nor_fails(monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert require(True, REASON) is None
    assert require_module("json", REASON) is json


def test_outside_ci_a_missing_component_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as info:
        require(False, REASON)
    assert info.value.msg == REASON


def test_under_ci_a_missing_component_fails_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as info:
        require(False, REASON)
    assert info.value.msg == f"{REASON} (CI=true: a missing component fails the test)"
    assert not info.value.pytrace  # the reason alone, not the helper's traceback


def test_a_module_that_does_not_import_skips_outside_ci_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        require_module(NO_SUCH_MODULE, "needs the extra")
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        require_module(NO_SUCH_MODULE, "needs the extra")
    # the reason, then the ImportError's own words (which module is missing)
    assert skipped.value.msg == f"needs the extra (No module named '{NO_SUCH_MODULE}')"
    assert failed.value.msg == f"{skipped.value.msg} (CI=true: a missing component fails the test)"


@pytest.mark.parametrize("check", [lambda: require(False, REASON), lambda: require_module(NO_SUCH_MODULE, REASON)],
                         ids=["require", "require_module"])
def test_a_skip_is_reported_at_the_callers_line(monkeypatch: pytest.MonkeyPatch, check) -> None:
    # pytest's summary shows the last frame not hidden by __tracebackhide__: the test's, not tests/conftest.py's
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as info:
        check()
    shown = [entry for entry in info.traceback if not entry.ishidden(info)]
    assert Path(shown[-1].path) == Path(__file__)
