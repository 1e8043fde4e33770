"""Commands that did nothing fail loudly: a plan in which nothing could be estimated exits non-zero with the
reasons, and a GPU memory not larger than the reserve is refused with a clear message (not a negative capacity)."""
import sys

import pytest

from lowmembp.plan import plan
from lowmembp.plan.__main__ import main

plan_module = sys.modules["lowmembp.plan"]  # the package (``lowmembp.plan`` as an attribute is the function)

LLAMA = ["--model", "llama-7b", "--batch-size", "2", "--seq-len", "8", "--methods", "lora", "--jobs", "1",
         "--margin", "0"]


def test_a_gpu_smaller_than_the_reserve_is_refused(capsys):
    with pytest.raises(ValueError, match=r"not larger than the reserve .*smaller reserve"):
        plan("llama-7b", batch_size=2, gpu_memory="100MiB", reserved="1GiB", margin=0.0, methods=["lora"])
    with pytest.raises(ValueError, match=r"GPU memory 1GiB .*not larger than the reserve"):
        plan("llama-7b", batch_size=2, gpu_memory="80GiB", reserved="1GiB", more_gpus=["1GiB"], margin=0.0)
    assert main(LLAMA + ["--gpu-memory", "512MiB", "--reserved", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "not larger than the reserve" in err and "-" not in err.split("MiB")[0]


def test_a_plan_where_nothing_could_be_estimated_exits_non_zero(monkeypatch, capsys):
    def fails(spec, method, **kwargs):  # what an estimate that cannot run on this torch / model raises
        raise RuntimeError(f"cannot estimate {method} here")
    monkeypatch.setattr(plan_module, "Peaks", fails)
    assert main(LLAMA + ["--gpu-memory", "80GiB", "--reserved", "0"]) == 1
    err = capsys.readouterr().err
    assert "nothing could be estimated" in err and "baseline: RuntimeError: cannot estimate baseline here" in err, err
