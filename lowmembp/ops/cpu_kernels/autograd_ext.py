"""The C++ autograd extension of the CPU fast path (``autograd.cpp``): compiled on first use, cached, imported.

:func:`extension` compiles the source with the system C++ compiler (``$CXX``, else the first of :data:`COMPILERS`)
against this torch's headers and libraries (no ninja, no ``torch.utils.cpp_extension.load``), into a module cached
under :func:`lowmembp.cache.cache_dir` named by a hash of the source, torch's version and folder, the C++ ABI flag,
the Python extension suffix, the compiler and the flags; later calls and processes import the cached file (about a
millisecond). The build takes tens of seconds, once; it writes a temporary file and renames it into place, under a
file lock so that parallel test workers build it once. The module gets kernels.c's functions
(:func:`lowmembp.ops.cpu_kernels.library`) as addresses. ``LOWMEMBP_CPU_EXT=0`` (read at import) turns it off; a
missing compiler or Python header, a failed build or import warn once (RuntimeWarning) and :func:`extension` returns
None: the callers then run their Python route, which gives the same bits. Never built at ``import lowmembp``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sysconfig
import threading
import time
from pathlib import Path

import torch

from lowmembp.cache import cache_dir
from lowmembp.ops.cpu_kernels import build as _kernels

ENV_SWITCH = "LOWMEMBP_CPU_EXT"  # "0" turns the C++ extension off (the Python route runs instead)
COMPILERS = ("c++", "g++", "clang++")  # tried in this order when $CXX is not set
SOURCE = Path(__file__).with_name("autograd.cpp")
MODULE = "lowmembp_cpu_ext"  # the module's name (PyInit_<MODULE>); the file is named by its hash
# bit-exact IEEE fp32 as kernels.c (the activations themselves are ATen's calls, compiled in torch)
FLAGS = ("-O2", "-fPIC", "-shared", "-std=c++20", "-ffp-contract=off", "-fno-fast-math", "-w",
         f"-DTORCH_EXTENSION_NAME={MODULE}", "-DTORCH_API_INCLUDE_EXTENSION_H")
LIBS = ("c10", "torch", "torch_cpu", "torch_python")

_OFF = os.environ.get(ENV_SWITCH, "1").strip() == "0"  # read once, at import (tests set _OFF itself)
_lock = threading.Lock()
_state: dict = {"ext": None, "tried": False, "compiles": 0, "seconds": None, "path": None, "reason": None}


def compiler() -> str | None:
    """The C++ compiler's path: ``$CXX`` if set (its first word), else the first of :data:`COMPILERS` found."""
    return _kernels.find_compiler("CXX", COMPILERS)


def _flags() -> tuple[str, ...]:
    """The flags: :data:`FLAGS`, the C++ ABI torch was built with, torch's and Python's headers, torch's libraries."""
    torch_dir = Path(torch.__file__).resolve().parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    return (*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            *(f"-I{p}" for p in includes), f"-I{sysconfig.get_paths()['include']}", f"-L{torch_dir / 'lib'}",
            f"-Wl,-rpath,{torch_dir / 'lib'}", *(f"-l{name}" for name in LIBS))


def _module_path(folder: Path, cxx: str, flags: tuple) -> Path:
    st = os.stat(cxx)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__, str(torch.compiled_with_cxx11_abi()),
                 sysconfig.get_config_var("EXT_SUFFIX") or "", os.path.realpath(cxx), f"{st.st_size}:{st.st_mtime_ns}",
                 " ".join(flags), platform.platform()):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return folder / f"autograd-{key.hexdigest()[:20]}{suffix}"


class _FileLock:
    """An exclusive lock on ``path`` (fcntl; no lock where fcntl is missing: the rename still keeps files whole)."""

    def __init__(self, path: Path):
        self.path, self.fh = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return self
        self.fh = open(self.path, "a")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fh is not None:
            self.fh.close()  # closing releases the lock


def _build(folder: Path, cxx: str) -> Path:
    """The cached module for this source, torch, Python and compiler, compiled now if it is not there yet."""
    import subprocess
    import tempfile

    flags = _flags()
    path = _module_path(folder, cxx, flags)
    if path.is_file():
        return path
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        raise RuntimeError(f"no Python headers (Python.h) under {sysconfig.get_paths()['include']}")
    folder.mkdir(parents=True, exist_ok=True)
    with _FileLock(path.with_name(path.name + ".lock")):
        if path.is_file():  # another process built it while this one waited
            return path
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            start = time.perf_counter()
            done = subprocess.run([cxx, str(SOURCE), "-o", tmp, *flags], capture_output=True, text=True)
            if done.returncode != 0:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or [done.stderr.strip()]
                raise RuntimeError(f"{cxx} failed: {' '.join(errors[:3])[:600]}")
            os.replace(tmp, path)  # atomic: a reader sees no file or a whole one
            _state["compiles"] += 1
            _state["seconds"] = time.perf_counter() - start
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def _import(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def extension():
    """The loaded extension with kernels.c's functions handed over, built on first use; None when turned off
    (``LOWMEMBP_CPU_EXT=0``), when kernels.c is unavailable (its own warning says why) or when the extension cannot
    be built or imported (warned once per process)."""
    if _OFF:
        return None
    if _state["tried"]:
        return _state["ext"]
    return _kernels.build_once(_state, _lock, "ext", _load, "the CPU fast path's C++ autograd extension is",
                               "the Python route runs instead", ENV_SWITCH)


def _load():
    lib = _kernels.library()
    if lib is None:  # already warned (or turned off on purpose)
        raise _kernels.Unavailable(f"kernels.c unavailable: "
                                   f"{_kernels.build_info()['reason'] or f'{_kernels.ENV_SWITCH}=0'}")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found ($CXX or one of {', '.join(COMPILERS)} on the PATH)")
    path = _build(cache_dir() / "cpu_kernels", cxx)
    ext = _import(path)
    ext.set_kernels(_address(lib.lmbp_codes2), _address(lib.lmbp_slopes2), _address(lib.lmbp_check))
    ext.set_norm_kernels(_address(lib.lmbp_layer_norm_fwd), _address(lib.lmbp_norm_bwd_rows))
    return ext, path


def extension_info() -> dict:
    """``{"path", "compiles", "seconds", "reason"}``: the loaded module's file, the builds this process ran and the
    last one's wall time, and why the extension is unavailable (None when it is)."""
    return _kernels.build_info_of(_state)


def _reset() -> None:
    """Forget the loaded extension (tests): the next :func:`extension` call imports, or builds, it again."""
    with _lock:
        _state.update(ext=None, tried=False, path=None, reason=None)
