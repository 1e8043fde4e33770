"""One forward and backward shared by the optimizers (lowmembp.plan.shared): every optimizer's step read off the
shared run equals that optimizer's own direct fake step (lowmembp.plan.steps.Steps, itself estimate()'s procedure,
tests/plan/test_plan_fast.py) to the byte: peak, split by category, phase, saved bytes, host bytes, the creation
events (what the batch line is fitted on) and the FLOPs; and a plan over several optimizers and weights gives the
rows that planning each alone gives."""
import pytest

from lowmembp.estimator.step import MODELS
from lowmembp.estimator.weights import WEIGHTS
from lowmembp.methods.optim_levers import LEVERS
from lowmembp.methods.optimizers import OPTIMIZERS
from lowmembp.plan import make_plan
from lowmembp.plan.combination import Peaks, StepSource
from lowmembp.plan.shared import QUIET, STEP_PARTS, NotShared, SharedSteps
from lowmembp.plan.steps import Steps

pytestmark = pytest.mark.slow  # ~5 min: three optimizers' direct steps beside each shared one

LLAMA = dict(overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 61, "num_hidden_layers": 4}, seq_len=16, dtype="bf16")
VIT = dict(overrides={"img_size": 32, "embed_dim": 48, "num_heads": 3}, seq_len=None, dtype="fp16")
MODELS_ = {"llama-7b": LLAMA, "vit-b16": VIT}
ALL = tuple(o for o in OPTIMIZERS if o not in LEVERS)  # the other packages' levers are stepped directly (NotShared)
# the weights each model is stepped with: the ViT under fp16 autocast with fp32 or fp16 weights (bf16 weights there
# meet fp16 activations in one op, which autocast refuses); nf4 is a bf16 step with the base linears' bytes
# replaced, planned only with a LoRA-family method
STORED = {"llama-7b": WEIGHTS, "vit-b16": ("fp32", "fp16")}
CASES = [(m, meth, w) for m in MODELS_ for w in STORED[m] for meth in ("baseline", "lora", "lora+checkpointing")
         if w != "nf4" or meth != "baseline"]


def _direct(model, method, weights, optimizer, batch, flops=False, layers=2, **kw):
    steps = Steps(MODELS[model], method, layers=layers, weights=weights, optimizer=optimizer, **MODELS_[model], **kw)
    run = steps.run(batch, flops=flops)
    return run, steps.shard(run.peak)


def _same_run(got, want):
    assert got.peak == want.peak
    assert got.events == want.events
    assert got.flops == want.flops


@pytest.mark.parametrize("model, method, weights", CASES)
def test_every_optimizer_read_off_the_shared_step_equals_its_direct_step(model, method, weights):
    STEP_PARTS.clear()
    QUIET.clear()   # the optimizers' steps recorded at batch 3 and read back at batch 4
    shared = SharedSteps(MODELS[model], method, layers=2, weights=weights, optimizers=ALL, **MODELS_[model])
    for batch, flops in ((3, True), (4, False)):   # the second batch reuses the optimizers' recorded steps
        runs = shared.run(batch, flops=flops)
        assert set(runs) == set(ALL)
        for z in ALL:
            want, want_sharded = _direct(model, method, weights, z, batch, flops=flops)
            _same_run(runs[z], want)
            assert shared.shard(runs[z].peak, z) == want_sharded
    if method != "baseline" or model == "llama-7b":  # fused-backward's steps in the backward: run once, then known
        assert QUIET and all(QUIET.values())
    # the optimizers differ where they should: the state, and fused-backward's gradients (never all alive)
    peaks = {z: runs[z].peak for z in ALL}
    assert peaks["adamw"]["by_category"]["optimizer_state"] != peaks["adamw8bit"]["by_category"]["optimizer_state"]
    assert peaks["adamw-fused-backward"]["by_category"]["gradients"] < peaks["adamw"]["by_category"]["gradients"] \
        or peaks["adamw-fused-backward"]["phase"] != "optimizer"


@pytest.mark.parametrize("optimizers", [("adamw", "adamw8bit"), ("adamw-fused-backward", "adamw")])
def test_any_two_optimizers_share(optimizers):
    shared = SharedSteps(MODELS["llama-7b"], "lora", layers=2, weights="bf16", optimizers=optimizers, **LLAMA)
    runs = shared.run(3)
    for z in optimizers:
        _same_run(runs[z], _direct("llama-7b", "lora", "bf16", z, 3)[0])


