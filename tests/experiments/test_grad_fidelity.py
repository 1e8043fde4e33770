"""The grad-fidelity reproduction: its comparisons on tiny models (fast; exact controls at rounding level, approximate
methods not, adapters built alike), its table view, and the real-weights run at reduced scale (slow)."""
import importlib
import math

import pandas as pd
import pytest
import torch

from tiny_models import build, logits

gf = importlib.import_module("experiments.repro.grad_fidelity")  # the module (the package exports its function)


def _loss(model, batch):
    out = logits(model, batch["inputs"]).float()
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), batch["labels"].flatten())


def _tiny(name):
    model, inputs = build(name)
    batches = []
    for seed in (1, 2):
        b = inputs(seed)
        n = logits(model, b).shape[:-1]
        batches.append({"inputs": b, "labels": torch.randint(0, 3, n, generator=torch.Generator().manual_seed(seed))})
    return model, batches


@pytest.fixture(scope="module")
def vit_rows():
    model, batches = _tiny("vit")
    case = gf.Case("vit", "none", 2, None, {"tokentune": "k=4", "velora": "num_groups=8"})
    return pd.DataFrame(gf.compare(model, _loss, batches, case, dtypes=("fp32", "bf16"), comparisons=FAST))


# a subset, to keep this file in the fast tier (every comparison: test_real_weights_small)
FAST = (("lowmembp", "lowmembp-norm"), ("mesa", "baseline"), ("tokentune", "baseline"), ("velora", "lora"),
        ("lora-fa", "lora"), ("checkpointing", "baseline"), ("tiled-mlp", "baseline"), ("chunked-ce", "baseline"))


def test_exact_controls_are_exact_and_approximations_are_not(vit_rows):
    whole = vit_rows[vit_rows["depth"] == "all"].set_index(["dtype", "method"])
    for method in ("checkpointing", "tiled-mlp"):
        assert whole.loc[("fp32", method), "rel_error"] < 1e-5, method
        assert whole.loc[("fp32", method), "cosine"] == pytest.approx(1.0, abs=1e-6)
    for method in ("lowmembp", "mesa", "tokentune", "velora"):
        assert whole.loc[("fp32", method), "rel_error"] > 1e-4, method
        assert 0 < whole.loc[("fp32", method), "cosine"] < 1
    # LoRA-FA trains B and the head only: their gradients are LoRA's exactly
    assert whole.loc[("fp32", "lora-fa"), "rel_error"] == 0
    assert "chunked-ce" not in set(vit_rows["method"])  # causal LMs only
    yard = whole.loc[("bf16", gf.YARDSTICK)]
    assert yard["compared_with"] == "baseline (fp32)" and 0 < yard["rel_error"] < 0.1


def test_depth_rows_cover_the_model(vit_rows):
    low = vit_rows[(vit_rows["method"] == "lowmembp") & (vit_rows["dtype"] == "fp32")].set_index("depth")
    assert list(low.index) == ["all", "blocks", "embed", "0", "1", "head"]
    assert list(low["position"]) == [-1, -2, 0, 1, 2, 3]
    depths = low.loc[["embed", "0", "1", "head"]]
    assert low.loc["all", "tensors"] == depths["tensors"].sum()
    # the whole gradient's squared error is the sum of the depths': rel_all² ‖g‖² = Σ rel_d² ‖g_d‖²
    def err(rows):
        return math.sqrt((rows["rel_error"] ** 2 * rows["ref_norm"] ** 2).sum())
    assert err(depths) / low.loc["all", "ref_norm"] == pytest.approx(low.loc["all", "rel_error"], rel=1e-9)
    assert err(depths.loc[["0", "1"]]) / low.loc["blocks", "ref_norm"] == pytest.approx(
        low.loc["blocks", "rel_error"], rel=1e-9)
    # LoRA models train nothing in the embeddings: their blocks still sit at the same positions
    velora = vit_rows[(vit_rows["method"] == "velora") & (vit_rows["dtype"] == "fp32")].set_index("depth")
    assert velora.loc["0", "position"] == 1 and velora.loc["head", "position"] == 3 and "embed" not in velora.index


