"""The full-fine-tuning levers' reproduction (experiments/repro/stacked_full.py) at a tiny width: every optimizer and
every stacked row present; the optimizers' states ordered as their layouts say; each stacked row the lever it names."""
import pytest

from experiments.repro.stacked_full import REFRESH, STACKS, stacked_full
from lowmembp.methods.optim_levers import LEVERS


@pytest.mark.slow  # 38 fake steps at a tiny width: ~20 s
def test_every_row_and_what_each_lever_changes():
    df = stacked_full(small=True)
    opt = df[df["part"] == "optimizers"].set_index("lever")
    assert list(opt.index) == ["adamw", *LEVERS, REFRESH]
    s = opt["optimizer_GiB"]
    assert s["adamw4bit-torchao"] < s["adamw8bit-torchao"] < s["adamw"]
    assert s["adafactor"] < 0.05 * s["adamw"] and s["adamw-cpu-offload"] < 0.01 * s["adamw"]
    assert s["paged-adamw"] == pytest.approx(2 * s["adamw"], rel=0.01)  # fp32 states of bf16 weights
    assert s[REFRESH] == s["galore-adamw"]
    st = df[df["part"] == "stacked"]
    for model, (_, _, rows) in STACKS.items():
        got = st[st["model"] == model]
        assert list(got["lever"]) == [r[0] for r in rows]
        by = got.set_index("lever")
        lowmembp = next(r[0] for r in rows if r[0] == "+ LowMemoryBP")
        assert by.loc[lowmembp, "activations_GiB"] < by.shift(1).loc[lowmembp, "activations_GiB"]
        ckpt = "+ activation checkpointing"
        assert by.loc[ckpt, "activations_GiB"] < by.shift(1).loc[ckpt, "activations_GiB"]
    comp = df[df["part"] == "compact"]
    for model in STACKS:
        by = comp[comp["model"] == model].set_index("lever")["saved_GiB"]
        assert by["compact"] < by["baseline"] and by["lowmembp"] < by["baseline"]
        assert by["compact+lowmembp"] < min(by["compact"], by["lowmembp"])
