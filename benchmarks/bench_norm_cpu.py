"""CPU forward+backward of the MS-norms (PyTorch reference path) against PyTorch's own norms (no affine).

    OMP_NUM_THREADS=1 pytest benchmarks/bench_norm_cpu.py --benchmark-only

Shapes: ViT-B/16 LayerNorm input [B*197, 768] (B = LOWMEMBP_BENCH_B, default 8) and LLaMA-7B RMSNorm input
[tokens, 4096] (tokens = LOWMEMBP_BENCH_TOKENS, default 512), fp32. Each pair shares a benchmark group; the MS case
prints `ratio ms/native` (of the minimum and of the median time; the minimum is the steadier on a shared
machine) once the native case of its group has run (it runs first). LOWMEMBP_BENCH_ROUNDS sets the rounds (30).
"""
import os

import pytest
import torch
import torch.nn.functional as F

from lowmembp.ops.ms_norm import ms_layer_norm, ms_rms_norm

B = int(os.environ.get("LOWMEMBP_BENCH_B", "8"))
TOKENS = int(os.environ.get("LOWMEMBP_BENCH_TOKENS", "512"))
CASES = {
    "vit_b_layernorm": ((B * 197, 768), ms_layer_norm, lambda x: F.layer_norm(x, x.shape[-1:], eps=1e-5)),
    "llama7b_rmsnorm": ((TOKENS, 4096), ms_rms_norm, lambda x: F.rms_norm(x, x.shape[-1:], eps=1e-6)),
}
ROUNDS = int(os.environ.get("LOWMEMBP_BENCH_ROUNDS", "30"))
_STATS = {}


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("LOWMEMBP_BACKEND", "torch")  # CPU tensors use the reference anyway; never the interpreter


@pytest.mark.parametrize("impl", ["native", "ms"])
@pytest.mark.parametrize("case", list(CASES))
def test_norm_fwd_bwd(benchmark, capsys, case, impl):
    shape, ms_fn, native_fn = CASES[case]
    fn = ms_fn if impl == "ms" else native_fn
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).requires_grad_(True)
    g = torch.randn(shape, generator=gen)

    def step():
        x.grad = None
        fn(x).backward(g)

    benchmark.group = f"{case} {shape[0]}x{shape[1]} fp32 fwd+bwd"
    benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=3)
    assert x.grad is not None and torch.isfinite(x.grad).all()
    st = benchmark.stats.stats
    _STATS[(case, impl)] = (st.min, st.median)
    benchmark.extra_info.update(min_s=st.min, median_s=st.median)
    if impl == "ms" and (case, "native") in _STATS:
        (mn, md), (nmn, nmd) = _STATS[(case, "ms")], _STATS[(case, "native")]
        benchmark.extra_info.update(ratio_min=mn / nmn, ratio_median=md / nmd)
        with capsys.disabled():
            print(f"\n{case} {shape[0]}x{shape[1]} fwd+bwd: ms-norm min {mn * 1e3:.2f} ms / median {md * 1e3:.2f} ms, "
                  f"native min {nmn * 1e3:.2f} ms / median {nmd * 1e3:.2f} ms; "
                  f"ratio ms/native: min {mn / nmn:.2f}, median {md / nmd:.2f}")
