"""``mesa_momentum``: the EMA range λ (default 0.9, docs/design.md#mesa) — validated, applied to each range tracker and
the lag it causes when activations grow fast (a from-scratch model at a high learning rate), which λ = 0 removes."""
import pytest
import torch

import lowmembp

from lowmembp.methods.mesa import convert
from lowmembp.methods.registry import method_options
from lowmembp.ops.mesa_layers import MesaRMSNorm
from lowmembp.ops.mesa_quant import MOMENTUM, EMAQuantizer

from tiny_models import build


def tiny_llama():
    return build("llama")[0]


def _quantizers(model):
    return [m for m in model.modules() if isinstance(m, EMAQuantizer)]


@pytest.mark.parametrize("method", ["mesa", "mesa-gelu-ln"])
def test_momentum_reaches_every_range_tracker(method):
    assert method_options(method)["mesa_momentum"] == MOMENTUM == 0.9
    default = lowmembp.apply(tiny_llama(), method)
    assert _quantizers(default) and {q.momentum for q in _quantizers(default)} == {0.9}
    model = lowmembp.apply(tiny_llama(), method, mesa_momentum=0.0)
    assert {q.momentum for q in _quantizers(model)} == {0.0}


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, "0.5", True, None])
def test_bad_momentum_is_refused(bad):
    with pytest.raises(ValueError, match="mesa_momentum"):
        convert(tiny_llama(), linears=False, acts=True, norms=True, attention="keep", groups=8, momentum=bad)


def _last_step_grad_error(momentum: float, growth: float, steps: int = 10) -> float:
    """Feed one MesaRMSNorm inputs whose scale grows by ``growth`` per step; the relative error of the input gradient
    of the last step against the exact RMSNorm's."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(1 + 0.1 * torch.randn(64, generator=gen))
    norm = MesaRMSNorm(weight, 1e-6).train()
    norm.quant.momentum = momentum
    for step in range(steps):
        x = (growth ** step * torch.randn(32, 64, generator=gen)).requires_grad_()
        g = torch.randn(32, 64, generator=gen)
        norm(x).backward(g)
    ref = x.detach().clone().requires_grad_()
    h = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6)
    (weight.detach() * h).backward(g)
    return float((x.grad - ref.grad).norm() / ref.grad.norm())


def test_ema_lag_clamps_when_activations_grow_and_momentum_zero_follows():
    steady = _last_step_grad_error(MOMENTUM, growth=1.0)
    lagging = _last_step_grad_error(MOMENTUM, growth=1.35)  # ~15x over 10 steps, as llama-tiny's residual stream
    own_range = _last_step_grad_error(0.0, growth=1.35)
    assert steady < 0.01  # 8-bit noise only (measured 0.3 %)
    assert own_range < 0.01  # measured 0.2 %
    assert lagging > 10 * own_range  # the lagging EMA range clamps the larger values (measured 7.8 %)
