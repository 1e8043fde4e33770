"""The ``compile`` method: composes with the others, compiled gradients equal eager ones, the memory budget is in
force when the backward graph is partitioned, and converted blocks trace without graph breaks from our code.

Compile time is kept small: a one-layer BERT, and AOT autograd's ``aot_eager_decomp_partition`` backend (the same
decompositions and min-cut partitioner as inductor, no code generation) except in the one inductor test.
"""
import inspect
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import lowmembp  # noqa: E402
from lowmembp.memory import saved_bytes  # noqa: E402
from lowmembp.methods.compile import compile_info, is_compiled  # noqa: E402
from tiny_models import _randomise_norms, build  # noqa: E402

FAST = "aot_eager_decomp_partition"


def _bert1(seed=0):
    """A one-layer tiny BERT classifier (random norms) and its batch, with a padded row."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                                  vocab_size=61, max_position_embeddings=40, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg)
    _randomise_norms(model)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, 61, (2, 9), generator=g),
             "attention_mask": torch.tensor([[1] * 9, [1] * 6 + [0] * 3]),
             "labels": torch.tensor([0, 2])}
    return model, batch


def _grads(spec, **options):
    model, batch = _bert1()
    model = lowmembp.apply(model, spec, **options)
    model.train()
    torch.manual_seed(123)
    out = model(**batch)
    (out.loss + out.logits.pow(2).mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, grads


def _assert_close(eager, compiled, rtol=2e-4):
    assert eager.keys() == compiled.keys() and eager
    scale = max(g.abs().max().item() for g in eager.values())  # some grads are ~0 in exact math (key biases)
    for name, g in eager.items():
        err = (g - compiled[name]).abs().max().item()
        assert err <= rtol * scale, f"{name}: |eager - compiled| = {err:.3g} > {rtol} x {scale:.3g}"


@pytest.mark.parametrize("spec,options", [
    ("baseline", {}), ("lowmembp", {}), ("mesa", {}), ("lora", {}), ("checkpointing", {}),
    ("tokentune", {"k": 4, "seed": 7}),
])
def test_compiled_gradients_equal_eager(spec, options):
    torch._dynamo.reset()
    ref, eager = _grads(spec, **options)
    model, compiled = _grads(spec + "+compile", compile_backend=FAST, **options)
    assert is_compiled(model) and compile_info(model)["graphs"] >= 1  # something really went through the backend
    _assert_close(eager, compiled)
    if spec.startswith("tokentune"):
        from lowmembp.methods.tokentune import tokentune_state
        assert torch.equal(tokentune_state(model).last.positions, tokentune_state(ref).last.positions)


@pytest.mark.slow
def test_inductor_lowmembp_gradients():
    """The real default backend (CPU inductor, C++ codegen): same gradients; the saving survives compilation."""
    torch._dynamo.reset()
    _, eager = _grads("lowmembp")
    model, compiled = _grads("lowmembp+compile")
    assert compile_info(model)["backend"] == "inductor" and compile_info(model)["graphs"] >= 1
    _assert_close(eager, compiled, rtol=1e-3)


def _llama_batch():
    model, inputs = build("llama")
    batch = inputs()
    return model, dict(batch, labels=batch["input_ids"])


def _compiled_saved(spec, make=_bert1, **options):
    model, batch = make()
    model = lowmembp.apply(model, spec, **options)
    model.train()
    model(**batch).loss.backward()  # compile (forward and backward) outside the count
    return saved_bytes(model, lambda: model(**batch).loss)["total"]


def test_memory_budget_is_in_force_when_partitioning():
    torch._dynamo.reset()
    full = _compiled_saved("compile", memory_budget=1.0, compile_backend=FAST)
    none = _compiled_saved("compile", memory_budget=0.0, compile_backend=FAST)
    again = _compiled_saved("compile", memory_budget=1.0, compile_backend=FAST)  # no graph reused across budgets
    assert none < 0.25 * full, (none, full)
    assert again == full


@pytest.mark.parametrize("make", [
    _bert1,
    pytest.param(_llama_batch, marks=pytest.mark.xfail(strict=True, reason=(
        "measured (benchmarks/compiled_saving.py, L=64): the min-cut partitioner already recomputes SiLU and the "
        "RMSNorm product for the compiled baseline (1425 -> 1086 KiB) while lowmembp's custom ops stay opaque "
        "(944 -> 937 KiB): compiled LLaMA keeps ~41 % of the eager saving"))),
], ids=["bert", "llama"])
def test_compiled_lowmembp_keeps_90_percent_of_the_eager_saving(make):
    """Saving = 1 - saved bytes / the baseline's in the same mode (eager vs eager, compiled vs compiled)."""
    torch._dynamo.reset()

    def eager(spec):
        model, batch = make()
        model = lowmembp.apply(model, spec)
        model.train()
        return saved_bytes(model, lambda: model(**batch).loss)["total"]

    eager_saving = 1 - eager("lowmembp") / eager("baseline")
    compiled_saving = 1 - _compiled_saved("lowmembp+compile", make, compile_backend=FAST) / _compiled_saved(
        "compile", make, compile_backend=FAST)
    assert eager_saving > 0.2
    assert compiled_saving >= 0.9 * eager_saving, (compiled_saving, eager_saving)


