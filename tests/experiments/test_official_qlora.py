"""The emulation of the official LowMemoryBP QLoRA run's memory (experiments.repro.official_qlora) on a tiny LLaMA on
fake tensors: bf16 adapters, fp32 norms (qlora.py:437-442), each 4-bit linear keeping its bf16 input (bitsandbytes'
MatMul4Bit), LoRA dropout with CUDA's 1-byte masks; the patches are gone when the context closes; KeptInputMatmul's
gradient is the matmul's."""
from __future__ import annotations

import torch

import lowmembp.measurement.saved as memory
from lowmembp.estimator.step import estimate
from experiments.repro import official_qlora as oq

KW = dict(batch_size=2, seq_len=16, layers=2, rank=4, alpha=16, weights="bf16",
          overrides={"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 160, "num_key_value_heads": 4})
B, S, D, I = 2, 16, 64, 160


def _block_rows(monkeypatch, method="lora", emulate=True, **kw):
    tables = []
    report = memory.SavedTensorAccountant.report

    def rep(self):
        tables.append(self.table())
        return report(self)

    monkeypatch.setattr(memory.SavedTensorAccountant, "report", rep)
    if emulate:
        with oq.emulated():
            est = estimate("llama-7b", method, **KW, **kw)
    else:
        est = estimate("llama-7b", method, **KW, **kw)
    return est, [r for r in tables[-1] if ".layers.1." in r["module"]]


def test_each_four_bit_linear_keeps_its_bf16_input(monkeypatch):
    est, rows = _block_rows(monkeypatch)
    kept = {r["module"].rsplit(".", 2)[-2]: r for r in rows if r["module"].endswith(".base_layer")}
    assert set(kept) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} - {"o_proj"}
    for name, r in kept.items():  # o_proj's input is the attention output, kept by attention already (one storage)
        assert r["dtype"] == "bfloat16"
        assert r["bytes"] == B * S * (I if name == "down_proj" else D) * 2
    _, plain = _block_rows(monkeypatch, emulate=False)
    assert not any(r["module"].endswith(".base_layer") for r in plain)  # peft's frozen linear keeps nothing


def test_dropout_keeps_cuda_one_byte_masks(monkeypatch):
    _, rows = _block_rows(monkeypatch, dropout=0.1)
    masks = [r for r in rows if "lora_dropout" in r["module"]]
    assert len(masks) == 7 and all(r["dtype"] == "bool" for r in masks)
    assert sum(r["bytes"] for r in masks) == B * S * (6 * D + I)


def test_dtypes_as_the_official_script_and_patches_undone(monkeypatch):
    import torch.nn.functional as F

    import lowmembp
    from lowmembp.estimator import step as est_mod

    seen = {}
    prepare = est_mod.prepare_model

    def spy(*a, **k):
        model = prepare(*a, **k)
        seen["lora"] = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
        seen["norm"] = {p.dtype for n, p in model.named_parameters() if "norm" in n}
        seen["embed"] = {p.dtype for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n}
        return model

    monkeypatch.setattr(est_mod, "prepare_model", spy)
    apply, dropout = lowmembp.apply, F.dropout
    with oq.emulated():
        estimate("llama-7b", "lora", **KW)
    assert seen == {"lora": {torch.bfloat16}, "norm": {torch.float32}, "embed": {torch.bfloat16}}
    assert lowmembp.apply is apply and F.dropout is dropout


def test_paged_optimizer_state_is_what_the_peak_leaves_out(monkeypatch):
    est, _ = _block_rows(monkeypatch)
    assert oq.paged_optimizer_bytes(est) == est["peak"]["by_category"]["optimizer_state"] > 0


def test_kept_input_matmul_gradient_is_the_matmul_gradient():
    torch.manual_seed(0)
    a = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, dtype=torch.float64)
    torch.autograd.gradcheck(lambda x: oq.KeptInputMatmul.apply(x, w), (a,))
    x = torch.randn(2, 7, requires_grad=True)
    layer = torch.nn.Linear(7, 3)
    out = oq.four_bit_forward(layer, x, torch.float32)
    torch.testing.assert_close(out, layer(x))


def test_cuda_dropout_keeps_a_bool_mask_and_scales():
    torch.manual_seed(0)
    x = torch.ones(1000, requires_grad=True)
    y = oq.cuda_dropout(x, 0.1, True)
    kept = y != 0
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.9))
    assert 0.8 < kept.float().mean() < 0.97
    assert oq.cuda_dropout(x, 0.1, False) is x and oq.cuda_dropout(x, 0.0, True) is x
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "NativeDropoutBackward0"
