"""The planner with the full-fine-tuning optimizers of other packages (lowmembp.methods.optim_levers): its
``optimizer`` axis takes them (options written in), each row's peak is estimate_by_depth's with that optimizer, and
their states order the rows as their layouts say."""
import pytest

from lowmembp.estimator.step import estimate_by_depth
from lowmembp.plan import make_plan

LLAMA = dict(overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 61, "num_hidden_layers": 4}, seq_len=16, dtype="bf16")


def test_the_optimizer_axis_plans_each_lever_as_estimate_does():
    opts = ["adamw", "galore-adamw-layerwise@rank=8", "adafactor", "adamw4bit-torchao"]
    p = make_plan("llama-7b", batch_size=2, gpu_memory=2**30, methods=["baseline"], optimizer=opts, weights=["bf16"],
                  margin=0.0, reserved=0, **LLAMA)
    rows = {r["optimizer"]: r for r in p.rows}
    assert set(rows) == set(opts) and all(r["status"] == "ok" for r in rows.values()), rows
    for o, r in rows.items():
        want = estimate_by_depth("llama-7b", "baseline", batch_size=2, weights="bf16", optimizer=o, **LLAMA)["peak"]
        assert r["peak_bytes"] == want["bytes"], o
    assert rows["adafactor"]["peak_bytes"] < rows["adamw"]["peak_bytes"]


def test_a_bad_optimizer_option_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="rank"):
        make_plan("llama-7b", batch_size=2, methods=["baseline"], optimizer=["galore-adamw@rank=x"], **LLAMA)
