"""lowmembp / lowmembp-act / lowmembp-norm on tiny random models of every family: exact forward, exact (norm) or
close (act) gradients, fewer saved bytes, LoRA in either order, meta/fake tensors, refusals."""
import copy

import pytest
import torch
import torch.nn as nn

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.models import UnsupportedModelError, get_layout

from tiny_models import FAMILY_BUILDERS, build, logits, lora_wrap

ALL = sorted(FAMILY_BUILDERS)
REPS = ["vit", "swin", "bert", "roberta", "llama", "mistral", "qwen2"]  # one per family / architecture



def norm_affine(norm):
    """(γ, β) as stored on a LayerNorm / LLaMA-style RMSNorm; either may be None (no affine, no bias)."""
    return getattr(norm, "weight", None), getattr(norm, "bias", None)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _loss(model, batch, seed=3):
    out = logits(model, batch)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return (out * w).sum()


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", ALL)
def test_forward_equal(name, mode):
    model, inputs = build(name)
    getattr(model, mode)()
    batch = inputs()
    with torch.no_grad():
        ref = logits(model, batch)
        conv = lowmembp.apply(copy.deepcopy(model), "lowmembp")
        getattr(conv, mode)()
        out = logits(conv, batch)
    assert out.shape == ref.shape
    assert rel(out, ref) <= 1e-5, rel(out, ref)
    rep = conv.lowmembp_report
    assert rep["norms"] and rep["acts"]
    kinds = {type(m).__name__ for m in conv.modules()}
    assert kinds & {"MSLayerNorm", "MSRMSNorm"} and kinds & {"ReGELU2", "ReSiLU2"}


def _fold_records(model):
    """For every norm a conversion will fold: γ, β (clones), their names, and its consumer linears' names."""
    lay = get_layout(model)
    names = {id(p): n for n, p in model.named_parameters()}
    recs = []
    for ns in lay.all_norms():
        if not ns.foldable:
            continue
        g, b = norm_affine(ns.get())
        lins = []
        for c in ns.consumers:
            mod = c.get()
            lins += [mod.base_layer, *mod.lora_A.values()] if hasattr(mod, "lora_A") else [mod]
        res = [f"{r.path}.residual_affine" for r in ns.residual_consumers]
        recs.append(dict(g=g.detach().clone(), b=None if b is None else b.detach().clone(), gname=names[id(g)],
                         bname=None if b is None else names[id(b)], res=res,
                         lins=[(names[id(l.weight)], l.weight.detach().clone(), l.bias is not None) for l in lins]))
    return recs


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    if "x" in batch:
        batch = {"x": batch["x"].clone().requires_grad_(True)}
    _loss(model, batch).backward()
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if "x" in batch:
        g["<input>"] = batch["x"].grad.detach().clone()
    return g


@pytest.mark.parametrize("name", REPS)
def test_norm_fold_gradient_is_exact(name):
    """lowmembp-norm: gradients map back to the original model's exactly by the chain rule of the fold."""
    model, inputs = build(name)
    model.train()  # fp32: the MS norms take fp32/fp16/bf16 only
    batch = inputs()
    recs = _fold_records(model)
    g0 = _grads(model, batch)
    conv = lowmembp.apply(copy.deepcopy(model), "lowmembp-norm")
    g1 = _grads(conv, batch)
    expect = dict(g1)
    for r in recs:
        dg = torch.zeros_like(r["g"], dtype=torch.float64)
        db = torch.zeros_like(r["g"], dtype=torch.float64)
        for wname, w0, had_bias in r["lins"]:
            bname = wname[: -len("weight")] + "bias"
            dw1 = g1[wname].double()
            dg += (dw1 * w0.double()).sum(0)
            dw0 = dw1 * r["g"].double()
            if r["b"] is not None:
                dbias = g1[bname].double()
                dw0 += torch.outer(dbias, r["b"].double())
                db += w0.double().t() @ dbias
                if not had_bias:
                    expect.pop(bname)
            expect[wname] = dw0
        for res in r["res"]:
            dg += g1.get(f"{res}.weight", torch.zeros_like(dg)).double()
            db += g1.get(f"{res}.bias", torch.zeros_like(db)).double()
            expect.pop(f"{res}.weight", None), expect.pop(f"{res}.bias", None)
        expect[r["gname"]] = dg
        if r["bname"]:
            expect[r["bname"]] = db
    assert set(expect) == set(g0), set(expect) ^ set(g0)
    # relative to the tensor's gradient, floored at 1e-4 of the largest one (key biases get ~0 exact gradient:
    # softmax is invariant to them, so their gradients are rounding noise in both models)
    floor = 1e-4 * max(g.double().norm().item() for g in g0.values())
    errs = {k: (expect[k].double() - g0[k].double()).norm().item() / max(g0[k].double().norm().item(), floor)
            for k in g0}
    worst = max(errs.values())
    print(f"\n{name}: lowmembp-norm chain-rule gradient, worst rel err over {len(g0)} tensors: {worst:.2e}")
    assert worst <= 5e-4  # fp32 rounding through 2 layers with ~unit-gain weights; a wrong map gives O(1)


