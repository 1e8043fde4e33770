"""``tiled-mlp``: the loss and every gradient equal the plain model's to rounding (float64) on ViT, BERT and LLaMA,
with tiles that do not divide the sequence; each tile recomputed in the backward; composes with lora / lowmembp /
checkpointing / tokentune; fewer saved bytes and a lower step peak than the plain model at a long sequence; eval
and export give the plain model back; clear refusals."""
import copy
import functools

import pytest
import torch

import lowmembp
from peers_common import FAMILIES, assert_same_step, loss_of, same_lora_b, saved_total, train_steps
from tiny_models import build, logits


def _double(batch):
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


def _pair(name, spec, base="baseline", **options):
    """(reference, tiled, batch) in float64: ``base`` applied to the reference, ``spec`` to the other."""
    model, inputs = build(name)
    model.double()
    for m in model.modules():  # GPT-2's tiny config keeps dropout 0.1: masks are drawn per tile
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref = lowmembp.apply(copy.deepcopy(model), base).train()
    out = lowmembp.apply(model, spec, **options).train()
    return ref, out, _double(inputs())


EXACT = 1e-12  # float64: the tiles' sums round apart by ~1e-16 per op


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("options", [{"tiles": 3}, {"tile_len": 2}, {"tile_len": 5}, {}])
def test_loss_and_every_gradient_equal_the_plain_models(name, options):
    """The text batches have 2 × 7 tokens, ViT 2 × 17 (16 patches + [CLS]): 3 tiles of 5/5/4 or 12/11/11 (one
    spanning two sequences), tiles of 2 or 5 tokens (a shorter last one), and the default (32-token tiles: one tile
    of text, two of ViT)."""
    ref, out, batch = _pair(name, "tiled-mlp", **options)
    assert_same_step(ref, out, batch, EXACT)


class _Counter:
    """Counts the calls of each MLP's plain forward and the token counts it saw."""

    def __init__(self, model):
        from lowmembp.methods.tiled_mlp import _TiledForward
        self.seen = []
        self.wrappers = [w for m in model.modules() for w in m.__dict__.values() if isinstance(w, _TiledForward)]
        assert self.wrappers
        for w in self.wrappers:
            w.inner = self._wrap(w.inner or getattr(type(w.owner), w.attr).__get__(w.owner))

    def _wrap(self, fn):
        @functools.wraps(fn)  # the same signature (transformers' apply_chunking_to_forward reads it)
        def counted(x, *a, **k):
            self.seen.append(x.shape[:-1].numel())  # tokens
            return fn(x, *a, **k)
        return counted


