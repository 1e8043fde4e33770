"""The planner (lowmembp.plan): its peaks are estimate()'s, its largest batch is checked by estimate, its cost order
agrees with measured step times, its combinations are the registry's, and the command prints its table."""
import csv
import inspect
import json
from pathlib import Path

import pytest

from lowmembp.estimator.step import estimate, estimate_by_depth
from lowmembp.estimator.hf_config import hf_spec
from lowmembp.methods.registry import parse
from lowmembp.plan import make_plan
from lowmembp.plan.combos import (ALL, DEFAULT_MAX_METHODS, NOT_ESTIMATED, VARIANTS, combinations,
                                  default_max_methods, option_grid, parse_option_sweeps, variants)
from lowmembp.plan.models import resolve_model
from lowmembp.plan.search import largest_batch
from lowmembp.plan.sources import margin, measured_ratios, parse_bytes

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_RUNS = ROOT / "results" / "reference" / "runs.csv"
# BERT-large at a tiny width and 4 blocks: the planner extends its 2- and 3-block builds to 4
BERT = dict(overrides={"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 101,
                       "num_hidden_layers": 4}, seq_len=13, dtype="fp32")
NO_MARGIN = dict(margin=0.0, reserved=0)


@pytest.fixture(scope="module")
def bert_plan():
    return make_plan("bert-large", batch_size=3, gpu_memory=int(1.7 * 2**20), methods=["checkpointing", "lora"],
                runs=REFERENCE_RUNS, **NO_MARGIN, **BERT)


def _estimate(method, b, options=None, full=True):
    f = estimate if full else estimate_by_depth
    return f("bert-large", method, batch_size=b, **BERT, **(options or {}))["peak"]["bytes"]


def test_peak_equals_estimate(bert_plan):
    rows = {r["method"]: r for r in bert_plan.rows}
    assert set(rows) == {"baseline", "checkpointing", "lora", "lora+checkpointing"}
    for method, r in rows.items():
        assert r["status"] == "ok", r
        assert r["peak_bytes"] == _estimate(method, 3)            # the whole model, to the byte
        assert r["need_bytes"] == r["peak_bytes"]                  # no margin asked for


def test_largest_batch_fits_and_the_next_does_not(bert_plan):
    cap = bert_plan.settings["capacity_bytes"]
    assert any(r["largest_batch"] > 3 for r in bert_plan.rows) and any(not r["fits"] for r in bert_plan.rows)
    for r in bert_plan.rows:
        b = r["largest_batch"]
        assert r["largest_batch_how"] == f"checked: {b} fits, {b + 1} does not"
        assert _estimate(r["method"], b, full=False) <= cap < _estimate(r["method"], b + 1, full=False)
        assert r["fits"] == (b >= 3)
        assert r["estimates"] <= 12                                # the line: a few estimates per combination


def test_cost_order_agrees_with_measured_cpu_step_times(bert_plan):
    rows = {r["method"]: r for r in bert_plan.rows}
    measured, where = measured_ratios(REFERENCE_RUNS)
    assert where == str(REFERENCE_RUNS) and measured["checkpointing"]
    base, ckpt = rows["baseline"], rows["checkpointing"]
    assert base["flops_ratio"] == 1.0 < ckpt["flops_ratio"]        # recomputation counted
    assert ckpt["measured_ratio"] > 1.0                            # and slower wherever it was measured
    ratios = sorted(m["ratio"] for m in ckpt["measured"])
    assert ratios[len(ratios) // 2] > 1.0  # in most cells (a 5-step cell's CPU timing on a shared machine is noisy)
    assert rows["lora"]["flops_ratio"] < 1.0                       # frozen weights: no weight gradients
    # FLOPs of a full step of a linear model: forward 2·n·d·k, backward twice that (input and weight gradients)
    assert base["flops"] > 0 and rows["lora+checkpointing"]["flops"] > rows["lora"]["flops"]


def test_margin_and_fits():
    kw = dict(batch_size=2, gpu_memory="8MiB", methods=["checkpointing"], max_methods=1, **BERT)
    p = make_plan("bert-large", margin=0.25, reserved="1MiB", **kw)
    for r in p.rows:
        assert r["need_bytes"] == int(r["peak_bytes"] * 1.25 + 2**20)
        assert r["fits"] == (r["need_bytes"] <= 8 * 2**20)
    assert "25%" in p.sources["margin"] and "given" in p.sources["margin"]
    m = margin()
    assert m["fraction"] == 0.10 and "rule-of-thumb" in m["source"]


def test_margin_file(tmp_path):
    f = tmp_path / "margin.json"
    f.write_text(json.dumps({"fraction": 0.07, "reserved_bytes": 512 * 2**20, "source": "H100 runs"}))
    m = margin(margin_file=f)
    assert m["fraction"] == 0.07 and m["reserved_bytes"] == 512 * 2**20 and "H100 runs" in m["source"]
    f.write_text("{}")
    with pytest.raises(ValueError, match="margin file"):
        margin(margin_file=f)


@pytest.fixture
def tiny_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 56,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 61,
        "max_position_embeddings": 64}))
    return tmp_path


