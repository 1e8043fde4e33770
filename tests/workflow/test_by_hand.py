"""The workflow scripts run by hand: a wrong number of arguments exits 2 with the script's usage line (-h: the usage,
exit 0), before any work and without a traceback."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "workflow" / "scripts"
USAGE = {  # script -> (its usage line, how many arguments it takes)
    "aggregate": ("python aggregate.py OUT.csv RECORD.json ...", "2 or more"),
    "capacity": ("python capacity.py OUT.csv OUT.md OUT.png", "3"),
    "headline": ("python headline.py RUNS.csv OUTDIR", "2"),
    "plots": ("python plots.py RUNS.csv FIGURE_NAME OUT.png", "3"),
    "plots_pareto": ("python plots_pareto.py RUNS.csv OUT.png", "2"),
    "plots_repro": ("python plots_repro.py NAME REPRO.csv OUT.png", "3"),
    "run_notebook": ("python run_notebook.py NOTEBOOK.ipynb RESULTS_DIR OUT.ipynb", "3"),
    "table_html": ("python table_html.py TABLE.csv OUT.html", "2"),
}


def run_by_hand(monkeypatch, script: str, *argv: str) -> int:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as for a script run by path
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / f"{script}.py"), *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(SCRIPTS / f"{script}.py"), run_name="__main__")
    return stop.value.code


@pytest.mark.parametrize("script", list(USAGE))
def test_a_wrong_argument_count_is_a_usage_error(script, monkeypatch, capsys, tmp_path):
    usage, count = USAGE[script]
    assert run_by_hand(monkeypatch, script, str(tmp_path / "only-one")) == 2
    err = capsys.readouterr().err
    assert f"usage: {usage}" in err and f"error: {count} argument(s) expected, got 1" in err
    assert run_by_hand(monkeypatch, script, "--help") == 0
    assert capsys.readouterr().err.strip() == f"usage: {usage}"
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_helper_returns_the_arguments_when_the_count_is_right(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import by_hand

    assert by_hand.arguments("u", ["a", "b"], 2) == ["a", "b"]
    assert by_hand.arguments("u", ["a", "b", "c"], 2, more=True) == ["a", "b", "c"]
    with pytest.raises(SystemExit) as stop:
        by_hand.arguments("u", ["a", "b", "c"], 2)
    assert stop.value.code == 2
