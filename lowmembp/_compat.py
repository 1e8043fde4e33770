"""The one place where lowmembp uses torch's private names.

Every name of torch's that is not public API (``torch._C``, ``torch._subclasses``, ``torch._prims_common``,
``torch._dynamo``, ``torch._functorch``, ``torch._inductor``, ``torch._guards``, ``torch.utils._python_dispatch``,
``torch.utils._pytree``, private aten ops) is looked up here and nowhere else in the library
(``tests/test_compat.py`` scans the package for them). Each entry detects the feature it needs (``hasattr``, a
try-import, an op's schema), never the version string, and where the feature is missing falls back to a public path
that gives the same result, or raises an error that says what is missing.

Lookups that import more of torch are functions (cached), so importing this module imports nothing beyond ``torch``.
Class-like names (:data:`TorchDispatchMode`, :data:`FakeTensorMode`, :data:`FakeTensor`, :func:`tree_flatten`,
:func:`tree_leaves`) are module attributes resolved on first access (PEP 562).

The fake-tensor fast path of :mod:`lowmembp.estimator.fake_mode` needs more of ``FakeTensorMode``'s internals than any
other
part: :func:`fast_fake_internals` gathers them and checks that they behave as that path expects; where they do not
(or where the environment variable ``LOWMEMBP_FAST_FAKE`` is ``0``) the fast path switches itself off and torch's own
``FakeTensorMode`` does the work, giving the same estimates, slower.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import os
import types

import torch

# The first six names come from the module's __getattr__ (loaded on first use), hence F822.
__all__ = ["TorchDispatchMode", "FakeTensorMode", "FakeTensor", "tree_flatten", "tree_leaves",  # noqa: F822
           "storage_key",  # noqa: F822
           "current_graph_task_id", "fused_rms_norm", "is_non_overlapping_and_dense", "is_fake", "detect_fake_mode",
           "unset_fake_temporarily", "top_saved_tensors_hooks", "functorch_unwrap_grad_tracking", "forward_ad_active",
           "dispatch_mode_active", "is_functorch_wrapped", "cuda_raw_stream", "cuda_current_device",
           "triton_compiled_launcher",
           "lookup_backend", "list_backends", "is_optimized_module", "functorch_config", "reset_compiler",
           "aot_autograd", "inductor_decompositions", "fast_fake_enabled", "fast_fake_internals", "FAST_FAKE_ENV"]

FAST_FAKE_ENV = "LOWMEMBP_FAST_FAKE"

#: a storage's identity while it lives (``StorageWeakRef(storage).cdata``): ``storage_key(t.untyped_storage())``
storage_key = operator.attrgetter("_cdata")


def __getattr__(name: str):
    """The class-like names, imported on first access."""
    if name == "TorchDispatchMode":
        from torch.utils._python_dispatch import TorchDispatchMode
        return TorchDispatchMode
    if name in ("FakeTensorMode", "FakeTensor"):
        from torch._subclasses import fake_tensor
        return getattr(fake_tensor, name)
    if name in ("tree_flatten", "tree_leaves"):
        return getattr(_pytree(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _pytree():
    """torch's pytree module: the public ``torch.utils.pytree`` where it exists, else the private one."""
    try:
        import torch.utils.pytree as pytree
        if hasattr(pytree, "tree_flatten") and hasattr(pytree, "tree_leaves"):
            return pytree
    except ImportError:
        pass
    import torch.utils._pytree as pytree
    return pytree


# ------------------------------------------------------------------------------------------------------------ nn
def batch_norm_types(fast: bool = True) -> tuple[type, ...]:
    """Classes every batch norm module is an instance of: torch's base ``_BatchNorm`` where it exists, else the
    public batch norm classes (``fast=False``: those always)."""
    base = getattr(torch.nn.modules.batchnorm, "_BatchNorm", None)
    if fast and base is not None:
        return (base,)
    nn = torch.nn
    return tuple(c for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                             getattr(nn, "LazyBatchNorm1d", None), getattr(nn, "LazyBatchNorm2d", None),
                             getattr(nn, "LazyBatchNorm3d", None)) if c is not None)


def conv_types(fast: bool = True) -> tuple[type, ...]:
    """Classes every convolution module is an instance of: torch's base ``_ConvNd`` where it exists, else the
    public convolution classes (``fast=False``: those always)."""
    base = getattr(torch.nn.modules.conv, "_ConvNd", None)
    if fast and base is not None:
        return (base,)
    nn = torch.nn
    return tuple(getattr(nn, f"{lazy}Conv{t}{d}d") for lazy in ("", "Lazy") for t in ("", "Transpose")
                 for d in (1, 2, 3) if hasattr(nn, f"{lazy}Conv{t}{d}d"))


