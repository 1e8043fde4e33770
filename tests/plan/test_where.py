"""Where the peak is and what it holds (lowmembp.plan.breakdown, the tracker's phases and saved bytes), the weights
axis (auto, NF4) and the sequence-length search, each against an independent computation."""
import contextlib

import pytest
import torch
import torch.nn as nn

from lowmembp.estimator.step import estimate
from lowmembp.estimator.weights import auto_weights, nf4_base_weights, nf4_weight_bytes
from lowmembp.measurement.peak import StorageTracker, prime_optimizer
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.plan import make_plan
from lowmembp.plan.breakdown import DEVICE_PARTS, compact, split_peak

NO_MARGIN = dict(margin=0.0, reserved=0)
# LLaMA at a tiny width, 4 blocks, bf16 autocast (as tests/plan/test_plan_fast.py)
LLAMA = dict(overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 61, "num_hidden_layers": 4}, seq_len=16, dtype="bf16")


def _nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def _tracked_step(model, opt, x, loss_fn):
    """One real CPU step under the tracker, as the planner's steps run it: phases and saved tensors watched."""
    prime_optimizer(opt)
    tracker = StorageTracker()
    tracker.track_external(model, opt, x)
    tracker.watch(model)
    tracker.watch_phases(model, model[-1])
    with tracker:
        with tracker.saved_hooks():
            loss = loss_fn(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tracker


def test_a_peak_in_the_loss_holds_the_weights_the_state_and_every_saved_tensor():
    """The loss makes a large temporary outside the graph: the peak falls there, with every tensor the forward
    saved alive (the accountant's count of the same forward), the weights (their bytes) and AdamW's two fp32
    states per trainable element."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 16)
    big = 1 << 16

    def loss_fn(out):
        return out.square().mean() + torch.zeros(big).sum()   # 256 KiB, not part of the graph

    tracker = _tracked_step(model, opt, x, loss_fn)
    with SavedTensorAccountant(model) as acc:
        model(x).square().mean()
    params = list(model.parameters())
    assert tracker.peak_phase == "loss"
    cats = tracker.peak_by_category
    assert cats["parameters"] == _nbytes(params)
    steps = [s["step"] for s in opt.state.values()]
    assert cats["optimizer_state"] == 2 * _nbytes(params) + _nbytes(steps)
    assert tracker.peak_saved == acc.report()["total"] > 0
    parts = split_peak({"bytes": tracker.peak, "by_category": cats, "saved_bytes": tracker.peak_saved})
    assert sum(parts[k] for k in DEVICE_PARTS) == tracker.peak
    assert parts["temporaries"] >= big * 4 and parts["gradients"] == 0


def test_a_peak_in_the_optimizer_step_holds_every_gradient():
    """Weights dominate, activations are tiny: the optimizer's step (the for-loop AdamW, which makes temporaries)
    is the peak, with every trainable parameter's gradient alive."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    model[0].bias.requires_grad_(False)                    # a frozen parameter: weight, no gradient, no state
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)
    tracker = _tracked_step(model, opt, torch.randn(1, 256), lambda out: out.sum())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert tracker.peak_phase == "optimizer"
    assert tracker.peak_by_category["gradients"] == _nbytes(trainable)
    assert tracker.peak_by_category["parameters"] == _nbytes(model.parameters())


def test_auto_weights_follow_the_recipes():
    assert auto_weights("lora+checkpointing", "bf16") == "bf16" == auto_weights("velora@rank=8", "bf16")
    assert auto_weights("mesa+checkpointing", "bf16") == "fp32" == auto_weights("baseline", "bf16")
    assert auto_weights("lora", "fp32") == "fp32"           # no autocast: nothing to load the base in but fp32


def test_nf4_rows_are_the_bf16_step_with_the_base_in_four_bits():
    """An NF4 row: the bf16 step's peak less each frozen base linear's bf16 bytes, plus its NF4 bytes (bitsandbytes'
    layout, computed here from the shapes) and one dequantised weight; only LoRA-family rows are planned at nf4."""
    from lowmembp.estimator.step import MODELS, prepare_model

    p = make_plan("llama-7b", batch_size=2, gpu_memory="1GiB", methods=["lora", "checkpointing"], max_methods=1,
                  weights=["bf16", "nf4"], **NO_MARGIN, **LLAMA)
    rows = {(r["method"], r["weights"]): r for r in p.rows}
    assert set(rows) == {(m, w) for m in ("baseline", "checkpointing", "lora") for w in ("bf16",)} | {("lora", "nf4")}
    assert "nf4 weights" in p.skipped
    model = prepare_model(MODELS["llama-7b"], "lora", contextlib.nullcontext(), layers=4,
                          overrides=LLAMA["overrides"], device="cpu", weights="bf16")
    base = nf4_base_weights(model)
    assert base and all(w.dtype == torch.bfloat16 and not w.requires_grad for w in base)
    saved = sum(2 * w.numel() - nf4_weight_bytes(w.numel()) for w in base)
    dequant = max(2 * w.numel() for w in base)
    nf4, bf16 = rows[("lora", "nf4")], rows[("lora", "bf16")]
    assert nf4["peak_bytes"] == bf16["peak_bytes"] - saved + dequant
    assert nf4["peak_breakdown"]["weights"] == bf16["peak_breakdown"]["weights"] - saved
    assert nf4["peak_bytes"] == estimate("llama-7b", "lora", batch_size=2, layers=4, weights="nf4",
                                         **LLAMA)["peak"]["bytes"]


