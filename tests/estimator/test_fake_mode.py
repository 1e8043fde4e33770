"""lowmembp.estimator.fake_mode.StepFakeMode: torch's FakeTensorMode with a one-pass cache key and its cache hits served
from recipes. It must give what FakeTensorMode gives, op for op: a whole training step (every single method on a
tiny LLaMA, a few on ViT and BERT) runs the same ops with the same output metadata and the same storage sharing in
both modes, calls that differ only in one fact of an argument (strides, storage offset, storage size,
requires_grad, dtype, a scalar's type) are told apart, and what the key form does not cover goes to torch's key code
(real tensors, constants) and still works. The fast key and the recipes must also be in use (keys in its form in
the cache, most ops of a step served from recipes), or these tests would compare torch with itself."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lowmembp.estimator.step import make_optimizer, prepare_model, train_step
from lowmembp.estimator.zoo import MODELS, make_batch
from lowmembp.estimator.fake_mode import DEVICE_QUERY, KEY_MARK, StepFakeMode
from lowmembp.measurement.peak import prime_optimizer
from lowmembp.plan.combos import combinations

SMALL = {
    "llama-7b": dict(overrides={"hidden_size": 32, "intermediate_size": 56, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "vocab_size": 61}, seq_len=9, dtype="bf16"),
    "vit-b16": dict(overrides={"img_size": 32, "embed_dim": 48, "num_heads": 3}, seq_len=None, dtype="fp16"),
    "bert_base": dict(overrides={"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4,
                                 "vocab_size": 101}, seq_len=13, dtype="fp16"),
}
CASES = ([("llama-7b", m) for m in combinations(max_methods=1)[0]]
         + [("llama-7b", m) for m in ("lora+lowmembp+sac", "lora-fa+mesa+checkpointing", "tokentune+offload")]
         + [(model, m) for model in ("vit-b16", "bert_base") for m in ("baseline", "lora+lowmembp", "mesa")])


def _meta(x):
    if isinstance(x, FakeTensor):
        return ("fake", x.dtype, tuple(x.shape), x.stride(), str(x.fake_device), x.storage_offset(),
                x.untyped_storage().nbytes(), x.requires_grad, x.is_conj(), x.is_neg())
    if isinstance(x, (list, tuple)):
        return tuple(_meta(y) for y in x)
    return repr(x) if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else type(x).__name__


def _recording(base):
    class Recording(base):
        """Records the ops its caller runs, not those of its own decompositions (which run on a cache miss only,
        so they depend on what the shared cache already holds, e.g. from earlier tests)."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.ops, self._inside = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._inside:
                return super().__torch_dispatch__(func, types, args, kwargs or {})
            self._inside += 1
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs or {})
            finally:
                self._inside -= 1
            self.ops.append((str(func), _meta(out), _shares(args, kwargs, out)))
            return out
    return Recording


def _shares(args, kwargs, out):
    """For each output tensor, the positions of the arguments whose storage it is on (views, in-place ops)."""
    import torch.utils._pytree as pytree
    ins = [t.untyped_storage()._cdata if isinstance(t, torch.Tensor) else None
           for t in pytree.tree_leaves((args, kwargs or {}))]
    return tuple(tuple(i for i, s in enumerate(ins) if s == t.untyped_storage()._cdata)
                 for t in pytree.tree_leaves(out) if isinstance(t, FakeTensor))


def _step_ops(base, model_name, method):
    spec, kw = MODELS[model_name], SMALL[model_name]
    torch.manual_seed(0)
    mode = _recording(base)(allow_non_fake_inputs=True)
    model = prepare_model(spec, method, mode, layers=2, overrides=kw["overrides"])
    with mode:
        opt = make_optimizer(model)
        prime_optimizer(opt)
        batch = make_batch(spec, model, 3, kw["seq_len"], kw["overrides"].get("vocab_size"))
        train_step(spec, model, batch, opt, kw["dtype"])
        train_step(spec, model, batch, opt, kw["dtype"])  # a second step: the cache's hits
    return mode.ops


def _fast_keys():
    return sum(1 for k in FakeTensorMode.cache if KEY_MARK in k.key)