# ---------------------------------------------------------------------------------------------------------- autograd
def current_graph_task_id() -> int:
    """The id of the backward pass the autograd engine is running on this thread, -1 outside one."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    if get is None:
        raise RuntimeError("lowmembp's peak tracker needs torch._C._current_graph_task_id (torch >= 1.13); "
                           "upgrade torch")
    return get()


def top_saved_tensors_hooks():
    """The innermost ``torch.autograd.graph.saved_tensors_hooks`` pair in force ``(pack, unpack)``, or None."""
    autograd = getattr(torch._C, "_autograd", None)
    get = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    if get is None:
        raise RuntimeError("the offload method needs torch._C._autograd._top_saved_tensors_default_hooks; "
                           "upgrade torch")
    return get(False)


# ------------------------------------------------------------------------------------------------------------- ops
@functools.cache
def fused_rms_norm_takes_shape() -> bool:
    """True where ``torch._fused_rms_norm(x, normalized_shape: int[], weight, eps)`` exists (torch >= 2.9; torch 2.8
    has the op with ``normalized_shape_ndim: int`` and no CPU kernel)."""
    if not hasattr(torch, "_fused_rms_norm"):
        return False
    try:
        schema = torch.ops.aten._fused_rms_norm.default._schema
        arg = schema.arguments[1]
        return arg.name == "normalized_shape" and isinstance(arg.type, torch.ListType)
    except Exception:
        return False


def fused_rms_norm(x: torch.Tensor, eps: float, fast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim without weight: ``(y, rstd)``, ``rstd`` of shape ``[..., 1]``, in ``x``'s dtype.

    torch's fused kernel where it has the signature expected (``fast``: None detects, False forces the math below);
    else ``rstd = rsqrt(mean(x²) + eps)``, ``y = x * rstd`` (the same formula, ~1 ulp apart)."""
    if fast is None:
        fast = fused_rms_norm_takes_shape()
    if fast:
        y, rstd = torch._fused_rms_norm(x, [x.shape[-1]], None, eps)
        return y, rstd.reshape(*x.shape[:-1], 1)
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x * rstd, rstd


def is_non_overlapping_and_dense(t: torch.Tensor, fast: bool | None = None) -> bool:
    """True when ``t``'s elements fill its storage span exactly once in some order of its dims (what
    ``torch.empty_like`` keeps the strides of). torch's own check where it exists (``fast=False``: the math)."""
    if fast is None or fast:
        try:
            from torch._prims_common import is_non_overlapping_and_dense_or_false as check
        except ImportError:
            try:
                from torch._prims_common import is_non_overlapping_and_dense as check
            except ImportError:
                check = None
        if check is not None:
            return bool(check(t))
        if fast:
            raise RuntimeError("torch._prims_common has no is_non_overlapping_and_dense here")
    if t.is_sparse or t.layout != torch.strided:
        return False
    if t.dim() == 0:
        return True
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


# ------------------------------------------------------------------------------------------------------ fake tensors
def is_fake(t: torch.Tensor) -> bool:
    """True for a ``FakeTensor`` (also one wrapped by a functorch transform)."""
    try:
        from torch._subclasses.fake_tensor import is_fake as check
    except ImportError:
        return type(t).__name__ == "FakeTensor"
    return bool(check(t))


def detect_fake_mode(*tensors):
    """The fake mode in force (or of ``tensors``), or None: torch's ``detect_fake_mode``."""
    try:
        from torch._guards import detect_fake_mode as detect
    except ImportError:
        detect = None
    if detect is not None:
        return detect(tensors) if tensors else detect()
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = torch.utils._python_dispatch._get_current_dispatch_mode()
    if isinstance(mode, FakeTensorMode):
        return mode
    return next((t.fake_mode for t in tensors if hasattr(t, "fake_mode")), None)


def unset_fake_temporarily():
    """A context in which no ``FakeTensorMode`` is in force (real tensors can be made and read)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily as unset
    except ImportError:
        return contextlib.nullcontext()
    return unset()


# ---------------------------------------------------------------------------------------------------------- functorch
def functorch_unwrap_grad_tracking(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(innermost tensor, whether a grad-tracking level wraps it)`` of a tensor inside ``torch.func`` transforms."""
    ft = getattr(torch._C, "_functorch", None)
    if ft is None or not hasattr(ft, "is_functorch_wrapped_tensor"):
        return t, False
    grad = False
    while ft.is_functorch_wrapped_tensor(t):
        grad = grad or ft.is_gradtrackingtensor(t)
        if grad:
            return t, True
        t = ft.get_unwrapped(t)
    return t, grad


