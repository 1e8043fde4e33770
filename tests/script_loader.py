"""A repository script (``benchmarks/*.py``, ``workflow/scripts/*.py``) loaded as a module, for tests that call its
functions instead of running it in a subprocess.

    from script_loader import load_script
    load_script("benchmarks/cpu_ops.py").main(["--ops", "ms-rmsnorm"])
"""
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str) -> ModuleType:
    """The script at ``path`` (relative to the repository's root), executed fresh as a module on each call."""
    file = ROOT / path
    spec = importlib.util.spec_from_file_location("_".join(Path(path).with_suffix("").parts), file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
