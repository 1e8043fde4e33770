"""Every argument of the training job is checked before any work (exit 2, a message, no record), and a run that
started ends with a record whatever fails later — the environment capture and the record's assembly included.
TokenTune's ``--k`` is read as its registry entry declares (``kinds``: a count or a fraction): ``--k 0.3`` is the
official scripts' ``--prefix_length 0.3``, ``--k 16`` a count; values the method refuses (0, -1, 1.5, text) stop the
job at once with status 2; ``k`` written into the method spec (``tokentune@k=4``) is the same option, given once."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from experiments import train
from experiments.args import ArgError, parse_args

BASE = ["--task", "mnist5k", "--method", "baseline", "--batch-size", "4", "--limit", "32", "--eval-limit", "8",
        "--no-progress"]
RUN = [*BASE, "--steps", "3"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The job sets torch's thread count (--threads); give the test process its own back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def refused(argv, capsys) -> str:
    t0 = time.time()
    assert train.main([str(a) for a in argv]) == 2
    assert time.time() - t0 < 10  # at once: nothing was built or trained
    return capsys.readouterr().err


@pytest.fixture
def places(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    locked = "/proc/lowmembp-test/r.json" if os.geteuid() == 0 else str(tmp_path / "locked" / "r.json")
    if os.geteuid() != 0:
        (tmp_path / "locked").mkdir(mode=0o555)
    return {"empty": ("", "empty path"), "folder": (str(tmp_path / "a_dir"), "is a directory"),
            "under a file": (str(tmp_path / "a_file" / "r.json"), "is a file"),
            "unwritable": (locked, "cannot write")}


@pytest.mark.parametrize("where", ["empty", "folder", "under a file", "unwritable"])
@pytest.mark.parametrize("flag", ["--out", "--save-model"])
def test_unwritable_destinations_are_refused_at_start(flag, where, places, tmp_path, capsys):
    path, needle = places[where]
    out = str(tmp_path / "r.json") if flag == "--save-model" else path
    argv = [*BASE, "--out", out] + ([flag, path] if flag == "--save-model" else [])
    err = refused(argv, capsys)
    assert f"{flag}:" in err and needle in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--max-memory-mb", "0"], "--max-memory-mb must be positive"),
    (["--max-memory-mb", "-5"], "--max-memory-mb must be positive"),
    (["--max-memory-mb", "nan"], "--max-memory-mb must be finite"),
    (["--warmup-steps", "-5"], "--warmup-steps must be a non-negative integer"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must be >= 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 4294967295]"),
    (["--seed", str(2**32)], "--seed must be an integer in"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--epochs", "inf"], "--epochs must be finite"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer"),
    (["--eval-batch-size", "-2"], "--eval-batch-size must be a positive integer"),
    (["--eval-limit", "0"], "--eval-limit must be a positive integer"),
    (["--threads", "0"], "--threads must be a positive integer"),
    (["--timing-warmup", "-1"], "--timing-warmup must be a non-negative integer"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--lr", "0"], "--lr must be positive"),
    (["--lr", "nan"], "--lr must be finite"),
    (["--lr-base", "-1"], "--lr-base must be positive"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--device", "cuda:99"], "--device cuda:99"),
])
def test_bad_numbers_and_devices_are_refused(extra, needle, tmp_path, capsys):
    err = refused([*BASE, *extra, "--out", tmp_path / "r.json"], capsys)
    assert needle in err, err
    assert not (tmp_path / "r.json").exists()


def test_batch_size_zero_in_a_config_file_is_refused(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: mnist5k\nmethod: baseline\nbatch_size: 0\nwarmup_steps: -3\n")
    assert "--batch-size must be a positive integer" in refused(["--config", cfg, "--out", tmp_path / "r.json"],
                                                               capsys)
    cfg.write_text("task: mnist5k\nmethod: baseline\nbatch_size: 2\nwarmup_steps: -3\n")
    assert "--warmup-steps must be a non-negative" in refused(["--config", cfg, "--out", tmp_path / "r.json"],
                                                              capsys)
    cfg.write_text("task: mnist5k\nmethod: baseline\nbatch_size: 2\nlr: 1e-3\n")  # YAML reads 1e-3 as text
    from experiments.args import parse_args

    assert parse_args(["--config", str(cfg), "--out", str(tmp_path / "r.json")])[0].lr == 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_with_one_message(tmp_path, capsys):
    err = refused([*BASE, "--device", "cuda", "--out", tmp_path / "r.json"], capsys)
    assert "CUDA is not available" in err and "--device cpu" in err and "Traceback" not in err


def test_same_file_for_record_and_weights_is_refused(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert "name the same file" in refused([*BASE, "--out", out, "--save-model", out], capsys)


def test_a_failing_environment_capture_still_leaves_a_record(tmp_path, monkeypatch):
    from experiments import provenance

    def broken(device=None):
        raise RuntimeError("no device name today")
    monkeypatch.setattr(provenance, "capture_environment", broken)
    out = tmp_path / "r.json"
    assert train.main([*RUN, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok" and "no device name today" in rec["environment"]["device"]
    assert rec["metric"] is not None  # the run's results are kept


def test_a_record_that_does_not_assemble_becomes_an_error_record(tmp_path, monkeypatch):
    real = train.train

    def sloppy(cfg, task, out):
        real(cfg, task, out)
        out["final_loss"] = "not a number"  # a bug in the job: the section does not fit the layout
    monkeypatch.setattr(train, "train", sloppy)
    out = tmp_path / "r.json"
    assert train.main([*RUN, "--out", str(out)]) == 1
    rec = json.loads(out.read_text())
    assert rec["status"] == "error" and "could not assemble its record" in rec["message"]
    assert (rec["run"]["task"], rec["run"]["batch_size"]) == ("mnist5k", 4)


def test_good_arguments_still_run(tmp_path):
    out = tmp_path / "new" / "dir" / "r.json"  # missing parents are fine
    assert train.main([*RUN, "--seed", "0", "--warmup-steps", "0", "--timing-warmup", "0", "--out", str(out)]) == 0
    rec = json.loads(Path(out).read_text())
    assert rec["status"] == "ok" and rec["step_time_s"]["n"] == 1  # steps 0, 1 measure memory; step 2 is timed


def test_unreadable_or_invalid_config_files_are_refused(tmp_path, capsys):
    assert "cannot read it" in refused(["--config", tmp_path / "missing.yaml", "--out", tmp_path / "r.json"], capsys)
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    assert "not valid YAML" in refused(["--config", bad, "--out", tmp_path / "r.json"], capsys)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert "not valid JSON" in refused(["--config", bad, "--out", tmp_path / "r.json"], capsys)


def test_a_training_pool_smaller_than_a_batch_is_refused(tmp_path, capsys):
    assert "smaller than one batch" in refused([*BASE, "--limit", "3", "--out", tmp_path / "r.json"], capsys)


def test_list_shows_the_per_method_defaults(capsys):
    assert train.main(["--list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("tweets-sentiment:"))
    assert "lr 0.0001" in line and "lora: lr 0.003" in line


# ---------------------------------------------------------------------------------------------------- TokenTune's --k
K_BASE = ["--task", "mnist5k", "--batch-size", "4", "--limit", "32", "--eval-limit", "8", "--no-progress",
        "--device", "cpu"]


def tokentune_options(tmp_path, *extra):
    cfg, _ = parse_args([*K_BASE, "--out", str(tmp_path / "r.json"), *map(str, extra)])
    return cfg.method, cfg.method_options


@pytest.mark.parametrize("text, value", [("0.3", 0.3), ("16", 16), ("1", 1), ("0.05", 0.05), ("4.0", 4.0)])
def test_k_reads_as_a_count_or_a_fraction(tmp_path, text, value):
    _, opts = tokentune_options(tmp_path, "--method", "tokentune", "--k", text)
    assert opts["k"] == value
    assert type(opts["k"]) is type(value)  # 0.3 a fraction, 16 a count (int("0.3") was an error); 4.0: apply counts 4


def test_a_fraction_from_a_config_file_and_in_the_spec(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("method: tokentune\noptions: {k: 0.3}\n")
    assert tokentune_options(tmp_path, "--config", conf)[1] == {"k": 0.3}
    assert tokentune_options(tmp_path, "--method", "tokentune@k=0.3") == ("tokentune@k=0.3", {"k": 0.3})
    assert tokentune_options(tmp_path, "--method", "lora@rank=2+tokentune@k=8", "--seed", "1") == \
        ("lora@rank=2+tokentune@k=8", {"rank": 2, "k": 8})
    # the config file's k gives way to the spec's (the spec names the cell)
    assert tokentune_options(tmp_path, "--config", conf, "--method", "tokentune@k=4")[1] == {"k": 4}


@pytest.mark.parametrize("extra, needle", [
    (["--method", "tokentune", "--k", "0"], "got 0"),
    (["--method", "tokentune", "--k", "-1"], "got -1"),
    (["--method", "tokentune", "--k", "1.5"], "got 1.5"),
    (["--method", "tokentune", "--k", "0.0"], "got 0.0"),
    (["--method", "tokentune", "--k", "many"], "cannot read 'many' as int or float"),
    (["--method", "tokentune@k=0"], "got 0"),
    (["--method", "tokentune@k=4", "--k", "4"], "fixed by the method spec 'tokentune@k=4'"),
    (["--method", "tokentune@rank=4"], "'tokentune' does not take option(s) rank"),
    (["--method", "tokentune@k"], "write options as name@option=value"),
    (["--method", "tokentune@k=1/2"], "write options as name@option=value"),
])
def test_bad_k_stops_the_job_at_once(tmp_path, capsys, extra, needle):
    out = tmp_path / "r.json"
    assert train.main([*K_BASE, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert not out.exists()
    with pytest.raises(ArgError):
        parse_args([*K_BASE, "--out", str(out), *extra])


def test_the_fraction_reaches_the_model(tmp_path):
    """A 2-step run with --k 0.5: the record keeps k = 0.5, and TokenTune took 1 + int(0.5 * 16) = 9 of the 17
    tokens per image (the class token plus half of the 16 patches)."""
    import json

    import lowmembp
    from lowmembp.methods.tokentune import tokentune_state

    out = tmp_path / "r.json"
    assert train.main([*K_BASE, "--out", str(out), "--method", "tokentune", "--k", "0.5", "--steps", "2"]) == 0
    rec = json.loads(out.read_text())
    assert rec["status"] == "ok" and rec["method_options"] == {"k": 0.5}
    from experiments.tasks import mnist5k

    cfg, task = parse_args([*K_BASE, "--out", str(tmp_path / "s.json"), "--method", "tokentune", "--k", "0.5"])
    model = lowmembp.apply(task.build(cfg.model, cfg).model, cfg.method, **cfg.method_options)
    model.train()
    model(torch.randn(2, 1, 28, 28))
    assert tokentune_state(model).last.positions.shape == (2, 1 + int(0.5 * (mnist5k.SEQ_LEN - 1)))
