"""``offload``: gradients equal the baseline's exactly (alone, with checkpointing, with LoRA); exactly the saved tensors
of the block-loop module go to host memory, the head's stay; the peak tracker reports host bytes apart and the device
peak falls by them; on fake tensors (paper scale) the copies are made and the device peak falls by the offloaded
bytes; trains a tiny ViT, BERT and LLaMA; composition rules. GPU: pinned copies on a side stream."""
import copy

import pytest
import torch

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.methods.offload import block_loop_owner
from lowmembp.models import get_layout
from lowmembp.measurement.peak import measure_step_peak
from peers_common import FAMILIES, grads, loss_of, pair, saved_total, train_steps
from tiny_models import build, logits


@pytest.mark.parametrize("name,spec", [(f, "offload") for f in FAMILIES] + [
    ("vit", "checkpointing+offload"), ("llama", "checkpointing+offload"), ("bert", "lora+offload"),
    ("llama", "sac+offload")])
def test_gradients_equal_baseline(name, spec):
    ref_spec = spec.replace("+offload", "").replace("offload", "baseline")
    model, inputs = build(name)
    batch = inputs()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)  # the same LoRA initialisation on both
    ref = lowmembp.apply(ref, ref_spec).train()
    torch.manual_seed(1)
    model = lowmembp.apply(model, spec).train()
    loss_of(ref, batch).backward()
    loss_of(model, batch).backward()
    g0, g1 = grads(ref), grads(model)
    assert g0.keys() == g1.keys() and g0
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_exactly_the_block_loop_tensors_go_to_host(name):
    """With min_bytes=0 the ledger holds, after the forward, exactly the bytes the baseline saves inside the module
    that runs the blocks — minus the head's (kept on the device, as torchtune keeps the LM head's output)."""
    ref, model, batch = pair(name, "offload", min_bytes=0)
    layout = get_layout(model)
    trunk = block_loop_owner(layout)
    prefix = next(n for n, m in model.named_modules() if m is trunk)  # the same names in ref (no wrapper)
    heads = [n for n, m in model.named_modules() if any(m is s.get() for s in layout.head)]
    with SavedTensorAccountant(ref) as acc:
        logits(ref, batch)

    def inside(module):
        under = prefix == "" or module == prefix or module.startswith(prefix + ".")
        return under and not any(module == h or module.startswith(h + ".") for h in heads)
    expected = sum(r["bytes"] for r in acc.table() if inside(r["module"]))
    out = logits(model, batch)
    ledger = model._lowmembp_host_ledger
    assert ledger.current == expected > 0
    del out
    assert ledger.current == 0  # the graph is gone: nothing left on the host


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_bytes_still_counted_and_min_bytes(name):
    _, base, batch = pair(name, "baseline")
    _, off, _ = pair(name, "offload")
    assert saved_total(off, batch)["total"] == saved_total(base, batch)["total"]  # the accountant still sees all
    _, big, _ = pair(name, "offload", min_bytes=1 << 30)
    logits(big, batch)
    assert big._lowmembp_host_ledger.peak == 0


def _peak(model, batch):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return measure_step_peak(model, opt, step, warmup=1)


@pytest.mark.parametrize("name", ["vit", "llama"])
def test_peak_reports_host_bytes_apart(name):
    model, inputs = build(name)
    batch = {k: torch.cat([v] * 8) for k, v in inputs().items()}  # batch 16: activations matter
    base = _peak(copy.deepcopy(model).train(), batch)
    off_model = lowmembp.apply(copy.deepcopy(model), "offload").train()
    off = _peak(off_model, batch)
    assert "host" not in base
    host = off["host"]
    assert host["bytes"] == off_model._lowmembp_host_ledger.peak > 0  # tracker and ledger agree
    # on the CPU nothing moves: the live bytes are the baseline's, split into device and host
    assert off["bytes"] + host["at_device_peak"] <= base["bytes"]
    assert off["bytes"] < base["bytes"] - host["bytes"] // 4


def test_fake_tensors_make_the_copies():
    """Paper scale (ViT-B/16 at full width, two blocks, fp16): the accountant's saved bytes are unchanged, the host
    holds all of them (and autocast's weight copies, also saved for backward), and the device peak falls."""
    from lowmembp.estimator.step import estimate

    kw = dict(layers=2, batch_size=4, dtype="fp16")
    base = estimate("vit-b16", "baseline", **kw)
    off = estimate("vit-b16", "offload", **kw)
    assert off["saved"]["total"] == base["saved"]["total"]
    host = off["peak"]["host"]["bytes"]
    kept = base["saved"]["total"] + base["saved"]["param_casts"]  # autocast's fp16 weight copies are saved tensors too
    assert 0.95 * kept < host < 1.05 * kept
    assert base["peak"]["bytes"] - off["peak"]["bytes"] > 0.2 * host