def _forward_ad_level():
    fad = torch.autograd.forward_ad
    return (lambda: fad._current_level >= 0) if hasattr(fad, "_current_level") else (lambda: True)


#: Whether a ``torch.autograd.forward_ad.dual_level`` is entered (only then can a tensor carry a tangent):
#: ``forward_ad``'s current level; True (assume one may be) where this torch has no such attribute.
forward_ad_active = _forward_ad_level()


def _dispatch_stack():
    stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return (lambda: True) if stack_len is None else (lambda: stack_len() > 0)


#: Whether a ``TorchDispatchMode`` (a memory tracker, a FLOP counter, a fake mode) is in force: the length of torch's
#: Python dispatch-mode stack; True (assume one may be: the caller then takes its always-correct path) where this
#: torch has no such function. Resolved once: the ops call it on every eager call.
dispatch_mode_active = _dispatch_stack()


def _functorch_wrapped():
    ft = getattr(torch._C, "_functorch", None)
    probe = getattr(ft, "is_functorch_wrapped_tensor", None)
    return probe if probe is not None else (lambda t: False)


#: Whether ``t`` is a ``torch.func`` wrapper (vmap's batched or grad's tracking tensor): False where this torch has
#: no functorch (no such wrappers then exist).
is_functorch_wrapped = _functorch_wrapped()


# ------------------------------------------------------------------------------------------------------ CUDA / Triton
def _cuda_probes():
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    dev = getattr(torch._C, "_cuda_getDevice", None)
    return (raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream),
            dev if dev is not None else torch.cuda.current_device)


