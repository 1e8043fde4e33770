"""The C kernels of the MS-norms' CPU fast path (:mod:`lowmembp.ops.ms_norm_cpu`) and the probes they rely on.

The backward (whole, row by row: :func:`norm_bwd_rows`; or its element-wise passes around ATen's row sums:
:func:`norm_prod`, :func:`norm_bwd`, :func:`norm_bwd_passes`), the LayerNorm forward (:func:`layer_norm_fwd`) and the
casts (:func:`cast`). They replicate ATen's CPU arithmetic, which depends on torch's build: probes at first use find
it by comparing with ATen on probe rows — how ``addcmul`` rounds (:func:`addcmul_fused`), the vector width of ``sum``
(:func:`aten_sum_width`) and the variant of LayerNorm (:func:`layer_norm_variant`); where a probe finds none, the
callers keep ATen's own ops. ``threads`` is the OpenMP team (1 where the caller splits the work over threads itself).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lowmembp.ops.cpu_kernels.build import _DTYPES, _check_tensor, _threads, library


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
