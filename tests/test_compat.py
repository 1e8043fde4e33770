"""lowmembp._compat: the one module through which the library uses torch's private names.

- No other library module names a private torch name (an AST scan of every ``lowmembp/**/*.py``).
- Each fallback (the public path taken where torch lacks the private feature) gives what the private path gives:
  the branch is forced and compared with the fast one on fresh random inputs.
- The fake-tensor fast path switched off (``LOWMEMBP_FAST_FAKE=0``, or internals other than expected) gives the
  same estimates and plan rows to the byte, and torch's own ``FakeTensorMode`` does the work then.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from lowmembp import _compat

ROOT = pathlib.Path(__file__).resolve().parents[1] / "lowmembp"
# attributes of tensors / storages that are torch internals although not reached through the ``torch`` module
PRIVATE_ATTRS = {"_cdata", "_make_subclass", "_make_wrapper_subclass", "_fused_rms_norm"}


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private torch name in ``source``: imports of / from ``torch._*`` modules or of ``_*``
    names from torch modules, ``torch.<...>._x`` attribute chains (``torch.ops.aten._op`` included), ``getattr`` /
    ``importlib.import_module`` of such names, and the tensor internals in :data:`PRIVATE_ATTRS`."""
    found = []
    aliases = {"torch"}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _private(a.name):
                    found.append((node.lineno, a.name))
                elif a.name == "torch" or a.name.startswith("torch."):
                    aliases.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _private(node.module):
                found.append((node.lineno, node.module))
            elif node.module.split(".")[0] == "torch":
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None:
                root, _, rest = dotted.partition(".")
                if root in aliases and _private("torch." + rest):
                    found.append((node.lineno, dotted))
                    continue
            if node.attr in PRIVATE_ATTRS:
                found.append((node.lineno, "." + node.attr))
        elif isinstance(node, ast.Call) and node.args:
            fn = _dotted(node.func)
            if fn in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
                obj, arg = _dotted(node.args[0]) or "", getattr(node.args[1], "value", None)
                if obj.split(".")[0] in aliases and isinstance(arg, str) and _private(f"torch.{arg}"):
                    found.append((node.lineno, f"{obj}.{arg}"))
            elif fn in ("importlib.import_module", "import_module", "__import__"):
                arg = getattr(node.args[0], "value", None)
                if isinstance(arg, str) and _private(arg):
                    found.append((node.lineno, arg))
    # an Attribute chain is walked at every level: keep the longest name per line and root
    found = sorted(set(found))
    return [(ln, n) for ln, n in found if not any(o != n and o.startswith(n + ".") and ol == ln for ol, o in found)]


def test_the_scan_finds_each_kind_of_private_name():
    src = """
import torch
import torch._dynamo
import torch.utils._pytree as pt
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import _checkpoint_without_reentrant
import torch as T
x = torch._C._get_default_device()
y = torch.ops.aten._unsafe_view.default
z = T._foo
w = storage._cdata
v = getattr(torch, "_fused_rms_norm", None)
u = importlib.import_module("torch._inductor.config")
ok = torch.nn.functional.rms_norm
also_ok = torch.Tensor.__dict__
"""
    names = {n for _, n in private_torch_names(src)}
    assert names == {"torch._dynamo", "torch.utils._pytree", "torch._subclasses.fake_tensor",
                     "torch.utils.checkpoint._checkpoint_without_reentrant", "torch._C._get_default_device",
                     "torch.ops.aten._unsafe_view.default", "T._foo", "._cdata", "torch._fused_rms_norm",
                     "torch._inductor.config"}, names


def test_no_private_torch_name_outside_compat():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "_compat.py" and path.parent == ROOT:
            continue
        for line, name in private_torch_names(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT.parent)}:{line}: {name}")
    assert not offenders, (
        "private torch names used outside lowmembp/_compat.py:\n  " + "\n  ".join(offenders) + "\n"
        "Add an entry to lowmembp/_compat.py that detects the feature (hasattr, a try-import, the op's schema; never "
        "the version string) and falls back to a public path giving the same result, test that fallback in "
        "tests/test_compat.py, and use the entry here instead.")


