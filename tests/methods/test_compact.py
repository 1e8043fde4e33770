"""The ``compact`` method (lowmembp.methods.compact): it converts the blocks' trained linears only, keeps the forward
exact and the parameters' names, runs the plain forward in eval, exports back to the stock model; linears of one input
share one projection; with lowmembp it saves less than either alone (paper-scale widths, fake tensors)."""
import pytest
import torch
import transformers

import lowmembp
from lowmembp.measurement.saved import SavedTensorAccountant
from lowmembp.methods.compact import compact_layers, rank_of


def _llama(width=32, layers=1):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=width, intermediate_size=2 * width,
                                   num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_converts_the_block_linears_exact_forward_and_plain_in_eval():
    ref, m = _llama(), lowmembp.apply(_llama(), "compact@ratio=0.5")
    names = sorted(n for n, x in m.named_modules() if x in compact_layers(m))
    assert names == sorted(f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                            "self_attn.v_proj", "self_attn.o_proj",
                                                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert m.model.layers[0].mlp.down_proj._compact["rank"] == rank_of(64, 0.5) == 32
    ids = torch.randint(0, 64, (2, 8))
    m.train(), ref.train()
    out, want = m(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits)
    out.loss.backward(), want.loss.backward()
    refs = dict(ref.named_parameters())
    for n, p in m.named_parameters():
        if n.endswith("weight") and "proj" in n:
            assert not torch.allclose(p.grad, refs[n].grad)  # the projections' weight gradients: estimates
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)
    plain = lowmembp.export(m)
    assert not compact_layers(plain) and "forward" not in plain.model.layers[0].mlp.down_proj.__dict__


def test_nothing_to_convert_and_bad_options_refuse():
    with pytest.raises(ValueError, match="frozen base"):
        lowmembp.apply(_llama(), "lora+compact")
    with pytest.raises(ValueError, match="ratio"):
        lowmembp.apply(_llama(), "compact@ratio=1.5")
    with pytest.raises(ValueError, match="mesa"):
        lowmembp.apply(_llama(), "compact+mesa")


def test_the_linears_of_one_input_share_one_projection():
    m = lowmembp.apply(_llama(width=64), "compact")  # r = 16 of 64
    m.train()
    ids = torch.randint(0, 64, (2, 16))
    acc = SavedTensorAccountant(m)
    with acc:
        m(input_ids=ids, labels=ids).loss.backward()
    rows = {r["module"]: r["bytes"] for r in acc.table() if r["kind"] == "linear"}
    # q (shared with k and v) and gate (shared with up): 32 tokens x 16 fp32 each; down: 32 x 32 of its 128 inputs
    assert rows["model.layers.0.self_attn.q_proj"] == 32 * 16 * 4
    assert rows["model.layers.0.mlp.gate_proj"] == 32 * 16 * 4
    assert "model.layers.0.self_attn.k_proj" not in rows and "model.layers.0.mlp.up_proj" not in rows
    assert rows["model.layers.0.mlp.down_proj"] == 32 * 32 * 4


def test_with_lowmembp_it_saves_less_than_either_alone_at_llama_7b_width():
    from lowmembp.estimator import estimate

    per_block = {}
    for spec in ("baseline", "compact", "lowmembp", "compact+lowmembp"):
        r = estimate("llama-7b", spec, batch_size=1, seq_len=64, dtype="bf16", weights="bf16", layers=2, peak=False)
        per_block[spec] = sum(r["per_block"].values())
    assert per_block["compact"] < per_block["baseline"]
    assert per_block["compact+lowmembp"] < min(per_block["compact"], per_block["lowmembp"])
