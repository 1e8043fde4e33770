"""Derive the approximate-activation constants from the paper's objective (docs/design.md#approx-act).

For an activation h and ``bits`` bits, find ``n = 2**bits − 1`` breakpoints c and weights a of
``h̃(x) = Σ a_i·max(x − c_i, 0)`` minimising ``∫_{−b}^{b} (h(x) − h̃(x))² dx``, with ``Σ a_i = 1`` and
``Σ a_i·c_i = 0`` (h̃ is 0 far left and x far right, like h) for every kind that tends to ReLU. The backward then
uses the slope of h̃: ``s_j = Σ_{i<=j} a_i`` for code j. a comes from a linear (KKT) solve for each c; c from BFGS on
the exact gradient, polished by Newton steps; the integrals are exact to rounding, so the result does not depend on
the CPU. The published ReGELU2 / ReSiLU2 constants are not this exact minimum (a simulated-annealing result close to
it), so the shipped table keeps them for ``("gelu", 2)`` and ``("silu", 2)`` and the derived ones elsewhere. The
solver, the integration and the interval rule (:func:`interval`): docs/design.md#derive.

Run ``python -m lowmembp.ops.approx_derive --table`` to print the table lowmembp/ops/approx_table.py ships.
Needs numpy and scipy (not imported by the ops themselves).
"""
from __future__ import annotations

import argparse
import math
import pprint

EPS = 1e-8  # the authors' truncated error
_K_QUICK = 1.702
_K_TANH = 2.0 * math.sqrt(2.0 / math.pi)
_RELU_LIKE = ("gelu", "gelu_tanh", "quick_gelu", "silu")
_KINDS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu", "relu2")


def _silu_type_bound(k: float, eps: float) -> float:
    """b with e^{−k·b/2} = k²·ε/2: the SiLU rule for silu(k·x)/k."""
    return (2.0 / k) * math.log(2.0 / (k * k * eps))


def interval(kind: str, eps: float = EPS) -> float:
    """The half-width b of the integration interval [−b, b] for ``kind`` (docs/design.md#derive)."""
    if kind in ("gelu", "relu2"):
        return math.sqrt(-2.0 * math.log(eps))
    if kind == "silu":
        return -2.0 * math.log(eps / 2.0)
    if kind == "quick_gelu":
        return _silu_type_bound(_K_QUICK, eps)
    if kind == "gelu_tanh":
        return _silu_type_bound(_K_TANH, eps)
    if kind == "relu":
        return 1.0  # any: the fit is exact
    raise ValueError(f"unknown activation kind {kind!r}; the kinds are {', '.join(_KINDS)}")


