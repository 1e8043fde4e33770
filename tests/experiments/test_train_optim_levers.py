"""The training job with the full-fine-tuning optimizer levers (lowmembp.methods.optim_levers): a run with GaLore's
options written into the name trains and records the name; those that cannot run here stop the job at once with what
to do."""
import importlib.util
import json

import pytest

from experiments import train

TINY = ["--task", "mnist5k", "--method", "baseline", "--batch-size", "4", "--steps", "2", "--eval-limit", "16"]


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="galore-torch not installed")
def test_galore_layerwise_trains_and_is_recorded(tmp_path):
    out = tmp_path / "r.json"
    assert train.main([*TINY, "--optimizer", "galore-adamw-layerwise@rank=8", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok", rec.get("message")
    assert rec["run"]["optimizer"] == "galore-adamw-layerwise@rank=8" and rec["final_loss"] > 0


@pytest.mark.parametrize("extra, needle", [
    (["--optimizer", "galore-adamw-layerwise", "--grad-accum", "2"], "inside the backward"),
    (["--optimizer", "galore-adamw@rank=x"], "rank must be a int"),
    (["--optimizer", "adafactor@rank=4"], "'adafactor' takes no options"),
    (["--optimizer", "adamw-cpu-offload", "--device", "cpu"], "needs a CUDA device"),
])
def test_a_lever_that_does_not_fit_the_run_fails_at_once(extra, needle, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert train.main([*TINY, *extra, "--out", str(out)]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()
