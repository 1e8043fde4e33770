"""The package's front door (lowmembp/__init__.py): a cheap import, the one-call entry points, no function shadowing
a module, and the deprecated names still working for one release."""
import importlib
import json
import pkgutil
import subprocess
import sys
import warnings

import pytest

import lowmembp

_PROBE = """
import json, sys
before = set(sys.modules)
import {what}
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _loaded_by(what: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(what=what)], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_import_loads_torch_and_the_registry_only():
    torch_alone = _loaded_by("torch")
    ours = _loaded_by("lowmembp")
    extra = ours - torch_alone
    assert {"lowmembp", "lowmembp.methods", "lowmembp.methods.registry"} <= extra
    heavy = ("transformers", "peft", "timm", "pandas", "triton", "lowmembp.estimator", "lowmembp.plan",
             "lowmembp.measurement", "lowmembp.ops", "lowmembp.models", "lowmembp._compat")
    assert not [m for m in extra if m.startswith(heavy)], sorted(extra)
    # no private torch module beyond those `import torch` loads itself
    assert not [m for m in extra if m.startswith("torch.")], sorted(m for m in extra if m.startswith("torch."))


@pytest.mark.parametrize("room", ["ops", "models", "methods", "measurement", "estimator", "plan"])
def test_rooms_are_modules_and_say_what_they_may_import(room):
    mod = importlib.import_module(f"lowmembp.{room}")
    assert isinstance(mod, type(sys)) and mod.__name__ == f"lowmembp.{room}"
    assert getattr(lowmembp, room) is mod
    assert "May import" in (mod.__doc__ or ""), f"lowmembp.{room}'s docstring must say what it may import"


def test_no_public_function_shadows_a_module():
    """For every module M.sub, the attribute M.sub is that module (the name ``sub`` is never rebound to a function
    of the same name)."""
    bad = []
    for info in pkgutil.walk_packages(lowmembp.__path__, "lowmembp."):
        parent, _, name = info.name.rpartition(".")
        if name == "__main__":
            continue
        mod = importlib.import_module(info.name)
        if getattr(importlib.import_module(parent), name) is not mod:
            bad.append(info.name)
    assert not bad


def test_entry_points_are_one_call():
    assert lowmembp.apply.__module__ == "lowmembp.methods.registry"
    assert "lowmembp" in lowmembp.list_methods()
    assert callable(lowmembp.export) and lowmembp.export.__module__ == "lowmembp.methods.export"
    assert callable(lowmembp.make_plan) and lowmembp.make_plan.__module__ == "lowmembp.plan"
    assert set(lowmembp.__all__) <= set(dir(lowmembp))
    with pytest.raises(AttributeError):
        lowmembp.no_such_name


def test_deprecated_names_warn_and_still_work():
    with pytest.warns(DeprecationWarning, match="list_methods"):
        assert lowmembp.methods() == lowmembp.list_methods()
    import lowmembp.plan as plan_room
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_room.make_plan is lowmembp.make_plan
    with pytest.warns(DeprecationWarning, match="make_plan"):
        with pytest.raises(ValueError, match="batch_size"):  # the call reaches make_plan, which checks its arguments
            lowmembp.plan("bert-large", batch_size=0)
    with pytest.warns(DeprecationWarning, match="make_plan"):
        with pytest.raises(ValueError, match="batch_size"):
            plan_room.plan("bert-large", batch_size=0)


def test_the_optional_bitsandbytes_kernel_notice_is_not_shown():
    """bitsandbytes' import (through peft) logs "Failed to load CPU gemm_4bit_forward from kernels-community" on
    CPUs with AVX512-BF16: ``import lowmembp`` drops exactly that line, and a first ``apply`` prints none."""
    import logging

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    make = lambda msg: logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, ("x",), None)  # noqa: E731
    assert not logger.filter(make("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ..."))
    assert logger.filter(make("any other warning: %s"))
    code = ("import transformers, lowmembp\n"
            "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
            " num_attention_heads=2, num_key_value_heads=2)\n"
            "lowmembp.apply(transformers.LlamaForCausalLM(cfg), 'lora', rank=2)\n"
            "import bitsandbytes\n")  # imported for certain, whatever peft does
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "gemm_4bit_forward" not in p.stdout + p.stderr
