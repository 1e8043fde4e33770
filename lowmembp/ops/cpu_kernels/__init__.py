"""One-pass C kernels of the CPU fast path (the default on CPU tensors): ReGELU2 / ReSiLU2's 2-bit codes and their
backward, Mesa's 8-bit quantise and dequantise, MS-LayerNorm's forward (a replica of ATen's CPU LayerNorm), the
MS-norms' backward (with a replica of ATen's CPU row sum) and their casts.

The package ships ``kernels.c`` as source. The first call compiles it with the system C compiler (``$CC``, else the
first of :data:`COMPILERS` on the ``PATH``) into a shared library cached under :func:`lowmembp.cache.cache_dir`
(named by a hash of the source, the flags, the compiler and the CPU, so another machine sharing the folder builds its
own) and loads it with :mod:`ctypes`; later calls and later processes load the cached file. Plain C on float /
uint16 / uint8 pointers, no Python or torch headers: the build takes a few seconds, once (:func:`build_info` says how
long). Building writes a temporary file and renames it into place, so processes building at the same time each load
a complete library.

``LOWMEMBP_CPU_KERNELS=0`` (read when this module is imported) turns the kernels off. Without a compiler, or if
the build fails, a RuntimeWarning says so once per process and every function here returns ``None``: the callers
then run their eager ATen ops, which give the same bits.

The kernels reproduce the PyTorch references' arithmetic bit for bit (IEEE fp32 operations one at a time: the build
passes ``-ffp-contract=off`` and never a fast-math flag; fp16 / bf16 converted exactly and rounded to nearest even).
Where a result holds a NaN whose bits ATen's conversions decide, a kernel reports it and the caller recomputes with
its eager ops. Threads: an OpenMP team of ``torch.get_num_threads()`` per call, each thread one contiguous range;
ctypes releases the GIL for the call. With torch's own OpenMP runtime loaded first, the library shares it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from lowmembp.cache import cache_dir

__all__ = ["ENV_SWITCH", "COMPILERS", "FLAGS", "compiler", "library", "build_info", "codes2",
           "codes2_trusted", "check", "slopes2", "slopes2_trusted", "quantize8", "dequantize8", "dequantize8_trusted",
           "round_to", "norm_prod", "norm_bwd", "cast", "addcmul_fused", "aten_sum_width", "row_sums",
           "norm_bwd_rows", "norm_bwd_rows_trusted", "mesa_pack8", "mesa_pack8_trusted", "PACK8_NAN",
           "PACK8_AMBIGUOUS", "PACK8_SKIPPED", "layer_norm_fwd", "layer_norm_fwd_trusted", "layer_norm_variant",
           "layer_norm_variants", "layer_norm_probe_rows", "LayerNormVariant"]

ENV_SWITCH = "LOWMEMBP_CPU_KERNELS"  # "0" turns the C kernels off (the eager ATen ops run instead)
COMPILERS = ("cc", "gcc", "clang")  # tried in this order when $CC is not set
SOURCE = Path(__file__).with_name("kernels.c")
# bit-exact IEEE fp32: no fused multiply-add, no fast-math; OpenMP for the threads
FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")
# the first that builds: the CPU's own instructions (on AVX-512 CPUs all 512 bits of them; GCC prefers 256 otherwise),
# then the portable flags, then without OpenMP (one thread per call: a compiler without it, such as Apple's clang)
_FLAG_SETS = (FLAGS + ("-march=native", "-mprefer-vector-width=512"), FLAGS + ("-march=native",), FLAGS, FLAGS[:-1])
LIBS = ("-lm",)  # linked after the source: fmaf, which the norms' pass calls where ATen's addcmul fuses
MIN_PER_THREAD = 1 << 16  # elements per thread below which a call runs on one thread
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_OFF = os.environ.get(ENV_SWITCH, "1").strip() == "0"  # read once, at import (tests set _OFF itself)
_lock = threading.Lock()
_state: dict = {"lib": None, "tried": False, "compiles": 0, "seconds": None, "path": None, "reason": None}


def compiler() -> str | None:
    """The C compiler's path: ``$CC`` if set (its first word), else the first of :data:`COMPILERS` found; None if
    there is none."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(shlex.split(cc)[0])
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


@functools.lru_cache(maxsize=None)
def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _library_path(folder: Path, cc: str, flags: tuple) -> Path:
    st = os.stat(cc)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), os.path.realpath(cc).encode(),
                 f"{st.st_size}:{st.st_mtime_ns}".encode(), _cpu_id().encode(), platform.platform().encode()):
        key.update(part)
        key.update(b"\0")
    return folder / f"kernels-{key.hexdigest()[:20]}.so"


