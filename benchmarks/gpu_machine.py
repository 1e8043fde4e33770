"""The machine a GPU run finds: its GPU and versions (machine.json), the commit the tree was sent from, the
pure-Python wheels carried in third_party/wheels, and the one CUDA architecture the official ops are built for.
``ctx`` is benchmarks/gpu_run.py's run context (its ``smoke`` and ``third_party``)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# the pure-Python wheels benchmarks/prepare_gpu_run.sh carries: label -> importable module (the wheel's name starts
# with it)
CARRIED = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


def ensure_liger(ctx) -> str:
    """Make ``liger_kernel`` importable (from third_party/wheels if needed); a line saying how."""
    return ensure_carried(ctx, "liger")


def ensure_carried(ctx, label: str) -> str:
    """Make the module of ``CARRIED[label]`` importable (from its wheel in third_party/wheels if needed); a line
    saying how."""
    import importlib.util
    module = CARRIED[label]
    if importlib.util.find_spec(module) is not None:
        return f"{module} importable as installed"
    if ctx.smoke:
        return f"{label}: not installed; skipped without CUDA"
    wheels = sorted((ctx.third_party / "wheels").glob(f"{module}-*.whl"))
    if not wheels:
        return f"{label}: not installed and no wheel in {ctx.third_party / 'wheels'} (run prepare_gpu_run.sh)"
    target = Path(os.environ.get("TMPDIR", "/tmp")) / f"lowmembp_{label}_site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                        "--upgrade", "--target", str(target), str(wheels[-1])], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        return f"{label}: pip install of {wheels[-1].name} failed: {r.stderr[-300:]}"
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(target)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return f"{label}: installed {wheels[-1].name} into {target}"


def set_build_arch(gpu_capability: str) -> str:
    """TORCH_CUDA_ARCH_LIST of this run and its parts: one architecture of the GPU at hand, the one the environment
    already names where it is one of this GPU's (``9.0a``, sm_90a, on an H200 whose image sets it), else the GPU's
    compute capability (``9.0``). The background build of the official ops gets it as ``--arch`` and the kernels part
    inherits it, so its ``load`` finds that build as ninja left it (another architecture would rebuild it there).
    Returns a line for machine.json."""
    from official_lomem import arch_for_gpu
    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        arch = arch_for_gpu(gpu_capability, before)
    except ValueError as e:
        return f"TORCH_CUDA_ARCH_LIST left as {before!r}: {e}"
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    return f"TORCH_CUDA_ARCH_LIST={arch} (GPU compute capability {gpu_capability}; environment had {before!r})"


def nvidia_smi() -> dict:
    """GPU name, driver, memory, compute capability — from nvidia-smi, else from torch in a child process (this
    process keeps off CUDA: a context here would count as memory outside the parts' allocators)."""
    exe = shutil.which("nvidia-smi")
    facts = {}
    if exe:
        try:
            out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total,compute_cap",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
            name, driver, mem, cap = [x.strip() for x in out.strip().splitlines()[0].split(",")]
            facts = {"name": name, "driver": driver, "memory_total": mem, "compute_capability": cap}
        except Exception as e:
            facts = {"error": f"nvidia-smi: {e}"}
    if not facts.get("name"):
        code = ("import torch\nif torch.cuda.is_available():\n    p = torch.cuda.get_device_properties(0)\n"
                "    print(p.name, '|', f'{p.major}.{p.minor}', '|', p.total_memory)")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
            if "|" in out:
                name, cap, mem = [x.strip() for x in out.strip().splitlines()[-1].split("|")]
                facts.update(name=name, compute_capability=cap, memory_total=f"{int(mem) >> 20} MiB", via="torch")
        except Exception as e:
            facts.setdefault("error", f"torch: {e}")
    return facts


def _version_line(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[-1]
    except Exception:
        return None


def machine_facts(ctx, argv: list[str], script: str = "benchmarks/gpu_run.py") -> dict:
    """The machine, its versions and the commit, for machine.json; ``script argv`` is the command that ran."""
    from importlib import metadata
    versions = {}
    for pkg in ("torch", "triton", "timm", "transformers", "peft", "liger-kernel", "cut-cross-entropy", "bitsandbytes",
                "numpy", "pytest"):
        try:
            versions[pkg] = metadata.version(pkg)
        except Exception:
            versions[pkg] = None
    git = {"commit": None, "dirty": None}
    sent = commit_sent(ctx)
    if sent:
        git.update(sent)
    try:
        if sent:
            raise StopIteration  # the commit the tree was sent from, not the copy's .git
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            git["commit"] = head.stdout.strip()
            git["dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                               capture_output=True, text=True, timeout=20).stdout.strip())
        git["how"] = "git rev-parse HEAD of the tree here (a copied tree's .git may be stale)"
    except Exception:
        pass
    prepared = ctx.third_party / "PREPARED.txt"
    return {"command": " ".join([Path(sys.executable).name, script] + argv),
            "cwd": str(Path.cwd()), "smoke": ctx.smoke, "gpu": nvidia_smi(), "cuda_torch": _torch_cuda(),
            "nvcc": _version_line(["nvcc", "--version"]) if shutil.which("nvcc") else None,
            "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "versions": versions, "git": git,
            "third_party": prepared.read_text().strip() if prepared.is_file() else "absent"}


def commit_sent(ctx) -> dict | None:
    """The commit the tree was sent from: ``$GPU_RUN_COMMIT`` (``<sha>`` or ``<sha> dirty``), else the first line
    of third_party/COMMIT (written by prepare_gpu_run.sh on the machine holding the repository); None when neither."""
    line, how = os.environ.get("GPU_RUN_COMMIT", "").strip(), "$GPU_RUN_COMMIT"
    if not line and (ctx.third_party / "COMMIT").is_file():
        line = (ctx.third_party / "COMMIT").read_text().strip().splitlines()[0:1]
        line, how = (line[0].strip() if line else ""), f"{ctx.third_party / 'COMMIT'} (written by prepare_gpu_run.sh)"
    if not line:
        return None
    sha, _, rest = line.partition(" ")
    return {"commit": sha, "dirty": "dirty" in rest if rest else None, "how": how, "sent": line}


def _torch_cuda():
    try:
        import torch
        return torch.version.cuda
    except Exception:
        return None
