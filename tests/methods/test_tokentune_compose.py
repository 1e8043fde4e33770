"""tokentune composed with lora / lowmembp / checkpointing, on the GPU, copied, trained; DropPath."""
import copy

import pytest
import torch
import torch.nn.functional as F

import lowmembp
from lowmembp.methods.tokentune import tokentune_state
from tokentune_refs import (_randomise, _vit, batch, build, compare_grads, grads, loss_of, reference_loss,
                            saved_bytes)


# ------------------------------------------------------------------------------------------------ composition
def test_with_peft_lora():
    from peft import LoraConfig, get_peft_model
    name = "bert"
    base = build(name)
    inputs = batch(name)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=["query", "key", "value", "dense"], init_lora_weights=False)
    peft_model = get_peft_model(base, cfg)
    ref = copy.deepcopy(peft_model)
    eval_in = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        expect = ref.eval()(**eval_in).logits
    model = lowmembp.apply(peft_model, "tokentune", k=5, seed=1)
    with torch.no_grad():
        assert torch.equal(model.eval()(**eval_in).logits, expect)
    model.train()
    model(**inputs).loss.backward()
    sel = tokentune_state(model).last
    ref.train()
    reference_loss(name, ref.get_base_model(), inputs, sel.positions, sel.valid).backward()
    g = grads(model)
    assert g and all("lora_" in n for n in g)
    compare_grads(g, grads(ref))


@pytest.mark.parametrize("name,how", [("vit", "timm"), ("llama", "transformers"), ("bert", "registry"),
                                      ("vit", "registry")])
def test_checkpointing_after_keeps_the_gradient(name, how):
    model = build(name)
    inputs = batch(name)
    plain = lowmembp.apply(copy.deepcopy(model), "tokentune", k=5, seed=2).train()
    loss_of(name, plain, inputs).backward()
    if how == "registry":
        model = lowmembp.apply(model, "tokentune+checkpointing", k=5, seed=2).train()
    else:
        model = lowmembp.apply(model, "tokentune", k=5, seed=2).train()
        if how == "timm":
            model.set_grad_checkpointing(True)
        else:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(tokentune_state(model).checkpoint_flags())
    loss_of(name, model, inputs).backward()
    compare_grads(grads(model), grads(plain))
    # next draw of the same seeded generator on both: the same positions; checkpointing keeps less
    assert saved_bytes(model, lambda: loss_of(name, model, inputs)) < \
        0.5 * saved_bytes(plain, lambda: loss_of(name, plain, inputs))


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
@pytest.mark.parametrize("spec", ["lora+tokentune", "lowmembp+tokentune", "lora+lowmembp+tokentune"])
def test_composes_through_the_registry(name, spec):
    """Eval output = the model converted without tokentune; training gradient = the detached reference built on
    that same conversion (ReGELU2 / MS norms / LoRA included)."""
    other = spec.replace("+tokentune", "")
    torch.manual_seed(4)
    converted = lowmembp.apply(build(name), other)  # the same model without tokentune
    if "lora" in spec:  # peft starts B at 0: give the adapters values so that their gradients are not trivial
        with torch.no_grad():
            for n, p in converted.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    ref = copy.deepcopy(converted)
    model = lowmembp.apply(converted, "tokentune", k=5, seed=6)
    inputs = batch(name, left_pad=True)
    eval_in = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        a = model.eval()(**eval_in) if "x" not in inputs else model.eval()(inputs["x"])
        b = ref.eval()(**eval_in) if "x" not in inputs else ref.eval()(inputs["x"])
    a, b = (a.logits, b.logits) if hasattr(a, "logits") else (a, b)
    assert torch.equal(a, b)
    model.train()
    ref.train()
    loss = loss_of(name, model, inputs)
    loss.backward()
    sel = tokentune_state(model).last
    inner = ref.get_base_model() if hasattr(ref, "get_base_model") else ref
    loss_ref = reference_loss(name, inner, inputs, sel.positions, sel.valid)
    loss_ref.backward()
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    worst = compare_grads(grads(model), grads(ref))
    print(f"{spec} {name}: max grad diff {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bert", "vit", "llama"])
def test_gradient_equals_reference_on_cuda(name):
    """The same check on the GPU kernels (SDPA with boolean masks, GQA, a CUDA generator)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(name).cuda()
    ref = copy.deepcopy(model).train()
    inputs = {k: v.cuda() for k, v in batch(name, left_pad=name == "llama").items()}
    model = lowmembp.apply(model, "tokentune", k=5, seed=3).train()
    loss_of(name, model, inputs).backward()
    sel = tokentune_state(model).last
    assert sel.positions.is_cuda
    reference_loss(name, ref, inputs, sel.positions, sel.valid).backward()
    g, gr = grads(model), grads(ref)
    for n in g:
        torch.testing.assert_close(g[n], gr[n], rtol=1e-3, atol=1e-5 * max(gr[n].abs().max().item(), 1e-3))


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_of_a_converted_model_run_on_their_own_parameters(name, how):
    import io
    model = lowmembp.apply(build(name), "tokentune", k=4, seed=1).train()
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    inputs = batch(name)
    loss_of(name, twin, inputs).backward()
    assert not grads(model), "the copy's training forward reached the original's parameters"
    assert grads(twin)
    loss_of(name, model, inputs).backward()  # same seed, same draw: identical gradients
    compare_grads(grads(twin), grads(model))


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
def test_training_steps_lower_the_loss(name):
    """A few AdamW steps on one batch (fresh positions every step) lower the ordinary full-sequence loss."""
    model = lowmembp.apply(build(name), "tokentune", k=4, seed=0)
    inputs = batch(name)
    y = torch.randint(0, 5, (3,), generator=torch.Generator().manual_seed(2))

    def eval_loss():
        model.eval()
        with torch.no_grad():
            if "x" in inputs:
                return F.cross_entropy(model(inputs["x"]), y).item()
            return model(**inputs).loss.item()

    before = eval_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(15):
        loss = F.cross_entropy(model(inputs["x"]), y) if "x" in inputs else model(**inputs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = eval_loss()
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize("spec", ["tokentune", "tokentune+checkpointing"])
def test_vit_drop_path_drops_a_sample_for_all_its_rows(spec):
    """Stochastic depth decides per sample: drawn once per block for the selected and the unselected rows, in timm's
    order, so with the same global RNG state the gradient equals the reference's (which runs timm's DropPath)."""
    torch.manual_seed(0)
    model = _vit(drop_path_rate=0.5, depth=3)
    _randomise(model)
    ref = copy.deepcopy(model).train()
    inputs = batch("vit", B=6)
    model = lowmembp.apply(model, spec, k=5, seed=3).train()  # private generator: global RNG left alone
    torch.manual_seed(11)
    loss = loss_of("vit", model, inputs)
    loss.backward()
    sel = tokentune_state(model).last
    torch.manual_seed(11)
    loss_ref = reference_loss("vit", ref, inputs, sel.positions, sel.valid)
    loss_ref.backward()
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    compare_grads(grads(model), grads(ref))
    tokentune_state(model).selector = lambda valid, k, decoder, gen: sel.positions  # same positions again
    torch.manual_seed(11)
    assert loss_of("vit", model, inputs).item() == loss.item()
    torch.manual_seed(12)  # another draw of the masks alone changes the loss: they do matter here
    assert abs(loss_of("vit", model, inputs).item() - loss.item()) > 1e-4
