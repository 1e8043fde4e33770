"""The full-fine-tuning optimizer levers of other packages (lowmembp.methods.optim_levers): each built by
make_optimizer is its package's optimizer, step for step; GaLore's layer-wise form steps what the plain one steps;
the state-byte formulas equal the packages' own states; GPU-only and missing-package levers refuse with what to do;
the estimator's stand-ins hold the states the real optimizers hold."""
import importlib.util
import warnings

import pytest
import torch
import torch.nn as nn

from lowmembp.methods import optim_levers as lv
from lowmembp.methods.optimizers import OPTIMIZERS, check_optimizer, frees_gradients, make_optimizer, \
    steps_in_backward

warnings.filterwarnings("ignore", category=FutureWarning)


def _have(mod):
    return importlib.util.find_spec(mod) is not None


need_galore = pytest.mark.skipif(not _have("galore_torch"), reason="galore-torch not installed")
need_apollo = pytest.mark.skipif(not _have("apollo_torch"), reason="apollo-torch not installed")
need_torchao = pytest.mark.skipif(not _have("torchao"), reason="torchao not installed")
need_bnb = pytest.mark.skipif(not _have("bitsandbytes"), reason="bitsandbytes not installed")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 40), nn.Tanh(), nn.Linear(40, 5))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 48, generator=g) for _ in range(n)]


def _train(m, opt, xs):
    for x in xs:
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return m


def _same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_every_lever_is_listed_and_options_are_read_and_checked():
    for name in lv.LEVERS:
        assert name in OPTIMIZERS
        assert check_optimizer(name) == name
    assert lv.split_optimizer("galore-adamw@rank=8,update_proj_gap=3") == ("galore-adamw",
                                                                            {"rank": 8, "update_proj_gap": 3})
    assert check_optimizer("apollo-adamw@scale=2.5") == "apollo-adamw"
    for bad in ("galore-adamw@rank=x", "galore-adamw@heads=2", "adafactor@rank=4", "adamw@rank=4", "sgd",
                "galore-adamw@rank=0"):
        with pytest.raises(ValueError):
            check_optimizer(bad)
    assert steps_in_backward("galore-adamw-layerwise@rank=4") and steps_in_backward("adamw-fused-backward")
    assert not steps_in_backward("galore-adamw") and not steps_in_backward("paged-adamw")


@need_galore
def test_galore_is_galore_torch_and_layerwise_steps_the_same():
    import galore_torch

    xs = _batches(5)
    ours = _model()
    opt = make_optimizer(ours.parameters(), "galore-adamw@rank=4,update_proj_gap=2", lr=1e-2, weight_decay=0.1,
                         eps=1e-6)
    _train(ours, opt, xs)
    ref = _model()
    mats = [p for p in ref.parameters() if p.dim() == 2]
    rest = [p for p in ref.parameters() if p.dim() != 2]
    ref_opt = galore_torch.GaLoreAdamW([{"params": rest}, {"params": mats, "rank": 4, "update_proj_gap": 2,
                                                             "scale": 0.25, "proj_type": "std"}],
                                       lr=1e-2, weight_decay=0.1, eps=1e-6, no_deprecation_warning=True)
    _train(ref, ref_opt, xs)
    _same(ours, ref)
    # the projected states: rank x width, not the matrix (48 -> 96: the first weight is 96 x 48, projected to 96 x 4)
    st = opt.state[ours[0].weight]
    assert st["exp_avg"].shape == (96, 4) and st["projector"].ortho_matrix.shape == (4, 48)
    held = [st["exp_avg"], st["exp_avg_sq"], st["projector"].ortho_matrix]
    # storages: the fp32 projection is a view of the SVD's whole Vh (48 x 48), which it keeps alive
    assert sum(t.untyped_storage().nbytes() for t in held) == lv.galore_state_bytes((96, 48), 4)
    half = nn.Linear(48, 96).to(torch.bfloat16)
    opt16 = make_optimizer([half.weight], "galore-adamw@rank=4")
    half(xs[0].to(torch.bfloat16)).float().sum().backward()
    opt16.step()
    st16 = opt16.state[half.weight]
    held16 = [st16["exp_avg"], st16["exp_avg_sq"], st16["projector"].ortho_matrix]
    assert sum(t.untyped_storage().nbytes() for t in held16) == lv.galore_state_bytes((96, 48), 4, torch.bfloat16)
    # layer-wise: each parameter stepped in the backward, gradient freed, the same weights bit for bit
    lw = _model()
    opt_lw = make_optimizer(lw.parameters(), "galore-adamw-layerwise@rank=4,update_proj_gap=2", lr=1e-2,
                            weight_decay=0.1, eps=1e-6)
    assert frees_gradients(opt_lw)
    for x in xs:
        lw(x).pow(2).mean().backward()
        assert all(p.grad is None for p in lw.parameters())
        opt_lw.step()
    _same(lw, ours)


