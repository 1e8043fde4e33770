"""The row helpers under TokenTune's family forwards (lowmembp/models/rows.py): indexing and merging row subsets of
B×L tensors, with the graph kept where it belongs."""
import torch
import torch.nn as nn

from lowmembp.models.rows import Context, Rows, call_as, embed_rows, merge, norm_all_rows, take
from lowmembp.models.tokentune_families import DRIVERS


def _split(B=2, L=7, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(L, generator=g) for _ in range(B)])
    return order[:, :k].sort(1).values, order[:, k:].sort(1).values


def test_take_is_gather_of_rows():
    t = torch.randn(2, 7, 5)
    idx, _ = _split()
    assert torch.equal(take(t, idx), t.gather(1, idx[..., None].expand(-1, -1, 5)))


def test_merge_puts_each_row_back_and_keeps_the_graph_on_grad_rows_only():
    t = torch.randn(2, 7, 5, requires_grad=True)
    sel, oth = _split()
    with torch.no_grad():
        const = take(t, oth)
    out = merge(const, oth, take(t, sel), sel, 7)
    assert torch.equal(out, t.detach())
    out.sum().backward()
    chosen = torch.zeros(2, 7, dtype=torch.bool).scatter_(1, sel, True)
    assert torch.equal(t.grad, chosen[..., None].float().expand(-1, -1, 5))


def test_embed_rows_keeps_the_graph_on_the_selected_rows():
    t = torch.randn(2, 7, 5, requires_grad=True)
    sel, _ = _split(seed=1)
    out = embed_rows(t, sel)
    assert torch.equal(out, t.detach())
    out.sum().backward()
    chosen = torch.zeros(2, 7, dtype=torch.bool).scatter_(1, sel, True)
    assert torch.equal(t.grad, chosen[..., None].float().expand(-1, -1, 5))
    plain = torch.randn(2, 7, 5)
    assert embed_rows(plain, sel) is plain


def test_frozen_norm_runs_the_others_without_graph():
    norm = nn.LayerNorm(5).requires_grad_(False)
    h = torch.randn(2, 7, 5, requires_grad=True)
    sel, oth = _split(seed=2)
    ctx = Context(length=7, selected=Rows(sel), others=Rows(oth))
    out = norm_all_rows(norm, h, ctx)
    torch.testing.assert_close(out, norm(h))
    (out * torch.linspace(-1, 1, 5)).sum().backward()  # (a plain sum of a LayerNorm's output has no gradient)
    chosen = torch.zeros(2, 7, dtype=torch.bool).scatter_(1, sel, True)
    assert bool((h.grad.abs().sum(-1) > 0).eq(chosen).all())


def test_call_as_runs_hooks_and_restores_forward():
    m = nn.Identity()
    seen = []
    m.register_forward_hook(lambda mod, args, out: seen.append(out))
    assert call_as(m, lambda x: x + 1, torch.tensor(1.0)) == 2.0
    assert seen == [torch.tensor(2.0)] and "forward" not in m.__dict__


def test_drivers_are_named_as_the_adapters_name_them():
    assert list(DRIVERS) == ["vit", "bert", "llama"]
    assert all(f.name == n for n, f in DRIVERS.items())