def test_config_json_on_disk(tiny_config):
    p = make_plan(str(tiny_config), batch_size=2, seq_len=16, gpu_memory="4MiB", methods=["lora"], **NO_MARGIN)
    spec = hf_spec(tiny_config, seq_len=16)
    assert spec.kwargs["head"] == "causal-lm" and "transformers config" in p.settings["model_source"]
    assert {r["method"] for r in p.rows} == {"baseline", "lora"}
    # auto weights: LoRA's frozen base in the compute dtype, the baseline's trained weights as fp32 masters
    assert {r["method"]: r["weights"] for r in p.rows} == {"baseline": "fp32", "lora": "bf16"}
    for r in p.rows:
        assert r["peak_bytes"] == estimate(spec, r["method"], batch_size=2, dtype="bf16",
                                           weights=r["weights"])["peak"]["bytes"]
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_spec(tiny_config / "nowhere")


def test_models_and_errors():
    spec, where = resolve_model("vit_tiny_patch16_224")
    assert spec.family == "timm" and "timm" in where
    with pytest.raises(ValueError, match="--image-size"):
        resolve_model("vit_tiny_patch16_224", seq_len=128)
    with pytest.raises(ValueError, match="paper model"):
        resolve_model("no_such_model_anywhere")
    with pytest.raises(ValueError, match="world_size"):
        make_plan("bert-large", batch_size=2, world_size=0, **BERT)
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("40GB") == 40 * 10**9 and parse_bytes(2) == 2
    with pytest.raises(ValueError, match="24GiB"):
        parse_bytes("24 gigs")


def test_combinations_are_the_registrys():
    combos, skipped = combinations()
    assert combos[0] == "baseline" and len(set(combos)) == len(combos)
    for c in combos[1:]:
        assert "+".join(m.name for m in parse(c)) == c               # valid, in application order
    assert "lowmembp+mesa" not in combos and "mesa+lowmembp" not in combos
    for name, why in NOT_ESTIMATED.items():
        if name in skipped:
            assert skipped[name] == why and not any(name in c.split("+") for c in combos)
    only, _ = combinations(["lora", "checkpointing"])
    assert only == ["baseline", "checkpointing", "lora", "lora+checkpointing"]
    assert all(c.count("+") < 1 for c in combinations(max_methods=1)[0])
    sweeps = parse_option_sweeps(["tokentune.k=4,8", "lora.rank=2"])
    assert sweeps == {"tokentune": {"k": [4, 8]}, "lora": {"rank": [2]}}
    assert option_grid("lora+tokentune", sweeps) == [{"rank": 2, "k": 4}, {"rank": 2, "k": 8}]
    with pytest.raises(ValueError, match="no option"):
        option_grid("lora", {"lora": {"k": [1]}})


def test_the_default_plan_is_short_combinations_without_variants():
    every, _ = combinations()
    default, skipped = combinations(max_methods=DEFAULT_MAX_METHODS, default=True)
    left_out = variants()
    assert {"lowmembp-act", "lowmembp-norm"} | set(VARIANTS) == set(left_out)   # the composite's parts, by the registry
    assert "lowmembp" in default and all(v not in c.split("+") for c in default for v in left_out)
    assert all(skipped[v] == why and "--methods" in why for v, why in left_out.items() if v not in NOT_ESTIMATED)
    wanted = [c for c in every if c.count("+") < DEFAULT_MAX_METHODS and not set(c.split("+")) & set(left_out)]
    assert default == wanted and len(default) < len(every)
    named, _ = combinations(["lowmembp-act", "lora"], default=True)              # named: every combination of them
    assert named == ["baseline", "lora", "lowmembp-act", "lora+lowmembp-act"]
    assert default_max_methods(None, None) == DEFAULT_MAX_METHODS
    assert default_max_methods(["lora"], None) is None and default_max_methods(None, ALL) is None
    assert default_max_methods(None, 3) == 3
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(ValueError, match="max_methods"):
            default_max_methods(None, bad)