def _group(n):
    if n == "<input>":
        return "input"
    if any(k in n for k in ("norm", "LayerNorm", "residual_affine")):
        return "norm"
    if any(k in n for k in ("attn", "attention", "query", "key", "value", "qkv", "proj.")) and "mlp" not in n:
        return "attention"
    if any(k in n for k in ("mlp", "intermediate", "output.dense", "fc1", "fc2", "gate", "up_", "down_")):
        return "mlp"
    if any(k in n for k in ("embed", "patch", "pos_", "cls_token", "token")):
        return "embed"
    return "head"


@pytest.mark.parametrize("name", REPS)
def test_act_gradient_close(name):
    """lowmembp (approximate activation derivative) against the exact gradient of the same folded model."""
    model, inputs = build(name)
    model.train()
    batch = inputs()
    exact = lowmembp.apply(copy.deepcopy(model), "lowmembp-norm")
    approx = lowmembp.apply(copy.deepcopy(exact), "lowmembp-act")
    ge, ga = _grads(exact, batch), _grads(approx, batch)
    assert set(ge) == set(ga)
    groups: dict[str, list] = {}
    for k in ge:
        groups.setdefault(_group(k), []).append(k)
    cosines = {g: cos(torch.cat([ga[k].flatten() for k in ks]), torch.cat([ge[k].flatten() for k in ks]))
               for g, ks in groups.items()}
    print(f"\n{name}: cosine(approx, exact) per group: "
          + ", ".join(f"{g} {c:.4f}" for g, c in sorted(cosines.items())))
    # the approximation changes the gradient (not bitwise equal) but keeps its direction
    assert min(cosines.values()) > 0.8
    assert any(rel(ga[k], ge[k]) > 1e-6 for k in ge)


def _saved(model, batch):
    model.train()
    acc = SavedTensorAccountant(model)
    with acc:
        loss = _loss(model, batch)
    loss.backward()
    return acc.report()


@pytest.mark.parametrize("name", REPS)
def test_saved_bytes_drop(name):
    model, inputs = build(name)
    batch = inputs()
    base = _saved(model, batch)
    conv = _saved(lowmembp.apply(copy.deepcopy(model), "lowmembp"), batch)
    b, c = base["by_kind"], conv["by_kind"]
    print(f"\n{name}: saved bytes {base['total']} -> {conv['total']} "
          f"({100 * (1 - conv['total'] / base['total']):.1f} % less); act {b['act']}->{c['act']}, "
          f"norm {b['norm']}->{c['norm']}")
    assert conv["total"] < base["total"]
    assert c["act"] * 8 <= b["act"]          # fp32 input (4 B/elt) -> 2-bit codes (0.25 B/elt) + rounding
    assert c["norm"] < b["norm"]


