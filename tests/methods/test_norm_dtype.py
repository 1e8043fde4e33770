"""lowmembp's ``norm_dtype`` option: MS norms emitting fp32 under autocast (the official lomem kernel's choice), the
next linear saving that same storage, gradients against the default and against float64 math."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.ops.ms_norm import (MSLayerNorm, MSRMSNorm, ms_layer_norm, ms_norm_fwd_ref, ms_norm_fwd_triton,
                                  ms_rms_norm)
from lowmembp.ops.shared_linear import CastWeightLinear, share_lora_inputs
from backends import force_backend

FN = {"layernorm": ms_layer_norm, "rmsnorm": ms_rms_norm}
EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6}
F16 = torch.float16


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)


def _math64(kind, x64, eps):
    if kind == "layernorm":
        return F.layer_norm(x64, x64.shape[-1:], eps=eps)
    return F.rms_norm(x64, x64.shape[-1:], eps=eps)


def _saved_storages(fn):
    recs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: recs.append(t) or t, lambda t: t):
        out = fn()
    return out, {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), t.dtype) for t in recs}


# ------------------------------------------------------------------------------------------------------- the op
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_fp32_output_under_autocast_is_saved_and_exact(monkeypatch, backend, kind):
    """fp32 under fp16 autocast: the fp32 output itself is saved (4 bytes per element + rstd), it and its gradient
    equal float64 math to fp32 rounding, and equal the default (fp16) output/gradient to fp16 rounding."""
    force_backend(monkeypatch, backend)
    x = _x((3, 4, 40), seed=1)
    g = _x((3, 4, 40), seed=2)
    out = {}
    for mode in ("auto", "fp32"):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=F16):
            y, st = _saved_storages(lambda: FN[kind](xi, EPS[kind], out_dtype=mode))
        assert y.dtype == (torch.float32 if mode == "fp32" else F16)
        assert xi.untyped_storage().data_ptr() not in st and y.untyped_storage().data_ptr() in st
        assert sum(b for b, _ in st.values()) == y.numel() * y.element_size() + 12 * 4
        y.backward(g.to(y.dtype))
        out[mode] = (y.detach(), xi.grad)
    x64 = x.double().requires_grad_(True)
    y64 = _math64(kind, x64, EPS[kind])
    y64.backward(g.double())
    y32, dx32 = out["fp32"]
    torch.testing.assert_close(y32.double(), y64.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx32.double(), x64.grad, rtol=1e-5, atol=1e-5 * float(x64.grad.abs().max()))
    y16, dx16 = out["auto"]
    torch.testing.assert_close(y16.float(), y32, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dx16, dx32, rtol=1e-2, atol=1e-2 * float(dx32.abs().max()))


def test_input_mode_is_the_inputs_dtype_and_bad_values_raise():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ms_layer_norm(_x((2, 8)), out_dtype="input").dtype == torch.float32
        assert ms_layer_norm(_x((2, 8), torch.bfloat16), out_dtype="input").dtype == torch.bfloat16
        assert ms_rms_norm(_x((2, 8), torch.bfloat16), out_dtype="fp32").dtype == torch.float32
        assert ms_layer_norm(_x((2, 8))).dtype == torch.bfloat16  # the default is unchanged
    assert "out_dtype='fp32'" in repr(MSRMSNorm(8, out_dtype="fp32")) and "out_dtype" not in repr(MSLayerNorm(8))
    with pytest.raises(ValueError, match="out_dtype must be one of 'auto', 'input', 'fp32'"):
        MSLayerNorm(8, out_dtype="fp16")
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        ms_layer_norm(_x((2, 8)), out_dtype=torch.float32)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("x_dtype", [torch.float32, F16])
def test_triton_kernel_writes_fp32_output(triton_backend, kind, x_dtype):
    """The Triton forward (interpreter) stores the output in out_dtype: fp32 from fp32 or fp16 input."""
    x = _x((5, 33), x_dtype, seed=3)
    y_t, r_t = ms_norm_fwd_triton(x, kind, EPS[kind], torch.float32)
    y_r, r_r = ms_norm_fwd_ref(x, kind, EPS[kind], torch.float32)
    assert y_t.dtype == torch.float32 and y_r.dtype == torch.float32
    torch.testing.assert_close(y_t, y_r, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(r_t, r_r, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------- with the next linear
H = 24


def _lora_model(out_dtype, wide):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential()
    base.add_module("norm", MSLayerNorm(H, out_dtype=out_dtype))
    base.add_module("q", nn.Linear(H, 10))
    base.add_module("v", nn.Linear(H, 10))
    cfg = peft.LoraConfig(r=4, target_modules=["q", "v"], lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    share_lora_inputs(model, save_wide_inputs=wide)
    return model


def _step(model, x, w):
    """Forward under fp16 autocast inside the accountant, backward; (activation-sized storages, grads)."""
    xi = x.clone().requires_grad_(True)
    inner = model.base_model.model
    with SavedTensorAccountant(model) as acc, torch.autocast("cpu", dtype=F16):
        h = inner.norm(xi)
        out = inner.q(h) + inner.v(h)
    (out.float() * w).sum().backward()
    big = [s for s in acc.storages if s.nbytes >= h.numel() * 2]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    grads["x"] = xi.grad
    model.zero_grad()
    return h, big, grads


def test_lora_saves_the_fp32_norm_output_once_and_gradients_hold():
    x, w = _x((4, 9, H), seed=4), _x((4, 9, 10), seed=5)
    h, big, g32 = _step(_lora_model("fp32", wide=True), x, w)
    assert h.dtype == torch.float32
    assert [(s.nbytes, s.dtype) for s in big] == [(h.numel() * 4, torch.float32)]  # one storage: the norm's
    # without save_wide_inputs autocast's fp16 copies (one for q, one for v) are saved beside it (the check can fail)
    _, big_copy, _ = _step(_lora_model("fp32", wide=False), x, w)
    assert sorted(s.nbytes for s in big_copy) == [h.numel() * 2, h.numel() * 2, h.numel() * 4]
    _, big16, g16 = _step(_lora_model("auto", wide=False), x, w)
    assert [(s.nbytes, s.dtype) for s in big16] == [(h.numel() * 2, F16)]
    # float64 reference of the math: LayerNorm without affine, then W h + b + B (A h) on q and v (scaling 1)
    model = _lora_model("auto", wide=False)
    inner = model.base_model.model
    x64 = x.double().requires_grad_(True)
    ps = {n: p.detach().double().requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    h64 = F.layer_norm(x64, (H,), eps=1e-5)
    out64 = 0
    for name in ("q", "v"):
        pre = f"base_model.model.{name}."
        lin = F.linear(h64, ps[pre + "base_layer.weight"], ps[pre + "base_layer.bias"])
        scale = getattr(inner, name).scaling["default"]
        A, B = ps[pre + "lora_A.default.weight"], ps[pre + "lora_B.default.weight"]
        out64 = out64 + lin + scale * (h64 @ A.t()) @ B.t()
    (out64 * w.double()).sum().backward()
    ref = {n: p.grad for n, p in ps.items() if p.requires_grad}
    ref["x"] = x64.grad
    assert set(ref) == set(g32)
    for n, r in ref.items():
        tol = 1e-2 * float(r.abs().max())
        torch.testing.assert_close(g32[n].double(), r, rtol=1e-2, atol=tol)
        torch.testing.assert_close(g32[n], g16[n], rtol=1e-2, atol=tol)


def _tiny_vit():
    from tiny_models import build
    model, inputs = build("vit")
    return model, inputs()["x"]


def _saved_and_grads(model, x):
    with SavedTensorAccountant(model) as acc, torch.autocast("cpu", dtype=F16):
        out = model(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return acc.report()["total"], out.detach(), grads


def test_full_finetuning_linears_share_the_fp32_norm_output():
    """lowmembp-norm@norm_dtype=fp32 on a tiny ViT (trainable linears read every norm): the saved bytes grow by
    exactly 2 bytes per norm-output element (fp16 -> fp32, stored once: the linear's own copy would add 2 more)."""
    import copy
    model, x = _tiny_vit()
    default = lowmembp.apply(copy.deepcopy(model), "lowmembp-norm")
    wide = lowmembp.apply(copy.deepcopy(model), "lowmembp-norm@norm_dtype=fp32")
    norms = [m for m in wide.modules() if isinstance(m, MSLayerNorm)]
    assert norms and all(m.out_dtype == "fp32" for m in norms)
    assert all(m.out_dtype == "auto" for m in default.modules() if isinstance(m, MSLayerNorm))
    assert type(wide.blocks[0].attn.qkv) is CastWeightLinear and wide.blocks[0].attn.qkv.save_wide_input
    assert type(default.blocks[0].attn.qkv) is nn.Linear
    s0, out0, g0 = _saved_and_grads(default, x)
    s1, out1, g1 = _saved_and_grads(wide, x)
    numel = x.shape[0] * (wide.patch_embed.num_patches + 1) * wide.embed_dim  # one norm output
    assert s1 - s0 == len(norms) * numel * 2
    torch.testing.assert_close(out1.float(), out0.float(), rtol=1e-2, atol=1e-2 * float(out0.abs().max()))
    assert set(g1) == set(g0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=2e-2, atol=2e-2 * float(g0[n].abs().max()), msg=n)


def test_spec_option_reaches_the_estimate():
    """'lora+lowmembp@norm_dtype=fp32' through lowmembp.estimator.step: ViT-B at 2 blocks saves 5 more units of b·s·d·2
    bytes (norm1, norm2 of each block and the final norm, each stored once in fp32) plus the head's fp16 copy of
    the class token (b·d·2), nothing else."""
    from lowmembp.estimator.step import estimate
    kw = dict(batch_size=1, dtype="fp16", rank=4, layers=2, targets="qkv", peak=False)
    a = estimate("vit-b16", "lora+lowmembp", **kw)["saved"]["total"]
    b = estimate("vit-b16", "lora+lowmembp@norm_dtype=fp32", **kw)["saved"]["total"]
    c = estimate("vit-b16", "lora+lowmembp", norm_dtype="fp32", **kw)["saved"]["total"]
    assert b == c and b - a == 5 * 197 * 768 * 2 + 768 * 2
    with pytest.raises(ValueError, match="norm_dtype: out_dtype must be one of"):
        estimate("vit-b16", "lora+lowmembp@norm_dtype=fp16", **kw)
    from lowmembp.methods.registry import check_options, method_options
    assert method_options("lowmembp-norm")["norm_dtype"] == "auto"
    with pytest.raises(ValueError, match="norm_dtype"):
        check_options("lowmembp", {"norm_dtype": "half"})


def test_linear_saving_wide_input_equals_autocast_linear():
    """save_wide_input under fp16 autocast: F.linear's values and gradients, but the fp32 input itself is saved
    (no fp16 copy); a frozen weight takes autocast's path (nothing of x saved)."""
    from lowmembp.ops.shared_linear import linear_sharing_input
    x0, w0, b0 = _x((3, 5, 16), seed=6), _x((7, 16), seed=7) * 0.3, _x((7,), seed=8)
    g = _x((3, 5, 7), seed=9).to(F16)
    res = {}
    for wide in (False, True):
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        with torch.autocast("cpu", dtype=F16):
            fn = (lambda: linear_sharing_input(x, w, b, save_wide_input=True)) if wide else (lambda: F.linear(x, w, b))
            y, st = _saved_storages(fn)
        y.backward(g)
        res[wide] = (y.detach(), x.grad, w.grad, b.grad, st, x.untyped_storage().data_ptr())
    y0, gx0, gw0, gb0, st0, p0 = res[False]
    y1, gx1, gw1, gb1, st1, p1 = res[True]
    assert y1.dtype == F16 and p1 in st1 and p0 not in st0
    assert not any(dt == F16 and nb == x0.numel() * 2 for nb, dt in st1.values())
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    torch.testing.assert_close(gx1, gx0, rtol=0, atol=0)
    torch.testing.assert_close(gw1, gw0, rtol=0, atol=0)
    torch.testing.assert_close(gb1, gb0, rtol=1e-3, atol=1e-3)
    x = x0.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=F16):
        _, st = _saved_storages(lambda: linear_sharing_input(x, w0, None, save_wide_input=True))  # frozen weight
    assert x.untyped_storage().data_ptr() not in st
