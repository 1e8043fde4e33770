"""experiments.repro.lever_estimates: its rows are the estimator's, the parameter and optimizer-state bytes agree with
a count by hand, and the method pages' reference table holds the function's numbers."""
from pathlib import Path

import pandas as pd
import pytest

from experiments.repro.lever_estimates import CATEGORIES, GiB, SECTIONS, SMALL, lever_estimates

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference" / "repro" / "lever-estimates.csv"


def _llama(hidden, inter, layers, vocab, heads):
    """LLaMA by hand: (parameters: embedding and head (untied), per block q/k/v/o, gate/up/down and two norms, the
    final norm; parameter tensors; bytes of the rotary embedding's fp32 ``inv_freq`` buffer, head_dim / 2 values)."""
    n = 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + hidden
    return n, 2 + 9 * layers + 1, 4 * (hidden // heads // 2)


def _check_full_fine_tuning(opt, hidden, inter, layers, vocab, heads):
    n, tensors, buffer = _llama(hidden, inter, layers, vocab, heads)
    assert (opt["parameters_at_peak_GiB"] * GiB == 2 * n + buffer).all()          # bf16 weights, the fp32 buffer
    # two bf16 moments per weight, and AdamW's fp32 step count per tensor
    assert opt.loc["adamw", "optimizer_state_at_peak_GiB"] * GiB == 2 * 2 * n + 4 * tensors
    assert opt.loc["adamw-fused-backward", "optimizer_state_at_peak_GiB"] * GiB == 2 * 2 * n + 4 * tensors
    assert opt.loc["adamw8bit", "optimizer_state_at_peak_GiB"] < opt.loc["adamw", "optimizer_state_at_peak_GiB"] / 1.5
    assert opt.loc["adamw-fused-backward", "gradients_at_peak_GiB"] <= opt.loc["adamw", "gradients_at_peak_GiB"]


@pytest.fixture(scope="module")
def small():
    return lever_estimates(small=True)


@pytest.mark.slow  # 16 fake steps: about 30 s on 2 idle cores
def test_every_section_and_method_has_a_row(small):
    assert list(dict.fromkeys(small["section"])) == list(SECTIONS)
    for section, (_, _, methods) in SECTIONS.items():
        got = small[small["section"] == section]
        assert list(dict.fromkeys(got["method"])) == list(methods)
    assert set(small[small["section"] == "optimizers"]["optimizer"]) == {"adamw", "adamw8bit", "adamw-fused-backward"}
    split = small[[f"{c}_at_peak_GiB" for c in CATEGORIES]].sum(axis=1)
    assert (split <= small["peak_GiB"] * (1 + 1e-12)).all()  # the split is of the peak ("other" aside)


@pytest.mark.slow
def test_full_fine_tuning_bytes_by_hand(small):
    o = SMALL["overrides"]
    _check_full_fine_tuning(small[small["section"] == "optimizers"].set_index("optimizer"), o["hidden_size"],
                            o["intermediate_size"], SMALL["layers"], o["vocab_size"], o["num_attention_heads"])


def test_the_method_pages_reference_holds_the_full_size_rows():
    ref = pd.read_csv(REFERENCE)
    assert list(dict.fromkeys(ref["section"])) == list(SECTIONS)
    assert not ref["setting"].str.contains("tiny width").any()  # the full-size run, not the reduced one
    _check_full_fine_tuning(ref[ref["section"] == "optimizers"].set_index("optimizer"), 4096, 11008, 32, 32000, 32)
    tiled = ref[ref["section"] == "tiled-mlp"].set_index("method")
    assert tiled.loc["tiled-mlp", "saved_GiB"] < tiled.loc["baseline", "saved_GiB"]
