"""benchmarks/gpu_full_ft_levers.py: the full-fine-tuning levers' GPU rows cover every optimizer of another package
and CompAct, are valid configurations, and build (their smoke rows) on the CPU, or refuse with the lever's reason."""
import sys
from pathlib import Path

from lowmembp.methods.optim_levers import LEVERS
from lowmembp.methods.registry import parse

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_full_ft_levers as levers  # noqa: E402
import gpu_run_steps as steps  # noqa: E402


def test_every_lever_has_a_row_once():
    configs = levers.full_ft_lever_configs(smoke=False)
    assert {c.optimizer for c in configs} >= set(LEVERS)
    keys = [steps.row_key(c) for c in configs]
    assert len(set(keys)) == len(keys)
    assert not set(keys) & {steps.row_key(c) for c in steps.step_configs(smoke=False)}
    for c in configs:
        parse(c.method)
    assert {c.method for c in configs} >= {"compact", "compact+lowmembp"}


def test_smoke_rows_build_on_the_cpu_or_refuse_with_the_reason():
    for c in levers.full_ft_lever_configs(smoke=True)[:3]:  # paged, GaLore layer-wise, CPU offload
        run, row = steps.build_run(c, "cpu", warmup=1)
        if c.optimizer == "adamw-cpu-offload":
            assert run is None and "CUDA or XPU" in row["note"]
        else:
            assert row is None and run is not None