def test_composes_last_and_keeps_the_model():
    from lowmembp.methods.registry import parse
    assert [m.name for m in parse("compile+lora+lowmembp+checkpointing")][-1] == "compile"
    model, batch = _bert1()
    model = lowmembp.apply(model, "lowmembp+checkpointing")
    sig, keys = inspect.signature(model.forward), list(model.state_dict())
    model = lowmembp.apply(model, "compile", compile_backend=FAST)
    assert model._lowmembp_methods == ("lowmembp", "checkpointing", "compile")
    assert inspect.signature(model.forward) == sig and list(model.state_dict()) == keys
    with pytest.raises(RuntimeError, match="already"):
        lowmembp.apply(model, "compile")


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", True])
def test_bad_budget_is_a_clear_error(bad):
    model, _ = _bert1()
    with pytest.raises(ValueError, match="memory_budget must be a number in"):
        lowmembp.apply(model, "compile", memory_budget=bad)


def test_bad_backend_is_a_clear_error():
    model, _ = _bert1()
    with pytest.raises(ValueError, match="unknown compile_backend"):
        lowmembp.apply(model, "compile", compile_backend="no-such-backend")


# ------------------------------------------------------------------------------------------- no graph breaks
def _block_and_args(name):
    model, inputs = build(name)
    model = lowmembp.apply(model, "lowmembp")
    model.train()
    if name == "vit":
        return model.blocks[0], (torch.randn(2, 17, 32),), {}
    if name == "bert":
        return model.bert.encoder.layer[0], (torch.randn(2, 7, 32),), {}
    layer = model.model.layers[0]
    h = torch.randn(2, 7, 32)
    pos = torch.arange(7)[None]
    return layer, (h,), {"position_embeddings": model.model.rotary_emb(h, pos), "position_ids": pos}


def _our_breaks(explanation):
    """Graph breaks whose reason or user stack points into the lowmembp package."""
    root = os.path.dirname(lowmembp.__file__)
    ours = []
    for br in explanation.break_reasons:
        frames = [f.filename for f in (getattr(br, "user_stack", None) or [])]
        if any(f.startswith(root) for f in frames) or root in str(getattr(br, "reason", "")):
            ours.append(f"{br.reason} @ {frames[-1] if frames else '?'}")
    return ours


@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
def test_converted_block_has_no_graph_break_from_lowmembp(name):
    torch._dynamo.reset()
    block, args, kwargs = _block_and_args(name)
    explanation = torch._dynamo.explain(block)(*args, **kwargs)
    assert not _our_breaks(explanation), _our_breaks(explanation)
    assert explanation.graph_count >= 1