@pytest.mark.parametrize("name", ["vit", "swin", "roberta", "llama", "qwen2"])
def test_lora_then_lowmembp(name):
    model, inputs = build(name)
    model.eval()
    batch = inputs()
    pm = lora_wrap(model, name)  # random B: the LoRA branch is live
    with torch.no_grad():
        ref = logits(pm, batch)
        conv = lowmembp.apply(pm, "lowmembp")
        out = logits(conv, batch)
    assert rel(out, ref) <= 1e-5
    trainable = {n for n, p in conv.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier" in n or "score" in n for n in trainable), trainable
    bias = [n for n in trainable if "lora_A" in n and n.endswith("bias")]
    # LayerNorm families: folded lora_A layers carry A·β as a (trainable) bias; RMSNorm has no β, so none
    assert bool(bias) == (name not in ("llama", "qwen2")), bias


@pytest.mark.parametrize("name", ["vit", "bert", "llama_tied"])
def test_lowmembp_then_lora(name):
    model, inputs = build(name)
    model.eval()
    batch = inputs()
    with torch.no_grad():
        ref = logits(model, batch)
        conv = lowmembp.apply(copy.deepcopy(model), "lowmembp")
        import peft
        targets = {"vit": ["qkv", "fc1"], "bert": ["query", "value"]}.get(name, ["q_proj", "v_proj", "up_proj"])
        pm = peft.get_peft_model(conv, peft.LoraConfig(r=4, target_modules=targets))
        out = logits(pm, batch)
    assert rel(out, ref) <= 1e-5
    loss = _loss(pm, batch)
    loss.backward()
    assert all(p.grad is not None for n, p in pm.named_parameters() if p.requires_grad)


def test_tied_embeddings_untied():
    model, inputs = build("llama_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    emb = model.model.embed_tokens.weight.detach().clone()
    conv = lowmembp.apply(model, "lowmembp-norm")
    assert conv.lm_head.weight is not conv.model.embed_tokens.weight
    assert torch.equal(conv.model.embed_tokens.weight, emb)
    assert conv.config.tie_word_embeddings is False


def test_requires_grad_kept():
    model, inputs = build("vit")
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    model.blocks[0].mlp.fc1.requires_grad_(False)
    lowmembp.apply(model, "lowmembp")
    assert not model.blocks[0].attn.qkv.weight.requires_grad
    assert not model.blocks[0].mlp.fc1.weight.requires_grad and not model.blocks[0].mlp.fc1.bias.requires_grad
    assert model.blocks[1].attn.qkv.weight.requires_grad


def test_new_bias_follows_weight():
    model, _ = build("swin")  # PatchMerging.reduction has no bias
    red = model.layers[1].downsample.reduction
    assert red.bias is None
    red.weight.requires_grad_(False)
    lowmembp.apply(model, "lowmembp-norm")
    assert red.bias is not None and not red.bias.requires_grad


@pytest.mark.parametrize("name", ["vit", "swin", "bert", "qwen2"])
def test_meta_device(name):
    with torch.device("meta"):
        model, _ = build(name)
    lowmembp.apply(model, "lowmembp")
    assert all(p.is_meta for p in model.parameters())
    assert any(type(m).__name__ in ("MSLayerNorm", "MSRMSNorm") for m in model.modules())


def test_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with torch.device("meta"):
        model, _ = build("llama")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        lowmembp.apply(model, "lowmembp")
        ids = torch.randint(1, 50, (2, 5))
        out = model(input_ids=ids).logits
        out.sum().backward()
    assert out.shape == (2, 5, model.config.vocab_size)


def test_unsupported_model():
    with pytest.raises(UnsupportedModelError, match="vit, swin, bert, llama"):
        lowmembp.apply(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), "lowmembp")


def test_double_apply_refused():
    model, _ = build("vit")
    lowmembp.apply(model, "lowmembp")
    with pytest.raises(RuntimeError, match="already"):
        lowmembp.apply(model, "lowmembp")
    m2, _ = build("llama")
    lowmembp.apply(m2, "lowmembp-norm")
    with pytest.raises(ValueError, match="cannot be combined.*already carries 'lowmembp-norm'"):
        lowmembp.apply(m2, "lowmembp")  # composition checked against what the model carries
    fresh, _ = build("llama")  # a copy of a converted model loses the registry mark; the MS norms still tell
    lowmembp.apply(fresh, "lowmembp-norm")
    object.__setattr__(fresh, "_lowmembp_methods", ())
    with pytest.raises(RuntimeError, match="MS norms"):
        lowmembp.apply(fresh, "lowmembp-norm")
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(build("vit")[0], "lowmembp+lowmembp-act")


def test_halves_compose_to_whole():
    model, inputs = build("bert")
    model.eval()
    batch = inputs()
    with torch.no_grad():
        ref = logits(model, batch)
        a = lowmembp.apply(copy.deepcopy(model), "lowmembp-act")
        b = lowmembp.apply(a, "lowmembp-norm")
        assert rel(logits(b, batch), ref) <= 1e-5


@pytest.mark.parametrize("name", REPS)
def test_registry_lora_then_lowmembp(name):
    """The project's ``lora`` method (modules_to_save heads included), then ``lowmembp``; and ``lora+lowmembp``."""
    model, inputs = build(name)
    model.eval()
    batch = inputs()
    with torch.no_grad():
        ref = logits(model, batch)
        both = lowmembp.apply(copy.deepcopy(model), "lora+lowmembp")
        assert rel(logits(both, batch), ref) <= 1e-5
        pm = lowmembp.apply(copy.deepcopy(model), "lora")
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
        ref_lora = logits(pm, batch)
        conv = lowmembp.apply(pm, "lowmembp")
        assert rel(logits(conv, batch), ref_lora) <= 1e-5
    rep = get_layout(conv).base.lowmembp_report
    if name != "bert" and name != "roberta":
        assert not rep["kept"], rep["kept"]  # the final norm was folded into the (wrapped) head


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("name", ["vit", "llama", "bert"])
def test_saved_bytes_drop_bf16_autocast(name, lora):
    """Under bf16 autocast the MS-norm output is the next linears' input (one storage), LoRA included."""
    model, inputs = build(name)
    if lora:
        model = lowmembp.apply(model, "lora")
    batch = inputs()

    def saved(m):
        m.train()
        acc = SavedTensorAccountant(m)
        with acc, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = logits(m, batch).float().sum()
        loss.backward()
        return acc.report()
    r0, r1 = saved(copy.deepcopy(model)), saved(lowmembp.apply(copy.deepcopy(model), "lowmembp"))
    print(f"\n{name}{' +lora' if lora else ''} bf16: {r0['total']} -> {r1['total']} B "
          f"({100 * (1 - r1['total'] / r0['total']):.1f} % less), by kind {r0['by_kind']} -> {r1['by_kind']}")
    assert r1["total"] < 0.75 * r0["total"]
    assert r1["by_kind"]["linear"] <= (r0["by_kind"]["linear"]
                                       + 2 * 17 * 32 * 2)  # + ViT's final-norm output (see README)
    if name != "bert":  # BERT keeps its last LayerNorm (and ResidualAffine saves nothing new)
        # what stays: rstd per row, plus the final MS-norm's bf16 output where the head is frozen (LoRA lm_head:
        # nothing else saves it) — against the fp32 input (+ fp32 normalised copy in LlamaRMSNorm) before
        assert r1["by_kind"]["norm"] * 4 < r0["by_kind"]["norm"]


@pytest.mark.parametrize("name", ["bert", "llama_tied", "swin"])
def test_state_dict_roundtrip_and_deepcopy(name):
    """A converted model's state dict loads into a fresh model converted the same way (the structure of a conversion
    does not depend on weight values); deepcopy keeps the residual re-affine hooks."""
    model, inputs = build(name, seed=0)
    model.eval()
    batch = inputs()
    conv = lowmembp.apply(copy.deepcopy(model), "lowmembp")
    other, _ = build(name, seed=5)
    other = lowmembp.apply(other, "lowmembp").eval()
    missing, unexpected = other.load_state_dict(conv.state_dict(), strict=True)
    assert not missing and not unexpected
    with torch.no_grad():
        ref = logits(model, batch)
        assert rel(logits(other, batch), ref) <= 1e-5
        assert rel(logits(copy.deepcopy(conv), batch), ref) <= 1e-5
