"""Proof of each conversion: a converted site computes what the original did, checked on random inputs.

``lowmembp`` keeps a copy of each norm and of the linears that read it before folding (:func:`snapshot_norm`),
then compares ``original consumer(original norm(x))`` with ``folded consumer(MS norm(x))`` — and, for residual
receivers, ``original norm(x)`` with ``ResidualAffine(MS norm(x))`` — on a random 4×width input in float32 (float64
for a float64 model). Activations: the replaced module against the original on random values over ±6. A mismatch
raises :class:`ConversionCheckError` naming the site. Consumers with more than ``MAX_COPY_PARAMS`` parameters (a
large vocabulary head) are not copied and not checked, so the cost stays small (the norm itself still is).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
MAX_COPY_PARAMS = 4_000_000


class ConversionCheckError(RuntimeError):
    """A converted site does not compute what the original computed."""


def _dtype_of(m: nn.Module):
    p = next(m.parameters(), None)
    return p.dtype if p is not None else torch.float32


def _is_real(m: nn.Module) -> bool:
    from lowmembp._compat import detect_fake_mode

    if detect_fake_mode() is not None:  # inside a FakeTensorMode (estimates): new tensors are fake, values unreadable
        return False
    return all(not p.is_meta and type(p).__name__ != "FakeTensor" for p in m.parameters())


def _check_dtype(m: nn.Module):
    dt = _dtype_of(m)
    return dt if dt in TOL else torch.float32


def _copy(m: nn.Module, dtype) -> nn.Module:
    c = copy.deepcopy(m)
    c.eval()
    return c.to(dtype)


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


def snapshot_norm(ns) -> dict | None:
    """Copies of the norm at ``ns`` and of its consumers (None when the weights are meta / fake: nothing to check)."""
    norm = ns.get()
    if not _is_real(norm) or not all(_is_real(c.get()) for c in ns.consumers):
        return None
    dt = _check_dtype(norm)
    big = [sum(p.numel() for p in c.get().parameters()) > MAX_COPY_PARAMS for c in ns.consumers]
    return {"dtype": dt, "norm": _copy(norm, dt),
            "consumers": [None if b else _copy(c.get(), dt) for c, b in zip(ns.consumers, big)]}


def _run(m: nn.Module, x: torch.Tensor, dtype) -> torch.Tensor:
    """``m(x)`` in eval mode, on a float ``dtype`` copy when the live module is in another dtype."""
    if _dtype_of(m) != dtype:
        m = _copy(m, dtype)
    was = [(mm, mm.training) for mm in m.modules()]
    m.eval()
    try:
        with torch.no_grad():
            return m(x)
    finally:
        for mm, t in was:
            mm.training = t


def check_norm(ns, snap: dict) -> None:
    """Compare the converted site ``ns`` (now an MS norm) with the snapshot taken before converting it."""
    dt, width = snap["dtype"], ns.width()
    w = getattr(snap["norm"], "weight", None)
    dev = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = (torch.randn(4, width, generator=g, dtype=torch.float64) * 1.7 + 0.3).to(device=dev, dtype=dt)
    with torch.no_grad():
        ref_norm = snap["norm"](x)
    new_norm = _run(ns.get(), x, dt)
    for c, orig in zip(ns.consumers, snap["consumers"]):
        if orig is None:
            continue
        with torch.no_grad():
            ref = orig(ref_norm)
        out = _run(c.get(), new_norm, dt)
        err = _relerr(out, ref)
        if not err <= TOL[dt]:
            raise ConversionCheckError(
                f"lowmembp: the converted norm {ns.path} -> {c.path} differs from the original on random inputs "
                f"(relative error {err:.2e} > {TOL[dt]:.0e}); the adapter's map of this model is wrong here — "
                f"please report it")
    for r in ns.residual_consumers:
        ra = getattr(r.get(), "residual_affine", None)
        if ra is None:
            continue
        out = _run(ra, new_norm, dt)
        err = _relerr(out, ref_norm)
        if not err <= TOL[dt]:
            raise ConversionCheckError(f"lowmembp: the re-applied γ/β on the residual of {r.path} (norm {ns.path}) "
                                       f"differ from the original norm output (relative error {err:.2e})")


def check_act(site, original: nn.Module) -> None:
    """Compare the activation now at ``site`` with ``original`` (forward values)."""
    if not _is_real(original):
        return
    dt = _check_dtype(original) if any(True for _ in original.parameters()) else torch.float32
    x = torch.linspace(-6, 6, 97, dtype=torch.float64).to(dt)
    with torch.no_grad():
        ref = original(x)
    out = _run(site.get(), x, dt)
    err = _relerr(out, ref)
    if not err <= max(TOL[dt], 1e-6):
        raise ConversionCheckError(f"lowmembp: the converted activation {site.path} ({site.kind}) differs from the "
                                   f"original {type(original).__name__} (relative error {err:.2e})")
