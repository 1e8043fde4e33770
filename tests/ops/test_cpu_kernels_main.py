"""``python -m lowmembp.ops.cpu_kernels``: builds or finds both native parts and says where; exit 1 with the reason
when one is unavailable."""
import os
import subprocess
import sys

import pytest

from lowmembp.ops.cpu_kernels import __main__ as cli
from lowmembp.ops.cpu_kernels import autograd_ext, build


def test_prints_both_parts_and_exits_0_when_available(capsys):
    if build.library() is None or autograd_ext.extension() is None:
        pytest.skip("no C / C++ compiler here: the unavailable case is tested below")
    assert cli.main() == 0
    out = capsys.readouterr().out
    assert "C kernels (kernels.c): " in out and "C++ autograd extension (autograd.cpp): " in out
    assert "not available" not in out


def test_exits_1_and_says_why_when_the_extension_is_off(monkeypatch, capsys):
    monkeypatch.setattr(autograd_ext, "_OFF", True)
    assert cli.main() == 1
    assert "C++ autograd extension (autograd.cpp): not available: turned off" in capsys.readouterr().out


def test_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "lowmembp.ops.cpu_kernels"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "LOWMEMBP_CPU_EXT": "0"})
    assert done.returncode == 1 and "turned off" in done.stdout
