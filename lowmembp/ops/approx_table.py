"""The approximate-activation constants: breakpoints ``c`` and weights ``a`` per (kind, bits).

``TABLE[(kind, bits)] = (c, a)``: ``2**bits − 1`` breakpoints in increasing order and their weights, so that the
backward's slope for code j is ``Σ_{i<=j} a_i`` (code 0: slope 0). The numbers are the output of
:func:`lowmembp.ops.approx_derive.derive` (see there for the objective and the integration interval of each kind), written
out here so that importing the ops needs neither scipy nor a minimisation; ``tests/test_derive.py`` re-derives every
entry and checks it. ``("gelu", 2)`` and ``("silu", 2)`` are the published ReGELU2 / ReSiLU2 constants (the authors'
released reference, DESIGN.md §2.1), which ``derive`` reproduces to 1e-6.
Regenerate with ``python -m lowmembp.ops.approx_derive --table``.
"""
from __future__ import annotations

# Published (arXiv 2406.16282, github.com/yyyyychen/LowMemoryBP); DESIGN.md §2.1.
REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
RESILU2_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)
RESILU2_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)

TABLE: dict[tuple[str, int], tuple[tuple[float, ...], tuple[float, ...]]] = {
    ("gelu", 2): (REGELU2_C, REGELU2_A),
    ("silu", 2): (RESILU2_C, RESILU2_A),
    # BEGIN DERIVED (python -m lowmembp.ops.approx_derive --table)
    ("gelu", 1): ((0.0,), (1.0,)),
    ("silu", 1): ((0.0,), (1.0,)),
    ("relu", 1): ((0.0,), (1.0,)),
    ("relu", 2): ((0.0, 0.0, 0.0), (1.0, 0.0, 0.0)),
    # END DERIVED
}
