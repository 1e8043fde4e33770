"""Multi-process training jobs (``experiments.distributed``) on the CPU: two gloo processes, spawned with torchrun's
environment, against one process with the same global batch.

Tolerances: the two ranks each average the loss over their 4 rows and DDP / FSDP2 average the two gradients, where
one process sums all 8 rows at once — the same numbers added in another order (float32, ~1e-7 relative per step),
which three AdamW steps carry into the weights at about lr × 1e-6 — more where a gradient entry is near Adam's ε,
and by how much depends on the CPU's kernels (lowmembp: 1.0e-5 on an AMD EPYC Zen 5, under 1e-5 on earlier
machines). So losses agree to 1e-5 relative and weights to 3e-5 absolute (a different selection, batch split or
statistics changes the gradients themselves, and Adam's steps are ~lr each: the three warm-up steps' learning rates
sum to 6e-4). Mesa rounds stochastically with noise indexed by element: a rank's 4 rows draw other noise than the
same rows in the 8-row batch, so Mesa agrees within its quantisation noise (looser bounds, below).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import distributed_jobs as jobs
from experiments import train

pytestmark = pytest.mark.slow  # the full suite only: DDP / FSDP in 2 processes

COMMON = ["--task", "mnist5k", "--batch-size", "8", "--steps", "3", "--limit", "48", "--eval-limit", "8",
          "--no-progress", "--seed", "1", "--threads", "1"]
CELLS = [("ddp", "baseline", []), ("ddp", "lowmembp", []), ("ddp", "lora+lowmembp", ["--rank", "2"]),
         ("ddp", "mesa", []), ("ddp", "tokentune", ["--k", "5"]),
         ("fsdp", "baseline", []), ("fsdp", "lora+lowmembp", ["--rank", "2"]), ("fsdp", "tokentune", ["--k", "5"])]
EXACT = dict(loss=1e-5, weights=3e-5)
MESA = dict(loss=2e-3, weights=2e-3)  # measured: ~1e-4 (loss), ~1e-4 (weights) — quantisation noise


def _argv(method, extra, out: Path, name: str, mode: str | None = None) -> list[str]:
    argv = COMMON + ["--method", method, *extra, "--out", str(out / f"{name}.json"),
                     "--save-model", str(out / f"{name}.safetensors")]
    return argv + (["--distributed", mode] if mode else [])


def _name(mode, method):
    return f"{mode}-{method.replace('+', '_')}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every cell in two processes (one spawn; also the Mesa jobs below), and each method once in this process."""
    out = tmp_path_factory.mktemp("distributed")
    assert "WORLD_SIZE" not in os.environ
    jobs.spawn([("train", (_argv(method, extra, out, _name(mode, method), mode),)) for mode, method, extra in CELLS]
               + [("mesa", (str(out / "mesa-reduced.pt"), True)), ("mesa", (str(out / "mesa-own.pt"), False))])
    threads = torch.get_num_threads()
    for method, extra in {m: e for _, m, e in CELLS}.items():
        assert train.main(_argv(method, extra, out, _name("one", method))) == 0
    torch.set_num_threads(threads)
    return out


def _record(path: Path) -> dict:
    rec = json.loads(path.read_text())
    assert rec["status"] == "ok", rec["message"]
    return rec


@pytest.mark.parametrize("mode, method, extra", CELLS, ids=[_name(m, x) for m, x, _ in CELLS])
def test_two_processes_train_as_one(runs, mode, method, extra):
    one, two = _record(runs / f"{_name('one', method)}.json"), _record(runs / f"{_name(mode, method)}.json")
    tol = MESA if method == "mesa" else EXACT
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=tol["loss"])
    assert two["metric"]["value"] == pytest.approx(one["metric"]["value"], abs=1 / 8 + 1e-9 if method == "mesa"
                                                   else 1e-9)
    w1 = load_file(runs / f"{_name('one', method)}.safetensors")
    w2 = load_file(runs / f"{_name(mode, method)}.safetensors")
    assert set(w1) == set(w2)
    worst = max(float((w1[k].float() - w2[k].float()).abs().max()) for k in w1)
    assert worst < tol["weights"], f"weights differ by up to {worst:.3g}"

    d = two["distributed"]
    assert (d["mode"], d["world_size"], d["backend"], d["batch_per_rank"]) == (mode, 2, "gloo", 4)
    assert len(d["peak_bytes_by_rank"]) == 2 and d["peak_bytes_max"] == max(d["peak_bytes_by_rank"])
    assert d["peak_bytes_mean"] == pytest.approx(sum(d["peak_bytes_by_rank"]) / 2)
    assert two["peak"]["device"]["bytes"] == d["peak_bytes_by_rank"][0]
    assert one["distributed"] is None and two["run"]["batch_size"] == 8
    # global throughput: every rank's samples over rank 0's step time
    assert two["throughput"]["samples_per_s"] == pytest.approx(8 / two["step_time_s"]["p50"], rel=1e-6)
    if mode == "fsdp":  # sharded: each rank holds about half the parameters and optimizer state
        assert two["peak"]["device"]["by_category"]["optimizer_state"] < \
            0.6 * one["peak"]["device"]["by_category"]["optimizer_state"]


