"""Switching the CPU fast path's C++ autograd nodes on or off in a test: ``set_up_node(monkeypatch, AC)`` (``AC``: an
op family's ``*_cpu`` module, ``approx_act_cpu`` or ``ms_norm_cpu``) turns the C kernels and the C++ extension on and
sets that family's node up anew (the extension itself stays loaded); ``use_route(monkeypatch, AC, "python")`` turns
the node off instead. Where a C++ compiler exists and the extension does not build, the test fails, not skips."""
from lowmembp.ops.cpu_kernels import autograd_ext as E
from lowmembp.ops.cpu_kernels import build as KB


def set_up_node(monkeypatch, module):
    """The family's set-up extension, or None where there is no C++ compiler."""
    monkeypatch.setattr(KB, "_OFF", False)
    monkeypatch.setattr(E, "_OFF", False)
    monkeypatch.setattr(module, "_NODE", [])
    if E.compiler() is None:
        return None
    ext = module._node_setup()
    assert ext is not None, f"the C++ extension did not build: {E.extension_info()['reason']}"
    return ext


def use_route(monkeypatch, module, route: str) -> str:
    """``route`` (``"node"`` or ``"python"``) for the family's eager CPU calls; returns it."""
    if route == "python":
        monkeypatch.setattr(module, "_NODE", [None])
    else:
        set_up_node(monkeypatch, module)
    return route


def node_or_skip(monkeypatch, module):
    """:func:`set_up_node` for a fixture: the set-up extension, the test skipped where there is no C++ compiler."""
    import pytest

    ext = set_up_node(monkeypatch, module)
    if ext is None:
        pytest.skip("no C++ compiler")
    return ext


def run_route(module, fn, x, dy, python: bool, monkeypatch, hooks=None, create_graph=False):
    """(y, saved tensors, dx, grad_fn name) of ``fn`` on a fresh leaf copy of ``x``, by the family's node or its Python
    route; ``hooks``: (pack, unpack) saved-tensor hooks around the forward (the saved tensors are recorded either
    way)."""
    import torch

    monkeypatch.setattr(module, "_NODE", [None] if python else [module._node_setup()])
    x = x.detach().clone().requires_grad_()
    saved = []
    pack, unpack = hooks or (lambda t: t, lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or pack(t), unpack):
        y = fn(x)
    (dx,) = torch.autograd.grad(y, x, dy, create_graph=create_graph)
    return y, saved, dx, y.grad_fn.name()