def test_the_scan_covers_the_library():
    files = list(ROOT.rglob("*.py"))
    assert len(files) > 30 and any(p.name == "fake_mode.py" for p in files)
    assert private_torch_names((ROOT / "_compat.py").read_text())  # the one module that does use them


def test_importing_compat_imports_no_more_of_torch():
    """The module alone (not the package's __init__): its heavy lookups are functions or first-access attributes."""
    import subprocess
    import sys
    code = ("import sys, torch, importlib.util as u; before = set(sys.modules); "
            "s = u.spec_from_file_location('c', 'lowmembp/_compat.py'); u.module_from_spec(s); "
            "s.loader.exec_module(u.module_from_spec(s)); "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent).stdout.strip()
    assert out == "[]", out


# ------------------------------------------------------------------------------------------------------- fallbacks
@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 130), (1, 1), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_fallback_equals_the_fused_kernel(shape, dtype):
    if not _compat.fused_rms_norm_takes_shape():
        pytest.skip("this torch has no _fused_rms_norm(x, normalized_shape, ...) to compare with")
    x = torch.randn(shape, dtype=dtype) * 3 + 0.5
    y0, r0 = _compat.fused_rms_norm(x, 1e-6, fast=True)
    y1, r1 = _compat.fused_rms_norm(x, 1e-6, fast=False)
    assert y0.shape == y1.shape == x.shape and r0.shape == r1.shape == (*shape[:-1], 1)
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y1, y0, **tol)
    torch.testing.assert_close(r1, r0, **tol)
    ref = torch.nn.functional.rms_norm(x, (shape[-1],), eps=1e-6)
    torch.testing.assert_close(y1, ref, **tol)


def test_rms_norm_detection_reads_the_schema(monkeypatch):
    _compat.fused_rms_norm_takes_shape.cache_clear()
    try:
        takes_shape = hasattr(torch, "_fused_rms_norm") and isinstance(
            torch.ops.aten._fused_rms_norm.default._schema.arguments[1].type, torch.ListType)  # torch 2.8: int
        assert _compat.fused_rms_norm_takes_shape() == takes_shape
        monkeypatch.delattr(torch, "_fused_rms_norm", raising=False)
        _compat.fused_rms_norm_takes_shape.cache_clear()
        assert not _compat.fused_rms_norm_takes_shape()
        x = torch.randn(4, 9)
        y, _ = _compat.fused_rms_norm(x, 1e-5)  # detected: the plain math
        torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (9,), eps=1e-5))
    finally:
        monkeypatch.undo()
        _compat.fused_rms_norm_takes_shape.cache_clear()


def _strided_cases():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, 4, generator=g)
    yield base
    yield base.transpose(0, 2)
    yield base.permute(1, 2, 0)
    yield base[:, ::2]
    yield base[1:]
    yield base[..., :3]
    yield base.expand(2, 6, 5, 4)
    yield torch.randn(3, 1, 4).expand(3, 7, 4)
    yield torch.empty_strided((2, 3), (1, 2))
    yield torch.empty_strided((2, 3), (3, 1))
    yield torch.empty_strided((4, 1, 3), (3, 100, 1))
    yield torch.empty_strided((2, 2), (1, 1))     # overlapping
    yield torch.empty_strided((2, 3), (4, 1))     # a gap
    yield torch.empty(0, 3)
    yield torch.tensor(1.0)
    for _ in range(40):
        n = int(torch.randint(1, 4, (1,), generator=g))
        shape = tuple(int(s) for s in torch.randint(1, 5, (n,), generator=g))
        stride = tuple(int(s) for s in torch.randint(0, 13, (n,), generator=g))
        yield torch.empty_strided(shape, stride)


def test_dense_check_fallback_equals_torchs():
    for t in _strided_cases():
        want = _compat.is_non_overlapping_and_dense(t, fast=True)
        assert _compat.is_non_overlapping_and_dense(t, fast=False) == want, (tuple(t.shape), t.stride())


