"""Method options as pipeline cells: options written into a method spec (``tokentune@k=4``,
lowmembp.methods.registry) name a variant of a method, so a sweep can list TokenTune at several k. Checked: the
spec's grammar and its errors; ``apply`` with a spec equals ``apply`` with the option; the sweep's cells, command
lines and check (workflow/sweep_config.py) keep the variants apart; records -> runs.csv -> tables keep one row per
k; the accuracy-vs-option figure plots each k's mean (config/tokentune-k.yaml makes it)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

import lowmembp  # noqa: E402
from lowmembp.methods.registry import parse, plain_spec, spec_options, spec_parts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT / "workflow" / "scripts", ROOT / "workflow"):
    sys.path.insert(0, str(_p))
import sweep_config  # noqa: E402


def test_spec_grammar():
    assert spec_parts("lora@rank=8,alpha=16+tokentune@k=0.3") == [("lora", {"rank": "8", "alpha": "16"}),
                                                                 ("tokentune", {"k": "0.3"})]
    assert plain_spec("lora@rank=8+tokentune@k=0.3") == "lora+tokentune"
    assert spec_options("lora@rank=8,alpha=0.5+tokentune@k=0.3") == {"rank": 8, "alpha": 0.5, "k": 0.3}
    assert spec_options("tokentune@k=16") == {"k": 16} and isinstance(spec_options("tokentune@k=16")["k"], int)
    assert [m.name for m in parse("tokentune@k=4+lora")] == ["lora", "tokentune"]  # application order as ever
    assert spec_options("lora+lowmembp") == {}


@pytest.mark.parametrize("spec, needle", [
    ("tokentune@", "cannot read the option ''"),
    ("tokentune@k", "cannot read the option 'k'"),
    ("tokentune@k=", "cannot read the option 'k='"),
    ("tokentune@k=a/b", "cannot read the option 'k=a/b'"),
    ("tokentune@K=4", "cannot read the option 'K=4'"),
    ("tokentune@k=4,k=8", "option 'k' is given twice"),
    ("tokentune@rank=4+lora", "'tokentune' does not take option(s) rank"),
    ("tokentunes@k=4", "unknown method 'tokentunes'"),
    ("tokentune@k=many", "cannot read 'many' as int or float"),
])
def test_bad_specs_say_what_is_wrong(spec, needle):
    with pytest.raises(ValueError) as err:
        spec_options(spec)
    assert needle in str(err.value)


def test_apply_with_a_spec_is_apply_with_the_option():
    from tiny_models import build

    from lowmembp.methods.tokentune import tokentune_state

    model, inputs = build("vit")
    a = lowmembp.apply(copy.deepcopy(model), "tokentune@k=3", seed=0)
    b = lowmembp.apply(copy.deepcopy(model), "tokentune", k=3, seed=0)
    assert tokentune_state(a).k == tokentune_state(b).k == 3
    a.train(), b.train()
    out_a, out_b = a(**inputs()), b(**inputs())
    assert tokentune_state(a).last.positions.shape[1] == 3
    assert torch.equal(tokentune_state(a).last.positions, tokentune_state(b).last.positions)
    assert torch.equal(out_a, out_b)
    assert tokentune_state(lowmembp.apply(copy.deepcopy(model), "tokentune@k=3", k=3)).k == 3  # the same, twice
    with pytest.raises(ValueError, match="contradicts the method spec 'tokentune@k=3'"):
        lowmembp.apply(copy.deepcopy(model), "tokentune@k=3", k=4)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        lowmembp.apply(copy.deepcopy(model), "tokentune@k=1.5")


SWEEP = {"tasks": [{"task": "mnist5k", "model": "vit-mnist"}], "batch_sizes": [8], "seeds": [0], "steps": 3,
         "methods": ["baseline", "tokentune", "tokentune@k=2", "tokentune@k=4", "lora@rank=2+tokentune@k=0.5"],
         "method_options": {"tokentune": {"k": 8, "seed": 1}, "lora": {"rank": 4}}}


def _config(**changes):
    sw = dict(copy.deepcopy(SWEEP), **changes)
    return sweep_config.fill_defaults({"sweeps": {"k": sw}})


def test_cells_and_command_lines_keep_the_variants_apart():
    config = _config()
    cells = sweep_config.cells(config)
    assert sorted(key[2] for key in cells) == sorted(SWEEP["methods"])
    sw = config["sweeps"]["k"]
    # the sweep's options for tokentune reach every variant, except what the spec fixes itself
    assert sweep_config.options_for(sw, "tokentune") == {"k": 8, "seed": 1}
    assert sweep_config.options_for(sw, "tokentune@k=4") == {"seed": 1}
    assert sweep_config.options_for(sw, "lora@rank=2+tokentune@k=0.5") == {"seed": 1}
    argv = sweep_config.cell_argv(sw, "mnist5k", "vit-mnist", "tokentune@k=4", 8, 0)
    assert argv[argv.index("--method") + 1] == "tokentune@k=4" and "--k" not in argv
    assert argv[argv.index("--seed", argv.index("--dtype")) + 1] == "1"  # tokentune's seed option
    assert sweep_config.spec_has_options("tokentune@k=4") and not sweep_config.spec_has_options("lora+tokentune")
    sweep_config.check(config, ROOT)  # the job accepts every cell's command line


@pytest.mark.parametrize("methods, options, needle", [
    (["tokentune@k=0"], {}, "k must be an integer >= 1"),
    (["tokentune@rank=2"], {}, "'tokentune' does not take option(s) rank"),
    (["tokentune"], {"tokentune": {"k": 1.5}}, "got 1.5"),
])
def test_the_config_check_refuses_bad_variants(methods, options, needle):
    with pytest.raises(sweep_config.ConfigError) as err:
        sweep_config.check(_config(methods=methods, method_options=options), ROOT)
    assert needle in str(err.value)


def test_the_tokentune_k_config():
    config = yaml.safe_load((ROOT / "config" / "tokentune-k.yaml").read_text())
    sweep_config.fill_defaults(config)
    sweep_config.check(config, ROOT)
    cells = sweep_config.cells(config)
    assert sorted(spec_options(m).get("k", 0) for (_, _, m, *_) in cells) == [0, 2, 4, 8, 17]
    assert config["results"] != "results"  # its own folder: the default sweep's tables stay


def _record(path: Path, method: str, value: float) -> Path:
    from experiments.record import error_record, write

    rec = error_record({"task": "mnist5k", "model": "vit-mnist", "method": method, "batch_size": 32, "seed": 0,
                        "dtype": "fp32", "steps": 200, "seq_len": 17}, None, "2026-01-01T00:00:00+00:00",
                       status="ok", metric={"name": "accuracy", "value": value, "split": "test (500)"},
                       method_options=spec_options(method))
    return write(rec, path)


ACCURACY = {"baseline": 0.60, "tokentune@k=2": 0.30, "tokentune@k=4": 0.45, "tokentune@k=8": 0.55,
            "tokentune@k=17": 0.59}


@pytest.fixture
def runs(tmp_path):
    import aggregate

    paths = [_record(tmp_path / "runs" / "mnist5k" / "vit-mnist" / m / "bs32" / "seed0.json", m, v)
             for m, v in ACCURACY.items()]
    return aggregate.aggregate(paths)


def test_runs_and_tables_keep_one_row_per_k(runs):
    import paper_claims
    import table_maths

    assert sorted(runs["method"]) == sorted(ACCURACY)
    k = runs.set_index("method")["opt_k"]
    assert k["tokentune@k=4"] == 4 and k["tokentune@k=17"] == 17 and pd.isna(k["baseline"])
    acc = table_maths.accuracy_table(runs, paper_claims.load_claims()).set_index("method")
    assert sorted(acc.index) == sorted(ACCURACY)
    for m, v in ACCURACY.items():
        assert acc.loc[m, "metric_mean"] == pytest.approx(100 * v)
    assert acc.loc["tokentune@k=4", "compared_with"] == "baseline"
    assert acc.loc["tokentune@k=4", "change_vs_compared"] == pytest.approx(-15.0)


def test_accuracy_vs_option_figure_plots_each_k(runs):
    import plots

    fig = plots.accuracy_vs_option(runs)
    ax = fig.axes[0]
    means = [line for line in ax.lines if line.get_marker() == "s"]
    assert len(means) == 1
    xs, ys = means[0].get_data()
    assert list(xs) == [2, 4, 8, 17]
    assert list(ys) == pytest.approx([30, 45, 55, 59])
    base = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(base) == 1 and base[0].get_ydata()[0] == pytest.approx(60)
    text = " ".join([ax.get_title(), ax.get_xlabel(), ax.get_ylabel()])
    assert "sequence length 17" in text and "k (in the spec tokentune@k=" in text and "accuracy (%)" in text
    plt.close(fig)
    empty = plots.accuracy_vs_option(runs[runs["method"] == "baseline"])
    assert "no finished cell has options" in empty.axes[0].get_title()
    plt.close(empty)


def test_figures_order_the_variants_by_value(runs):
    import plots

    assert plots._methods(runs) == ["baseline", "tokentune@k=2", "tokentune@k=4", "tokentune@k=8", "tokentune@k=17"]
    mixed = pd.DataFrame({"method": ["lora", "tokentune@k=8", "sac", "tokentune", "baseline", "tokentune@k=0.3"]})
    assert plots._methods(mixed) == ["baseline", "tokentune", "tokentune@k=0.3", "tokentune@k=8", "lora", "sac"]


def test_a_lora_variant_is_compared_with_its_own_lora():
    import table_maths

    assert table_maths.reference_method("lora+lowmembp") == "lora"
    assert table_maths.reference_method("lora@rank=8+lowmembp") == "lora@rank=8"
    assert table_maths.reference_method("lora@rank=8") == "baseline"
    assert table_maths.reference_method("tokentune@k=4") == "baseline"
    assert table_maths.reference_method("baseline") is None


def test_estimate_reads_options_written_into_the_spec():
    """``estimate`` (and the planner, which builds through it) takes ``lora@rank=8+lowmembp`` as ``rank=8``: the
    same peak, and not the default rank's."""
    from lowmembp.estimator.step import ModelSpec, estimate

    spec = ModelSpec("timm", "vit_base_patch16_224", 2, dtype="fp32", num_classes=10,
                     kwargs=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4))
    written = estimate(spec, "lora@rank=8+lowmembp", batch_size=2)["peak"]["bytes"]
    assert written == estimate(spec, "lora+lowmembp", batch_size=2, rank=8)["peak"]["bytes"]
    assert written != estimate(spec, "lora+lowmembp", batch_size=2)["peak"]["bytes"]
    assert estimate(spec, "tokentune@k=4", batch_size=2)["peak"] == estimate(spec, "tokentune", batch_size=2,
                                                                              k=4)["peak"]