def _build(folder: Path, cc: str) -> Path:
    """The cached library for this source, compiler and CPU, compiled now if it is not there yet."""
    import subprocess
    import tempfile

    for flags in _FLAG_SETS:  # a library built before, by the first flag set that built
        path = _library_path(folder, cc, flags)
        if path.is_file():
            return path
    folder.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _FLAG_SETS:
        path = _library_path(folder, cc, flags)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=folder)
        os.close(fd)
        try:
            start = time.perf_counter()
            done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), *LIBS], capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(tmp, path)  # atomic: a concurrent build's rename leaves a complete file either way
                _state["compiles"] += 1
                _state["seconds"] = time.perf_counter() - start
                return path
            errors.append(f"{cc} {' '.join(flags)}: {done.stderr.strip()[-400:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("; ".join(errors))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, i32, u32, f32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
    for name, args in (("lmbp_codes2", [p, i32, i64, f32, f32, f32, p, i32]),
                       ("lmbp_check", [p, i32, i64, i32]),
                       ("lmbp_slopes2", [p, i32, p, i64, p, p, i32]),
                       ("lmbp_quantize8", [p, i32, i64, i64, i64, p, p, u32, p, i32]),
                       ("lmbp_dequantize8", [p, i64, i64, i64, p, p, p, i32, i32]),
                       ("lmbp_norm_bwd", [p, i32, p, i32, i64, i64, p, p, p, p, i32, i32, i32]),
                       ("lmbp_norm_bwd_rows", [p, i32, p, i32, i64, i64, p, p, i32, i32, i32, i32, i32]),
                       ("lmbp_cast", [p, i32, i64, p, i32, i32]),
                       ("lmbp_layer_norm_fwd", [p, i32, i64, i64, f32, p, i32, p, i32, i32, i32]),
                       ("lmbp_mesa_pack8",
                        [p, i32, i64, i64, i64, p, p, p, p, f32, f32, f32, p, p, p, u32, p, p, i32])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i32
    lib.lmbp_round.argtypes, lib.lmbp_round.restype = [p, i64, p, i32], None
    lib.lmbp_norm_prod.argtypes, lib.lmbp_norm_prod.restype = [p, i32, p, i32, i64, p, p, i32], None
    lib.lmbp_row_sums.argtypes, lib.lmbp_row_sums.restype = [p, i64, i64, i32, p], None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None when turned off (``LOWMEMBP_CPU_KERNELS=0``) or when they
    cannot be built (warned once per process)."""
    if _OFF:
        return None
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if not _state["tried"]:
            try:
                cc = compiler()
                if cc is None:
                    raise RuntimeError(f"no C compiler found ($CC or one of {', '.join(COMPILERS)} on the PATH)")
                path = _build(cache_dir() / "cpu_kernels", cc)
                _state["lib"], _state["path"] = _declare(ctypes.CDLL(str(path))), path
            except Exception as e:  # no compiler, a failed build, an unloadable library: the eager ops run instead
                _state["reason"] = str(e)
                warnings.warn(f"lowmembp: the CPU fast path's C kernels are not available ({e}); its eager ATen "
                              f"ops run instead (the same results, slower). Set {ENV_SWITCH}=0 to skip the build.",
                              RuntimeWarning, stacklevel=3)
            _state["tried"] = True
    return _state["lib"]


def build_info() -> dict:
    """``{"path", "compiles", "seconds", "reason"}``: the loaded library's file, the builds this process ran and the
    last one's wall time, and why the kernels are unavailable (None when they are)."""
    return {k: _state[k] for k in ("path", "compiles", "seconds", "reason")}


def _reset() -> None:
    """Forget the loaded library (tests): the next :func:`library` call looks for it, or builds it, again."""
    with _lock:
        _state.update(lib=None, tried=False, path=None, reason=None)


def _threads(n: int) -> int:
    if n < 2 * MIN_PER_THREAD:  # one thread (without asking torch how many it has)
        return 1
    return max(1, min(torch.get_num_threads(), n // MIN_PER_THREAD))


# ----------------------------------------------------------------------------------------------- the kernels
# Each takes CPU tensors (inputs made contiguous, outputs checked) and returns None when the library is unavailable
# (the caller's eager ops run).
def _check_tensor(t: torch.Tensor, at_least: int, dtype: torch.dtype) -> None:  # inputs too (their device)
    """A tensor the kernel reads or writes by its data pointer: contiguous, on the CPU, of ``dtype``, big enough."""
    if not (t.is_cpu and t.is_contiguous() and t.dtype is dtype and t.numel() >= at_least):
        raise ValueError(f"lowmembp.ops.cpu_kernels: expected a contiguous CPU {dtype} tensor of at least "
                         f"{at_least} elements, got {t.dtype} of shape {tuple(t.shape)} on {t.device} "
                         f"(contiguous: {t.is_contiguous()})")


def read_byte(t: torch.Tensor, i: int) -> int:
    """Byte ``i`` of a contiguous CPU uint8 tensor, read from memory (no tensor indexing: a fraction of its cost)."""
    _check_tensor(t, i + 1, torch.uint8)
    return ctypes.c_uint8.from_address(t.data_ptr() + i).value


def read_byte_trusted(t: torch.Tensor, i: int) -> int:
    """:func:`read_byte` without its check, for a caller that has made sure ``t`` is a contiguous CPU uint8 tensor
    of more than ``i`` bytes."""
    return ctypes.c_uint8.from_address(t.data_ptr() + i).value


def write_byte(t: torch.Tensor, i: int, value: int) -> None:
    """Set byte ``i`` of a contiguous CPU uint8 tensor the caller has just allocated (nothing else holds it: its
    version counter is not bumped) to ``value``."""
    _check_tensor(t, i + 1, torch.uint8)
    ctypes.c_uint8.from_address(t.data_ptr() + i).value = value


NONFINITE, TINY_BF16 = 1, 2  # the bits that codes2 and check return


def codes2(x: torch.Tensor, thresholds, out: torch.Tensor) -> int | None:
    """Packed 2-bit codes of contiguous ``x`` (``Σ_j [x > t_j]`` in fp32, element i in byte i // 4, bits 2·(i % 4))
    into the first ``ceil(n / 4)`` bytes of ``out``; returns :func:`check`'s bits of x."""
    if library() is None or x.dtype not in _DTYPES:
        return None
    x = x.contiguous()
    n = x.numel()
    _check_tensor(x, n, x.dtype)
    _check_tensor(out, (n + 3) // 4, torch.uint8)
    return codes2_trusted(x, n, thresholds, out)


def codes2_trusted(x: torch.Tensor, n: int, thresholds, out: torch.Tensor) -> int | None:
    """:func:`codes2` without its checks, for a caller that has made sure of them (contiguous CPU x of n elements of
    fp32, bf16 or fp16; contiguous CPU uint8 out of at least ``ceil(n / 4)``): a wrong tensor here is memory
    corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    t0, t1, t2 = thresholds
    return lib.lmbp_codes2(x.data_ptr(), _DTYPES[x.dtype], n, t0, t1, t2, out.data_ptr(), _threads(n))


def check(x: torch.Tensor) -> int | None:
    """Bits about contiguous ``x``: :data:`NONFINITE` if some element is NaN or ±inf, :data:`TINY_BF16` if x is
    bf16 and some element is nonzero and below 2⁻¹²⁴ in magnitude (a native bf16 activation kernel may flush its
    result to zero there); 0 if neither."""
    lib = library()
    if lib is None or x.dtype not in _DTYPES:
        return None
    x = x.contiguous()
    n = x.numel()
    _check_tensor(x, n, x.dtype)
    return lib.lmbp_check(x.data_ptr(), _DTYPES[x.dtype], n, _threads(n))


def slopes2(dy: torch.Tensor, codes: torch.Tensor, slopes: torch.Tensor, dx: torch.Tensor) -> int | None:
    """``dx = s[code] · dy`` in fp32, rounded once to dy's dtype (dx's too), with 2-bit ``codes`` and the four fp32
    ``slopes``; returns 1 if some product is NaN (its bits are ATen's for fp32 only), else 0."""
    if library() is None or dy.dtype not in _DTYPES:
        return None
    dy, codes, slopes = dy.contiguous(), codes.contiguous(), slopes.float().contiguous()
    n = dy.numel()
    _check_tensor(dy, n, dy.dtype)
    _check_tensor(codes, (n + 3) // 4, torch.uint8)
    _check_tensor(slopes, 4, torch.float32)
    _check_tensor(dx, n, dy.dtype)
    return slopes2_trusted(dy, n, codes, slopes, dx)


def slopes2_trusted(dy: torch.Tensor, n: int, codes: torch.Tensor, slopes: torch.Tensor,
                    dx: torch.Tensor) -> int | None:
    """:func:`slopes2` without its checks, for a caller that has made sure of them (contiguous CPU dy and dx of n
    elements of one dtype of fp32, bf16 and fp16; contiguous CPU uint8 codes of at least ``ceil(n / 4)``, four
    contiguous CPU fp32 slopes): a wrong tensor here is memory corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    return lib.lmbp_slopes2(dy.data_ptr(), _DTYPES[dy.dtype], codes.data_ptr(), n, slopes.data_ptr(),
                            dx.data_ptr(), _threads(n))


def quantize8(x: torch.Tensor, inner: int, groups: int, scale: torch.Tensor, beta: torch.Tensor, seed: int,
              out: torch.Tensor) -> int | None:
    """Mesa's codes ``clamp(floor((x − β[g])·scale[g] + u_i), 0, 255)`` into uint8 ``out``; returns 1 if some value
    is NaN before the clamp (its code is ATen's conversion of NaN), else 0."""
    lib = library()
    if lib is None or x.dtype not in _DTYPES:
        return None
    x, scale, beta = x.contiguous(), scale.float().contiguous(), beta.float().contiguous()
    n = x.numel()
    _check_tensor(x, n, x.dtype)
    _check_tensor(out, n, torch.uint8)
    _check_tensor(scale, groups, torch.float32)
    _check_tensor(beta, groups, torch.float32)
    return lib.lmbp_quantize8(x.data_ptr(), _DTYPES[x.dtype], n, inner, groups, scale.data_ptr(), beta.data_ptr(),
                              int(seed) & 0xFFFFFFFF, out.data_ptr(), _threads(n))


def dequantize8(codes: torch.Tensor, inner: int, groups: int, step: torch.Tensor, beta: torch.Tensor,
                out: torch.Tensor) -> int | None:
    """Mesa's ``q·step[g] + β[g]`` in fp32, rounded once to out's dtype; returns 1 if some value is NaN, else 0."""
    if library() is None or out.dtype not in _DTYPES:
        return None
    codes, step, beta = codes.contiguous(), step.float().contiguous(), beta.float().contiguous()
    n = codes.numel()
    _check_tensor(codes, n, torch.uint8)
    _check_tensor(out, n, out.dtype)
    _check_tensor(step, groups, torch.float32)
    _check_tensor(beta, groups, torch.float32)
    return dequantize8_trusted(codes, n, inner, groups, step, beta, out)


def dequantize8_trusted(codes: torch.Tensor, n: int, inner: int, groups: int, step: torch.Tensor, beta: torch.Tensor,
                        out: torch.Tensor) -> int | None:
    """:func:`dequantize8` without its checks, for a caller that has made sure of them (contiguous CPU uint8 codes
    and out of n elements, out fp32, bf16 or fp16; contiguous CPU fp32 step and β of ``groups``): a wrong tensor here
    is memory corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    return lib.lmbp_dequantize8(codes.data_ptr(), n, inner, groups, step.data_ptr(), beta.data_ptr(),
                                out.data_ptr(), _DTYPES[out.dtype], _threads(n))


PACK8_NAN, PACK8_AMBIGUOUS, PACK8_SKIPPED = 1, 2, 4  # the bits that mesa_pack8 returns
_PACK8_STACK_GROUPS = 1024  # kernels.c's PACK8_STACK_GROUPS


def mesa_pack8(x: torch.Tensor, inner: int, groups: int, alpha: torch.Tensor, beta: torch.Tensor,
               count: torch.Tensor, skipped: torch.Tensor, momentum: float, min_range: float, seed: int,
               step: torch.Tensor, beta_out: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> int | None:
    """Mesa's ``EMAQuantizer.pack`` in training mode, in one call: each group's min and max of contiguous ``x``; if
    all are finite and so is every range, the EMA update of the fp32 ``alpha`` / ``beta`` in place (the first update,
    ``count == 0``, sets them; int64 ``count`` += 1), else int64 ``skipped`` += 1; then ``step = a/255``,
    ``scale = 255/a`` for ``a = max(alpha, min_range)`` (as ATen rounds them), ``beta_out = beta`` and the codes of
    :func:`quantize8` into ``out``. Returns the :data:`PACK8_NAN` bit as quantize8's 1, :data:`PACK8_SKIPPED` if
    ``skipped > 0`` afterwards, or only :data:`PACK8_AMBIGUOUS` when a group's min or max is a zero and the group
    holds a -0.0 (ATen's reduction order picks the sign: nothing is written, the caller runs the ATen ops)."""
    if library() is None or x.dtype not in _DTYPES:
        return None
    n = x.numel()
    _check_tensor(x, n, x.dtype)
    _check_tensor(out, n, torch.uint8)
    for t in (alpha, beta, step, beta_out, scale):
        _check_tensor(t, groups, torch.float32)
    for t in (count, skipped):
        _check_tensor(t, 1, torch.int64)
    return mesa_pack8_trusted(x, n, inner, groups, alpha, beta, count, skipped, momentum, min_range, seed, step,
                              beta_out, scale, out)


def mesa_pack8_trusted(x: torch.Tensor, n: int, inner: int, groups: int, alpha: torch.Tensor, beta: torch.Tensor,
                       count: torch.Tensor, skipped: torch.Tensor, momentum: float, min_range: float, seed: int,
                       step: torch.Tensor, beta_out: torch.Tensor, scale: torch.Tensor,
                       out: torch.Tensor) -> int | None:
    """:func:`mesa_pack8` without its checks, for a caller that has made sure of them (contiguous CPU tensors: x of
    n elements of fp32, bf16 or fp16, uint8 out of n, fp32 alpha, beta, step, beta_out and scale of ``groups``, int64
    count and skipped): a wrong tensor here is memory corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    threads = _threads(n)
    work = None  # scratch for per-thread minima, maxima and flags: the kernel's stack up to 1024 groups x threads
    if groups * threads > _PACK8_STACK_GROUPS:
        work = torch.empty(2 * groups * threads + (groups * threads + 3) // 4, dtype=torch.float32)
    return lib.lmbp_mesa_pack8(x.data_ptr(), _DTYPES[x.dtype], n, inner, groups, alpha.data_ptr(), beta.data_ptr(),
                               count.data_ptr(), skipped.data_ptr(), momentum, 1.0 - momentum, min_range,
                               step.data_ptr(), beta_out.data_ptr(), scale.data_ptr(), int(seed) & 0xFFFFFFFF,
                               out.data_ptr(), None if work is None else work.data_ptr(), threads)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """fp32 ``x`` rounded to ``dtype`` as the kernels round their outputs (for the tests)."""
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    lib.lmbp_round(x.data_ptr(), x.numel(), out.data_ptr(), _DTYPES[dtype])
    return out


# ----------------------------------------------------------------------------------------------- MS-norms
# The backward of ``lowmembp.ops.ms_norm.ms_norm_bwd_cpu`` (whole, or its element-wise passes around ATen's row
# sums) and the casts of ``ms_norm_fwd_cpu``. ``threads`` is the OpenMP team (1 where the caller splits the work over
# threads itself).
def norm_prod(g: torch.Tensor, y: torch.Tensor, prod: torch.Tensor, gcopy: torch.Tensor | None = None,
              threads: int | None = None) -> bool:
    """``prod = fp32(g) * fp32(y)`` element by element (the reference's ``gf * yf``), and ``gcopy = fp32(g)``
    when given, into the first ``g.numel()`` elements of the fp32 outputs; False when the library is unavailable."""
    lib = library()
    if lib is None or g.dtype not in _DTYPES or y.dtype not in _DTYPES:
        return False
    g, y = g.contiguous(), y.contiguous()
    n = g.numel()
    _check_tensor(y, n, y.dtype)
    _check_tensor(prod, n, torch.float32)
    if gcopy is not None:
        _check_tensor(gcopy, n, torch.float32)
    lib.lmbp_norm_prod(g.data_ptr(), _DTYPES[g.dtype], y.data_ptr(), _DTYPES[y.dtype], n, prod.data_ptr(),
                       None if gcopy is None else gcopy.data_ptr(), _threads(n) if threads is None else threads)
    return True


@functools.lru_cache(maxsize=None)
def addcmul_fused() -> bool | None:
    """How this torch's CPU ``torch.addcmul(s, a, m, value=-1)`` rounds ``s − a·m`` in fp32: True if once (its
    build contracted the multiply and the add into a fused multiply-add), False if twice (product, then sum), None
    if neither or if its vectorised loop and its scalar loop (one element) differ (the C pass then does not run)."""
    s = torch.tensor([1.0, -3.0, 0.1, 7.5] * 16, dtype=torch.float32)
    a = torch.tensor([1 + 2**-12, 1 + 2**-20, 3.3, -0.7] * 16, dtype=torch.float32)
    m = torch.tensor([1 + 2**-13, 1 - 2**-21, 0.31, 10.3] * 16, dtype=torch.float32)
    exact = (s.double() - a.double() * m.double()).float()  # one rounding (the product is exact in float64)
    twice = s - a * m
    answers = set()
    for k in (1, s.numel()):  # one element: the scalar loop; 64: the vectorised loop
        got = torch.addcmul(s[:k], a[:k], m[:k], value=-1.0).view(torch.int32)
        answers.add("once" if torch.equal(got, exact[:k].view(torch.int32)) else
                    "twice" if torch.equal(got, twice[:k].view(torch.int32)) else "other")
    if len(answers) != 1 or "other" in answers:
        return None
    return answers.pop() == "once"


def norm_bwd(g: torch.Tensor, y: torch.Tensor, sgy: torch.Tensor, sg: torch.Tensor | None, rstd: torch.Tensor,
             dx: torch.Tensor, threads: int | None = None) -> int | None:
    """``dx = ((g − y·(sgy[r] / n)) − sg[r] / n)·rstd[r]`` in fp32 over the rows r of ``y``'s last dimension of n
    elements, from the fp32 row sums ``sgy`` of g·y and ``sg`` of g (None: no mean term), rounded once to dx's
    dtype: the reference's ``sum(-1).div_(n)``, ``addcmul(gf, yf, mgy, value=-1)``, ``sub_(mean)`` (ATen's CPU
    mean is its sum divided by n) and ``mul_(rstd)``, the addcmul rounded as :func:`addcmul_fused` says. Returns 1
    if some dx is NaN (its bits are ATen's only by chance), else 0; None when the library is unavailable or ATen's
    addcmul rounds neither way."""
    lib = library()
    fused = addcmul_fused()
    if lib is None or fused is None or g.dtype not in _DTYPES or y.dtype not in _DTYPES or dx.dtype not in _DTYPES:
        return None
    g, y = g.contiguous(), y.contiguous()
    n = y.shape[-1] if y.dim() else 1
    rows = y.numel() // n if n else 0
    _check_tensor(g, y.numel(), g.dtype)
    _check_tensor(dx, y.numel(), dx.dtype)
    for t in (sgy, rstd) if sg is None else (sgy, sg, rstd):
        _check_tensor(t, rows, torch.float32)
    return lib.lmbp_norm_bwd(g.data_ptr(), _DTYPES[g.dtype], y.data_ptr(), _DTYPES[y.dtype], rows, n,
                             sgy.data_ptr(), None if sg is None else sg.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                             _DTYPES[dx.dtype], int(fused), _threads(y.numel()) if threads is None else threads)


def cast(x: torch.Tensor, out: torch.Tensor, threads: int | None = None) -> int | None:
    """``out = x`` converted (fp16 / bf16 to fp32 exactly, fp32 to fp16 / bf16 rounded to nearest even; one side
    fp32) into the first ``x.numel()`` elements of ``out``. Returns 1 if some value is NaN (a rounded NaN's bits are
    ATen's only by chance), else 0; None when the library is unavailable or the pair is not one of these."""
    lib = library()
    if lib is None or x.dtype not in _DTYPES or out.dtype not in _DTYPES or \
            (x.dtype == torch.float32) == (out.dtype == torch.float32):
        return None
    x = x.contiguous()
    n = x.numel()
    _check_tensor(out, n, out.dtype)
    return lib.lmbp_cast(x.data_ptr(), _DTYPES[x.dtype], n, out.data_ptr(), _DTYPES[out.dtype],
                         _threads(n) if threads is None else threads)


def norm_bwd_passes(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, dx: torch.Tensor, prod: torch.Tensor,
                    gcopy: torch.Tensor | None, threads: int | None = None):
    """:func:`norm_prod` and :func:`norm_bwd` over row ranges of 2-D ``g``, ``y`` and ``dx`` (rows of ``y``'s last
    dimension), checked once here: returns ``(prod_rows, bwd_rows)`` where ``prod_rows(r, e)`` writes rows [r, e)'s
    products (and fp32 copies of g) to the first rows of ``prod`` (and ``gcopy``) and ``bwd_rows(r, e, sgy, sg)``
    writes their dx from those rows' fp32 sums ``sgy`` and ``sg`` (None: RMSNorm; :func:`norm_bwd`) and returns 1
    if some dx is NaN;
    None when the library is unavailable or ATen's addcmul rounds neither way (:func:`addcmul_fused`). The per-call
    cost is a ctypes call: for loops over row blocks."""
    lib = library()
    fused = addcmul_fused()
    if lib is None or fused is None or any(t.dtype not in _DTYPES for t in (g, y, dx)):
        return None
    rows, n = y.shape
    for t, dt in ((g, g.dtype), (y, y.dtype), (dx, dx.dtype)):
        _check_tensor(t, rows * n, dt)
    _check_tensor(rstd, rows, torch.float32)
    _check_tensor(prod, 0, torch.float32)
    if gcopy is not None:
        _check_tensor(gcopy, prod.numel(), torch.float32)
    cap = prod.numel() // max(n, 1)
    gd, yd, dd = _DTYPES[g.dtype], _DTYPES[y.dtype], _DTYPES[dx.dtype]
    gp, yp, dp, rp, pp = g.data_ptr(), y.data_ptr(), dx.data_ptr(), rstd.data_ptr(), prod.data_ptr()
    cp = None if gcopy is None else gcopy.data_ptr()
    gs, ys, ds = g.element_size() * n, y.element_size() * n, dx.element_size() * n
    prod_fn, bwd_fn = lib.lmbp_norm_prod, lib.lmbp_norm_bwd

    def team(k: int) -> int:
        return _threads(k * n) if threads is None else threads

    def prod_rows(r: int, e: int) -> None:
        if not 0 <= r <= e <= rows or e - r > cap:
            raise ValueError(f"rows [{r}, {e}) out of [0, {rows}) or over the buffer's {cap}")
        prod_fn(gp + r * gs, gd, yp + r * ys, yd, (e - r) * n, pp, cp, team(e - r))

    def bwd_rows(r: int, e: int, sgy: torch.Tensor, sg: torch.Tensor | None) -> int:
        if not 0 <= r <= e <= rows:
            raise ValueError(f"rows [{r}, {e}) out of [0, {rows})")
        _check_tensor(sgy, e - r, torch.float32)
        if sg is not None:
            _check_tensor(sg, e - r, torch.float32)
        return bwd_fn(gp + r * gs, gd, yp + r * ys, yd, e - r, n, sgy.data_ptr(),
                      None if sg is None else sg.data_ptr(), rp + 4 * r, dp + r * ds, dd, int(fused), team(e - r))

    return prod_rows, bwd_rows


# ATen's CPU sum of contiguous fp32 rows, as kernels.c's row_sum replicates it for each vector width
SUM_WIDTHS = (16, 8, 4)  # the lanes of ATen's Vectorized<float>: AVX-512, AVX2 and the default build, NEON
# rows whose sums the probe compares: short rows (the scalar cascade), every remainder of a vector and of four
# vectors, and rows long enough for the cascade's second and third levels (16 and 256 groups of four vectors)
_PROBE_LENGTHS = (*range(1, 70), 100, 255, 256, 257, 768, 1000, 1023, 1024, 1025, 1040, 4096, 4097, 5000,
                  11008, 16383, 16384, 16400, 20000, 32768)


def row_sums(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """The sums of the rows of contiguous 2-D fp32 ``x`` in the order of ATen's CPU ``sum`` for ``width`` lanes
    (:data:`SUM_WIDTHS`); None when the library is unavailable."""
    lib = library()
    if lib is None:
        return None
    if width not in SUM_WIDTHS or x.dim() != 2:
        raise ValueError(f"row_sums: width must be one of {SUM_WIDTHS} and x 2-D, got {width} and {x.dim()}-D")
    _check_tensor(x, x.numel(), torch.float32)
    out = torch.empty(x.shape[0], dtype=torch.float32)
    lib.lmbp_row_sums(x.data_ptr(), x.shape[0], x.shape[1], width, out.data_ptr())
    return out


@functools.lru_cache(maxsize=None)
def aten_sum_width() -> int | None:
    """The vector width (:data:`SUM_WIDTHS`) for which :func:`row_sums` gives this torch's CPU ``x.sum(-1)`` bit
    for bit on contiguous fp32 rows, probed once on rows of many lengths whose values span 60 binades (any other
    summation order gives other bits); None if no width does or the library is unavailable (the callers then keep
    ATen's sums)."""
    if library() is None:
        return None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in _PROBE_LENGTHS:  # two rows each: ATen sums a single long row on several threads in another order
        x = torch.randn(2, n, generator=gen) * torch.exp2(torch.randint(-30, 30, (2, n), generator=gen).float())
        rows.append((x, x.sum(-1)))
    for width in SUM_WIDTHS:
        if all(torch.equal(row_sums(x, width).view(torch.int32), want.view(torch.int32)) for x, want in rows):
            return width
    return None


def norm_bwd_rows(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, dx: torch.Tensor, layernorm: bool,
                  threads: int | None = None) -> int | None:
    """The MS-norms' whole backward in one call, row by row over the rows of ``y`` (its last dimension; g and dx
    hold as many elements): the reference's ``gf * yf`` (and ``gf``), their row sums in ATen's order
    (:func:`aten_sum_width`), then :func:`norm_bwd`'s dx. Returns 1 if some dx is NaN (its bits are ATen's only by
    chance), else 0; None when the library is unavailable, the rows are empty, ATen's addcmul rounds neither way
    (:func:`addcmul_fused`) or ATen's sum is not replicated (:func:`aten_sum_width`)."""
    if library() is None or any(t.dtype not in _DTYPES for t in (g, y, dx)):
        return None
    n = y.shape[-1] if y.dim() else 0
    if n == 0:
        return None
    rows = y.numel() // n
    for t in (g, y, dx):
        _check_tensor(t, rows * n, t.dtype)
    _check_tensor(rstd, rows, torch.float32)
    return norm_bwd_rows_trusted(g, y, rows, n, rstd, dx, layernorm, threads)


def norm_bwd_rows_trusted(g: torch.Tensor, y: torch.Tensor, rows: int, n: int, rstd: torch.Tensor, dx: torch.Tensor,
                          layernorm: bool, threads: int | None = None) -> int | None:
    """:func:`norm_bwd_rows` without its checks, for a caller that has made sure of them (contiguous CPU g, y and dx
    of ``rows · n > 0`` elements of fp32, bf16 or fp16, fp32 rstd of ``rows``): a wrong tensor here is memory
    corrupted, not an error."""
    lib = library()
    fused, width = addcmul_fused(), aten_sum_width()
    if lib is None or fused is None or width is None:
        return None
    team = _threads(rows * n) if threads is None else threads
    bits = lib.lmbp_norm_bwd_rows(g.data_ptr(), _DTYPES[g.dtype], y.data_ptr(), _DTYPES[y.dtype], rows, n,
                                  rstd.data_ptr(), dx.data_ptr(), _DTYPES[dx.dtype], layernorm, fused, width,
                                  max(1, min(team, rows)))
    if bits & 2:
        raise MemoryError(f"lowmembp.ops.cpu_kernels.norm_bwd_rows: no memory for a scratch row of {n} floats")
    return bits


# ATen's CPU LayerNorm forward of fp32 rows (no weight, no bias), as kernels.c's lmbp_layer_norm_fwd replicates it:
# the vector width of ATen's Welford moments (its Vectorized<float> lanes) and which of its multiply-adds the build
# fused (the LN_* bits of kernels.c), plus the output line
LN_VEC_FMA = 1  # the vector fmadd of the Welford passes and of AddMomentsVec's m2 is one rounding (FMA instructions)
LN_VEC_M1_FUSED = 2  # AddMomentsVec's m1 + c·delta contracted into a fused multiply-add
LN_ADD_M1_FUSED = 4  # the scalar AddMoments' m1 += c·delta contracted
LN_ADD_M2_FUSED = 8  # the scalar AddMoments' m2_add + (delta·delta·c)·m0 contracted
LN_TAIL_FUSED = 16  # the leftover elements' m2 += delta·(x − m1) contracted
LN_OUT_SHIFT = 5
LN_OUTPUTS = ("sub", "fma", "muladd")  # y = (x − mean)·rstd; fmaf(x, rstd, −rstd·mean); x·rstd + (−rstd·mean)
LN_WIDTHS = (16, 8, 4)
LN_FLAG_NAMES = {LN_VEC_FMA: "vec_fma", LN_VEC_M1_FUSED: "vec_m1_fused", LN_ADD_M1_FUSED: "add_m1_fused",
                 LN_ADD_M2_FUSED: "add_m2_fused", LN_TAIL_FUSED: "tail_fused"}
# rows the probe compares: every length below two vectors of 16 and past them (the scalar leftovers and the lanes),
# rows of one and several Welford chunks (counts that are not powers of two: merges that round), and rows long
# enough for the cascade's deeper levels
_LN_PROBE_LENGTHS = (*range(1, 71), 100, 255, 256, 257, 768, 1000, 1023, 1024, 1025, 4096, 4097, 5000, 11008,
                     *range(16383, 16401), 20000, 32768)
_LN_SCREEN_LENGTHS = (37, 1025, 5000, 16397)  # tried first: most wrong variants differ on one of these


def layer_norm_probe_rows(gen: torch.Generator) -> list[torch.Tensor]:
    """Fresh fp32 rows that tell the variants apart (:func:`layer_norm_variant`): for each of the probe's lengths,
    32 rows up to 70 elements, 16 up to 5000 and 4 above (the fused multiply-adds of the leftover elements and of
    the chunk merges change a row's bits only now and then), each ``(randn + randn·2^a)·2^b``: means of 1/4 to 2^10
    standard deviations, scales 2^-12 to 2^12."""
    rows = []
    for n in _LN_PROBE_LENGTHS:
        k = 32 if n <= 70 else 16 if n <= 5000 else 4
        scale = torch.exp2(torch.randint(-12, 12, (k, 1), generator=gen).float())
        rel = torch.exp2(torch.randint(-2, 10, (k, 1), generator=gen).float())
        rows.append((torch.randn(k, n, generator=gen) + torch.randn(k, 1, generator=gen) * rel) * scale)
    return rows


class LayerNormVariant(NamedTuple):
    """Which arithmetic of ATen's CPU LayerNorm forward :func:`layer_norm_fwd` replicates: ``width`` lanes
    (:data:`LN_WIDTHS`) and ``flags`` (the ``LN_*`` bits, the output line in bits 5-6: :data:`LN_OUTPUTS`)."""
    width: int
    flags: int

    def __str__(self) -> str:
        fused = [name for bit, name in LN_FLAG_NAMES.items() if self.flags & bit]
        out = LN_OUTPUTS[self.flags >> LN_OUT_SHIFT]
        return f"width {self.width}, output {out}, fused: {', '.join(fused) or 'none'}"


def layer_norm_variants() -> list[LayerNormVariant]:
    """Every variant the C replica computes, in the order the probe tries them."""
    return [LayerNormVariant(w, f | o << LN_OUT_SHIFT)
            for w in LN_WIDTHS for o in range(len(LN_OUTPUTS)) for f in range(2 * LN_TAIL_FUSED)]


def layer_norm_fwd(x: torch.Tensor, eps: float, y: torch.Tensor, rstd: torch.Tensor, threads: int | None = None,
                   variant: LayerNormVariant | None = None) -> int | None:
    """ATen's CPU ``native_layer_norm(x.float(), [n], None, None, eps)`` of the rows of contiguous ``x`` (its last
    dimension, n elements; fp32, bf16 or fp16, converted exactly) in one call: fp32 ``rstd`` (one per row) and ``y``
    (as many elements as x) rounded once to its dtype (the reference's ``y.to(dtype)``), with the arithmetic of
    ``variant`` (default: the one :func:`layer_norm_variant` finds for this torch). Returns 1 if some y or rstd is
    NaN (its bits are ATen's only by chance: the caller recomputes), else 0; None when the library is unavailable, no
    variant replicates this torch's LayerNorm, or the rows are empty."""
    if library() is None or x.dtype not in _DTYPES or y.dtype not in _DTYPES:
        return None
    if x.dim() == 0:
        raise ValueError("layer_norm_fwd: x must have at least 1 dimension (its rows are the last), got a 0-d tensor")
    n = x.shape[-1]
    if n == 0:
        return None
    rows = x.numel() // n
    _check_tensor(x, rows * n, x.dtype)
    _check_tensor(y, rows * n, y.dtype)
    _check_tensor(rstd, rows, torch.float32)
    return layer_norm_fwd_trusted(x, rows, n, eps, y, rstd, threads, variant)


def layer_norm_fwd_trusted(x: torch.Tensor, rows: int, n: int, eps: float, y: torch.Tensor, rstd: torch.Tensor,
                           threads: int | None = None, variant: LayerNormVariant | None = None) -> int | None:
    """:func:`layer_norm_fwd` without its checks, for a caller that has made sure of them (contiguous CPU x and y of
    ``rows · n > 0`` elements of fp32, bf16 or fp16, fp32 rstd of ``rows``): a wrong tensor here is memory
    corrupted, not an error."""
    lib = library()
    if lib is None:
        return None
    if variant is None:
        variant = layer_norm_variant()
        if variant is None:
            return None
    team = _threads(rows * n) if threads is None else threads
    bits = lib.lmbp_layer_norm_fwd(x.data_ptr(), _DTYPES[x.dtype], rows, n, eps, y.data_ptr(), _DTYPES[y.dtype],
                                   rstd.data_ptr(), variant.width, variant.flags, max(1, min(team, rows)))
    if bits < 0:
        raise ValueError(f"layer_norm_fwd: not a variant of the C replica: {variant!r}")
    return bits


@functools.lru_cache(maxsize=None)
def layer_norm_variant() -> LayerNormVariant | None:
    """The variant (:func:`layer_norm_variants`) for which :func:`layer_norm_fwd` gives this torch's CPU
    ``torch.native_layer_norm`` y and rstd bit for bit on contiguous fp32 rows without weight and bias, probed once on
    rows of many lengths whose values have varied means and scales (:func:`layer_norm_probe_rows`: on them every
    variant gives other bits); the first that matches, None if none does or the library is unavailable (the callers
    then keep ATen's fp32 norm)."""
    if library() is None:
        return None
    cases = {}
    for x in layer_norm_probe_rows(torch.Generator().manual_seed(0)):
        y, _, r = torch.native_layer_norm(x, x.shape[-1:], None, None, 1e-5)
        cases[x.shape[-1]] = (x, y.view(torch.int32), r.reshape(-1).view(torch.int32))
    order = [*_LN_SCREEN_LENGTHS, *(n for n in _LN_PROBE_LENGTHS if n not in _LN_SCREEN_LENGTHS)]

    def matches(variant: LayerNormVariant) -> bool:
        for n in order:
            x, want_y, want_r = cases[n]
            y, r = torch.empty_like(x), torch.empty(x.shape[0])
            if layer_norm_fwd(x, 1e-5, y, r, threads=1, variant=variant) != 0 or \
                    not torch.equal(y.view(torch.int32), want_y) or not torch.equal(r.view(torch.int32), want_r):
                return False
        return True

    return next((v for v in layer_norm_variants() if matches(v)), None)
