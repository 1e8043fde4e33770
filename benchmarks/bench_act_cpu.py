"""CPU benchmark: forward+backward of ReGELU2 / ReSiLU2 (PyTorch reference) against native F.gelu / F.silu.

    pytest benchmarks/bench_act_cpu.py --benchmark-only

Shapes: the MLP activation of ViT-B (hidden 3072, 197 tokens) at batch 8 — a slice of the paper's batch 64, which
takes minutes per round on a 2-core machine; the per-element cost is what matters — and of LLaMA-7B (hidden 11008)
at batch 1, sequence 512. One round = forward and backward (``torch.autograd.grad``) of one activation call. At the
end a table gives the median time of ours over native (ratio > 1: ours is slower).
"""
import pytest
import torch
import torch.nn.functional as F

from lowmembp.ops.approx_act import regelu2, resilu2

SHAPES = {"vit-b-mlp(8x197x3072)": (8, 197, 3072), "llama7b-mlp(1x512x11008)": (1, 512, 11008)}
IMPLS = {("gelu", "regelu2"): regelu2, ("gelu", "native"): F.gelu,
         ("silu", "resilu2"): resilu2, ("silu", "native"): F.silu}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_MEDIANS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def ratio_table(request):
    yield
    if not _MEDIANS:
        return
    lines = ["", f"{'activation':10s} {'shape':26s} {'dtype':5s} {'native ms':>10s} "
                 f"{'ours ms':>10s} {'ours/native':>12s}"]
    for (act, shape, dt), v in sorted(_MEDIANS.items()):
        if "native" in v and "ours" in v:
            lines.append(f"{act:10s} {shape:26s} {dt:5s} {v['native'] * 1e3:10.1f} {v['ours'] * 1e3:10.1f} "
                         f"{v['ours'] / v['native']:12.2f}")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():  # print past pytest's output capture
        print("\n".join(lines), flush=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act,impl", IMPLS)
def test_fwd_bwd(benchmark, act, impl, shape, dtype, torch_backend_env):
    fn = IMPLS[(act, impl)]
    x = torch.randn(SHAPES[shape], dtype=DTYPES[dtype]).mul_(3).requires_grad_()
    dy = torch.randn(SHAPES[shape], dtype=DTYPES[dtype])

    def step():
        return torch.autograd.grad(fn(x), x, dy)[0]

    benchmark.group = f"{act} {shape} {dtype}"
    benchmark.pedantic(step, rounds=7, warmup_rounds=1)
    if benchmark.stats is not None:
        key = "native" if impl == "native" else "ours"
        _MEDIANS.setdefault((act, shape, dtype), {})[key] = benchmark.stats.stats.median


@pytest.fixture
def torch_backend_env(monkeypatch):
    monkeypatch.setenv("LOWMEMBP_BACKEND", "torch")