def test_adapters_are_the_same_in_every_lora_model():
    model, _ = _tiny("llama")
    case = gf.Case("llama", "none", 2, None, {"velora": "num_groups=8"}, causal=True)
    built = {m: dict(gf.build_method(model, case, m).named_parameters()) for m in ("lora", "velora", "lora-fa")}
    a_names = [n for n in built["lora"] if ".lora_A." in n]
    b_names = [n for n in built["lora"] if ".lora_B." in n]
    assert a_names and b_names
    for n in a_names + b_names:
        assert torch.equal(built["lora"][n], built["velora"][n]) and torch.equal(built["lora"][n], built["lora-fa"][n])
    assert all(built["lora"][n].abs().sum() > 0 for n in b_names)  # B is not zero: A's gradient is not zero
    assert not any(built["lora-fa"][n].requires_grad for n in a_names)


def test_table_view_one_row_per_model_and_method():
    rows = []
    for dtype, scale in (("fp32", 1.0), ("bf16", 2.0)):
        for depth, pos, rel in (("all", -1, 0.1), ("blocks", -2, 0.2), ("embed", 0, 0.05), ("0", 1, 0.3),
                                ("head", 2, 0.0)):
            rows.append(dict(model="m", dtype=dtype, method="x", compared_with="baseline", kind="approximate",
                             depth=depth, position=pos, tensors=1, cosine=1 - rel * scale / 10,
                             rel_error=rel * scale, ref_norm=1.0))
    values, shown = gf.table_view(pd.DataFrame(rows))
    assert len(values) == 1 and len(values.columns) <= 10
    row = values.iloc[0]
    assert row["rel_err_fp32"] == 0.1 and row["rel_err_bf16"] == 0.2 and row["cos_fp32"] == pytest.approx(0.99)
    assert row["blocks_rel_err_fp32"] == 0.2 and row["blocks_cos_fp32"] == pytest.approx(0.98)
    assert row["worst_depth"] == "0" and row["worst_rel_err"] == 0.3
    assert shown.iloc[0]["cos_fp32"] == "0.9900" and shown.iloc[0]["rel_err_fp32"] == "0.1"
    exact = pd.DataFrame([{**r, "rel_error": 0.0, "cosine": 1.0} for r in rows if r["dtype"] == "fp32"])
    values, shown = gf.table_view(exact)
    assert values.iloc[0]["worst_depth"] == "-" and shown.iloc[0]["rel_err_bf16"] == "-"


@pytest.mark.slow
def test_real_weights_small(tmp_path):
    """Every model of the reproduction on its real weights (bases trained 4 steps into ``tmp_path``), 4-sample batches:
    rows for every comparison, exact controls exact, the yardstick in bf16."""
    df = gf.grad_fidelity(small=True, cache_dir=tmp_path)
    assert set(df["model"]) == {c.model for c in gf.CASES}
    whole = df[df["depth"] == "all"]
    for case in gf.CASES:
        got = set(whole[whole["model"] == case.model]["method"])
        want = {m for m, _ in gf.COMPARISONS if case.causal or m != "chunked-ce"} | {gf.YARDSTICK}
        assert got == want, case.model
    exact = whole[(whole["kind"] == "exact") & (whole["dtype"] == "fp32")]
    assert (exact["rel_error"] < 1e-4).all(), exact[["model", "method", "rel_error"]]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "grad-fidelity-llama-tiny-small.safetensors", "grad-fidelity-vit-mnist-small.safetensors"]


def test_reference_figure_and_table_read_alone():
    """The committed reference rows make the figure (one panel per model and dtype, units and machine in the text,
    every method in the legend) and the table (one row per model and method, no summary rows on the x axis)."""
    import sys
    from pathlib import Path

    import matplotlib
    matplotlib.use("Agg")
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "workflow" / "scripts"), str(root / "workflow")]
    import plots_repro

    df = pd.read_csv(root / "results" / "reference" / "repro" / "grad-fidelity.csv")
    fig = plots_repro.figure("grad_fidelity", df)
    text = "\n".join([fig._suptitle.get_text()] + [t for ax in fig.axes for t in
                                                    (ax.get_title(), ax.get_ylabel(), ax.get_xlabel())]
                     + [t.get_text() for leg in fig.legends for t in leg.get_texts()]
                     + [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()])
    assert "relative gradient error" in text and "CPU" in text and "bf16" in text and "fp32" in text
    assert set(df["method"]) <= set(text.split("\n")) and "blocks" not in text.split("\n")
    assert len(fig.axes) == df["model"].nunique() * df["dtype"].nunique()
    values, shown = gf.table_view(df)
    assert len(values) == df.groupby(["model", "method"]).ngroups and shown.shape == values.shape