@pytest.mark.parametrize("model_name,method", CASES, ids=[f"{a}:{b}" for a, b in CASES])
def test_a_training_step_runs_the_same_ops_with_the_same_outputs(model_name, method):
    try:
        want = _step_ops(FakeTensorMode, model_name, method)
    except Exception as e:  # noqa: BLE001  a method that cannot run on this model: it must refuse in both modes
        with pytest.raises(type(e)):
            _step_ops(StepFakeMode, model_name, method)
        return
    before = _fast_keys()
    served = []
    build = StepFakeMode._from_recipe
    StepFakeMode._from_recipe = lambda self, recipe, args: served.append(1) or build(self, recipe, args)
    try:
        got = _step_ops(StepFakeMode, model_name, method)
    finally:
        StepFakeMode._from_recipe = build
    assert len(got) == len(want) > 50
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"op {i}: {g} != {w}"
    assert _fast_keys() >= before  # (the cache may have held them from another case)
    assert _fast_keys() > 0
    real = [g for g in got if g[0] != str(DEVICE_QUERY)]  # (device queries are answered without the cache)
    assert len(served) > len(real) // 2  # two steps: at least the second one's ops from recipes


def _both(fn):
    """``fn()`` in a plain fake mode and in a StepFakeMode: the outputs' metadata."""
    out = []
    for base in (FakeTensorMode, StepFakeMode):
        with base(allow_non_fake_inputs=True):
            out.append(_meta(fn()))
    return out


@pytest.mark.parametrize("name,fn", [
    # the same op on arguments that differ in one fact only, in one call so that the second could hit the first's
    # cache entry; the results differ (first vs second) in the plain mode, and must in the fast one alike
    ("strides", lambda: [torch.empty(4, 6).clone(), torch.empty(6, 4).t().clone()]),
    ("storage offset", lambda: [torch.empty(10)[2:6].view(2, 2), torch.empty(10)[3:7].view(2, 2)]),
    ("storage size", lambda: [torch.ops.aten.alias(torch.empty(10)[:4]), torch.ops.aten.alias(torch.empty(12)[:4])]),
    ("requires_grad", lambda: [torch.empty(3, requires_grad=True) * 2, torch.empty(3) * 2]),
    ("dtype", lambda: [torch.empty(3, dtype=torch.float16) * 2, torch.empty(3, dtype=torch.float32) * 2]),
    ("scalar type", lambda: [torch.ones(3, dtype=torch.bool) + 1, torch.ones(3, dtype=torch.bool) + 1.0,
                             torch.ones(3, dtype=torch.bool) + True]),
    ("size list", lambda: [torch.empty(6).view([2, 3]), torch.empty(6).view([3, 2]), torch.empty(6).view((6,))]),
    ("kwargs", lambda: [torch.empty(2, 3).sum(dim=0), torch.empty(2, 3).sum(dim=1, keepdim=True)]),
])
def test_arguments_that_differ_in_one_fact_are_told_apart(name, fn):
    plain, fast = _both(fn)
    assert len(set(plain)) == len(plain), f"{name}: the cases are not distinct in torch's own mode"
    assert fast == plain