def test_rows_say_where_the_peak_is_and_their_parts_add_up(tmp_path):
    p = make_plan("llama-7b", batch_size=2, gpu_memory="1GiB", methods=["lora", "checkpointing"], **NO_MARGIN,
                  **LLAMA)
    for r in p.rows:
        assert r["status"] == "ok", r
        assert r["peak_phase"] in ("forward", "loss", "backward", "optimizer")
        assert sum(r["peak_breakdown"][k] for k in DEVICE_PARTS) == r["peak_bytes"]
        want = estimate("llama-7b", r["method"], batch_size=2, layers=4, weights=r["weights"], **LLAMA)["peak"]
        assert r["peak_breakdown"]["weights"] == want["by_category"]["parameters"]
        assert r["peak_breakdown"]["optimizer_states"] == want["by_category"]["optimizer_state"]
        assert compact(r).split()[0] in ("fwd", "loss", "bwd", "opt")
    rows = {r["method"]: r for r in p.rows}
    # checkpointing keeps only the blocks' inputs for the backward: fewer saved bytes than the baseline's
    assert rows["checkpointing"]["peak_breakdown"]["saved_activations"] < rows["baseline"]["peak_breakdown"][
        "saved_activations"]
    assert "peak at" in p.table()
    p.plot(tmp_path / "where.png")
    assert (tmp_path / "where.png").stat().st_size > 10_000


def test_find_seq_len_fits_and_one_token_more_does_not():
    cap = 400_000
    p = make_plan("llama-7b", batch_size=2, gpu_memory=cap, methods=["lora"], weights="bf16", find="seq-len",
                  **NO_MARGIN, **LLAMA)
    for r in p.rows:
        n = r["largest_seq_len"]
        assert r["largest_seq_len_how"] == f"checked: {n} fits, {n + 1} does not"
        kw = dict(LLAMA, seq_len=None)

        def peak(L):
            return estimate("llama-7b", r["method"], batch_size=2, layers=4, weights="bf16", **dict(kw, seq_len=L))[
                "peak"]["bytes"]
        assert peak(n) <= cap < peak(n + 1)
    with pytest.raises(ValueError, match="text model"):
        make_plan("vit_tiny_patch16_224", batch_size=2, find="seq-len", methods=["lora"])


def test_the_search_finds_the_largest_length_of_a_quadratic_peak():
    """The batch's search, parametrised: a peak growing with the square of the length (eager attention) gets its
    exact answer, checked at the answer and one more."""
    from lowmembp.plan.search import largest_fitting

    def peak(n):
        return 1000 + 3 * n + n * n // 4

    want = max(n for n in range(1, 5000) if peak(n) <= 200_000)
    known = {64: peak(64)}
    got, how = largest_fitting(peak, 200_000, known=known, floor=1000, first_slope=3, unit="sequence length")
    assert got == want and how == f"checked: {want} fits, {want + 1} does not"
    assert largest_fitting(peak, 1002, known={64: peak(64)}, unit="sequence length") == (
        0, "none: sequence length 1 does not fit (checked)")


def test_cli_weights_find_and_plot(tmp_path, capsys):
    import json

    from lowmembp.plan.__main__ import main

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 56,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 61,
        "max_position_embeddings": 64}))
    args = ["--model", str(tmp_path), "--batch-size", "2", "--seq-len", "16", "--gpu-memory", "4MiB", "--methods",
            "lora", "--jobs", "1", "--reserved", "0", "--margin", "0"]
    assert main(args + ["--weights", "auto,nf4", "--find", "seq-len", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "max seq len" in out and "peak at" in out and "weights auto, nf4" in out and "nf4, adamw" in out
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert main(args + ["--find", "seq-length"]) == 2
    assert "seq-len" in capsys.readouterr().err


def test_a_peak_extended_from_builds_peaking_in_different_phases_is_split_proportionally():
    """LLaMA-7B with checkpointing peaks in the loss at 2 blocks and in the backward at 3 (the figures of those two
    fake steps): the extended peak keeps the weights and optimizer states extended exactly, and splits the rest as
    the 3-block build does, so the parts still add up to the peak and none is negative."""
    lo = {"bytes": 12453446268, "phase": "loss", "saved_bytes": 1914863616, "how": "fake",
          "by_category": {"parameters": 2667659776, "gradients": 0, "optimizer_state": 5335318612,
                          "activations": 4450336808, "temporaries": 0, "other": 131072}}
    hi = {"bytes": 15480767104, "phase": "backward", "saved_bytes": 134283264, "how": "fake",
          "by_category": {"parameters": 3477193216, "gradients": 2323726336, "optimizer_state": 6954385528,
                          "activations": 153108488, "temporaries": 2572222464, "other": 131072}}
    from lowmembp.estimator.step import extend_by_depth
    from lowmembp.plan.combination import Peaks

    peaks = Peaks.__new__(Peaks)
    peaks.shallow, peaks.depth = (2, 3), 32
    out = peaks._combine({2: {"peak": lo, "flops": None}, 3: {"peak": hi, "flops": None}})["peak"]
    assert out["bytes"] == extend_by_depth({"peak": lo}, {"peak": hi}, (2, 3), 32)["peak"]["bytes"]
    parts = split_peak(out)
    assert sum(parts[k] for k in DEVICE_PARTS) == out["bytes"] and min(parts.values()) >= 0
    assert parts["weights"] == 3477193216 + 29 * (3477193216 - 2667659776)
    hb = split_peak(hi)
    rest = [hb["gradients"], hb["saved_activations"], hb["temporaries"]]
    got = [parts["gradients"], parts["saved_activations"], parts["temporaries"]]
    assert [round(g / sum(got), 6) for g in got] == [round(r / sum(rest), 6) for r in rest]
    assert compact({"peak_phase": "backward", "peak_breakdown_how": "proportional", "peak_bytes": out["bytes"],
                    "peak_breakdown": parts}).startswith("bwd~")
