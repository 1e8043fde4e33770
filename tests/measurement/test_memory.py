"""Saved-for-backward accounting (lowmembp.measurement.saved) and peak tracking (lowmembp.measurement.peak) against hand
counts."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.measurement.kinds import module_kind
from lowmembp.measurement.peak import StorageTracker, measure_step_peak, profiler_peak


def _mlp(d, h):
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.LayerNorm(h), nn.Linear(h, 3))


def test_counts_by_kind_match_hand_count():
    B, d, h = 5, 7, 11
    model = _mlp(d, h)
    x = torch.randn(B, d)
    with SavedTensorAccountant(model) as acc:
        model(x).sum().backward()
    rep = acc.report()
    f = 4  # fp32 bytes
    # fc1 saves its input x; GELU its input; LayerNorm its input + mean + rstd (one per row); fc2 its input
    assert rep["by_kind"]["linear"] == B * d * f + B * h * f
    assert rep["by_kind"]["act"] == B * h * f
    assert rep["by_kind"]["norm"] == B * h * f + 2 * B * f
    assert rep["total"] == sum(rep["by_kind"].values())
    assert rep["by_kind"]["attention"] == rep["by_kind"]["product"] == 0
    assert rep["param_casts"] == 0  # weights are parameters: excluded, not casts


def test_dedupe_by_storage_and_views():
    class Sq(nn.Module):
        def forward(self, x):
            v = x[1:]            # a view: same storage as x
            return (x * x).sum() + (v * 2.0).exp().sum()

    x = torch.randn(6, 9, requires_grad=True)
    with SavedTensorAccountant(Sq()) as acc:
        acc.model(x)
    rows = acc.table()
    # x (saved twice by mul, counted once) and the exp output; the view v is not saved (mul by scalar)
    assert sorted(r["bytes"] for r in rows) == sorted([6 * 9 * 4, 5 * 9 * 4])
    assert acc.report()["total"] == 6 * 9 * 4 + 5 * 9 * 4


def test_a_storage_at_a_replaced_buffers_address_is_counted():
    """A parameter or buffer replaced during the forward (VeLoRA's first-batch initialisation does so) frees its
    storage; the allocator may put the next new storage at the same address. That storage is an activation and is
    counted, whatever the allocator did (repeated so that the address is reused at least once on most machines)."""
    n = 257

    class Replaces(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.randn(n))

        def forward(self, x):
            self.scale = torch.randn(n)  # the old buffer's storage is freed here
            return x * torch.randn(n)    # saves a new storage of the same size (mul saves the other operand)

    for _ in range(20):
        model = Replaces()
        x = torch.randn(3, n, requires_grad=True)
        with SavedTensorAccountant(model) as acc:
            model(x)
        assert [r["bytes"] for r in acc.table()] == [n * 4]


def test_frozen_params_and_buffers_excluded():
    lin = nn.Linear(8, 4)
    lin.weight.requires_grad_(False)
    lin.register_buffer("scale", torch.randn(4))
    model = nn.Sequential(lin)

    class Mul(nn.Module):
        def forward(self, x):
            return lin(x) * lin.scale

    x = torch.randn(3, 8, requires_grad=True)
    with SavedTensorAccountant(model) as acc:
        Mul()(x).sum()
    # mm saves only the frozen weight (a parameter): nothing counted; the mul by a buffer saves only the buffer
    assert acc.report()["total"] == 0


def test_autocast_weight_casts_are_reported_apart():
    B, d, h = 4, 6, 10
    model = nn.Sequential(nn.Linear(d, h))
    x = torch.randn(B, d, requires_grad=True)  # so that the weight is saved too
    with SavedTensorAccountant(model) as acc, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum()
    rep = acc.report()
    assert rep["by_kind"]["linear"] == B * d * 2  # the bf16 copy of the input
    assert rep["param_casts"] == h * d * 2        # the bf16 copy of the weight


def test_a_weight_cast_where_a_freed_one_was_is_counted_too():
    # without autocast's cache every forward casts the weight anew; each cast dies with its graph, and the next one
    # may get the dead one's storage address: it is a new storage, counted again (it used to be taken as seen)
    B, d, h, n = 4, 6, 10, 20
    model = nn.Sequential(nn.Linear(d, h))
    x = torch.randn(B, d, requires_grad=True)
    with SavedTensorAccountant(model) as acc, torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        for _ in range(n):
            y = model(x)
            del y
    assert acc.report()["param_casts"] == n * h * d * 2


class TinyMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate, self.up, self.down, self.act = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d), nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class TinyAttention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv, self.drop = nn.Linear(d, 3 * d), nn.Dropout(0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = self.drop((q @ k.transpose(-1, -2)).softmax(-1))
        return a @ v


def test_product_and_attention_kinds():
    B, N, d, h = 2, 5, 6, 9
    mlp, attn = TinyMLP(d, h), TinyAttention(d)
    model = nn.Sequential(attn, mlp)
    x = torch.randn(B, N, d)
    with SavedTensorAccountant(model) as acc:
        model(x)
    by = acc.report()["by_kind"]
    assert by["product"] == 2 * B * N * h * 4  # act output and up output, saved by the MLP's own mul
    assert by["act"] == B * N * h * 4          # SiLU input
    # attention: q, k (saved by q@k^T, views of one qkv storage counted once), softmax output, dropout mask
    # (bool on fused kernels, fp32 on the CPU's decomposed dropout), dropped probabilities (for a@v); v is the
    # same qkv storage
    qkv = B * N * 3 * d * 4
    probs = B * N * N * 4
    assert by["attention"] in {qkv + probs + B * N * N * mask + probs for mask in (1, 4)}
    assert by["linear"] == B * N * d * 4 * 2 + B * N * h * 4  # qkv input, gate/up input (shared x), down input


def test_shared_storage_counts_once_under_linear():
    class SaveOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class OutNorm(nn.Module):  # a norm that saves its output, like MS-LayerNorm
        def forward(self, x):
            return SaveOut.apply(x)

    model = nn.Sequential(OutNorm(), nn.Linear(7, 3))
    x = torch.randn(4, 7, requires_grad=True)
    with SavedTensorAccountant(model) as acc:
        model(x)
    rep = acc.report()
    assert rep["total"] == 4 * 7 * 4
    assert rep["by_kind"]["linear"] == 4 * 7 * 4 and rep["by_kind"]["norm"] == 0


def test_module_kind_rules_and_override():
    import timm.layers
    from transformers.activations import GELUActivation
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert module_kind(nn.GELU()) == "act" and module_kind(GELUActivation()) == "act"
    assert module_kind(timm.layers.activations.GELU()) == "act"
    assert module_kind(nn.Softmax(-1)) is None
    assert module_kind(LlamaRMSNorm(8)) == "norm" and module_kind(nn.LayerNorm(3)) == "norm"
    assert module_kind(nn.Conv2d(3, 3, 1)) == "linear"
    assert module_kind(nn.MultiheadAttention(8, 2)) == "attention"
    m = nn.Identity()
    m.memory_kind = "act"
    assert module_kind(m) == "act"
    m.memory_kind = "bogus"
    with pytest.raises(ValueError, match="memory_kind"):
        module_kind(m)


def _tiny_vit(device):
    import timm
    with torch.device(device):
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=48,
                                 patch_size=16, depth=2, embed_dim=36, num_heads=3)


def test_fake_equals_real_saved_bytes():
    torch.manual_seed(0)
    real = _tiny_vit("cpu")
    x = torch.randn(3, 3, 48, 48)
    with SavedTensorAccountant(real) as acc, torch.autocast("cpu", dtype=torch.bfloat16):
        real(x)
    fake_model = _tiny_vit("meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        fm = fake_model.to_empty(device="cpu")
        with SavedTensorAccountant(fm) as facc, torch.autocast("cpu", dtype=torch.bfloat16):
            fm(torch.randn(3, 3, 48, 48))
    assert facc.report() == acc.report()
    assert [(r["module"], r["kind"], r["bytes"]) for r in facc.table()] == \
           [(r["module"], r["kind"], r["bytes"]) for r in acc.table()]


def test_storage_tracker_peak_matches_cpu_allocator_events():
    torch.manual_seed(0)
    model = _tiny_vit("cpu")
    # the tracker sees tensors, not a kernel's private scratch: freeze the patch embedding so that the CPU
    # convolution's backward (an im2col buffer of its own) does not run
    model.patch_embed.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)
    x, y = torch.randn(5, 3, 48, 48), torch.randint(0, 5, (5,))

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    pk = measure_step_peak(model, opt, step, external=(x, y))
    ref = profiler_peak(model, opt, step, warmup=0, external=(x, y))
    assert abs(pk["bytes"] - ref) <= 0.01 * ref
    cats = pk["by_category"]
    nparam = sum(p.numel() for p in model.parameters()) * 4
    ntrain = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    assert cats["parameters"] == nparam
    assert cats["optimizer_state"] >= 2 * ntrain  # exp_avg + exp_avg_sq (+ step counters)
    assert sum(cats.values()) == pk["bytes"]


def test_storage_tracker_frees_and_tags():
    w = nn.Parameter(torch.randn(16, 16))
    tr = StorageTracker()
    tr.track_external(None, None, w)
    with tr:
        a = torch.randn(100)      # 400 B activation
        b = torch.randn(50)       # 200 B
        del a
        c = torch.randn(10)       # 40 B: the peak stays at w + a + b
    assert tr.peak == 16 * 16 * 4 + 400 + 200
    assert tr.total == 16 * 16 * 4 + 200 + 40
    assert tr.peak_by_category["activations"] == 600
    del b, c


@pytest.mark.gpu
def test_cuda_peak_from_allocator_and_events():
    from lowmembp.measurement.timing import time_steps

    torch.manual_seed(0)
    model = _tiny_vit("cpu").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 3, 48, 48, device="cuda"), torch.randint(0, 5, (4,), device="cuda")

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    pk = measure_step_peak(model, opt, step, external=(x, y))
    assert pk["how"] == "cuda max_memory_allocated"
    cats = pk["by_category"]
    assert cats["parameters"] == sum(p.numel() for p in model.parameters()) * 4
    assert pk["bytes"] >= cats["parameters"] + cats["optimizer_state"]
    t = time_steps(step, warmup=1, repeats=3, device="cuda")
    assert t["how"] == "cuda events" and t["n"] == 3 and 0 < t["p20"] <= t["p80"]


@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
def test_checkpoint_held_block_inputs_are_counted(name):
    """torch.utils.checkpoint (non-reentrant) keeps each checkpointed block's input as a saved tensor made through the
    default saved-tensor hooks (``_CheckpointFrame.save_inputs``), so the accountant counts it; what the block saves
    inside the region is not saved (its own hooks), which is the point of checkpointing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    import lowmembp
    from lowmembp.measurement.saved import _storage_key, saved_bytes
    from lowmembp.models import get_layout
    from tiny_models import build

    model, inputs = build(name)
    batch = inputs()
    plain = saved_bytes(model, lambda: model(batch["x"]) if name == "vit" else model(**batch))
    lowmembp.apply(model, "checkpointing")
    keys = []
    hooks = [site.get().register_forward_pre_hook(
        lambda mod, args, kwargs: keys.append(_storage_key(kwargs.get("hidden_states", args[0] if args else None))),
        with_kwargs=True) for site in get_layout(model).blocks]
    model.train()
    with SavedTensorAccountant(model) as acc:
        model(batch["x"]) if name == "vit" else model(**batch)
    for h in hooks:
        h.remove()
    counted = {s.ref.cdata for s in acc.storages}
    assert keys and all(k in counted for k in keys)
    assert acc.report()["total"] < plain["total"] / 2


def test_checkpoint_region_counts_its_input_only():
    from torch.utils.checkpoint import checkpoint

    m = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    h = torch.randn(32, 64, requires_grad=True) * 2  # an input nothing else saves (x * scalar saves nothing)
    with SavedTensorAccountant(m) as acc:
        checkpoint(m, h, use_reentrant=False).sum().backward()
    assert acc.report()["total"] == h.numel() * 4
    with SavedTensorAccountant(m) as acc:
        m(h)
    assert acc.report()["total"] > 3 * h.numel() * 4  # without checkpointing: the inputs of both linears and GELU


class _FailingStorage(torch.Tensor):
    """A tensor whose storage query fails with a RuntimeError: a fault to report, not a tensor without storage."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.untyped_storage:
            raise RuntimeError("storage query failed")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensors_without_storage_are_skipped_and_other_failures_propagate():
    """Sparse tensors and functorch's batched wrappers have no storage (torch: NotImplementedError): not counted.
    Any other failure of the storage query reaches the caller."""
    from lowmembp.measurement.peak import _storage
    from lowmembp.measurement.saved import _storage_key

    sparse = torch.eye(3).to_sparse()
    assert _storage(sparse) is None and _storage_key(sparse) is None
    seen = []
    torch.vmap(lambda x: seen.append((_storage(x), _storage_key(x))) or x.sum())(torch.randn(2, 3))
    assert seen == [(None, None)]
    dense = torch.randn(3)
    assert _storage(dense).nbytes() == 12 and _storage_key(dense) == _storage_key(dense[1:])
    failing = torch.randn(3).as_subclass(_FailingStorage)
    for probe in (_storage, _storage_key):
        with pytest.raises(RuntimeError, match="storage query failed"):
            probe(failing)
    w = torch.randn(3, 4, requires_grad=True)
    with SavedTensorAccountant(None) as acc:  # sparse.mm saves the sparse operand alone for w's gradient
        torch.sparse.mm(sparse, w)
    assert acc.report()["total"] == 0
    with SavedTensorAccountant(None) as acc:
        torch.sparse.mm(sparse, w)
        (w * w).sum()  # saves w twice: one storage of 3 × 4 floats
    assert acc.report()["total"] == 48