@need_galore
def test_galore_projects_the_layout_linears_only():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = make_optimizer(model.parameters(), "galore-adamw@rank=8", model=model)
    proj = [g for g in opt.param_groups if "rank" in g][0]["params"]
    names = {id(p): n for n, p in model.named_parameters()}
    got = sorted(names[id(p)] for p in proj)
    assert got == sorted(n for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    assert not any("embed" in n or "lm_head" in n for n in got)


@need_apollo
def test_apollo_is_apollo_torch():
    import apollo_torch

    xs = _batches(4)
    ours = _model()
    opt = make_optimizer(ours.parameters(), "apollo-adamw@rank=4,update_proj_gap=2", lr=1e-2, weight_decay=0.1)
    _train(ours, opt, xs)
    ref = _model()
    mats = [p for p in ref.parameters() if p.dim() == 2]
    rest = [p for p in ref.parameters() if p.dim() != 2]
    ref_opt = apollo_torch.APOLLOAdamW([{"params": rest}, {"params": mats, "rank": 4, "update_proj_gap": 2,
                                                             "scale": 1.0, "proj": "random", "scale_type": "channel",
                                                             "proj_type": "std"}],
                                       lr=1e-2, weight_decay=0.1, eps=1e-8)
    _train(ref, ref_opt, xs)
    _same(ours, ref)
    st = opt.state[ours[0].weight]
    held = [st["exp_avg"], st["exp_avg_sq"], st["projector"].ortho_matrix, st["scaled_grad"]]
    assert sum(t.untyped_storage().nbytes() for t in held) == lv.apollo_state_bytes((96, 48), 4)


def test_adafactor_is_torch_adafactor_and_its_state_bytes():
    xs = _batches(4)
    ours = _model()
    opt = make_optimizer(ours.parameters(), "adafactor", lr=1e-2, weight_decay=0.1)
    _train(ours, opt, xs)
    ref = _model()
    _train(ref, torch.optim.Adafactor(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False), xs)
    _same(ours, ref)
    for p in ours.parameters():
        held = sum(v.numel() * v.element_size() for v in opt.state[p].values())
        assert held == lv.adafactor_state_bytes(tuple(p.shape))
    assert lv.adafactor_state_bytes((4096, 4096)) < 8 * 4096 * 4096 / 1000  # two vectors, not two matrices


@need_torchao
@pytest.mark.slow  # torch.compile of each state layout's step on the CPU: ~20 s
@pytest.mark.parametrize("name, cls", [("adamw8bit-torchao", "AdamW8bit"), ("adamw4bit-torchao", "AdamW4bit"),
                                       ("adamw-fp8-torchao", "AdamWFp8")])
def test_torchao_low_bit_is_torchao_and_its_state_bytes(name, cls):
    import torchao.optim as aoo

    xs = _batches(2)
    ours = _model()
    opt = make_optimizer(ours.parameters(), name, lr=1e-2, weight_decay=0.1)
    _train(ours, opt, xs)
    ref = _model()
    _train(ref, getattr(aoo, cls)(ref.parameters(), lr=1e-2, weight_decay=0.1), xs)
    _same(ours, ref)
    for p in ours.parameters():
        held = 0
        for k in ("exp_avg", "exp_avg_sq"):
            s = opt.state[p][k]
            parts = [getattr(s, a) for a in getattr(s, "tensor_attrs", ())] or [s]
            held += sum(t.numel() * t.element_size() for t in parts)
        assert held == lv.torchao_state_bytes(name, tuple(p.shape)), (name, tuple(p.shape))
    # a 4096 x 4096 matrix: about a quarter (8-bit, fp8) or an eighth (4-bit) of fp32 AdamW's 128 MiB
    big = lv.torchao_state_bytes(name, (4096, 4096)) / (8 * 4096 * 4096)
    assert 0.12 < big < 0.27


@need_bnb
@pytest.mark.parametrize("name, cls", [("paged-adamw", "PagedAdamW"), ("paged-adamw8bit", "PagedAdamW8bit")])
def test_paged_adamw_is_bitsandbytes(name, cls):
    import bitsandbytes as bnb

    xs = _batches(3)
    ours = _model()
    opt = make_optimizer(ours.parameters(), name, lr=1e-2, weight_decay=0.1)
    _train(ours, opt, xs)
    ref = _model()
    _train(ref, getattr(bnb.optim, cls)(ref.parameters(), lr=1e-2, weight_decay=0.1), xs)
    _same(ours, ref)
    assert type(opt).__name__ == cls


@need_torchao
def test_cpu_offload_refuses_on_the_cpu_with_what_to_do():
    with pytest.raises(RuntimeError, match="CUDA or XPU"):
        make_optimizer(_model().parameters(), "adamw-cpu-offload")


def test_a_missing_package_refuses_with_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "galore_torch" else real(n, *a))
    assert "pip install 'galore-torch==1.0'" in lv.missing_package("galore-adamw")
    with pytest.raises(ImportError, match="pip install 'galore-torch==1.0'"):
        make_optimizer(_model().parameters(), "galore-adamw")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offload_and_paged_on_cuda_keep_their_state_outside_the_allocator():
    from lowmembp.measurement.peak import measure_step_peak

    x = _batches(1)[0].cuda()
    big = nn.Sequential(nn.Linear(48, 4096), nn.GELU(), nn.Linear(4096, 48)).cuda()  # 2 x 196,608 > paging's 1e5
    ref = {}
    for name in ("adamw", "adamw-cpu-offload", "paged-adamw"):
        m = _model().cuda() if name == "adamw-cpu-offload" else big
        opt = make_optimizer(m.parameters(), name, lr=1e-3)

        def step():
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        pk = measure_step_peak(m, opt, step)
        assert pk["device_resident"]["bytes"] >= pk["bytes"]
        ref[name] = pk
    assert ref["paged-adamw"]["device_resident"]["outside_allocator"] >= \
        ref["adamw"]["device_resident"]["outside_allocator"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offload_is_adamw_and_paged_is_bitsandbytes_adamw_on_cuda():
    import bitsandbytes as bnb

    xs = [x.cuda() for x in _batches(4)]
    ref = _model().cuda()
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), xs)
    off = _model().cuda()
    _train(off, make_optimizer(off.parameters(), "adamw-cpu-offload", lr=1e-2, weight_decay=0.1), xs)
    for p, q in zip(ref.parameters(), off.parameters()):  # the host's fused AdamW: AdamW to rounding
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    plain = _model().cuda()
    _train(plain, bnb.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, optim_bits=32), xs)
    paged = _model().cuda()
    _train(paged, make_optimizer(paged.parameters(), "paged-adamw", lr=1e-2, weight_decay=0.1), xs)
    _same(paged, plain)  # paging moves the states, not the update
