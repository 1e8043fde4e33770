"""``chunked-ce``: the op equals lm_head + cross-entropy (float64, any chunk size, bias, ignored targets, bf16
autocast); the method's loss and gradients equal the model's own (LLaMA, tied embeddings, Mistral, Qwen2, with LoRA),
eval and label-free calls are untouched; no saved tensor is V wide and the saved bytes drop by the fp32 logits; refused
for models without a causal-LM head; trains a tiny LLaMA."""
import copy

import pytest
import torch
import torch.nn.functional as F

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.ops.chunked_ce import chunked_linear_cross_entropy
from peers_common import grads, train_steps
from tiny_models import VOCAB, build


def _plain(h, w, b, t):
    return F.cross_entropy(F.linear(h, w, b).float(), t, ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 5, 13, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_op_equals_linear_cross_entropy(chunk, bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(29, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(29, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, 29, (13,), generator=g)
    t[[2, 7]] = -100
    # the op takes the log-softmax in fp32 like transformers (here a down-cast from float64): fp32 tolerances
    ref = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, [h, w] + ([b] if bias else []))
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if bias else None
    ours = chunked_linear_cross_entropy(h2, w2, b2, t, chunk=chunk)
    our_grads = torch.autograd.grad(ours, [h2, w2] + ([b2] if bias else []))
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-7)  # fp32 log-softmax inside
    for a, r in zip(our_grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_op_bf16_autocast_matches_plain():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(50, 16, generator=g)).requires_grad_()
    t = torch.randint(0, 50, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _plain(h, w, None, t)
    gr = torch.autograd.grad(ref, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_linear_cross_entropy(h, w, None, t, chunk=7)
    go = torch.autograd.grad(ours, [h, w])
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)  # the same bf16 logits, chunk by chunk
    torch.testing.assert_close(go[0], gr[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(go[1], gr[1], rtol=2e-2, atol=2e-3)  # dW: per-chunk bf16 products summed in fp32


def _lm_batch(inputs, seed=1):
    ids = inputs(seed)["input_ids"]
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("name", ["llama", "llama_tied", "mistral", "qwen2"])
def test_loss_and_gradients_equal_the_models_own(name):
    # float64 weights: in fp32 the chunked sums round differently from the whole ones, and by how much depends on
    # the CPU's matmul kernels (7 of 1952 Qwen2 gradients 5e-6 apart on an AMD EPYC Zen 5); what is left in float64
    # is the fp32 log-softmax both take (~4e-8 here)
    model, inputs = build(name)
    model = model.double()
    batch = _lm_batch(inputs)
    ref = copy.deepcopy(model).train()
    model = lowmembp.apply(model, "chunked-ce", chunk=3).train()
    l0, l1 = ref(**batch).loss, model(**batch).loss
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    l0.backward()
    l1.backward()
    g0, g1 = grads(ref), grads(model)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=2e-7)


def test_with_lora_and_untouched_without_labels():
    model, inputs = build("llama")
    batch = _lm_batch(inputs)
    ref = copy.deepcopy(model)
    torch.manual_seed(0)
    ref = lowmembp.apply(ref, "lora").train()
    torch.manual_seed(0)
    model = lowmembp.apply(model, "lora+chunked-ce").train()
    l0, l1 = ref(**batch).loss, model(**batch).loss
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    l0.backward()
    l1.backward()
    for k, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[k], g, rtol=1e-5, atol=1e-6)
    assert model(**batch).logits is None  # training with labels: no logits
    with torch.no_grad():  # no grad, eval, or no labels: the model's own forward (logits as usual)
        torch.testing.assert_close(model(**batch).logits, ref(**batch).logits)
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(input_ids=batch["input_ids"]).logits, ref(input_ids=batch["input_ids"]).logits)


def test_with_mesa_the_head_is_computed_here():
    # mesa makes lm_head a MesaLinear (forward exactly F.linear, 8-bit input saved); chunked-ce computes it itself:
    # the loss is the plain model's, lm_head's gradient the exact one (not Mesa's from the 8-bit input), and every
    # other gradient Mesa's (the same gradient reaches the last hidden state)
    model, inputs = build("llama")
    batch = _lm_batch(inputs)
    out = {}
    for spec in ("baseline", "mesa", "mesa+chunked-ce"):
        torch.manual_seed(0)
        m = lowmembp.apply(copy.deepcopy(model), spec, **({"chunk": 4} if "chunked" in spec else {})).train()
        torch.manual_seed(1)
        loss = m(**batch).loss
        loss.backward()
        out[spec] = (loss.detach(), grads(m), m)
    assert type(out["mesa+chunked-ce"][2].lm_head).__name__ == "MesaLinear"
    torch.testing.assert_close(out["mesa+chunked-ce"][0], out["baseline"][0], rtol=1e-6, atol=1e-6)
    head = "lm_head.weight"
    g_plain, g_mesa, g_both = out["baseline"][1], out["mesa"][1], out["mesa+chunked-ce"][1]
    torch.testing.assert_close(g_both[head], g_plain[head], rtol=1e-5, atol=1e-6)
    assert (g_mesa[head] - g_plain[head]).abs().max() > 1e-4  # Mesa's own head gradient is the 8-bit one
    assert g_both.keys() == g_mesa.keys()
    for k in g_mesa:
        if k != head:
            torch.testing.assert_close(g_both[k], g_mesa[k], rtol=1e-4, atol=1e-5)


def test_never_saves_the_logits():
    model, inputs = build("llama")
    batch = _lm_batch(inputs)
    totals, widest = {}, {}
    for spec in ("baseline", "chunked-ce"):
        m = lowmembp.apply(copy.deepcopy(model), spec, **({"chunk": 4} if spec != "baseline" else {})).train()
        with SavedTensorAccountant(m) as acc:
            loss = m(**batch).loss
        loss.backward()
        totals[spec] = acc.report()["total"]
        widest[spec] = max(r["shape"][-1] if r["shape"] else 0 for r in acc.table())
    tokens = batch["input_ids"].numel()
    assert widest["baseline"] == VOCAB and widest["chunked-ce"] < VOCAB
    # the baseline keeps the fp32 log-probabilities of every token (B·S·V·4 bytes); chunked-ce keeps none of them
    assert totals["baseline"] - totals["chunked-ce"] >= tokens * VOCAB * 4


@pytest.mark.parametrize("name", ["vit", "bert", "llama_cls", "llama_bare", "bert_mlm"])
def test_refused_without_a_causal_lm_head(name):
    model, _ = build(name)
    with pytest.raises(ValueError, match="causal-LM head"):
        lowmembp.apply(model, "chunked-ce")


def test_refused_for_lora_on_lm_head_and_bad_chunk():
    model, _ = build("llama")
    with pytest.raises(ValueError, match="lm_head"):
        lowmembp.apply(model, "lora+chunked-ce", targets=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="chunk"):
        lowmembp.apply(build("llama")[0], "chunked-ce", chunk=0)


def test_trains():
    model, inputs = build("llama")
    batch = _lm_batch(inputs)
    model = lowmembp.apply(model, "chunked-ce", chunk=5).train()
    losses, moved = train_steps(model, batch, loss=lambda m, b: m(**b).loss, lr=1e-2)
    assert moved and losses[-1] < losses[0]


@pytest.mark.parametrize("spec, first, second, how", [
    ("cce+chunked-ce", "cce", "chunked-ce", "chunk by chunk"),
    ("chunked-ce+cce", "cce", "chunked-ce", "chunk by chunk"),
    ("liger+chunked-ce", "liger", "chunked-ce", "fused linear cross-entropy"),
    ("cce+liger", "liger", "cce", "fused linear cross-entropy")])
def test_two_loss_methods_are_refused_by_name_and_reason(spec, first, second, how):
    """Every method that computes the causal-LM loss itself excludes the others; the refusal names both and says
    why (one loss per model), before any model is touched; the model keeps no trace of either."""
    from lowmembp.methods.registry import parse

    with pytest.raises(ValueError) as refusal:
        parse(spec)
    message = str(refusal.value)
    assert message.startswith(f"'{first}' cannot be combined with '{second}': both compute the causal-LM loss")
    assert how in message and "a model has one loss: choose one" in message and f"(in {spec!r})" in message
    model = build("llama")[0]
    with pytest.raises(ValueError, match="a model has one loss"):
        lowmembp.apply(model, spec)
    assert not getattr(model, "_lowmembp_methods", ())
    model = lowmembp.apply(model, "chunked-ce")
    with pytest.raises(ValueError, match="a model has one loss.*already carries 'chunked-ce'"):
        lowmembp.apply(model, "cce")
