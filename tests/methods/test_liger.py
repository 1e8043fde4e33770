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