def _h(kind: str):
    import numpy as np
    from scipy import special
    if kind == "gelu":
        return lambda x: 0.5 * x * (1.0 + special.erf(x / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if kind == "quick_gelu":
        return lambda x: x * special.expit(_K_QUICK * x)
    if kind == "silu":
        return lambda x: x * special.expit(x)
    if kind == "relu":
        return lambda x: np.maximum(x, 0.0)
    if kind == "relu2":
        return lambda x: np.maximum(x, 0.0) ** 2
    raise ValueError(f"unknown activation kind {kind!r}; the kinds are {', '.join(_KINDS)}")


class _Problem:
    """The objective for one kind on [−b, b]: inner solve for a, value and gradient in c."""

    def __init__(self, kind: str, bits: int, b: float, nodes: int = 24, piece: float = 2.0, refine: int = 1):
        import numpy as np
        self.np = np
        self.kind, self.n, self.b, self.refine = kind, 2 ** bits - 1, b, refine
        self.h = _h(kind)
        self.constrained = kind in _RELU_LIKE
        # Every segment between cuts gets the same m pieces, so the nodes and weights are affine in the cuts and the
        # objective is smooth in c (a piece count that follows the segment's width jumps as c moves). No segment is
        # wider than 2b, so no piece is wider than ``piece``: with h's nearest complex singularity 1.85 from the real
        # axis (quick_gelu's, at ±iπ/1.702; SiLU's π, gelu_tanh's 2.75), 24-node Gauss–Legendre on pieces 2 wide
        # errs by a factor ~(1.85 + √(1.85² + 1))^−48 ≈ 1e-28: exact to rounding.
        m = max(1, int(math.ceil(2 * b / piece)))
        gx, gw = np.polynomial.legendre.leggauss(nodes)
        t = np.linspace(0.0, 1.0, m + 1)
        half, mid = (t[1:] - t[:-1])[:, None] / 2, (t[1:] + t[:-1])[:, None] / 2
        self.ref_x, self.ref_w = (mid + half * gx).ravel(), (half * gw).ravel()  # the rule on [0, 1]
        # the point count is fixed (n + 2 segments), so the [n, points] arrays are allocated once: allocating them
        # afresh on every call costs several times the arithmetic (page faults)
        shape = (self.n, (self.n + 2) * len(self.ref_x))
        self._phi, self._pw = np.empty(shape), np.empty(shape)

    def _cuts(self, c):
        """The segment ends: −b, b, 0 (relu2's kink; the other kinds are smooth there) and the breakpoints."""
        np = self.np
        return np.sort(np.concatenate([[-self.b, 0.0, self.b], np.clip(c, -self.b, self.b)]))

    def _points(self, c):
        """Nodes (increasing) and weights on [−b, b]: m pieces per segment, 24 Gauss–Legendre nodes per piece."""
        cuts = self._cuts(c)
        lo, width = cuts[:-1, None], (cuts[1:] - cuts[:-1])[:, None]
        return (lo + width * self.ref_x).ravel(), (width * self.ref_w).ravel()

    def solve(self, c):
        """(a, μ, value) for breakpoints c: the inner least squares (with the two constraints if relu-like).

        Normal equations (the KKT system with the Gram matrix G), then one step of iterative refinement on the
        residual computed point by point (corrected semi-normal equations). The plain normal equations square the
        condition number of the design matrix (G's is up to ~2e8 here) and leave ~1e-9 in a, which the envelope
        gradient carries at first order; after the refinement a agrees with an orthogonal-factorisation solve to
        ~1e-15. The value is the integral of the squared residual, not ``∫h² − 2a·r + a·G·a``, which cancels ~1e4
        down to ~1e-5 and so is noisy at ~1e-12."""
        np = self.np
        c = np.asarray(c, dtype=float)
        x, w = self._points(c)
        phi, pw = self._phi, self._pw
        np.maximum(np.subtract(x[None, :], c[:, None], out=phi), 0.0, out=phi)  # [n, points]: max(x − c_i, 0)
        np.multiply(phi, w, out=pw)
        hx = self.h(x)
        G = pw @ phi.T
        if self.constrained:
            A = np.vstack([np.ones(self.n), c])
            K = np.block([[2 * G, A.T], [A, np.zeros((2, 2))]])
            target = np.array([1.0, 0.0])
            sol = np.linalg.lstsq(K, np.concatenate([2 * (pw @ hx), target]), rcond=None)[0]
            for _ in range(self.refine):
                a, mu = sol[: self.n], sol[self.n:]
                rhs = np.concatenate([2 * (pw @ (hx - a @ phi)) - A.T @ mu, target - A @ a])
                sol = sol + np.linalg.lstsq(K, rhs, rcond=None)[0]
            a, mu = sol[: self.n], sol[self.n:]
        else:
            a = np.linalg.lstsq(G, pw @ hx, rcond=None)[0]
            for _ in range(self.refine):
                a = a + np.linalg.lstsq(G, pw @ (hx - a @ phi), rcond=None)[0]
            mu = np.zeros(2)
        resid = hx - a @ phi
        wr = w * resid
        self._wr = wr
        return a, mu, float(wr @ resid)

    def value_grad(self, c):
        """(value, dV/dc): ``dV/dc_k = 2·a_k·∫_{c_k}^{b} (h − h̃) dx + μ₂·a_k`` (envelope theorem)."""
        np = self.np
        c = np.asarray(c, dtype=float)
        a, mu, value = self.solve(c)
        cuts = self._cuts(c)
        per_segment = self._wr.reshape(len(cuts) - 1, -1).sum(axis=1)  # ∫ (h − h̃) over each segment
        tail = (cuts[None, :-1] >= c[:, None]) @ per_segment  # c_k is a cut: the segments right of it
        return value, 2 * a * tail + mu[1] * a


def _starts(kind: str, n: int):
    """Symmetric starting breakpoints at a few scales (sorted)."""
    import numpy as np
    scale = {"gelu": 3.2, "gelu_tanh": 3.2, "quick_gelu": 3.7, "silu": 6.3, "relu2": 4.0}[kind]
    out = []
    for width in (0.5, 0.75, 1.0, 1.25, 1.6):
        if kind == "relu2":
            out.append(np.linspace(0.0, width * scale, n + 2)[1:-1] if n > 1 else np.array([width]))
        else:
            out.append(np.linspace(-width * scale, width * scale, n) if n > 1 else np.array([0.0]))
    return out


def derive(kind: str, bits: int = 2, half_width: float | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(c, a)``: the ``2**bits − 1`` breakpoints (increasing) and weights minimising the §2.1 objective.

    ``half_width``: the integration interval [−b, b] (default :func:`interval`)."""
    import numpy as np
    from scipy import optimize
    if kind not in _KINDS:
        raise ValueError(f"unknown activation kind {kind!r}; the kinds are {', '.join(_KINDS)}")
    if bits not in (1, 2, 3, 4):
        raise ValueError(f"bits must be 1, 2, 3 or 4, got {bits!r}")
    n = 2 ** bits - 1
    if kind == "relu":
        return (0.0,) * n, (1.0,) + (0.0,) * (n - 1)
    if kind in _RELU_LIKE and n == 1:
        return (0.0,), (1.0,)  # Σa = 1 and Σa·c = 0 leave nothing free
    b = interval(kind) if half_width is None else float(half_width)
    prob = _Problem(kind, bits, b)
    best = None
    for c0 in _starts(kind, n):
        res = optimize.minimize(prob.value_grad, c0, jac=True, method="BFGS", options=dict(gtol=1e-10, maxiter=2000))
        if best is None or res.fun < best.fun:
            best = res
    c = _newton(prob, np.sort(best.x), symmetric=kind in _RELU_LIKE)
    a, _, _ = prob.solve(c)
    return tuple(float(v) for v in c), tuple(float(v) for v in a)


def _newton(prob, c, symmetric: bool, max_steps: int = 30):
    """Polish c to the root of the gradient: Newton steps, Hessian by central differences of the exact gradient.

    With ``symmetric`` (h − ReLU even: the objective is symmetric under x → −x, and the minimum is symmetric) in the
    reduced parameters p, the positive half of c (c = −p reversed, 0, p). Steps until the gradient stops shrinking
    and returns the iterate with the smallest gradient (among those not above the start's value). Newton's fixed
    point depends on the gradient only (the Hessian sets the speed), so wherever BFGS stopped this lands on the same
    point, up to the gradient's rounding noise (~1e-14) over the Hessian's smallest eigenvalue (≥ 3e-6 here)."""
    np = prob.np
    n = len(c)
    if symmetric:
        p = _symmetric(c)[n // 2 + 1:]
        expand = lambda p: np.concatenate([-p[::-1], [0.0], p])  # noqa: E731
        reduce = lambda g: g[n // 2 + 1:] - g[: n // 2][::-1]  # noqa: E731  (chain rule: dV/dp)
    else:
        p = np.array(c, dtype=float)
        expand = reduce = lambda v: v  # noqa: E731

    def value_grad(p):
        value, g = prob.value_grad(expand(p))
        return value, reduce(g)

    value0, g = value_grad(p)
    best_p, best_g = p, float(np.abs(g).max())
    stalls = 0
    for _ in range(max_steps):
        step = 1e-5 * np.maximum(1.0, np.abs(p))
        H = np.empty((len(p), len(p)))
        for j in range(len(p)):
            e = np.zeros(len(p))
            e[j] = step[j]
            H[:, j] = (value_grad(p + e)[1] - value_grad(p - e)[1]) / (2 * step[j])
        p = p - np.linalg.solve((H + H.T) / 2, g)
        value, g = value_grad(p)
        g_max = float(np.abs(g).max())
        if g_max < best_g and value <= value0 + 1e-12 * abs(value0):
            best_p, best_g, stalls = p, g_max, 0
        else:
            stalls += 1
            if stalls == 2:
                break
    return np.sort(expand(best_p))


def _symmetric(c):
    """Breakpoints mirrored about 0 (the mean of c and −c reversed); the middle one of an odd count becomes 0."""
    return (c - c[::-1]) / 2


def table(bits_list=(1, 2, 3, 4)) -> dict:
    """{(kind, bits): (c, a)} for every kind and bits, derived."""
    return {(k, b): derive(k, b) for k in _KINDS for b in bits_list}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", action="store_true", help="print the derived entries of lowmembp/ops/approx_table.py")
    p.add_argument("--kind", default="gelu")
    p.add_argument("--bits", type=int, default=2)
    args = p.parse_args(argv)
    if args.table:
        for (k, b), (c, a) in table().items():
            if (k, b) in (("gelu", 2), ("silu", 2)):
                continue  # shipped as the published numbers
            print(f"    ({k!r}, {b}): (")
            for vals in (c, a):
                text = pprint.pformat(vals, width=104, compact=True).replace("\n", "\n        ")
                print(f"        {text},")
            print("    ),")
        return 0
    c, a = derive(args.kind, args.bits)
    print(f"c = {c}\na = {a}\ninterval = [-{interval(args.kind)}, {interval(args.kind)}]")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