def test_optimizer_steps_recorded_on_one_combination_serve_another_of_the_same_parameters():
    STEP_PARTS.clear()
    QUIET.clear()
    SharedSteps(MODELS["llama-7b"], "baseline", layers=2, optimizers=ALL, **LLAMA).run(3, flops=True)
    known = dict(STEP_PARTS)
    runs = SharedSteps(MODELS["llama-7b"], "checkpointing", layers=2, optimizers=ALL, **LLAMA).run(5, flops=True)
    assert STEP_PARTS == known                                  # nothing recorded again
    for z in ALL:
        _same_run(runs[z], _direct("llama-7b", "checkpointing", "fp32", z, 5, flops=True)[0])


def test_offload_host_bytes_and_saved_bytes_come_through_the_timeline():
    opts = {"min_bytes": 0}
    shared = SharedSteps(MODELS["llama-7b"], "offload", layers=2, optimizers=ALL, **LLAMA, **opts)
    runs = shared.run(3)
    for z in ALL:
        want = _direct("llama-7b", "offload", "fp32", z, 3, **opts)[0]
        assert runs[z].peak["host"]["bytes"] > 0 and runs[z].peak["saved_bytes"] > 0
        _same_run(runs[z], want)


def test_a_source_falls_back_to_direct_steps_when_the_shared_step_fails(monkeypatch):
    def refuse(self, *a, **k):
        raise NotShared("test")

    monkeypatch.setattr(SharedSteps, "run", refuse)
    src = StepSource(MODELS["llama-7b"], "lora", layers=(2,), optimizers=ALL, weights="bf16", **LLAMA)
    for z in ALL:
        _same_run(src.run(2, 3, z), _direct("llama-7b", "lora", "bf16", z, 3)[0])
    assert src._shared is None and len(src._direct) == len(ALL)


def test_peaks_over_a_shared_source_equal_peaks_of_their_own():
    src = StepSource(MODELS["llama-7b"], "lora+checkpointing", layers=(2, 3), optimizers=ALL, weights="bf16",
                     **LLAMA)
    for z in ALL:
        for w in ("bf16", "nf4"):
            mine = Peaks(MODELS["llama-7b"], "lora+checkpointing", shallow=(2, 3), depth=4, optimizer=z, weights=w,
                         **LLAMA)
            shared = Peaks(MODELS["llama-7b"], "lora+checkpointing", shallow=(2, 3), depth=4, optimizer=z, weights=w,
                           source=src, **LLAMA)
            assert shared.direct(3, flops=True) == mine.direct(3, flops=True)
            assert shared.fit_line(3) and mine.fit_line(3)
            assert shared.at(17) == mine.at(17) and shared.at(1) == mine.at(1)
            assert shared.steps_run == mine.steps_run


def _rows(plan):
    keep = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "cpu_seconds")}  # noqa: E731
    return sorted((keep(r) for r in plan.rows), key=lambda r: (r["label"], r["weights"]))


def test_a_plan_over_optimizers_and_weights_gives_each_ones_own_rows():
    kw = dict(batch_size=3, gpu_memory="20MiB", margin=0.0, reserved=0, jobs=1, combos=["lora", "checkpointing"],
              **{k: LLAMA[k] for k in ("seq_len", "dtype", "overrides")})
    together = make_plan("llama-7b", optimizer=list(ALL), weights=["bf16", "nf4", "fp32"], **kw)
    alone = [r for z in ALL for w in ("bf16", "nf4", "fp32")
             for r in make_plan("llama-7b", optimizer=z, weights=w, **kw).rows]
    assert len(together.rows) == len(alone) > len(ALL)
    drop = {"rank", "flops_ratio", "measured", "measured_ratio"}
    want = sorted(({k: v for k, v in r.items() if k not in drop | {"seconds", "cpu_seconds"}} for r in alone),
                  key=lambda r: (r["label"], r["weights"]))
    got = [{k: v for k, v in r.items() if k not in drop} for r in _rows(together)]
    assert got == want