@pytest.mark.parametrize("name", FAMILIES)
def test_trains(name):
    _, model, batch = pair(name, "offload")
    losses, moved = train_steps(model, batch)
    assert moved and losses[-1] < losses[0]


def test_eval_and_composition_rules():
    ref, model, batch = pair("bert", "offload")
    ref.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(model, batch), logits(ref, batch), rtol=0, atol=0)
    assert model._lowmembp_host_ledger.peak == 0
    with pytest.raises(ValueError, match="cannot be combined"):
        lowmembp.apply(build("llama")[0], "offload+tokentune")
    with pytest.raises(ValueError, match="min_bytes"):
        lowmembp.apply(build("llama")[0], "offload", min_bytes=-1)


@pytest.mark.gpu
def test_cuda_pinned_side_stream():
    ref, model, batch = pair("llama", "offload")
    ref, model = ref.cuda(), model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    loss_of(ref, batch).backward()
    loss_of(model, batch).backward()
    for k, g in grads(ref).items():
        torch.testing.assert_close(grads(model)[k], g, rtol=0, atol=0)
    assert model._lowmembp_host_ledger.peak > 0
    pk = _peak(model, {k: torch.cat([v] * 8) for k, v in batch.items()})
    assert "cuda" in pk["how"] and pk["host"]["bytes"] > 0


def test_saved_tensors_come_back_with_their_strides_sac_on_fake_tensors():
    """SAC's recomputation must see what it saved with its layout (a transposed attention output stays transposed,
    or ``contiguous()`` clones in the recomputation and SAC's op log no longer matches): sac+offload on fake tensors."""
    from lowmembp.estimator.step import estimate

    small = dict(layers=2, batch_size=2, seq_len=8, overrides=dict(hidden_size=64, intermediate_size=128,
                                                                    num_attention_heads=4, num_key_value_heads=4,
                                                                    vocab_size=100))
    sac = estimate("llama-7b", "sac", **small)
    both = estimate("llama-7b", "sac+offload", **small)
    assert both["saved"]["total"] == sac["saved"]["total"]
    assert both["peak"]["host"]["bytes"] > 0.5 * sac["saved"]["total"]


def test_a_new_tensor_where_a_freed_one_was_gets_its_own_copy():
    """Each distinct view is copied once, but only while its storage lives: a tensor the allocator puts where a freed,
    offloaded one was (same shape, the next block's) must get its own host copy, not the freed tensor's (which would
    come back in its place in the backward). On fake tensors, where freed storages' addresses are reused at once."""
    import torch.nn as nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowmembp.methods.offload import HostLedger, Offloader

    off = Offloader(nn.Linear(2, 2), min_bytes=0, ledger=HostLedger())
    with FakeTensorMode():
        with off.hooks():
            helds = []
            for _ in range(64):
                t = torch.empty(32, 48)
                helds.append(off.pack(t))
                del t                                   # its storage dies; the next one may take its address
            x = torch.empty(16, 8)
            same = off.pack(x), off.pack(x), off.pack(x.view(8, 16))
        off.done()
    assert len({id(h) for h in helds}) == 64 and all(h.moved for h in helds)
    assert same[0] is same[1] and same[2] is not same[0]    # one copy per distinct view of a live storage


def test_tensors_without_storage_stay_and_other_failures_propagate():
    """The pack hook keeps a strided tensor without storage (functorch's batched wrapper: torch raises
    NotImplementedError) on the device as it is; any other failure of the storage query reaches the caller."""
    from lowmembp.methods.offload import HostLedger, Offloader

    class FailingStorage(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.untyped_storage:
                raise RuntimeError("storage query failed")
            return super().__torch_function__(func, types, args, kwargs or {})

    model = torch.nn.Linear(4, 4)
    ledger = HostLedger()
    off = Offloader(model, min_bytes=0, ledger=ledger)
    off.hooks()  # the parameters' storages, to be skipped
    kept = []
    torch.vmap(lambda x: kept.append(off.pack(x) is x) or x.sum())(torch.randn(2, 8))
    assert kept == [True] and ledger.current == 0
    assert off.pack(model.weight.detach()) is not None and ledger.current == 0  # a parameter's storage: skipped
    with pytest.raises(RuntimeError, match="storage query failed"):
        off.pack(torch.randn(8).as_subclass(FailingStorage))

