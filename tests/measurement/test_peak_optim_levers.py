"""The peak of a real CPU step with the other packages' optimizers (lowmembp.measurement.peak): torchao's compiled
low-bit step is measured from the CPU allocator's events (it cannot run under the storage tracker's dispatch mode),
its states counted by the tensors they are made of; GaLore's projections are optimizer state."""
import importlib.util

import pytest
import torch
import torch.nn as nn

from lowmembp.measurement.peak import measure_step_peak
from lowmembp.methods import optim_levers as lv
from lowmembp.methods.optimizers import make_optimizer


def _case(name):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    opt = make_optimizer(m.parameters(), name, lr=1e-3)
    x = torch.randn(8, 64)

    def step():
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return m, opt, step


@pytest.mark.slow  # torch.compile of torchao's step: ~10 s
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_torchao_step_is_measured_by_the_allocator_and_its_states_by_their_parts():
    m, opt, step = _case("adamw8bit-torchao")
    pk = measure_step_peak(m, opt, step)
    assert "allocator events" in pk["how"]
    want = sum(lv.torchao_state_bytes("adamw8bit-torchao", tuple(p.shape)) + 4 for p in m.parameters())
    assert pk["by_category"]["optimizer_state"] == want
    assert pk["by_category"]["optimizer_state"] < 0.5 * 8 * sum(p.numel() for p in m.parameters())


@pytest.mark.skipif(importlib.util.find_spec("galore_torch") is None, reason="galore-torch not installed")
def test_galore_projections_are_optimizer_state():
    m, opt, step = _case("galore-adamw@rank=8")
    pk = measure_step_peak(m, opt, step)
    want = sum(lv.galore_state_bytes(tuple(p.shape), 8) for p in m.parameters())  # its step counters are ints
    assert pk["by_category"]["optimizer_state"] == want
