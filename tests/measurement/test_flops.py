"""lowmembp.measurement.flops: the step FLOP counter hands torch's formulas the shapes by its own conversion (not
torch's pytree map); the totals must be torch's, op by op and over whole training steps (real and fake tensors)."""
import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper

from lowmembp.estimator.step import make_optimizer, prepare_model, train_step
from lowmembp.estimator.zoo import MODELS, make_batch
from lowmembp.estimator.fake_mode import StepFakeMode
from lowmembp.measurement.flops import _SHAPED, _cpu_formulas, step_flop_counter


def _torchs():
    """A counter with torch's own registry as torch wraps it (its pytree shape conversion)."""
    counter = step_flop_counter()
    counter._registry = {**flop_registry, **{k: shape_wrapper(v) for k, v in _cpu_formulas().items()}}
    return counter


def _ops():
    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 4, requires_grad=True)
    (a @ b).sum().backward()
    torch.addmm(torch.randn(4), a, b)
    torch.baddbmm(torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5))
    x = torch.randn(1, 3, 9, 9, requires_grad=True)
    torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3), stride=[2, 2], padding=[1, 1]).sum().backward()
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()


def test_each_op_counts_what_torchs_formulas_count():
    ours, theirs = step_flop_counter(), _torchs()
    with ours:
        _ops()
    with theirs:
        _ops()
    assert ours.get_total_flops() == theirs.get_total_flops() > 0
    shaped = [k for k, f in theirs._registry.items() if getattr(f, "__code__", None) is _SHAPED]
    assert shaped and all(ours._registry[k] is not theirs._registry[k] for k in shaped)  # ours in use


def test_a_fake_training_step_counts_what_torchs_formulas_count():
    spec = MODELS["llama-7b"]
    overrides = {"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "vocab_size": 61}
    totals = []
    for make in (step_flop_counter, _torchs):
        mode = StepFakeMode(allow_non_fake_inputs=True)
        model = prepare_model(spec, "lora+checkpointing", mode, layers=2, overrides=overrides)
        with mode:
            opt = make_optimizer(model)
            batch = make_batch(spec, model, 3, 9, overrides["vocab_size"])
            counter = make()
            with counter:
                train_step(spec, model, batch, opt, "bf16")
        totals.append(counter.get_total_flops())
    assert totals[0] == totals[1] > 0