def test_the_plan_and_the_command_line_state_and_take_the_limit(tiny_config, capsys):
    from lowmembp.plan.__main__ import main

    kw = dict(batch_size=2, seq_len=16, gpu_memory="4MiB", jobs=1, reserved=0)
    p = make_plan(str(tiny_config), combos=["lora"], **kw)
    assert p.settings["max_methods"] is None                                     # exact combinations: no limit
    p = make_plan(str(tiny_config), methods=["lora", "checkpointing", "tokentune"], max_methods=1, **kw)
    assert p.settings["max_methods"] == 1 and {r["method"] for r in p.rows} == {"baseline", "lora", "checkpointing",
                                                                                 "tokentune"}
    assert "4 combinations of up to 1 methods (--max-methods N or all: more)" in p.table()
    args = ["--model", str(tiny_config), "--batch-size", "2", "--seq-len", "16", "--gpu-memory", "4MiB",
            "--methods", "lora,checkpointing", "--jobs", "1", "--reserved", "0", "--json"]
    assert main(args + ["--max-methods", "all"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 4
    with pytest.raises(SystemExit) as e:
        main(args + ["--max-methods", "0"])
    assert e.value.code == 2 and "positive number or all" in capsys.readouterr().err


def test_search_on_a_line_and_off_it():
    line = lambda b: 1000 + 37 * b  # noqa: E731
    for slope_guess in (37, 50, 20):
        known = {4: line(4)}
        assert largest_batch(line, 5000, known=known, floor=1000, first_slope=slope_guess)[0] == 108
        assert {108, 109} <= set(known) and len(known) <= 4
    bent = lambda b: max(3000, 1000 + 37 * b)  # noqa: E731  (another phase peaks at small batches)
    assert largest_batch(bent, 5000, known={4: bent(4)}, floor=1000, first_slope=10)[0] == 108
    assert largest_batch(bent, 2000, known={4: bent(4)}, floor=1000)[:1] == (0,)
    assert largest_batch(line, 900, known={4: line(4)}, floor=1000)[0] == 0      # floor alone too big
    assert largest_batch(line, 1e12, known={4: line(4)}, floor=0, first_slope=37, max_batch=100)[0] == 100


def test_cli_prints_table_json_and_csv(tiny_config, tmp_path, capsys):
    from lowmembp.plan.__main__ import main

    args = ["--model", str(tiny_config), "--batch-size", "2", "--seq-len", "16", "--gpu-memory", "4MiB",
            "--methods", "checkpointing", "--jobs", "1", "--runs", str(REFERENCE_RUNS), "--reserved", "0"]
    assert main(args + ["--csv", str(tmp_path / "plan.csv")]) == 0
    out = capsys.readouterr().out
    assert "What fits" in out and "checkpointing" in out and "Where the figures come from" in out
    assert "max batch" in out and "measured x" in out and str(REFERENCE_RUNS) in out
    rows = list(csv.DictReader(open(tmp_path / "plan.csv")))
    assert {r["method"] for r in rows} == {"baseline", "checkpointing"}
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["rows"]) == 2 and doc["settings"]["batch_size"] == 2
    if "world_size" in inspect.signature(estimate).parameters:  # FSDP sharding: passed through to estimate
        assert main(args + ["--world-size", "2", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        spec = hf_spec(tiny_config, seq_len=16)
        for r in doc["rows"]:
            assert r["peak_bytes"] == estimate(spec, r["method"], batch_size=2, dtype="bf16",
                                               world_size=2)["peak"]["bytes"]
    else:
        assert main(args + ["--world-size", "2"]) == 2
        assert "world_size" in capsys.readouterr().err
    assert main(args + ["--weights", "bf16", "--json"]) == 0  # the model loaded in bf16: estimate's weights=
    doc = json.loads(capsys.readouterr().out)
    spec = hf_spec(tiny_config, seq_len=16)
    assert doc["settings"]["weights"] == ["bf16"]
    for r in doc["rows"]:
        assert r["peak_bytes"] == estimate(spec, r["method"], batch_size=2, dtype="bf16",
                                           weights="bf16")["peak"]["bytes"]
    assert main(args + ["--weights", "fp8"]) == 2  # not a storage: a usage error naming the choices
    assert "auto, fp32, bf16, fp16, nf4" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
def test_a_composite_is_its_parts_and_is_listed_once(name):
    """``lowmembp`` declares ``parts`` (-act and -norm): applied together they make exactly the same model (same
    logits and gradients, γ/β perturbed), so the planner lists the combination once, under ``lowmembp``."""
    import copy

    import torch

    import lowmembp
    from tests.tiny_models import build, logits

    model, inputs = build(name)
    batch = inputs()
    out = {}
    for spec in ("lowmembp", "lowmembp-act+lowmembp-norm"):
        m = lowmembp.apply(copy.deepcopy(model), spec)
        y = logits(m, batch)
        y.float().square().mean().backward()
        out[spec] = (y.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    (ya, ga), (yb, gb) = out.values()
    assert torch.equal(ya, yb) and ga.keys() == gb.keys() and ga
    assert all(torch.equal(ga[n], gb[n]) for n in ga)
    combos, _ = combinations()
    assert not any({"lowmembp-act", "lowmembp-norm"} <= set(c.split("+")) for c in combos)
    assert "lora+lowmembp" in combos and "lowmembp-act" in combos and "lowmembp-norm" in combos
    without, _ = combinations(exclude=["lowmembp"])  # no composite: its parts together stand for it
    assert "lowmembp-act+lowmembp-norm" in without


def test_progress_bar_counts_every_combination(monkeypatch):
    """progress="bar" (the command line's default): one tick per row, the total the rows actually planned."""
    import sys

    seen = {"n": 0}

    class Recorder:
        def __init__(self, total):
            seen["total"] = [total]

        def __call__(self, row):
            seen["n"] += 1

        def set_total(self, total):
            seen["total"].append(total)

        def close(self):
            seen["closed"] = True

    monkeypatch.setattr(sys.modules["lowmembp.plan"], "Bar", Recorder)
    p = make_plan("bert-large", batch_size=2, gpu_memory="8MiB", methods=["checkpointing", "lora"], progress="bar",
                  reserved=0,
             **BERT)
    assert seen["n"] == len(p.rows) == seen["total"][-1] == 4 and seen["closed"]


def test_progress_bar_on_a_terminal(monkeypatch):
    import io
    import sys

    from lowmembp.plan.progress import Bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = Bar(5)
    bar({"label": "lora"})
    bar.set_total(2)
    bar({"label": "lora+checkpointing"})
    bar.close()
    out = sys.stderr.getvalue()
    assert "plan" in out and "2/2" in out and "lora+checkpointing" in out


def _row(label, fits, best, peak, floor, flops=1.0, weights="bf16"):
    return {"label": label, "status": "ok", "fits": fits, "largest_batch": best, "peak_bytes": peak,
            "floor_bytes": floor, "flops_ratio": flops, "largest_batch_how": f"checked: {best} fits",
            "weights": weights}


@pytest.mark.parametrize("rows,weights,words", [
    ([_row("lora+checkpointing", True, 6, 17 * 2**30, 13 * 2**30, 1.02), _row("lora+tokentune", True, 9, 15 * 2**30,
      13 * 2**30, 0.4), _row("lora", False, 0, 65 * 2**30, 13 * 2**30, 0.69)], "auto",
     ["2 of 3 combinations fit batch 4 (auto weights)",
      "the least compute: lora+checkpointing with bf16 weights (FLOPs 1.02x)",
      "the largest batch: lora+tokentune with bf16 weights (9)"]),
    ([_row("lora", False, 2, 25 * 2**30, 13 * 2**30)], "bf16",
     ["No combination fits batch 4 (weights bf16); 1 fit a smaller batch, the largest 2 with lora with bf16 weights"]),
    ([_row("lora", False, 0, 90 * 2**30, 25 * 2**30, weights="fp32"),
      _row("baseline", False, 0, 146 * 2**30, 100 * 2**30, weights="fp32")], "fp32",
     ["Nothing fits at any batch (weights fp32)", "(lora with fp32 weights: 25.0 GiB) already exceed the 20.0 GiB",
      "--weights nf4"]),
    ([_row("lora", False, 0, 117 * 2**30, 12 * 2**30, weights="nf4")], ["bf16", "nf4"],
     ["Nothing fits, not even batch 1 (weights bf16, nf4)", "(lora with nf4 weights: 12.0 GiB of 20.0 GiB)",
      "at batch 4: lora with nf4 weights (117.0 GiB)"]),
])
def test_verdict_says_what_fits_or_why_nothing_does(rows, weights, words):
    from lowmembp.plan import Plan
    from lowmembp.plan.report import verdict

    p = Plan({"capacity_bytes": 20 * 2**30, "batch_size": 4, "weights": weights}, rows, {}, {})
    got = verdict(p)
    for w in words:
        assert w in got, got
    assert ("--weights nf4" in got) == ("nf4" not in weights and not any(r["largest_batch"] for r in rows))


def test_the_fork_server_imports_what_the_workers_need_once():
    import logging

    from lowmembp.plan.pool import modules_needed as _modules_needed
    spec, _ = resolve_model("llama-7b", seq_len=None, num_classes=None, image_size=None)
    with_lora = _modules_needed(spec, None, ["baseline", "lora+lowmembp"])
    assert with_lora[0] == "lowmembp.plan.worker"          # first: its logger setting holds for what follows
    assert "transformers.models.llama.modeling_llama" in with_lora and "peft" in with_lora
    assert "peft" not in _modules_needed(spec, None, ["baseline", "mesa+checkpointing"])
    swin, _ = resolve_model("swin-t", seq_len=None, num_classes=None, image_size=None)  # depth per stage
    assert "timm.models.swin_transformer" in _modules_needed(swin, None, ["baseline"])
    # lowmembp's import (the workers' first) drops bitsandbytes' "cannot download the CPU 4-bit kernel" line
    record = logging.LogRecord("bitsandbytes.backends.cpu.ops", logging.WARNING, __file__, 1,
                               "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'",
                               None, None)
    assert not logging.getLogger("bitsandbytes.backends.cpu.ops").filter(record)


def test_optimizer_axis_rows_are_estimates_with_that_optimizer(tiny_config, capsys):
    """Every combination with every optimizer asked for: one row each, its peak estimate()'s with that optimizer
    to the byte; the 8-bit states and the step inside the backward need less than AdamW's."""
    opts = ["adamw", "adamw8bit", "adamw-fused-backward"]
    p = make_plan("bert-large", batch_size=3, gpu_memory=int(1.7 * 2**20), methods=["checkpointing"], jobs=1,
                  optimizer=opts, **NO_MARGIN, **BERT)
    rows = {(r["method"], r["optimizer"]): r for r in p.rows}
    assert set(rows) == {(m, o) for m in ("baseline", "checkpointing") for o in opts}
    for (method, opt), r in rows.items():
        assert r["status"] == "ok", r
        assert r["peak_bytes"] == estimate("bert-large", method, batch_size=3, optimizer=opt, **BERT)["peak"]["bytes"]
        assert r["label"] == method + ("" if opt == "adamw" else f" [{opt}]")
    for method in ("baseline", "checkpointing"):
        assert rows[(method, "adamw8bit")]["floor_bytes"] < rows[(method, "adamw")]["floor_bytes"]
        assert rows[(method, "adamw-fused-backward")]["peak_bytes"] < rows[(method, "adamw")]["peak_bytes"]
    assert p.settings["optimizer"] == opts
    table = p.table()
    assert "optimizer" in table.splitlines()[3] and "adamw-fused-backward" in table
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_plan("bert-large", batch_size=3, optimizer="sgd", **BERT)
    from lowmembp.plan.__main__ import main
    args = ["--model", str(tiny_config), "--batch-size", "2", "--seq-len", "16", "--gpu-memory", "4MiB",
            "--reserved", "0",
            "--methods", "checkpointing", "--jobs", "1", "--optimizer", "adamw8bit", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["optimizer"] for r in doc["rows"]} == {"adamw8bit"} and doc["settings"]["optimizer"] == ["adamw8bit"]
    assert main(args[:-3] + ["--optimizer", "sgd"]) == 2