def test_a_device_query_gets_torchs_answer_without_its_dispatch(monkeypatch):
    """prim.device (in a whole step the ops above compare its answers too): the device torch's mode gives, for a
    fake CUDA and a fake CPU tensor, answered before FakeTensorMode.dispatch (which the plain mode goes through)."""
    calls = []
    dispatch = FakeTensorMode.dispatch

    def counted(self, func, *args, **kwargs):
        calls.append(func)
        return dispatch(self, func, *args, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    for base in (FakeTensorMode, StepFakeMode):
        calls.clear()
        with base(allow_non_fake_inputs=True):
            got = [DEVICE_QUERY(torch.empty(2, device=d)) for d in ("cuda", "cpu")]
        assert got == [torch.device("cuda", 0), torch.device("cpu")]
        assert calls.count(DEVICE_QUERY) == (2 if base is FakeTensorMode else 0), base


def test_what_the_key_form_does_not_cover_goes_to_torch():
    real = torch.arange(6.0)  # a real tensor argument (allow_non_fake_inputs): torch bypasses its cache
    plain, fast = _both(lambda: [torch.empty(6) + real, torch.tensor([1.0, 2.0]) * 3])  # and a constant
    assert fast == plain
    with StepFakeMode() as mode:
        x = torch.empty(3)
        key_args = []
        mode._prep_args_for_hash(key_args, (x, 2), None, [])
        assert key_args[0] is KEY_MARK                      # fake tensors and plain values: the one-pass key
        with pytest.raises(Exception):
            mode._prep_args_for_hash([], (real,), None, [])  # torch's code: bypasses the cache for a real tensor


def test_to_fake_cpu_gives_what_to_empty_gives():
    from lowmembp.estimator.step import to_fake_cpu

    def model():
        m = torch.nn.Linear(5, 3, device="meta")
        m.weight = torch.nn.Parameter(torch.empty(5, 3, device="meta").t())                  # dense, transposed
        m.register_buffer("wide", torch.empty(3, device="meta").expand(4, 3), persistent=False)  # not dense
        m.register_buffer("steps", torch.zeros((), dtype=torch.int64, device="meta"))
        return m

    got, want = [], []
    for make, out in ((lambda m: to_fake_cpu(m), got), (lambda m: m.to_empty(device="cpu"), want)):
        m = model()  # built before the fake mode is entered, as prepare_model does
        with StepFakeMode(allow_non_fake_inputs=True):
            m = make(m)
            out += [(n, type(t).__name__, _meta(t)) for n, t in [*m.named_parameters(), *m.named_buffers()]]
    assert got == want and len(got) == 4
    assert got[0][2][3] == (1, 3)  # the transposed weight keeps its strides


def _twice(fn):
    """``fn(x)`` twice in a StepFakeMode (the second from a recipe), and once in a plain FakeTensorMode."""
    served = []
    out = {}
    for base in (FakeTensorMode, StepFakeMode):
        with base(allow_non_fake_inputs=True) as mode:
            x = torch.empty(6, 4)
            first = fn(x)
            if base is StepFakeMode:
                build = mode._from_recipe
                mode._from_recipe = lambda recipe, args: served.append(1) or build(recipe, args)
            out[base] = (x, first, fn(x))
    return out[FakeTensorMode], out[StepFakeMode], len(served)


def test_a_recipe_builds_the_fake_tensor_torch_builds():
    """A new tensor, a view (on its argument's storage) and an in-place op (its argument itself): what the recipe
    gives has the metadata, the attributes (vars) and the dispatch keys of torch's own."""
    cases = {
        "new": lambda x: x * 2,
        "view": lambda x: x.t(),
        "in-place": lambda x: x.add_(1),
        "tuple": lambda x: torch.ops.aten.var_mean.correction(x, [1]),
    }
    for name, fn in cases.items():
        (px, pfirst, plain), (fx, ffirst, fast), served = _twice(fn)
        assert served == 1, name
        for p, f in zip(plain if isinstance(plain, tuple) else (plain,), fast if isinstance(fast, tuple) else (fast,)):
            assert _meta(f) == _meta(p), name
            assert set(vars(f)) == set(vars(p)) and f.fake_device == p.fake_device, name
            assert f.constant is None and f.fake_mode is not None, name
            assert torch._C._dispatch_key_set(f) == torch._C._dispatch_key_set(p), name
        if name == "view":
            assert fast.untyped_storage()._cdata == fx.untyped_storage()._cdata
        if name == "in-place":
            assert fast is fx
        if name == "new":
            assert fast.untyped_storage()._cdata not in (fx.untyped_storage()._cdata, ffirst.untyped_storage()._cdata)


def test_calls_torch_does_not_cache_get_recipes_from_their_first_output():
    """``aten._unsafe_view`` (torch bypasses its cache: a non-view op that aliases) and this library's functional
    ops: the second call is served by a recipe, the same metadata as torch's dispatch, on the right storage."""
    import lowmembp.ops.approx_act  # noqa: F401  (registers lowmembp::approx_act_fwd)
    (px, _, plain), (fx, ffirst, fast), served = _twice(lambda x: torch.ops.aten._unsafe_view(x, [4, 6]))
    assert served == 1 and _meta(fast) == _meta(plain)
    assert fast.untyped_storage()._cdata == fx.untyped_storage()._cdata  # a view of its argument, as torch's

    def act(x):
        return torch.ops.lowmembp.approx_act_fwd(x, "gelu", [-1.0, 0.0, 1.0], [0.1, 0.8, 0.1], True)
    (px, _, plain), (fx, ffirst, fast), served = _twice(act)
    assert served == 1 and _meta(fast) == _meta(plain)
    fresh = {t.untyped_storage()._cdata for t in fast}
    before = {fx.untyped_storage()._cdata} | {t.untyped_storage()._cdata for t in ffirst}
    assert len(fresh) == 2 and not fresh & before  # new storages, as the op's fake implementation makes


def test_no_recipes_where_torch_would_not_serve_from_its_cache():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    with StepFakeMode(shape_env=ShapeEnv()) as mode:
        assert mode._recipe_key(torch.ops.aten.mul.Tensor, (torch.empty(2), torch.empty(2)), {}) is None
    with StepFakeMode() as mode:
        x = torch.empty(2)
        assert mode._recipe_key(torch.ops.aten.mul.Tensor, (x, x), {}) is not None
        mode.cache_crosscheck_enabled = True
        assert mode._recipe_key(torch.ops.aten.mul.Tensor, (x, x), {}) is None