#: ``cuda_raw_stream(index)``: the current CUDA stream of device ``index`` as the integer handle a kernel launch takes
#: (torch's C getter; the public ``torch.cuda.current_stream(index).cuda_stream`` where it is missing).
#: ``cuda_current_device()``: the current CUDA device's index.
cuda_raw_stream, cuda_current_device = _cuda_probes()


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed: a function, or a non-empty chain (Triton 3.6+'s ``HookChain``)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def triton_compiled_launcher(compiled):
    """A function ``launch(grid0, grid1, grid2, stream, *args)`` that starts Triton's compiled kernel ``compiled`` (what
    ``kernel[grid](...)`` returns) directly, ``args`` being every parameter of the kernel in order, constexprs
    included: the launch ``JITFunction.run`` makes after its binding, specialisation and cache lookup, which the
    caller has done once for this signature. While a launch hook is installed (a profiler such as proton) the launch
    goes through the compiled kernel's public ``compiled[grid](*args)``, which calls the hooks. None where this
    Triton's ``CompiledKernel`` lacks the pieces (``run``, ``function``, ``packed_metadata``): the caller then keeps
    the ordinary launch."""
    try:
        from triton import knobs

        hooks = knobs.runtime
        run = compiled.run  # loads the binary on first access
        function, metadata = compiled.function, compiled.packed_metadata
    except Exception:  # another Triton: the ordinary launch
        return None
    if not callable(run) or function is None:
        return None

    def launch(grid0, grid1, grid2, stream, *args):
        if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            compiled[(grid0, grid1, grid2)](*args, stream=stream)
        else:
            run(grid0, grid1, grid2, stream, function, metadata, None, None, None, *args)

    return launch


# ---------------------------------------------------------------------------------------------------------- compiler
def lookup_backend(name: str):
    """The ``torch.compile`` backend callable registered under ``name`` (KeyError-like failure if unknown)."""
    import torch._dynamo
    return torch._dynamo.lookup_backend(name)


def list_backends() -> list[str]:
    """The ``torch.compile`` backend names."""
    return list(torch.compiler.list_backends())


def is_optimized_module(m) -> bool:
    """True for a ``torch.compile(module)`` wrapper (dynamo's ``OptimizedModule``)."""
    mod = __import__("sys").modules.get("torch._dynamo.eval_frame")
    if mod is None:  # nothing has been compiled in this process: no wrapper can exist
        return False
    return isinstance(m, mod.OptimizedModule)


def functorch_config():
    """``torch._functorch.config`` (``activation_memory_budget``, ``patch``)."""
    import torch._functorch.config as config
    return config


def reset_compiler() -> None:
    """Forget every compiled graph (``torch.compiler.reset``)."""
    torch.compiler.reset()


def aot_autograd(**kwargs):
    """Dynamo's ``aot_autograd`` backend factory."""
    from torch._dynamo.backends.common import aot_autograd as make
    return make(**kwargs)


def inductor_decompositions():
    """Inductor's decomposition table (what ``aot_eager_decomp_partition`` traces with)."""
    from torch._inductor.compile_fx import select_decomp_table
    return select_decomp_table()


# ------------------------------------------------------------------------------------------- the fake-mode fast path
def fast_fake_enabled() -> bool:
    """True when :mod:`lowmembp.estimator.fake_mode`'s fast path is to be used: not switched off by
    ``LOWMEMBP_FAST_FAKE=0`` and torch's fake-tensor internals are the ones it was written for
    (:func:`fast_fake_internals`)."""
    if os.environ.get(FAST_FAKE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return fast_fake_internals() is not None


@functools.cache
def fast_fake_internals() -> types.SimpleNamespace | None:
    """The private pieces of ``FakeTensorMode`` the fast path uses, or None where any is missing or behaves
    differently (a probe builds one fake tensor both ways and compares)."""
    try:
        return _probe_fast_fake()
    except Exception:
        return None


def _probe_fast_fake() -> types.SimpleNamespace | None:
    import dataclasses

    from torch._subclasses import fake_tensor as ft
    C = torch._C
    ns = types.SimpleNamespace(
        FakeTensor=ft.FakeTensor, FakeTensorMode=ft.FakeTensorMode, FakeTensorConfig=ft.FakeTensorConfig,
        BypassDispatchCache=ft._BypassDispatchCache, CacheKeyState=ft._CacheKeyState,
        DispatchCacheValidEntry=ft._DispatchCacheValidEntry,
        answer_device=ft._DISPATCH_META_HANDLERS[torch.ops.prim.device.default],
        UNSAFE_VIEW=torch.ops.aten._unsafe_view.default, PROXY=C._TorchDispatchModeKey.PROXY,
        get_dispatch_mode=C._get_dispatch_mode,
        get_dispatch_mode_pre_dispatch=torch._ops._get_dispatch_mode_pre_dispatch,
        get_default_device=C._get_default_device, DisableTorchDispatch=C._DisableTorchDispatch,
        set_conj=C._set_conj, set_neg=C._set_neg, set_throw_on_mutable_data_ptr=C._set_throw_on_mutable_data_ptr,
        set_warn_deprecated_on_mutable_data_ptr=C._set_warn_deprecated_on_mutable_data_ptr,
        make_subclass=torch.Tensor._make_subclass)
    if {f.name for f in dataclasses.fields(ns.DispatchCacheValidEntry)} < {"output_infos", "is_output_tuple"}:
        return None
    info = ft._DispatchCacheEntryOutputInfo
    if {f.name for f in dataclasses.fields(info)} < {"inplace_idx", "metadata", "view_idx", "constant_value"}:
        return None
    mode_cls = ns.FakeTensorMode
    for attr in ("_prep_args_for_hash", "_cache_key", "cache"):
        if not hasattr(mode_cls, attr):
            return None
    import inspect
    if list(inspect.signature(mode_cls._prep_args_for_hash).parameters)[:3] != ["self", "result", "args"] \
            or list(inspect.signature(mode_cls._cache_key).parameters) != ["self", "state", "func", "args", "kwargs"]:
        return None
    # one fake tensor made as torch makes it and as the fast path does: the same class, device and attributes
    mode = mode_cls()
    for attr in ("cache_enabled", "cache_crosscheck_enabled", "shape_env", "_allow_unsafe_data_ptr_access"):
        if not hasattr(mode, attr):
            return None
    elem = torch.empty_strided((2, 3), (3, 1), device="meta")
    ref = ns.FakeTensor(mode, elem, torch.device("cpu"))
    attrs = vars(ref)
    if "_fake_device" not in attrs or not hasattr(ref, "fake_mode") or not hasattr(ref, "constant") \
            or not hasattr(ref, "_has_symbolic_sizes_strides"):
        return None
    made = ns.make_subclass(ns.FakeTensor, elem, False, dispatch_device=True,
                            device_for_backend_keys=torch.device("cpu"))
    made.__dict__.update(attrs)
    if made.device != ref.device or made.fake_device != ref.fake_device or made.fake_mode is not mode:
        return None
    return ns