def test_fake_helpers():
    mode = _compat.FakeTensorMode()
    assert _compat.detect_fake_mode() is None
    with mode:
        t = torch.empty(3)
        assert _compat.is_fake(t) and _compat.detect_fake_mode() is mode and _compat.detect_fake_mode(t) is mode
        with _compat.unset_fake_temporarily():
            r = torch.ones(2)
            assert not _compat.is_fake(r) and r.sum().item() == 2.0
    assert not _compat.is_fake(torch.ones(1))


def test_grad_tracking_is_seen_through_functorch_wrappers():
    seen = []

    def f(x):
        seen.append(_compat.functorch_unwrap_grad_tracking(x)[1])
        return x.sum()

    torch.func.grad(f)(torch.randn(3))
    torch.func.vmap(f)(torch.randn(2, 3))
    f(torch.randn(3))
    assert seen == [True, False, False]


def test_module_type_fallbacks_cover_the_same_modules():
    nn = torch.nn
    mods = [nn.BatchNorm1d(3), nn.BatchNorm2d(3), nn.BatchNorm3d(3), nn.SyncBatchNorm(3), nn.Conv1d(2, 2, 1),
            nn.Conv2d(2, 2, 1), nn.Conv3d(2, 2, 1), nn.ConvTranspose1d(2, 2, 1), nn.ConvTranspose2d(2, 2, 1),
            nn.ConvTranspose3d(2, 2, 1), nn.Linear(2, 2), nn.LayerNorm(2), nn.InstanceNorm1d(2)]
    for m in mods:
        for kind in (_compat.batch_norm_types, _compat.conv_types):
            assert isinstance(m, kind(fast=True)) == isinstance(m, kind(fast=False)), (type(m), kind)


def test_public_pytree_and_dispatch_mode():
    assert _compat.tree_leaves({"a": [1, (2, 3)]}) == [1, 2, 3]
    assert _compat.tree_flatten([1, [2]])[0] == [1, 2]
    assert issubclass(_compat.FakeTensorMode, _compat.TorchDispatchMode)
    with pytest.raises(AttributeError):
        _compat.no_such_name  # noqa: B018


def test_dispatch_mode_active(monkeypatch):
    """Off outside any mode, on inside one (nested too), and True where torch lacks the stack's length (the ops then
    take their custom op, which is right under a mode and only slower without one)."""
    assert not _compat.dispatch_mode_active()
    with _compat.TorchDispatchMode():
        assert _compat.dispatch_mode_active()
        with _compat.TorchDispatchMode():
            assert _compat.dispatch_mode_active()
    assert not _compat.dispatch_mode_active()
    monkeypatch.delattr(torch._C, "_len_torch_dispatch_stack")
    assert _compat._dispatch_stack()()  # resolved again without the function: the fallback says True


def test_functorch_wrapped_and_forward_ad():
    """The probes resolved once at import: a vmap-wrapped tensor is recognised, a plain one is not; forward-mode AD
    is on only inside a dual level."""
    x = torch.randn(3, 2)
    seen = []
    torch.func.vmap(lambda r: seen.append(_compat.is_functorch_wrapped(r)) or r)(x)
    assert seen == [True] and not _compat.is_functorch_wrapped(x)
    assert not _compat.forward_ad_active()
    with torch.autograd.forward_ad.dual_level():
        assert _compat.forward_ad_active()


def test_compile_helpers():
    assert "inductor" in _compat.list_backends() and callable(_compat.lookup_backend("eager"))
    m = torch.nn.Linear(2, 2)
    assert not _compat.is_optimized_module(m)
    assert _compat.is_optimized_module(torch.compile(m))
    assert 0 <= _compat.functorch_config().activation_memory_budget <= 1
    _compat.reset_compiler()


def test_saved_tensor_hooks_and_graph_task():
    assert _compat.top_saved_tensors_hooks() is None and _compat.current_graph_task_id() == -1
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _compat.top_saved_tensors_hooks() == (pack, unpack)
    ids = []
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda g: ids.append(_compat.current_graph_task_id()))
    y.sum().backward()
    assert ids and ids[0] != -1


