"""``liger``: refused with the reason on a machine without CUDA, on fake tensors, for timm models and for model types
Liger has no patch for; excludes the methods that rewrite the same layers. On a GPU (``gpu`` marker): Liger's own
patching of a tiny LLaMA gives the baseline's loss and gradients to Liger's tolerance and trains."""
import copy

import pytest
import torch

import lowmembp
from peers_common import grads
from tiny_models import build

HAS_CUDA = torch.cuda.is_available()


def test_listed_and_refused_for_timm_models():
    assert "liger" in lowmembp.list_methods()
    with pytest.raises(ValueError, match="transformers models only"):
        lowmembp.apply(build("vit")[0], "liger")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU refusal")
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_refused_without_cuda_with_the_reason(name):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*interpreter"):
        lowmembp.apply(build(name)[0], "liger")


@pytest.mark.parametrize("spec", ["liger+lowmembp", "liger+chunked-ce", "liger+mesa", "liger+tokentune"])
def test_excludes_the_same_layers(spec):
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(build("llama")[0], spec)


def test_estimate_refuses_it():
    from lowmembp.estimator.step import estimate
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        estimate("llama-7b", "liger", layers=1, batch_size=1, seq_len=8, peak=False)


@pytest.mark.gpu
def test_gpu_refuses_unsupported_model_types():
    pytest.importorskip("liger_kernel")
    with pytest.raises(ValueError, match="no patch for model type 'bert'"):
        lowmembp.apply(build("bert")[0].cuda(), "liger")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_gpu_same_loss_and_gradients(name):
    pytest.importorskip("liger_kernel")
    model, inputs = build(name)
    model = model.cuda()
    ref = copy.deepcopy(model).train()
    m = lowmembp.apply(model, "liger").train()
    ids = inputs()["input_ids"].cuda()
    batch = {"input_ids": ids, "labels": ids.clone()}
    l0, l1 = ref(**batch).loss, m(**batch).loss
    torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
    l0.backward()
    l1.backward()
    g0, g1 = grads(ref), grads(m)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-3, atol=1e-4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = m(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_nothing_but_the_instance_changes(monkeypatch):
    """Liger-Kernel 0.8.5's ``apply_liger_kernel_to_llama(model=...)`` also rebinds module-level names
    (``modeling_llama.LlamaRMSNorm`` / ``LlamaMLP`` / ``apply_rotary_pos_emb``; ``F.cross_entropy`` and class-level
    ``forward`` for some families): every LLaMA built later in the process got Liger's modules, and every one built
    before its Triton RoPE (the GPU run's offload / tokentune LLaMA tests after test_liger failed: an MLP without
    ``act_fn``, a Triton kernel on a CPU model). lowmembp restores those names; the instance keeps its own patches and
    a class-level ``forward`` moves onto it. A stand-in for liger_kernel that patches as 0.8.5 does, on the CPU."""
    import sys
    import types

    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama as ml

    from lowmembp.models import get_layout

    names = ("LlamaMLP", "LlamaRMSNorm", "apply_rotary_pos_emb")
    for name in names:  # whatever happens below, the teardown puts the originals back
        monkeypatch.setattr(ml, name, getattr(ml, name))
    monkeypatch.setattr(ml.LlamaForCausalLM, "forward", ml.LlamaForCausalLM.forward)
    monkeypatch.setattr(F, "cross_entropy", F.cross_entropy)
    before = {name: getattr(ml, name) for name in names}
    class_forward, cross_entropy = ml.LlamaForCausalLM.__dict__["forward"], F.cross_entropy
    old = build("llama")[0]

    def liger_forward(self, *args, **kwargs):
        return "liger forward"

    def apply_to_instance(model):
        ml.LlamaMLP = type("LigerSwiGLUMLP", (torch.nn.Module,), {})
        ml.LlamaRMSNorm = type("LigerRMSNorm", (torch.nn.Module,), {})
        ml.apply_rotary_pos_emb = lambda *args, **kwargs: 1 / 0
        ml.LlamaForCausalLM.forward = liger_forward
        F.cross_entropy = lambda *args, **kwargs: 1 / 0
        norm = model.model.norm
        norm.forward = types.MethodType(lambda self, x: x, norm)  # an instance patch: it stays

    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None}
    fake._apply_liger_kernel_to_instance = apply_to_instance
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = lowmembp.apply(build("llama")[0], "liger")
    assert {name: getattr(ml, name) for name in names} == before
    assert ml.LlamaForCausalLM.__dict__["forward"] is class_forward and F.cross_entropy is cross_entropy
    assert model() == "liger forward" and "forward" in model.model.norm.__dict__
    for m, inputs in ((old, None), build("llama")):  # built before and after: transformers' own, and they run
        assert type(m.model.layers[0].mlp) is ml.LlamaMLP and "forward" not in m.model.norm.__dict__
        get_layout(m)
        if inputs is not None:
            assert m(**inputs()).logits.isfinite().all()
