"""The planner's fast path (lowmembp.plan.steps / combination): a model built once and stepped at several batches
gives estimate()'s peaks to the byte, the batch line through two steps gives estimate()'s peak at other batches,
a method whose op sequence changes with the batch (chunked-ce with small chunks) is detected and stepped instead,
and a plan's largest batch fits and the next does not per estimate()."""
import pytest

from lowmembp.estimator.step import estimate, estimate_by_depth
from lowmembp.plan import make_plan
from lowmembp.plan.combination import Peaks
from lowmembp.plan.combos import combinations
from lowmembp.plan.steps import BatchLine, Steps

pytestmark = pytest.mark.slow  # the full suite only: the planner's shortcuts against direct steps

# LLaMA at a tiny width, 4 blocks (the planner extends its 2- and 3-block builds), bf16 autocast as the paper
LLAMA = dict(overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 61, "num_hidden_layers": 4}, seq_len=16, dtype="bf16")
SINGLES = [c for c in combinations(max_methods=1)[0]]
NO_MARGIN = dict(margin=0.0, reserved=0)
# At this width offload's default min_bytes (1024) is crossed between batch 3 and 4 (more saved tensors are
# offloaded at 4: a batch-dependent op sequence, no line; the chunked-ce test covers that case), so its line is
# tested with every saved tensor offloaded. (Its storage count also used to differ from step to step at one batch,
# 531/533/532, while it reused a freed tensor's host copy for the next tensor at the same address: fixed, and tested
# in test_offload.)
TINY_OPTIONS = {"offload": {"min_bytes": 0}}


def _peak(method, b, layers=None, by_depth=False, **options):
    f = estimate_by_depth if by_depth else estimate
    return f("llama-7b", method, batch_size=b, layers=layers, **LLAMA, **options)["peak"]


def _same(got, want):
    assert got["bytes"] == want["bytes"]
    assert {k: v for k, v in got["by_category"].items() if v} == {k: v for k, v in want["by_category"].items() if v}


@pytest.mark.parametrize("method", SINGLES)
def test_steps_and_line_equal_estimate(method):
    opts = TINY_OPTIONS.get(method, {})
    try:
        want = {b: _peak(method, b, layers=2, **opts) for b in (3, 4, 1, 9)}
    except Exception as e:  # noqa: BLE001  a method estimate() cannot run on this model: the steps refuse it too
        with pytest.raises(type(e)):
            Steps(estimate.__globals__["MODELS"]["llama-7b"], method, layers=2, **LLAMA, **opts).run(3)
        return
    steps = Steps(estimate.__globals__["MODELS"]["llama-7b"], method, layers=2, **LLAMA, **opts)
    runs = {b: steps.run(b, flops=b == 3) for b in (3, 4)}   # the second step reuses the model
    for b, r in runs.items():
        _same(r.peak, want[b])
        assert r.peak.get("host") == want[b].get("host")        # offload's host bytes too, step after step
    assert runs[3].flops == estimate("llama-7b", method, batch_size=3, layers=2, flops=True, **LLAMA,
                                     **opts)["flops"] > 0
    line = BatchLine(runs[3], runs[4])
    assert line.ok, f"{method}: the op sequence changed between batch 3 and 4"
    for b in (3, 4, 9):
        _same(line.peak(b), want[b])
    assert line.peak(1) is None                                 # batch 1 is stepped, never read off a line


def test_a_batch_dependent_op_sequence_gets_no_line_and_is_stepped():
    opts = {"chunk": 8}  # 16 tokens per sample: 2 chunks per sample, so the chunk loop grows with the batch
    spec = estimate.__globals__["MODELS"]["llama-7b"]
    steps = Steps(spec, "chunked-ce", layers=2, **LLAMA, **opts)
    a, b = steps.run(3), steps.run(4)
    assert len(a.events) != len(b.events) and not BatchLine(a, b).ok and BatchLine(a, b).peak(9) is None
    peaks = Peaks(spec, "chunked-ce", shallow=(2, 3), depth=4, **LLAMA, **opts)
    assert not peaks.fit_line(3)
    for b in (1, 9):
        _same(peaks.at(b), _peak("chunked-ce", b, **opts))      # stepped, at full depth: estimate() of 4 blocks


@pytest.mark.parametrize("method", ["baseline", "lora+checkpointing"])
def test_full_depth_from_the_line_equals_estimate(method):
    peaks = Peaks(estimate.__globals__["MODELS"]["llama-7b"], method, shallow=(2, 3), depth=4, **LLAMA)
    _same(peaks.direct(3)["peak"], _peak(method, 3))            # estimate() of the whole 4-block model
    assert peaks.fit_line(3)
    steps = peaks.steps_run
    for b in (1, 11):
        _same(peaks.at(b), _peak(method, b))
    _same(peaks.at(11), _peak(method, 11, by_depth=True))
    assert peaks.steps_run == steps + 2                         # only batch 1 was stepped (2 depths)


