"""A captured training step (lowmembp.measurement.capture): the static buffers and the capture protocol on the CPU
through a stand-in for torch.cuda's graph calls; the real CUDA graph on a GPU (marker gpu)."""
import pytest
import torch
import torch.nn as nn

from lowmembp.measurement.capture import CAPTURE_MODES, CapturedStep, StaticInputs, check_capture


class FakeGraphs:
    """torch.cuda's part of a capture on the CPU: a 'graph' whose replay runs the captured function again and writes
    its result into the static output, as a real replay overwrites it; every call is logged. A real replay's backward
    writes the gradients afresh; the stand-in sets them to None (``zero_grad``) before it runs the function again."""

    def __init__(self, zero_grad=lambda: None):
        self.log, self.zero_grad = [], zero_grad

    def warm_up(self, fn, n, zero_grad):
        self.log.append(("warm_up", n))
        for _ in range(n):
            zero_grad()
            fn()

    def capture(self, fn):
        self.log.append(("capture",))
        out = fn()
        log, zero_grad = self.log, self.zero_grad

        class Graph:
            def replay(self):
                log.append(("replay",))
                zero_grad()
                out.copy_(fn())
        return Graph(), out


def make_run(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zeroed = []

    def zero_grad():
        zeroed.append(1)
        opt.zero_grad(set_to_none=True)

    def fn(batch):
        loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        return loss.detach()
    return model, opt, fn, zero_grad, zeroed


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(3, 4, generator=g), "y": torch.randint(0, 2, (3,), generator=g)} for _ in range(n)]


def test_static_inputs_refill_in_place_and_refuse_another_shape():
    b = batches(2)
    s = StaticInputs(b[0])
    x = s.tensors["x"]
    assert s.fill(b[1])["x"] is x and torch.equal(x, b[1]["x"])
    with pytest.raises(ValueError, match="static shapes"):
        s.fill({"x": torch.randn(2, 4), "y": b[0]["y"]})
    with pytest.raises(ValueError, match="keys"):
        s.fill({"x": b[0]["x"]})


def test_capture_warms_up_zeroes_grads_captures_once_then_replays_the_same_buffers():
    model, opt, fn, zero_grad, zeroed = make_run()
    graphs = FakeGraphs()
    step = CapturedStep(fn, mode="cuda-graphs", warmup=2, zero_grad=zero_grad, graphs=graphs)
    data = batches(4)
    outs = [step(b) for b in data]
    assert graphs.log == [("warm_up", 2), ("capture",)] + [("replay",)] * 4
    assert step.captures == 1 and len(zeroed) == 3  # before each warm-up step and before the capture, never after
    assert all(o is outs[0] for o in outs)  # one static loss tensor, overwritten by every replay
    # the last replay ran on the last batch, through the static buffer
    assert torch.equal(step.static.tensors["x"], data[-1]["x"])


def test_the_step_function_trains_as_the_eager_loop_does():
    """The function a capture records is the eager step: the same losses step by step (here: eager both sides, the
    stand-in replays by calling it; the GPU test checks a real graph)."""
    data = batches(5)
    _, _, fn, zero_grad, _ = make_run()
    step = CapturedStep(fn, mode="cuda-graphs", warmup=1, zero_grad=zero_grad, graphs=FakeGraphs(zero_grad))
    captured = [float(step(b)) for b in data]
    _, opt, fn2, _, _ = make_run()
    eager = []
    fn2(data[0])  # the warm-up step (a real step, on the first batch)
    opt.zero_grad(set_to_none=True)
    fn2(data[0])  # the capture's run (the stand-in executes it; a real capture does not)
    opt.zero_grad(set_to_none=True)
    for b in data:
        eager.append(float(fn2(b)))
        opt.zero_grad(set_to_none=True)
    assert captured == pytest.approx(eager, rel=0, abs=0)


def test_capture_refused_on_a_cpu_with_what_is_valid():
    assert CAPTURE_MODES == ("none", "cuda-graphs", "reduce-overhead")
    check_capture("none", "cpu")
    for mode in ("cuda-graphs", "reduce-overhead"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            check_capture(mode, "cpu")
    with pytest.raises(ValueError, match="choose one of none, cuda-graphs, reduce-overhead"):
        check_capture("graphs", "cuda")
    with pytest.raises(ValueError, match="choose one of"):
        CapturedStep(lambda b: None, mode="graphs")
    assert CapturedStep(lambda b: b["x"].sum(), mode="none")({"x": torch.ones(2)}) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cuda-graphs", "reduce-overhead"])
def test_real_capture_gives_the_eager_losses(mode):
    torch.manual_seed(0)
    data = [{k: v.cuda() for k, v in b.items()} for b in batches(6)]

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), capturable=True)

        def fn(batch):
            loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            return loss.detach()
        return opt, fn

    opt, fn = build()
    step = CapturedStep(fn, mode=mode, warmup=1, zero_grad=lambda: opt.zero_grad(set_to_none=True))
    if mode == "cuda-graphs":
        got = [float(step(b)) for b in data]
        opt2, fn2 = build()
        fn2(data[0])
        opt2.zero_grad(set_to_none=True)
        want = [float(fn2(b)) for b in data]  # the capture itself runs nothing: replays start after the warm-up
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    else:
        got = []
        for b in data:
            got.append(float(step(b)))
            opt.zero_grad(set_to_none=True)
        opt2, fn2 = build()
        want = []
        for b in data:
            want.append(float(fn2(b)))
            opt2.zero_grad(set_to_none=True)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
