"""The largest batch (or sequence length) that fits, found from a few estimates and then checked directly.

    largest_batch(peak_of, fits, known={4: 17e9}, floor=16e9)  -> (batch, how)
    largest_fitting(peak_of, fits, known={2048: 17e9}, unit="sequence length")  -> (tokens, how)

The same search for any size the peak grows with (:func:`largest_fitting`; ``largest_batch`` is it for the batch).
For the sequence length the peak is not affine (eager attention's scores grow with its square): the line's
prediction is then only a first guess, and the checks and the bisection below give the answer.

``peak_of(b)`` is the estimated peak (bytes) at batch ``b`` (each call one estimate; results are kept in ``known``),
``fits(bytes)`` says whether that peak fits the GPU. At a fixed sequence length a step's bytes are affine in the
batch size (activations, temporaries and inputs grow by the same bytes per sample; parameters, gradients and
optimizer state do not), so the line through two estimates predicts the answer ``B``; ``B`` and ``B + 1`` are then
estimated directly, and the answer is only returned when ``B`` fits and ``B + 1`` does not. A wrong prediction
(the peak can move to another phase of the step at small batches) only costs more estimates: the search keeps the
largest batch known to fit and the smallest known not to, predicts again inside that bracket, and bisects if the
line stops helping.

``floor``: bytes every batch needs (parameters and optimizer state are alive through the whole step); when even
that does not fit, no batch does and nothing is estimated.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["largest_batch", "largest_fitting"]


def largest_batch(peak_of: Callable[[int], int], capacity: float, *, known: dict[int, int], floor: int = 0,
                  max_batch: int = 1 << 16, first_slope: float | None = None,
                  max_estimates: int = 24) -> tuple[int, str]:
    """``(batch, how)``: the largest batch in ``[0, max_batch]`` whose peak is at most ``capacity`` bytes."""
    return largest_fitting(peak_of, capacity, known=known, floor=floor, max_value=max_batch, first_slope=first_slope,
                           max_estimates=max_estimates, unit="batch")


def largest_fitting(peak_of: Callable[[int], int], capacity: float, *, known: dict[int, int], floor: int = 0,
                    max_value: int = 1 << 16, first_slope: float | None = None, max_estimates: int = 24,
                    unit: str = "batch") -> tuple[int, str]:
    """``(n, how)``: the largest ``n`` in ``[0, max_value]`` whose peak ``peak_of(n)`` is at most ``capacity`` bytes
    (``unit`` names ``n`` in ``how``: "batch", "sequence length")."""
    max_batch = max_value
    if floor > capacity:
        return 0, "none: parameters and optimizer state alone do not fit"

    def peak(b: int) -> int:
        if b not in known:
            known[b] = peak_of(b)
        return known[b]

    calls = 0
    while True:
        lo = max((b for b, p in known.items() if p <= capacity), default=0)
        hi = min((b for b, p in known.items() if p > capacity and b > lo), default=None)
        if hi is not None and hi == lo + 1:
            return lo, (f"checked: {lo} fits, {hi} does not" if lo else f"none: {unit} 1 does not fit (checked)")
        if hi is None and lo >= max_batch:
            return max_batch, f"at least {max_batch} (the search's cap; {max_batch} checked)"
        if calls >= max_estimates:
            raise RuntimeError(f"largest {unit}: no answer after {calls} estimates (known: {sorted(known)})")
        top = (hi - 1) if hi is not None else max_batch
        guess = _predict(known, capacity, first_slope)
        bisect = calls >= 4 or guess is None
        if bisect:  # the line does not converge: bisect the bracket (or double past the largest that fits)
            guess = (lo + hi) // 2 if hi is not None else 2 * max(lo, 1)
        guess = min(max(guess, lo), top)
        # one estimate on the prediction gives the line; after that, the answer and the batch after it; a bisection
        # halves the bracket with one estimate until the bracket is two wide
        single = (len(known) == 1 or (bisect and (hi is None or hi - lo > 2))) and guess >= 1 and guess not in known
        pair = (guess,) if single else (guess, guess + 1)
        new = [b for b in pair if b >= 1 and b not in known and (hi is None or b <= hi)]
        if not new:  # the prediction only names batches already estimated: split the bracket instead
            mid = (lo + hi) // 2 if hi is not None else 2 * max(lo, 1)
            new = [b for b in (mid, mid + 1) if b >= 1 and b not in known and (hi is None or b <= hi)]
        if not new:
            raise RuntimeError(f"largest {unit}: nothing left to estimate (known: {sorted(known)})")
        for b in new:
            peak(b)
            calls += 1


def _predict(known: dict[int, int], capacity: float, first_slope: float | None) -> int | None:
    """The largest batch at most ``capacity`` on the line through the two estimates nearest the threshold."""
    pts = sorted(known.items())
    inside = [b for b, p in pts if p <= capacity]
    outside = [b for b, p in pts if p > capacity]
    if inside and outside and min(outside) > max(inside):
        b1, b2 = max(inside), min(outside)
    elif len(pts) >= 2:
        b1, b2 = pts[-2][0], pts[-1][0]
    else:
        b1 = b2 = pts[0][0] if pts else None
    if b1 is None:
        return None
    p1 = known[b1]
    slope = (known[b2] - p1) / (b2 - b1) if b2 != b1 else first_slope
    if not slope or slope <= 0:
        return None
    return max(0, b1 + int((capacity - p1) // slope))
