"""The estimator follows the full-fine-tuning optimizer levers (lowmembp.methods.optim_levers): GaLore (plain and
layer-wise) by its own step on fake tensors, equal to a real CPU step to the byte; APOLLO and Adafactor by stand-ins
(lowmembp.estimator.optim_standins) whose states equal the real optimizers' to the byte; torchao's low-bit states by
the formula checked against torchao's own states (tests/methods/test_optim_levers.py); GaLore's SVD refresh seen when
the measured step is a refresh step."""
import importlib.util
import warnings

import pytest

from lowmembp.estimator import estimate
from lowmembp.methods import optim_levers as lv

warnings.filterwarnings("ignore", category=FutureWarning)
TINY = dict(batch_size=1, seq_len=16, dtype="fp32", layers=2,
            overrides={"hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
                       "num_key_value_heads": 4, "vocab_size": 512})


def _have(mod):
    return importlib.util.find_spec(mod) is not None


def _peak(optimizer, device="fake"):
    return estimate("llama-7b", "baseline", optimizer=optimizer, device=device, **TINY)["peak"]


@pytest.mark.skipif(not _have("galore_torch"), reason="galore-torch not installed")
@pytest.mark.parametrize("name", ["galore-adamw@rank=16", "galore-adamw-layerwise@rank=16"])
def test_galore_fake_step_equals_a_real_cpu_step(name):
    fake, real = _peak(name), _peak(name, "cpu")
    assert fake["bytes"] == real["bytes"] and fake["by_category"] == real["by_category"]
    adamw = _peak("adamw")["by_category"]
    assert fake["by_category"]["optimizer_state"] < 0.75 * adamw["optimizer_state"]
    if "layerwise" in name:  # the gradients never all alive
        assert fake["by_category"]["gradients"] < 0.25 * adamw["gradients"]


@pytest.mark.skipif(not _have("galore_torch"), reason="galore-torch not installed")
def test_galore_refresh_step_shows_the_svd_outputs():
    steady, refresh = _peak("galore-adamw@rank=16"), _peak("galore-adamw@rank=16,update_proj_gap=1")
    assert refresh["by_category"]["optimizer_state"] == steady["by_category"]["optimizer_state"]
    extra = refresh["bytes"] - steady["bytes"]
    # the largest matrix (172 x 64, fp32): U, S, Vh of its SVD at least
    assert extra >= lv.svd_workspace_bytes((172, 64)) - 172 * 64 * 4


@pytest.mark.parametrize("name", ["apollo-adamw@rank=16", "adafactor"])
def test_stand_in_states_equal_the_real_optimizers(name):
    if name.startswith("apollo") and not _have("apollo_torch"):
        pytest.skip("apollo-torch not installed")
    fake, real = _peak(name), _peak(name, "cpu")
    assert fake["by_category"]["optimizer_state"] == real["by_category"]["optimizer_state"]
    assert fake["by_category"]["gradients"] == real["by_category"]["gradients"]
    assert abs(fake["bytes"] - real["bytes"]) <= 0.02 * real["bytes"]  # the step's temporaries, modelled


def test_torchao_and_cpu_offload_stand_ins_hold_the_packages_layout():
    from lowmembp.estimator.step import build, model_spec
    spec = model_spec("llama-7b")
    params = [p for p in build(spec, layers=2, overrides=TINY["overrides"], device="meta").parameters()]
    for name in lv.TORCHAO_BLOCK:
        want = sum(lv.torchao_state_bytes(name, tuple(p.shape)) + 4 for p in params)  # + each 0-d step counter
        assert _peak(name)["by_category"]["optimizer_state"] == want, name
    small = sum(2 * p.numel() * 4 + 4 for p in params if p.numel() < lv.TORCHAO_MIN_SIZE)
    assert _peak("adamw-cpu-offload")["by_category"]["optimizer_state"] == small