def test_mesa_statistics_are_reduced_over_ranks(runs):
    """Mesa at λ = 0.9 under DDP, the second rank's rows 4× wider than the first's: with the batch statistics
    reduced over the ranks the EMA ranges are one process's (to float32 rounding); without (each rank its own, rank
    0's broadcast by DDP) they are not. The gradients are one process's within Mesa's rounding noise: at this tiny
    scale that noise is large — two one-process runs that differ only in the rounding seed are ~20 % apart (the
    relative norm of the gradient difference) — so the gradient bound is the noise floor, measured here."""
    with_, without = runs / "mesa-reduced.pt", runs / "mesa-own.pt"
    model = jobs.mesa_model()
    ref = jobs.mesa_gradients(model, jobs.mesa_batches())
    ref_alpha = {n: b.clone() for n, b in model.named_buffers() if n.endswith("alpha")}
    model = jobs.mesa_model()
    torch.manual_seed(999)  # other rounding noise, same weights and data
    floor = jobs.mesa_gradients(model, jobs.mesa_batches())

    def rel_err(grads):
        flat = torch.cat([grads[k].flatten() for k in ref])
        want = torch.cat([ref[k].flatten() for k in ref])
        return float((flat - want).norm() / want.norm())

    reduced, own = torch.load(with_), torch.load(without)
    assert len(ref_alpha) > 10 and set(reduced["alphas"]) == set(ref_alpha)
    worst = max(float(((reduced["alphas"][k] - a).abs() / a.abs().clamp_min(1e-12)).max())
                for k, a in ref_alpha.items())
    assert worst < 1e-5, worst
    assert any(not torch.allclose(own["alphas"][k], a, rtol=1e-2) for k, a in ref_alpha.items())
    assert rel_err(reduced["grads"]) < 1.5 * rel_err(floor), (rel_err(reduced["grads"]), rel_err(floor))


def test_arguments(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    assert train.main(COMMON + ["--method", "baseline", "--distributed", "ddp", "--out", str(out)]) == 2
    assert "torchrun --nproc-per-node N" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(COMMON + ["--method", "baseline", "--out", str(out)]) == 2
    assert "without --distributed" in capsys.readouterr().err
    assert train.main(COMMON[:2] + ["--batch-size", "7"] + COMMON[4:] +
                      ["--method", "baseline", "--distributed", "fsdp", "--out", str(out)]) == 2
    assert "must divide by the 2 processes" in capsys.readouterr().err
    assert not out.exists()


def test_the_run_rule_starts_torchrun_for_several_gpus(tmp_path):
    """A sweep cell's ``resources: {gpu: N}`` reaches run_cell.py as ``--nproc N``: N > 1 → torchrun."""
    from script_loader import load_script

    run_cell = load_script("workflow/scripts/run_cell.py")
    out = tmp_path / "r.json"
    args = ["--task", "mnist5k", "--method", "baseline", "--batch-size", "8"]
    for n in (0, 1):
        assert run_cell.job_command("py", args, out, n) == ["py", "-m", "experiments.train", *args, "--out", str(out)]
    assert run_cell.job_command("py", args, out, 4) == [
        "py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "experiments.train", *args,
        "--out", str(out), "--distributed", "ddp"]
    fsdp = run_cell.job_command("py", args + ["--distributed", "fsdp"], out, 2)
    assert fsdp[-4:] == ["--distributed", "fsdp", "--out", str(out)] and fsdp.count("--distributed") == 1
