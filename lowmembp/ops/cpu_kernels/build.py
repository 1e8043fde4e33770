"""The build of the CPU kernels: compile ``kernels.c`` on first use, cache the shared library, load it with ctypes.

The first call of :func:`library` compiles the source with the system C compiler (``$CC``, else the first of
:data:`COMPILERS` on the ``PATH``) into a shared library cached under :func:`lowmembp.cache.cache_dir` (named by a
hash of the source, the flags, the compiler and the CPU, so another machine sharing the folder builds its own); later
calls and later processes load the cached file. The build takes a few seconds, once (:func:`build_info` says how
long); it writes a temporary file and renames it into place, so processes building at the same time each load a
complete library. ``LOWMEMBP_CPU_KERNELS=0`` (read when this module is imported) turns the kernels off; without a
compiler, or if the build fails, a RuntimeWarning says so once per process and :func:`library` returns None. Also the
calling convention the wrappers share: the dtype codes, the tensor checks and the OpenMP team size.
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

import torch

from lowmembp.cache import cache_dir

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


class Unavailable(Exception):
    """A native part is unavailable for a reason already said (by another part's warning, or a switch set on
    purpose): :func:`build_once` records it without a warning of its own."""


def find_compiler(env: str, names: tuple[str, ...]) -> str | None:
    """A compiler's path: ``$env`` if set (its first word), else the first of ``names`` on the ``PATH``; None if
    there is none."""
    given = os.environ.get(env, "").strip()
    if given:
        return shutil.which(shlex.split(given)[0])
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def compiler() -> str | None:
    """The C compiler's path: ``$CC`` if set (its first word), else the first of :data:`COMPILERS` found; None if
    there is none."""
    return find_compiler("CC", COMPILERS)


def build_once(state: dict, lock: threading.Lock, key: str, make, what: str, instead: str, switch: str):
    """``state[key]``, made by ``make() -> (value, path)`` on the first call in this process (under ``lock``; the
    callers' fast path reads ``state["tried"]`` first). A failure is recorded in ``state["reason"]`` and, unless
    it is :class:`Unavailable`, warned once (RuntimeWarning: ``what`` is not available, ``instead`` runs, ``switch``
    =0 skips the build); the value is then None."""
    with lock:
        if not state["tried"]:
            try:
                state[key], state["path"] = make()
            except Unavailable as e:
                state["reason"] = str(e)
            except Exception as e:  # no compiler or headers, a failed build, an unloadable file
                state["reason"] = str(e)
                warnings.warn(f"lowmembp: {what} not available ({e}); {instead} (the same results, slower). Set "
                              f"{switch}=0 to skip the build.", RuntimeWarning, stacklevel=4)
            state["tried"] = True
    return state[key]


def build_info_of(state: dict) -> dict:
    """``{"path", "compiles", "seconds", "reason"}`` of a native part's ``state`` (:func:`build_once`)."""
    return {k: state[k] for k in ("path", "compiles", "seconds", "reason")}


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
    return build_once(_state, _lock, "lib", _load, "the CPU fast path's C kernels are",
                      "its eager ATen ops run instead", ENV_SWITCH)


def _load():
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler found ($CC or one of {', '.join(COMPILERS)} on the PATH)")
    path = _build(cache_dir() / "cpu_kernels", cc)
    return _declare(ctypes.CDLL(str(path))), path


def build_info() -> dict:
    """``{"path", "compiles", "seconds", "reason"}``: the loaded library's file, the builds this process ran and the
    last one's wall time, and why the kernels are unavailable (None when they are)."""
    return build_info_of(_state)


def _reset() -> None:
    """Forget the loaded library (tests): the next :func:`library` call looks for it, or builds it, again."""
    with _lock:
        _state.update(lib=None, tried=False, path=None, reason=None)


def _threads(n: int) -> int:
    if n < 2 * MIN_PER_THREAD:  # one thread (without asking torch how many it has)
        return 1
    return max(1, min(torch.get_num_threads(), n // MIN_PER_THREAD))


def _check_tensor(t: torch.Tensor, at_least: int, dtype: torch.dtype) -> None:  # inputs too (their device)
    """A tensor the kernel reads or writes by its data pointer: contiguous, on the CPU, of ``dtype``, big enough."""
    if not (t.is_cpu and t.is_contiguous() and t.dtype is dtype and t.numel() >= at_least):
        raise ValueError(f"lowmembp.ops.cpu_kernels: expected a contiguous CPU {dtype} tensor of at least "
                         f"{at_least} elements, got {t.dtype} of shape {tuple(t.shape)} on {t.device} "
                         f"(contiguous: {t.is_contiguous()})")


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """fp32 ``x`` rounded to ``dtype`` as the kernels round their outputs (for the tests)."""
    lib = library()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    lib.lmbp_round(x.data_ptr(), x.numel(), out.data_ptr(), _DTYPES[dtype])
    return out
