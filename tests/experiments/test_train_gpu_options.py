"""The training job's GPU-facing options: --synthetic-data (paper tasks on random weights and generated inputs of the
paper's shapes), --capture (refused off CUDA; the captured step on a GPU, marker gpu), and what a CUDA run records."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from experiments import train
from experiments.record import Record, schema

TINY_VIT = ["--task", "cifar100", "--model", "vit-b16", "--layers", "2", "--synthetic-overrides",
            json.dumps({"img_size": 32, "embed_dim": 48, "num_heads": 2})]
TINY_TEXT = {"glue-rte": ["--task", "glue-rte", "--model", "roberta-base", "--max-len", "16", "--layers", "1",
                          "--synthetic-overrides", json.dumps({"hidden_size": 32, "num_attention_heads": 2,
                                                               "intermediate_size": 64, "vocab_size": 300})],
             "alpaca": ["--task", "alpaca", "--model", "llama-7b", "--max-len", "16", "--layers", "1",
                        "--synthetic-overrides", json.dumps({"hidden_size": 32, "num_attention_heads": 2,
                                                             "num_key_value_heads": 2, "intermediate_size": 64,
                                                             "vocab_size": 300})]}
COMMON = ["--batch-size", "2", "--steps", "4", "--no-progress", "--seed", "3"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run(argv) -> int:
    return train.main([str(a) for a in argv])


def record(path) -> dict:
    rec = json.loads(Path(path).read_text())
    jsonschema.validate(rec, schema())
    assert Record.from_dict(rec).to_dict() == rec
    return rec


@pytest.mark.parametrize("args", [TINY_VIT, TINY_TEXT["glue-rte"], TINY_TEXT["alpaca"]],
                         ids=["cifar100", "glue-rte", "alpaca"])
def test_synthetic_data_runs_a_paper_task_without_downloads_and_records_no_metric(args, tmp_path):
    out = tmp_path / "r.json"
    assert run(args + COMMON + ["--method", "lora+lowmembp", "--synthetic-data", "--data-dir", tmp_path / "empty",
                                "--out", out]) == 0
    rec = record(out)
    assert rec["status"] == "ok" and rec["run"]["synthetic_data"] is True and rec["metric"] is None
    assert "synthetic data: no metric" in " ".join(rec["notes"])
    assert rec["task_facts"]["layers"] in (1, 2) and "random weights" in rec["task_facts"]["synthetic_data"]
    assert rec["peak"]["device"]["bytes"] > 0 and rec["step_time_s"]["n"] == 2
    st = rec["step_time_s"]
    assert st["ci95_low"] <= st["p50"] <= st["ci95_high"]
    assert "capture" not in rec["run"]


def test_synthetic_data_is_the_same_run_twice(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        assert run(TINY_VIT + COMMON + ["--method", "lora", "--synthetic-data", "--threads", "1", "--out", out]) == 0
    assert record(a)["final_loss"] == record(b)["final_loss"]


@pytest.mark.parametrize("argv, needle", [
    (["--task", "mnist5k", "--method", "baseline", "--synthetic-data"], "ships its own data"),
    (TINY_VIT + ["--method", "lora", "--synthetic-data", "--eval-every", "2"], "no metric"),
    (["--task", "cifar100", "--model", "vit-b16", "--method", "lora", "--layers", "2"], "only with --synthetic-data"),
    (TINY_VIT[:-1] + ["{not json", "--method", "lora", "--synthetic-data"], "JSON object"),
    (TINY_VIT + ["--method", "lora", "--synthetic-data", "--capture", "cuda-graphs", "--device", "cpu"],
     "needs a CUDA device"),
    (TINY_VIT + ["--method", "lora", "--synthetic-data", "--capture", "reduce-overhead", "--device", "cpu"],
     "leave --capture out"),
])
def test_bad_gpu_options_fail_at_once_with_exit_2(argv, needle, tmp_path, capsys):
    rc = run(argv + ["--batch-size", "2", "--out", tmp_path / "r.json"])
    assert rc == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_missing_download_says_how_to_fetch_it_or_to_use_synthetic_data(tmp_path, capsys):
    rc = run(["--task", "cifar100", "--model", "vit-b16", "--method", "lora", "--batch-size", "2", "--data-dir",
              tmp_path, "--out", tmp_path / "r.json"])
    err = capsys.readouterr().err
    assert rc == 2 and "tv.datasets.CIFAR100(" in err and "--synthetic-data" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the default device of a CPU machine")
def test_capture_without_a_device_given_is_refused_on_a_cpu_machine(tmp_path, capsys):
    rc = run(TINY_VIT + ["--method", "lora", "--synthetic-data", "--capture", "cuda-graphs", "--batch-size", "2",
                         "--out", tmp_path / "r.json"])
    assert rc == 2 and "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("capture", ["none", "cuda-graphs", "reduce-overhead"])
@pytest.mark.parametrize("method", ["lora", "lora+lowmembp", "lora+mesa-gelu-ln", "lora+checkpointing"])
def test_cuda_run_records_the_allocator_events_and_the_capture(method, capture, tmp_path):
    out = tmp_path / "r.json"
    rc = run(TINY_VIT + ["--method", method, "--synthetic-data", "--batch-size", "4", "--steps", "8", "--dtype",
                         "fp16", "--capture", capture, "--no-progress", "--device", "cuda", "--out", out])
    rec = record(out)
    assert rc == 0, rec["message"]
    assert rec["peak"]["device"]["reserved_bytes"] >= rec["peak"]["device"]["bytes"] > 0
    assert rec["step_time_s"]["how"].startswith("cuda events") and rec["environment"]["cuda"]
    assert rec["environment"]["capability"] and rec["environment"]["device_memory_bytes"] > 0
    assert rec["run"].get("capture") == (None if capture == "none" else capture)


@pytest.mark.gpu
def test_captured_run_trains_as_the_eager_run_does(tmp_path):
    """Same losses (to fp32 tolerance) eager and captured: the captured step is the eager step, replayed. The
    captured run takes CAPTURE_WARMUP extra steps at its step 2, so compare the steps before it (0-1) and the
    final loss's finiteness only."""
    losses = {}
    for capture in ("none", "cuda-graphs"):
        out = tmp_path / f"{capture}.json"
        assert run(TINY_VIT + ["--method", "lora+lowmembp", "--synthetic-data", "--steps", "10", "--dtype", "fp32",
                               "--capture", capture, "--no-progress", "--device", "cuda", "--batch-size", "4",
                               "--out", out]) == 0
        losses[capture] = record(out)["final_loss"]
    assert torch.isfinite(torch.tensor(losses["cuda-graphs"]))
    assert losses["cuda-graphs"] == pytest.approx(losses["none"], rel=0.2)


