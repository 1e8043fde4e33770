"""benchmarks/gpu_full_ft_levers.py: the full-fine-tuning levers' GPU rows cover every optimizer of another package
and CompAct, are valid configurations, and are cells the training job takes (on the CPU: all but the CUDA-only one,
refused with its reason)."""
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
    others = [c for c in steps.step_configs(smoke=False) if c.part != "full_ft"]
    assert not set(keys) & {steps.row_key(c) for c in others}  # rows of their own, not the llama part's
    assert [c for c in steps.step_configs(smoke=False) if c.part == "full_ft"] == configs  # the run's full_ft part
    assert all(c.part == "full_ft" for c in configs) and len({c.config for c in configs}) == len(configs)
    for c in configs:
        parse(c.method)
    assert {c.method for c in configs} >= {"compact", "compact+lowmembp"}


def test_the_job_takes_every_row_on_the_cpu_but_the_cuda_only_one():
    """The dry run's cells: the training job accepts each row's arguments, except the CPU offload's (CUDA only),
    which it refuses with the reason."""
    for c in levers.full_ft_lever_configs(smoke=True):
        row = steps.job_refuses(c, smoke=True)
        if c.optimizer == "adamw-cpu-offload":
            assert row is not None and row["status"] == "refused" and "needs a CUDA device" in row["note"]
        else:
            assert row is None, row
        assert c.weights == "bf16" and "--synthetic-data" in steps.job_argv(c, smoke=True)