@pytest.mark.parametrize("name", FAMILIES)
def test_each_tile_runs_once_forward_and_once_recomputed(name):
    _, out, batch = _pair(name, "tiled-mlp", tile_len=3)
    counter = _Counter(out)
    loss = loss_of(out, batch)
    length = 2 * (17 if name == "vit" else 7)  # the batch's tokens end to end
    tiles = [3] * (length // 3) + [length % 3]
    assert counter.seen == tiles * len(counter.wrappers)
    loss.backward()
    assert sorted(counter.seen) == sorted(tiles * len(counter.wrappers) * 2)  # each tile recomputed once
    counter.seen.clear()
    with torch.no_grad():
        logits(out, batch)
    assert counter.seen == [length] * len(counter.wrappers)  # no grad: the plain MLP, untiled
    counter.seen.clear()
    logits(out.eval(), batch)
    assert counter.seen == [length] * len(counter.wrappers)  # eval: untiled


@pytest.mark.parametrize("spec", ["lora", "lowmembp", "checkpointing", "lora+lowmembp+checkpointing"])
@pytest.mark.parametrize("name", FAMILIES)
def test_composes_exactly(spec, name):
    """float64, except with lowmembp (its MS norms and activations run in float32 / 16-bit): there the tiles' matmuls
    round apart by float32's ~1e-7 per op; the bound 2e-5 of the largest gradient leaves room for the sums."""
    torch.manual_seed(3)
    model, inputs = build(name)
    fp64 = "lowmembp" not in spec
    if fp64:
        model.double()
    torch.manual_seed(4)
    ref = lowmembp.apply(copy.deepcopy(model), spec).train()
    torch.manual_seed(4)
    out = lowmembp.apply(model, spec + "+tiled-mlp", tiles=2).train()
    same_lora_b(ref, out)
    assert_same_step(ref, out, _double(inputs()) if fp64 else inputs(), EXACT if fp64 else 2e-5)


@pytest.mark.parametrize("spec", ["tokentune+tiled-mlp", "mesa+tiled-mlp", "tiled-mlp+offload",
                                  "lora+chunked-ce+tiled-mlp", "velora+tiled-mlp"])
def test_composes_and_trains(spec):
    model, inputs = build("llama")
    options = {"tokentune": {"k": 3}, "velora": {"num_groups": 8}}
    m = lowmembp.apply(model, spec, tile_len=2, **options.get(spec.split("+")[0], {})).train()
    batch = inputs()
    if "chunked-ce" in spec:
        batch["labels"] = batch["input_ids"]
        losses, moved = train_steps(m, batch, loss=lambda mm, bb: mm(**bb).loss)
    else:
        losses, moved = train_steps(m, batch)
    assert moved and losses[-1] < losses[0]


def _long(name, length):
    model, _ = build(name)
    g = torch.Generator().manual_seed(1)
    return model, {"input_ids": torch.randint(1, 61, (1, length), generator=g)}


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_saved_bytes_and_step_peak_lower_at_a_long_sequence(name):
    from lowmembp.measurement.peak import measure_step_peak

    length = 256 if name == "llama" else 40  # tiny BERT has 40 positions
    rows = {}
    for spec in ("baseline", "tiled-mlp"):
        model, batch = _long(name, length)
        model = lowmembp.apply(model, spec, **({"tile_len": 8} if spec != "baseline" else {})).train()
        saved = saved_total(model, batch)["total"]
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step():
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak = measure_step_peak(model, opt, step, external=(batch["input_ids"],))
        rows[spec] = (saved, peak["bytes"], peak["by_category"].get("activations", 0))
    print(f"\n{name} L={length}: saved bytes, step peak, peak activations: {rows}")
    assert rows["tiled-mlp"][0] < rows["baseline"][0]
    assert rows["tiled-mlp"][1] < rows["baseline"][1]


def test_export_and_state_dict_give_the_plain_model():
    model, inputs = build("llama")
    stock = copy.deepcopy(model)
    m = lowmembp.apply(model, "tiled-mlp", tiles=2).train()
    assert set(m.state_dict()) == set(stock.state_dict())
    train_steps(m, inputs())
    exported = lowmembp.export(m)
    assert not any("forward" in x.__dict__ or "_lowmembp_tiled_mlp" in x.__dict__ for x in exported.modules())
    with torch.no_grad():
        torch.testing.assert_close(logits(exported.eval(), inputs(3)), logits(m.eval(), inputs(3)))
    copy.deepcopy(m)  # the patched forwards copy and pickle


def test_refusals():
    with pytest.raises(ValueError, match="give tiles .* or tile_len .*, not both"):
        lowmembp.apply(build("llama")[0], "tiled-mlp", tiles=2, tile_len=4)
    with pytest.raises(ValueError, match="tiles must be a positive integer"):
        lowmembp.apply(build("llama")[0], "tiled-mlp", tiles=0)
    with pytest.raises(ValueError, match="cannot read"):
        lowmembp.apply(build("llama")[0], "tiled-mlp@tile_len=half")
    m = lowmembp.apply(build("llama")[0], "tiled-mlp@tile_len=3")
    assert m._tiled_mlp == {"tiles": None, "tile_len": 3, "mlps": 2}
    with pytest.raises(RuntimeError, match="already"):
        lowmembp.apply(m, "tiled-mlp")
    assert "tiled-mlp" in lowmembp.methods()


def test_tile_lengths():
    from lowmembp.methods.tiled_mlp import tile_lengths
    assert tile_lengths(7, 32, 3, None) == [3, 2, 2]
    assert tile_lengths(7, 32, 10, None) == [1] * 7
    assert tile_lengths(7, 32, None, 3) == [3, 3, 1]
    assert tile_lengths(70, 32, None, None) == [32, 32, 6]
    assert tile_lengths(5, 32, None, None) == [5]


def test_estimated_on_fake_tensors_below_the_plain_model():
    from lowmembp.estimator.step import estimate

    saved = {m: estimate("llama-7b", m, batch_size=1, seq_len=256, layers=2)["saved"]["total"]
             for m in ("baseline", "tiled-mlp")}
    assert 0 < saved["tiled-mlp"] < saved["baseline"]


@pytest.mark.parametrize("name", ["swin", "gpt2", "gemma2", "phi3", "modernbert", "clip_vision"])
def test_more_families_exact(name):
    """Other block layouts the adapters find (Swin's B × H × W × C input, GPT-2's Conv1D MLP reshaping its input,
    ModernBERT's fused up projection, ...)."""
    ref, out, batch = _pair(name, "tiled-mlp", tile_len=3)
    assert_same_step(ref, out, batch, EXACT)


@pytest.mark.parametrize("name", ["distilbert", "debertav2"])
def test_blocks_without_a_known_mlp_are_refused(name):
    with pytest.raises(ValueError, match="no 'mlp' child and no BERT 'feed_forward_chunk'"):
        lowmembp.apply(build(name)[0], "tiled-mlp")