# ------------------------------------------------------------------------------------ the fake-mode fast path on/off
def test_fast_fake_switch(monkeypatch):
    from lowmembp.estimator.fake_mode import StepFakeMode
    monkeypatch.delenv(_compat.FAST_FAKE_ENV, raising=False)
    if _compat.fast_fake_internals() is None:  # internals other than expected (torch 2.8: FakeTensor.fake_device)
        assert torch.__version__ < "2.14", "the pinned torch must have the fast path's internals"
        assert not _compat.fast_fake_enabled() and not StepFakeMode().fast and not StepFakeMode(fast=True).fast
        return
    assert _compat.fast_fake_enabled() and StepFakeMode().fast
    monkeypatch.setenv(_compat.FAST_FAKE_ENV, "0")
    assert not _compat.fast_fake_enabled() and not StepFakeMode().fast
    assert StepFakeMode(fast=True).fast and not StepFakeMode(fast=False).fast


def test_the_probe_refuses_internals_other_than_expected(monkeypatch):
    """A FakeTensor that no longer keeps its device in ``_fake_device`` (as some torch releases do) switches the fast
    path off."""
    from torch._subclasses import fake_tensor as ft
    if _compat.fast_fake_internals() is None:
        pytest.skip("this torch's internals already switch the fast path off (test_fast_fake_switch checks that)")
    real_init = ft.FakeTensor.__init__ if "__init__" in vars(ft.FakeTensor) else None
    orig_new = ft.FakeTensor.__new__

    def new(cls, *a, **k):
        t = orig_new(cls, *a, **k)
        t.__dict__["_device_moved"] = t.__dict__.pop("_fake_device")
        return t
    _compat.fast_fake_internals.cache_clear()
    try:
        monkeypatch.setattr(ft.FakeTensor, "__new__", staticmethod(new))
        assert _compat.fast_fake_internals() is None and not _compat.fast_fake_enabled()
    finally:
        monkeypatch.undo()
        _compat.fast_fake_internals.cache_clear()
    assert real_init is None or ft.FakeTensor.__init__ is real_init
    assert _compat.fast_fake_internals() is not None


LLAMA = dict(overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 61, "num_hidden_layers": 4}, seq_len=16, dtype="bf16")


def _estimates():
    from lowmembp.estimator.step import estimate
    out = {}
    for method in ("baseline", "lora+lowmembp", "mesa+checkpointing", "tokentune", "lora+sac", "offload"):
        out[method] = estimate("llama-7b", method, batch_size=3, layers=2, **LLAMA)
    out["vit lora"] = estimate("vit-b16", "lora", batch_size=2, layers=1, dtype="fp16",
                               overrides={"img_size": 32, "embed_dim": 48, "num_heads": 3})
    return out


def _plan_rows():
    from lowmembp.plan import plan
    p = plan("llama-7b", batch_size=3, gpu_memory=800_000, methods=["lora", "lowmembp"], margin=0.0, reserved=0,
             **LLAMA)
    return [{k: v for k, v in r.items() if "time" not in k and "seconds" not in k} for r in p.rows]


def test_estimates_and_plan_rows_equal_with_the_fast_path_off(monkeypatch):
    import lowmembp.estimator.fake_mode as fm
    from lowmembp._compat import FakeTensorMode

    monkeypatch.delenv(_compat.FAST_FAKE_ENV, raising=False)
    fast = _estimates(), _plan_rows()
    dispatched = []
    orig = FakeTensorMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        dispatched.append(func)
        return orig(self, func, types, args, kwargs)
    monkeypatch.setenv(_compat.FAST_FAKE_ENV, "0")
    hits = len(fm.RECIPES)
    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", counting)
    slow = _estimates(), _plan_rows()
    assert len(fm.RECIPES) == hits, "the fast path made recipes while switched off"
    assert fm.DEVICE_QUERY in dispatched, "torch's FakeTensorMode did not answer the device queries"
    assert slow == fast
