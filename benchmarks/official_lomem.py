"""The official LowMemoryBP CUDA ops (github yyyyychen/LowMemoryBP, package ``lomem``), built and called beside ours.

    python benchmarks/official_lomem.py build --src third_party/lomem --build-dir /tmp/lomem_build   # nvcc + ninja
    ops = load_official("third_party/lomem", "/tmp/lomem_build")       # in a benchmark, on a CUDA machine
    ops.regelu2(x); ops.resilu2(x); ops.layer_norm(x, eps); ops.rms_norm(x, eps)   # autograd functions

Their code is never committed here: ``benchmarks/prepare_gpu_run.sh`` copies their ``lomem/`` (and setup.py, LICENSE)
into the git-ignored ``third_party/`` folder, which travels to the GPU machine with the device tool's ``carry``.

Build: their ``setup.py`` builds one extension ``lomem._C`` from ``lomem/csrc/*.cpp`` and ``*.cu`` with the flags in
:data:`NVCC_FLAGS` (copied from that setup.py) for sm_75/80/90. Here it is built just-in-time with
``torch.utils.cpp_extension.load`` (ninja) for the one GPU at hand (``TORCH_CUDA_ARCH_LIST`` of its compute
capability only: a third of the nvcc time), into a build folder that a second ``load`` with the same arguments and
environment reuses without recompiling — so a background ``build`` (no GPU needed: ``--arch 9.0``) can run while the
GPU does other work.

Calling: their Python package (``lomem/activation.py``, ``normalization.py``) is imported from the copy with the built
module put in place of ``lomem._C``, so their own ``autograd.Function`` classes run. If that import fails (say a
later torch drops ``torch.cuda.amp.custom_fwd``), :class:`_AdapterFns` calls the same ``_C`` functions the same way.

Without CUDA (the CPU dry run of ``benchmarks/gpu_run.py``) :func:`stand_in_c` gives a ``_C`` with their function
names and tensor layouts (codes without our flag byte, fp32 rstd of shape [rows]) computed by *our* PyTorch reference;
every wrapping code path then runs, and ``Official.source`` says that it is a stand-in, not their kernels.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
import types
import warnings
from pathlib import Path

EXTENSION_NAME = "lomem_official_C"
# from their setup.py (extra_compile_args), minus the -gencode list, which build_kwargs sets for the GPU at hand
CXX_FLAGS = ["-O3", "-std=c++17"]
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--use_fast_math"]
C_FUNCTIONS = ("regelu2_fw", "regelu2_bw", "resilu2_fw", "resilu2_bw", "layer_norm_fw", "layer_norm_bw",
               "rms_norm_fw", "rms_norm_bw")


class OfficialUnavailable(RuntimeError):
    """The official ops cannot be used here; the message says why and what to do."""


def find_sources(src: str | Path) -> dict:
    """``{"root": lomem dir, "sources": [csrc/*.cpp, csrc/*.cu] sorted, "include": csrc/include}`` of a copy.

    ``src`` is the ``lomem`` package folder or the folder holding it (the repository root)."""
    src = Path(src)
    root = src / "lomem" if (src / "lomem" / "csrc").is_dir() else src
    csrc = root / "csrc"
    if not csrc.is_dir():
        raise OfficialUnavailable(f"no official LowMemoryBP sources at {src} (expected lomem/csrc/); run "
                                  "`bash benchmarks/prepare_gpu_run.sh` to copy them into third_party/")
    sources = sorted(csrc.glob("*.cpp")) + sorted(csrc.glob("*.cu"))
    if not any(p.suffix == ".cu" for p in sources):
        raise OfficialUnavailable(f"{csrc} holds no .cu files: an incomplete copy; run "
                                  "`bash benchmarks/prepare_gpu_run.sh` again")
    return {"root": root.resolve(), "sources": [str(p.resolve()) for p in sources],
            "include": str((csrc / "include").resolve())}


ARCH_RE = re.compile(r"^(\d+)\.(\d+)(a?)(\+PTX)?$")  # 9.0, 9.0a (sm_90a), 9.0+PTX: torch's TORCH_CUDA_ARCH_LIST entries


def arch_of(capability) -> str:
    """``(9, 0)``, ``"9.0"`` -> ``"9.0"``; ``"9.0a"`` -> ``"9.0a"`` (sm_90a), ``"9.0+PTX"`` kept: the
    TORCH_CUDA_ARCH_LIST entry of one compute capability, written as torch's ``cpp_extension`` takes it. A list
    (``"8.0;9.0"``) or a named architecture (``"Hopper"``) is refused: the build is for the one GPU at hand."""
    if isinstance(capability, str):
        m = ARCH_RE.match(capability.strip())
        if m is None:
            raise ValueError(f"compute capability must look like (9, 0), '9.0' or '9.0a' (one architecture), "
                             f"got {capability!r}")
        major, minor, suffix, ptx = m.groups()
        return f"{int(major)}.{int(minor)}{suffix}{ptx or ''}"
    major, minor = capability
    if not str(major).isdigit() or not str(minor).isdigit():
        raise ValueError(f"compute capability must look like (9, 0), '9.0' or '9.0a' (one architecture), "
                         f"got {capability!r}")
    return f"{int(major)}.{int(minor)}"


def capability_of(arch: str) -> str:
    """``"9.0a"`` / ``"9.0+PTX"`` -> ``"9.0"``: the compute capability an architecture entry builds for."""
    m = ARCH_RE.match(arch_of(arch))
    return f"{m.group(1)}.{m.group(2)}"


def arch_for_gpu(gpu_capability: str, wanted: str | None = None) -> str:
    """The one architecture to build the official ops for on a GPU of ``gpu_capability`` (``"9.0"``, nvidia-smi's
    compute_cap): ``wanted`` (a TORCH_CUDA_ARCH_LIST already set in the environment, e.g. ``"9.0a"``) where it names
    one architecture of that capability, else the capability itself. benchmarks/gpu_run.py passes the result to the
    background build (``--arch``) and sets it as TORCH_CUDA_ARCH_LIST of every part, so that the kernels part's
    ``load`` asks ninja for the very build the background one made (another arch would rebuild it)."""
    cap = arch_of(gpu_capability)
    if wanted:
        try:
            if capability_of(wanted) == capability_of(cap):
                return arch_of(wanted)
        except ValueError:
            pass
    return cap


def cuda_home(environ=None, which=None) -> str | None:
    """The CUDA toolkit folder for the build: ``CUDA_HOME`` / ``CUDA_PATH`` when set, else the first folder that holds
    both ``bin/nvcc`` and ``include/cuda_runtime_api.h`` among: the one above the ``nvcc`` on the path, the one above
    its real path, ``/usr/local/cuda``, ``/usr/local/cuda-*`` (newest first). torch's own guess is only the folder above
    the ``nvcc`` on the path: where that ``nvcc`` is a wrapper script (``/usr/local/bin/nvcc`` execing
    ``/usr/local/cuda-13.0/bin/nvcc``) it takes ``/usr/local``, and the C++ sources miss ``cuda_runtime_api.h``."""
    import glob
    import shutil
    environ = os.environ if environ is None else environ
    set_ = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if set_:
        return set_
    nvcc = (which or shutil.which)("nvcc")
    found = [os.path.dirname(os.path.dirname(p)) for p in ([nvcc, os.path.realpath(nvcc)] if nvcc else [])]
    found += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in found:
        if os.path.isfile(os.path.join(home, "bin", "nvcc")) and \
                os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    return None


# the CUDA library headers torch's ATen/cuda/CUDAContextLight.h includes (their csrc includes ATen/cuda/CUDAContext.h)
TORCH_CUDA_HEADERS = ("cuda_runtime_api.h", "cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h")


def header_fallback_dirs(home: str | None, search: list[str] | None = None) -> list[str]:
    """Include folders of the pip CUDA packages (``nvidia/cu13/include``, ``nvidia/cusparse/include``, ...) holding
    the :data:`TORCH_CUDA_HEADERS` that ``home/include`` lacks (a toolkit with nvcc and the runtime only); [] when it
    has them all. They go after the toolkit's own folder (``-isystem``, searched after torch's ``-isystem
    CUDA_HOME/include``), so they only fill the gaps."""
    inc = os.path.join(home or "", "include")
    missing = [h for h in TORCH_CUDA_HEADERS if not os.path.isfile(os.path.join(inc, h))]
    if not missing:
        return []
    if search is None:
        spec = importlib.util.find_spec("nvidia")
        search = list(spec.submodule_search_locations or []) if spec is not None else []
    dirs = []
    for root in search:
        for d in sorted(Path(root).glob("*/include")):
            if any((d / h).is_file() for h in missing) and str(d) not in dirs:
                dirs.append(str(d))
    return dirs


def build_env(capability, cpus: int | None = None) -> dict:
    """Environment of the build: ``TORCH_CUDA_ARCH_LIST`` names the one GPU at hand, so torch's ``load`` adds
    ``-gencode arch=compute_XY,code=sm_XY`` for it alone (their setup.py builds sm_75, sm_80 and sm_90); ninja jobs."""
    cpus = cpus or os.cpu_count() or 2
    return {"TORCH_CUDA_ARCH_LIST": arch_of(capability), "MAX_JOBS": str(max(1, min(8, cpus // 2)))}


def cxx_standard(aten_header: str | Path | None = None) -> str:
    """``-std=c++17`` as their setup.py has it, or ``-std=c++20`` where the installed torch's headers refuse C++17
    (``ATen/ATen.h``: "C++20 or later compatible compiler is required", torch 2.14 here)."""
    if aten_header is None:
        import torch
        aten_header = Path(torch.__file__).parent / "include" / "ATen" / "ATen.h"
    try:
        text = Path(aten_header).read_text(errors="ignore")
    except OSError:
        return "-std=c++17"
    return "-std=c++20" if "C++20 or later" in text else "-std=c++17"


def build_kwargs(src: str | Path, build_dir: str | Path, nvcc_threads: int = 4, verbose: bool = False,
                 std: str | None = None) -> dict:
    """Keyword arguments of ``torch.utils.cpp_extension.load`` that build their ``_C`` (flags of their setup.py;
    ``std``: the C++ standard flag, default :func:`cxx_standard`).

    Identical arguments and environment give the same build: a second ``load`` reuses the first one's output."""
    found = find_sources(src)
    std = std or cxx_standard()
    fix = lambda flags: [std if f.startswith("-std=") else f for f in flags]  # noqa: E731
    return dict(name=EXTENSION_NAME, sources=found["sources"], extra_include_paths=[found["include"]],
                extra_cflags=fix(CXX_FLAGS), extra_cuda_cflags=fix(NVCC_FLAGS) + ["--threads", str(int(nvcc_threads))],
                build_directory=str(Path(build_dir).resolve()), verbose=verbose)


def build(src: str | Path, build_dir: str | Path, capability=None, verbose: bool = False):
    """Build (or reuse) their ``_C`` and return the loaded module.

    ``capability``: the GPU's, e.g. ``"9.0"``; default ``TORCH_CUDA_ARCH_LIST`` if set, else the current device's
    (the build itself needs nvcc, not a GPU)."""
    kw = build_kwargs(src, build_dir, verbose=verbose)
    if capability is None:
        capability = os.environ.get("TORCH_CUDA_ARCH_LIST") or None
    if capability is None:
        import torch
        if not torch.cuda.is_available():
            raise OfficialUnavailable("building the official ops needs a CUDA device or a compute capability "
                                      "(--arch 9.0 / TORCH_CUDA_ARCH_LIST), and nvcc")
        capability = torch.cuda.get_device_capability()
    try:
        env = build_env(capability)
    except ValueError as e:
        raise OfficialUnavailable(str(e)) from e
    for k, v in env.items():
        if k == "TORCH_CUDA_ARCH_LIST" or k not in os.environ:
            os.environ[k] = v
    home = cuda_home()
    if home and not os.environ.get("CUDA_HOME"):
        os.environ["CUDA_HOME"] = home  # read when torch.utils.cpp_extension is first imported
    for d in header_fallback_dirs(home):  # the same in every process: a later load reuses the build
        kw["extra_cflags"] = kw["extra_cflags"] + ["-isystem", d]
        kw["extra_cuda_cflags"] = kw["extra_cuda_cflags"] + ["-isystem", d]
    Path(kw["build_directory"]).mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils import cpp_extension
        if home and cpp_extension.CUDA_HOME != home:  # imported earlier with torch's own guess
            cpp_extension.CUDA_HOME = home
        return cpp_extension.load(**kw)
    except Exception as e:  # nvcc missing, a compile error: say so, with the build folder for the log
        raise OfficialUnavailable(f"building the official ops failed ({type(e).__name__}: {str(e)[-600:]}); build "
                                  f"folder {kw['build_directory']}") from e


# ------------------------------------------------------------------------------------------------ CPU stand-in
def stand_in_c() -> types.SimpleNamespace:
    """Their ``_C`` function names and tensor layouts, computed by lowmembp's PyTorch reference (CPU dry runs)."""
    import torch
    from lowmembp.ops import approx_act as aa
    from lowmembp.ops import ms_norm as mn

    def act_fw(kind):
        def fw(x):
            y, packed = aa.forward_reference(x, kind)
            return [y, packed[:-1].clone()]  # theirs: (N + 3) // 4 code bytes, no flag byte
        return fw

    def act_bw(kind):
        def bw(dy, packed):
            flag = torch.zeros(1, dtype=torch.uint8, device=packed.device)
            return aa.backward_reference(dy, torch.cat([packed, flag]), kind)
        return bw

    def norm_fw(kind):
        def fw(x, normalized_shape, eps):
            y, rstd = mn.ms_norm_fwd_ref(x, kind, float(eps))
            return [y, rstd.float()]
        return fw

    def norm_bw(kind):
        def bw(dy, y, rstd):
            return mn.ms_norm_bwd_ref(dy, y, rstd, kind, dy.dtype)
        return bw

    return types.SimpleNamespace(regelu2_fw=act_fw("gelu"), regelu2_bw=act_bw("gelu"),
                                 resilu2_fw=act_fw("silu"), resilu2_bw=act_bw("silu"),
                                 layer_norm_fw=norm_fw("layernorm"), layer_norm_bw=norm_bw("layernorm"),
                                 rms_norm_fw=norm_fw("rmsnorm"), rms_norm_bw=norm_bw("rmsnorm"))


# ------------------------------------------------------------------------------------------------ calling them
class _AdapterFns:
    """Their four ops as autograd functions over a ``_C``, written as their activation.py / normalization.py do."""

    def __init__(self, C):
        import torch

        class _Act(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, fw, bw):
                out, packed = fw(x)
                ctx.save_for_backward(packed)
                ctx.bw = bw
                return out

            @staticmethod
            def backward(ctx, g):
                return ctx.bw(g.contiguous(), ctx.saved_tensors[0]), None, None

        class _Norm(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, shape, eps, fw, bw):
                out, rstd = fw(x, shape, eps)
                ctx.save_for_backward(out, rstd)
                ctx.bw = bw
                return out

            @staticmethod
            def backward(ctx, g):
                return ctx.bw(g.contiguous(), *ctx.saved_tensors), None, None, None, None

        self.regelu2 = lambda x: _Act.apply(x, C.regelu2_fw, C.regelu2_bw)
        self.resilu2 = lambda x: _Act.apply(x, C.resilu2_fw, C.resilu2_bw)
        self.layer_norm = lambda x, shape, eps: _Norm.apply(x, list(shape), eps, C.layer_norm_fw, C.layer_norm_bw)
        self.rms_norm = lambda x, shape, eps: _Norm.apply(x, list(shape), eps, C.rms_norm_fw, C.rms_norm_bw)


def _their_python(root: Path, C):
    """Their ``lomem`` package imported from the copy, with ``C`` as ``lomem._C``; their functional module."""
    for name in [n for n in sys.modules if n == "lomem" or n.startswith("lomem.")]:
        del sys.modules[name]
    sys.modules["lomem._C"] = C
    spec = importlib.util.spec_from_file_location("lomem", root / "__init__.py", submodule_search_locations=[str(root)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["lomem"] = pkg
    pkg._C = C
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cuda.amp.custom_fwd is deprecated (FutureWarning)
        spec.loader.exec_module(pkg)
    return pkg.functional


class Official:
    """Their ReGELU2, ReSiLU2, MS-LayerNorm, MS-RMSNorm (no affine), each ``x -> y`` with autograd.

    ``source``: what computes them (their kernels built here, or the CPU stand-in); ``python``: whose autograd
    wrapper calls them (theirs from the copy, or :class:`_AdapterFns`); ``build_s``: seconds the build/load took."""

    def __init__(self, C, source: str, root: Path | None, build_s: float = 0.0):
        self.C, self.source, self.build_s = C, source, build_s
        self.python, fns = "adapter's autograd wrapper (their Python package not importable)", None
        if root is not None and (root / "functional.py").is_file():
            try:
                fns = _their_python(root, C)
                self.python = f"their lomem Python package ({root})"
            except Exception as e:
                self.python += f": {type(e).__name__}: {e}"
        if fns is None:
            fns = _AdapterFns(C)
        self._f = fns

    @property
    def is_stand_in(self) -> bool:
        return self.source.startswith("stand-in")

    def regelu2(self, x):
        return self._f.regelu2(x)

    def resilu2(self, x):
        return self._f.resilu2(x)

    def layer_norm(self, x, eps: float = 1e-5):
        return self._f.layer_norm(x, list(x.shape[-1:]), eps)

    def rms_norm(self, x, eps: float = 1e-6):
        return self._f.rms_norm(x, list(x.shape[-1:]), eps)


def load_official(src: str | Path, build_dir: str | Path, stand_in: bool = False) -> Official:
    """Their ops: built from ``src`` on a CUDA machine, or (``stand_in=True``, CPU) the reference stand-in.

    The stand-in still imports their Python package from ``src`` when the copy is there. Raises
    :class:`OfficialUnavailable` (with the reason) when neither is possible."""
    root = None
    try:
        root = find_sources(src)["root"]
    except OfficialUnavailable:
        if not stand_in:
            raise
    if stand_in:
        return Official(stand_in_c(), "stand-in: lowmembp's PyTorch reference (CPU dry run, not their kernels)", root)
    t = time.perf_counter()
    C = build(src, build_dir)
    missing = [f for f in C_FUNCTIONS if not hasattr(C, f)]
    if missing:
        raise OfficialUnavailable(f"the built module lacks {missing}: their csrc/module.cpp changed; update "
                                  "benchmarks/official_lomem.py")
    return Official(C, f"their CUDA kernels, built here from {src}", root, time.perf_counter() - t)


SWAPPED = {"ReGELU2": "regelu2", "ReSiLU2": "resilu2", "MSLayerNorm": "layer_norm", "MSRMSNorm": "rms_norm"}


def swap_into(model, ops: Official) -> dict:
    """Make every LowMemoryBP module of ``model`` (after ``lowmembp.apply(model, "...lowmembp")``: ReGELU2, ReSiLU2,
    MS-LayerNorm, MS-RMSNorm, found by class name) call the official op instead of ours: the same model, the same
    folded weights, their kernels. Returns ``{class name: count}``; ValueError when there is none to swap."""
    counts: dict = {}
    for m in model.modules():
        name = type(m).__name__
        if name not in SWAPPED:
            continue
        fn = getattr(ops, SWAPPED[name])
        if name.startswith("MS"):
            m.forward = (lambda f, eps: (lambda x: f(x, eps)))(fn, m.eps)
        else:
            m.forward = fn
        counts[name] = counts.get(name, 0) + 1
    if not counts:
        raise ValueError("swap_into: the model has no LowMemoryBP module (ReGELU2, ReSiLU2, MSLayerNorm, MSRMSNorm) "
                         "to swap; apply lowmembp first")
    return counts


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="build the official LowMemoryBP CUDA ops (JIT, ninja)")
    p.add_argument("command", choices=["build"])
    p.add_argument("--src", default="third_party/lomem", help="the copied lomem folder (default third_party/lomem)")
    p.add_argument("--build-dir", required=True, help="where ninja builds (reused by a later load)")
    p.add_argument("--arch", default=None, help="compute capability, e.g. 9.0 (default: the current GPU's)")
    a = p.parse_args(argv)
    t = time.perf_counter()
    print(f"official_lomem: building for {a.arch or os.environ.get('TORCH_CUDA_ARCH_LIST') or 'the current GPU'}, "
          f"CUDA_HOME {cuda_home()}, MAX_JOBS {os.environ.get('MAX_JOBS', 'default')}", flush=True)
    try:
        build(a.src, a.build_dir, capability=a.arch, verbose=True)
    except OfficialUnavailable as e:
        print(f"official_lomem: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"official_lomem: built in {time.perf_counter() - t:.0f} s into {a.build_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