def test_the_jobs_captured_path_on_the_cpu_through_a_stand_in_for_cuda_graphs(tmp_path, monkeypatch):
    """The job's --capture cuda-graphs path (steps 0-1 eager for the probes, step 2 warms up and captures, then
    replays; fused AdamW with a tensor lr; the schedule refilling it) run on the CPU: the CUDA graph calls are a
    stand-in that replays by calling the captured step again (tests/measurement/test_capture.py). The arguments'
    CUDA check is passed by (it refuses a CPU, as tested above)."""
    import sys as _sys

    from experiments import args as job_args
    from lowmembp.measurement import capture

    sys_path = str(Path(__file__).resolve().parents[1] / "measurement")
    monkeypatch.syspath_prepend(sys_path)
    from test_capture import FakeGraphs

    made = []

    class Graphs(FakeGraphs):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(capture, "_CudaGraphs", Graphs)
    monkeypatch.setattr(job_args, "check_capture_args", lambda values: None)
    out = tmp_path / "r.json"
    rc = run(TINY_VIT + ["--method", "lora+lowmembp", "--synthetic-data", "--batch-size", "2", "--steps", "7",
                         "--capture", "cuda-graphs", "--device", "cpu", "--no-progress", "--out", out])
    rec = record(out)
    assert rc == 0, rec["message"]
    assert rec["run"]["capture"] == "cuda-graphs" and rec["run"]["steps"] == 7
    assert rec["step_time_s"]["n"] == 4  # steps 3-6: 0-1 probes, 2 the warm-up and capture
    assert "step 2 warms up (3 extra steps on its batch) and captures" in " ".join(rec["notes"])
    log = made[0].log
    assert log[:2] == [("warm_up", 3), ("capture",)] and log.count(("replay",)) == 5  # steps 2-6
    assert _sys.modules["experiments.train"].CAPTURE_WARMUP == 3