def test_plan_largest_batch_by_estimate_with_and_without_a_line():
    """chunked-ce with 32-token chunks (2 samples of 16 tokens a chunk): its op sequence changes with the batch, so
    its rows are searched by steps; the others read every batch off their line; all answers stepped and checked."""
    chunk, cap, more = 32, 800_000, 2**20
    p = make_plan("llama-7b", batch_size=3, gpu_memory=cap, methods=["lora", "chunked-ce"],
             options={"chunked-ce": {"chunk": [chunk]}}, more_gpus=[more], **NO_MARGIN, **LLAMA)
    rows = {r["label"]: r for r in p.rows}
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["baseline"]["batch_line"] and not rows[f"chunked-ce chunk={chunk}"]["batch_line"]
    assert any(r["largest_batch"] > 3 for r in rows.values()) and any(not r["fits"] for r in rows.values())
    for r in rows.values():  # the planner's peaks are estimate_by_depth's (its 2- and 3-block builds extended)
        b, opts = r["largest_batch"], r["options"]

        def peak(n):  # with the weights auto chose for the row (LoRA's base in bf16)
            return _peak(r["method"], n, by_depth=True, weights=r["weights"], **opts)["bytes"]

        assert r["peak_bytes"] == peak(3)
        assert r["largest_batch_how"] == f"checked: {b} fits, {b + 1} does not"
        assert (b == 0 or peak(b) <= cap) and peak(b + 1) > cap
        g = r["largest_batch_by_gpu"][str(more)]
        assert peak(g) <= more < peak(g + 1)


def test_worker_processes_give_the_same_rows():
    """jobs=2 (forkserver workers) after this process has run autograd (the tests above): the same rows as jobs=1.
    The GPU holds less than the weights and AdamW state: 2 steps a row."""
    kw = dict(batch_size=2, gpu_memory=200_000, methods=["checkpointing"], **NO_MARGIN, **LLAMA)
    keep = ("label", "status", "peak_bytes", "largest_batch", "flops", "largest_batch_how")
    one = sorted(tuple(r.get(k) for k in keep) for r in make_plan("llama-7b", jobs=1, **kw).rows)
    two = sorted(tuple(r.get(k) for k in keep) for r in make_plan("llama-7b", jobs=2, **kw).rows)
    assert one == two and len(one) == 2 and all(r[1] == "ok" and r[3] == 0 for r in one)


BERT = dict(overrides={"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 101,
                       "num_hidden_layers": 3}, seq_len=12, dtype="bf16")
VIT = dict(overrides={"img_size": 32, "embed_dim": 48, "num_heads": 3}, seq_len=None, dtype="fp16")


def _stacked_run(steps, b):
    """One step with the tracker entered as its own dispatch mode above the fake mode (what estimate() does)."""
    from lowmembp.estimator.step import train_step
    from lowmembp.estimator.zoo import make_batch
    from lowmembp.measurement.flops import step_flop_counter
    from lowmembp.plan.steps import EventTracker

    with steps.mode:
        batch = make_batch(steps.spec, steps.model, b, steps.seq_len, steps.vocab)
        tracker = EventTracker(step_flop_counter())
        tracker.track_external(steps.model, steps.opt, *batch.values())
        tracker.watch(steps.model)
        tracker.watch_phases(steps.model, steps.last_block)   # as Steps.run: the phases and the saved tensors
        with tracker:
            train_step(steps.spec, steps.model, batch, steps.opt, steps.dtype, around_forward=tracker.saved_hooks())
    return tracker


@pytest.mark.parametrize("model,method", [("llama-7b", m) for m in SINGLES] + [
    ("bert-large", m) for m in ("baseline", "lowmembp", "lora+mesa", "tokentune+checkpointing")] + [
    ("vit-b16", m) for m in ("baseline", "lowmembp+sac", "mesa")])
def test_riding_in_the_fake_mode_sees_what_a_stacked_mode_sees(model, method):
    """The planner's tracker rides in its fake mode (RecordingFakeMode); entered as a dispatch mode of its own above
    the fake mode, as estimate() enters its tracker, it records the same events, peak and FLOPs, op for op."""
    from lowmembp.estimator.step import MODELS

    sizes = {"llama-7b": LLAMA, "bert-large": BERT, "vit-b16": VIT}[model]
    try:
        steps = Steps(MODELS[model], method, layers=2, **sizes)
    except Exception:  # noqa: BLE001  refused on this model (test_steps_and_line_equal_estimate checks that)
        return
    steps.run(3)  # both measured steps below start from the same state (optimizer state made, no gradients)
    riding = steps.run(3, flops=True)
    stacked = _stacked_run(steps, 3)
    assert len(riding.events) > 10 and riding.events == stacked.events
    assert riding.peak["bytes"] == stacked.peak and riding.flops == stacked.flops.total > 0
