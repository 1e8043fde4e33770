"""One combination's fake step shared by several optimizers: forward and backward once, every optimizer's step read
from that one run's timeline.

    steps = SharedSteps(spec, "lora", layers=2, seq_len=2048, dtype="bf16",
                        optimizers=("adamw", "adamw8bit", "adamw-fused-backward"))
    runs = steps.run(4, flops=True)    # {optimizer: StepRun}, each what Steps(..., optimizer=...).run(4) gives

Why: the optimizer changes only its own state (made and registered apart at the start), its step after the backward
(run for real on the fake tensors, recorded once per model: it does not depend on the batch) and, for
``adamw-fused-backward``, the per-parameter steps inside the backward and the gradients they free. The run records
every change the tracker makes to its live storages (:class:`TimelineTracker`); each optimizer's timeline is
replayed through a :class:`lowmembp.plan.steps.EventTracker` (:func:`replay`), giving its peak, split, phase and
saved bytes to the byte as a direct step would (``tests/plan/test_shared_steps.py``). A step that cannot be read off
this way raises :class:`NotShared`, and the planner steps each optimizer directly. The details:
docs/architecture.md, "How the planner's rows share their fake steps".
"""
from __future__ import annotations

import contextlib

import torch
from lowmembp.estimator.fsdp import fsdp_peak
from lowmembp.estimator.step import autocast_to, make_optimizer, prepare_model
from lowmembp.estimator.zoo import ModelSpec, block_names, compute_loss, make_batch
from lowmembp.estimator.weights import nf4_peak
from lowmembp.measurement.peak import HOST as HOST_CATEGORY, prime_optimizer
from lowmembp.plan.steps import EventTracker, RecordingFakeMode, StepRun, _peak_dict

__all__ = ["SharedSteps", "TimelineTracker", "replay", "NotShared", "FUSED_BACKWARD", "STEP_PARTS", "QUIET"]

FUSED_BACKWARD = "adamw-fused-backward"  # the optimizer that steps inside the backward (lowmembp.methods.optimizers)
# timeline entries: (COUNT, uid, bytes or None when already live, category, phase) | (FREE, uid) | (SAVED, uid)
# | (HOST, uid): a live storage moved to the host
COUNT, FREE, SAVED, HOST = range(4)


# What the optimizers' steps write in a timeline, kept for the worker's life (as torch keeps its fake-tensor cache):
# an optimizer's step after the backward (its part, renumbered from 0, and its FLOPs) by :func:`_step_key`, and
# whether fused-backward's step of one parameter inside the backward makes or changes nothing, by the layouts
STEP_PARTS: dict[tuple, tuple] = {}
QUIET: dict[tuple, bool] = {}


class NotShared(Exception):
    """A step that cannot be read off the shared run (docs/architecture.md): step each optimizer directly."""


class TimelineTracker(EventTracker):
    """An :class:`EventTracker` that also writes down, in :attr:`log`, every change to its live storages
    (docs/architecture.md); storages are named by a number of their own (``uid``), not their address, which a later
    storage can reuse.
    Between :meth:`part` calls the entries go to that named part instead of the main timeline."""

    def __init__(self, flops=None):
        super().__init__(flops)
        self.log: list[tuple] = []
        self.parts: dict[str, list[tuple]] = {}
        self._out = self.log
        self._uids: dict[int, int] = {}
        self._next = 0
        self.alias: dict[int, int] = {}  # storage key -> uid of the storage it stands for (fresh gradients)

    @contextlib.contextmanager
    def part(self, name: str):
        """Write the entries made inside this block to ``parts[name]``."""
        self._out = self.parts.setdefault(name, [])
        try:
            yield
        finally:
            self._out = self.log

    @property
    def next_uid(self) -> int:
        """A number past every storage's of this run."""
        return self._next

    def uid(self, t: torch.Tensor) -> int | None:
        """The uid of ``t``'s storage while it is counted, else None."""
        key = self.key_of(t)
        return self.alias.get(key, self._uids.get(key))

    def count_storage(self, st, key, category):
        if key in self.alias:  # a stand-in: only its re-tags are written, the storage itself is not counted
            self._out.append((COUNT, self.alias[key], None, category, self.phase()))
            return
        if self.category_of(key) is not None:
            self._out.append((COUNT, self._uids[key], None, category, self.phase()))
        else:
            self._uids[key] = uid = self._next
            self._next += 1
            self._out.append((COUNT, uid, int(st.nbytes()), category, self.phase()))
        super().count_storage(st, key, category)

    def free_storage(self, key):
        uid = self._uids.pop(key, None)
        if uid is not None:
            self._out.append((FREE, uid))
        super().free_storage(key)

    def mark_saved(self, t):
        key = self.key_of(t) if isinstance(t, torch.Tensor) else None
        if key in self._uids:
            self._out.append((SAVED, self._uids[key]))
        super().mark_saved(t)

    def to_host(self, t):
        key = self.key_of(t)
        category = self.category_of(key) if key is not None else None
        if category is not None and category != HOST_CATEGORY:
            self._out.append((HOST, self._uids[key]))
        super().to_host(t)


class _Storage:
    """A stand-in storage for a replay: its bytes, and weak references to it (the tracker frees on its death)."""
    __slots__ = ("n", "__weakref__")

    def __init__(self, n: int):
        self.n = n

    def nbytes(self) -> int:
        return self.n


class _Replay(EventTracker):
    """An :class:`EventTracker` fed from a timeline instead of a step: the phase of each entry is the one written."""
    now = "forward"

    def phase(self) -> str:
        return self.now


def replay(entries) -> EventTracker:
    """The tracker state (peak, split, phase, saved bytes, host bytes, events) that ``entries`` leave behind."""
    r, held = _Replay(), {}
    for e in entries:
        kind, uid = e[0], e[1]
        if kind == COUNT:
            st = held.get(uid)
            if st is None:
                if e[2] is None:  # a storage this timeline does not hold (another optimizer's state)
                    continue
                st = held[uid] = _Storage(e[2])
            r.now = e[4]
            r.count_storage(st, uid, e[3])
        elif kind == FREE:
            if held.pop(uid, None) is not None:
                pass  # the stand-in died here: the tracker's weak reference freed it
        elif kind == SAVED:
            r.mark_saved_storage(uid)
        elif kind == HOST:
            r.move_to_host(uid)
    r.held = held  # alive until the caller is done reading (their frees would only lower the totals)
    return r


class SharedSteps:
    """One combination at one depth, built once, its steps shared by ``optimizers`` (docs/architecture.md):
    :meth:`run` gives each optimizer's :class:`lowmembp.plan.steps.StepRun`. The arguments are
    :class:`lowmembp.plan.steps.Steps`'s."""

    def __init__(self, spec: ModelSpec, method: str, *, layers: int | None, seq_len: int | None, dtype: str,
                 optimizers, overrides: dict | None = None, world_size: int = 1, seed: int = 0,
                 weights: str = "fp32", **method_options):
        self.spec, self.seq_len, self.dtype, self.world_size = spec, seq_len or spec.seq_len, dtype, world_size
        if weights == "nf4" and world_size > 1:
            raise ValueError("weights='nf4' with world_size > 1 is not modelled (FSDP2 of 4-bit weights)")
        self.weights = weights
        from lowmembp.methods.optim_levers import LEVERS, split_optimizer

        levers = [z for z in optimizers if split_optimizer(z)[0] in LEVERS]
        if levers:  # GaLore's refresh depends on the step count, a layer-wise step is not fused-backward's: direct
            raise NotShared(f"{', '.join(levers)}: the other packages' optimizers are stepped directly")
        self.vocab = (overrides or {}).get("vocab_size")
        # the fused-backward optimizer first: its hooks on the parameters come first, as in its direct step
        self.optimizers = sorted(dict.fromkeys(optimizers), key=lambda z: z != FUSED_BACKWARD)
        torch.manual_seed(seed)
        self.mode = RecordingFakeMode(allow_non_fake_inputs=True)
        self.model = prepare_model(spec, method, self.mode, layers=layers, overrides=overrides, weights=weights,
                                   **method_options)
        self.opts = {z: make_optimizer(self.model, z) for z in self.optimizers}  # outside the mode, as estimate()
        with self.mode:
            for opt in self.opts.values():
                prime_optimizer(opt)
        self.blocks = block_names(self.model)
        self.last_block = self.model.get_submodule(self.blocks[-1]) if self.blocks else None

    def run(self, batch_size: int, flops: bool = False, seq_len: int | None = None) -> dict[str, StepRun]:
        """Each optimizer's step at ``batch_size`` (and ``seq_len`` tokens) from one forward and backward."""
        fused = FUSED_BACKWARD in self.opts and self.opts[FUSED_BACKWARD] is not None
        with self.mode:
            batch = make_batch(self.spec, self.model, batch_size, seq_len or self.seq_len, self.vocab)
            counter = None
            if flops:
                from lowmembp.measurement.flops import step_flop_counter
                counter = step_flop_counter()
            t = TimelineTracker(counter)
            t.track_external(self.model)                     # as measure_step_peak registers them, state apart
            head = len(t.log)
            for z, opt in self.opts.items():
                with t.part(("state", z)):
                    if opt is not None:
                        t.track_optimizer_state(opt)
            t.track_external(None, None, *batch.values())
            inner, grads = [], {}  # fused-backward's steps in the backward; parameter -> (gradient uid, layout)
            own = self._step_inside_backward(t, inner, grads) if fused else []  # first, as fused-backward's hooks
            t.watch(self.model)
            t.watch_phases(self.model, self.last_block)
            params = [p for p in self.model.parameters() if p.requires_grad]
            with t.recording(self.mode):
                handles = _watch_inner(t, inner) if fused else []
                try:
                    with t.saved_hooks(), autocast_to(self.dtype):
                        loss = compute_loss(self.spec, self.model, batch)
                    loss.backward()
                finally:
                    for h in handles + own:
                        h.remove()
                    if fused:
                        self.opts[FUSED_BACKWARD].attach()
                body_flops = counter.get_total_flops() if counter is not None else None
                layouts = [_layout(p.grad) if p.grad is not None else grads[p][1] if p in grads else None
                           for p in params]
                keys = {z: _step_key(z, opt, params, layouts) for z, opt in self.opts.items()}
                missing = [z for z in self.opts if keys[z] not in STEP_PARTS]
                if missing:
                    STEP_PARTS.update({keys[z]: part for z, part in
                                       self._record_steps(t, params, grads, missing).items()})
                parts = {z: STEP_PARTS[keys[z]] for z in self.opts}
            for opt in self.opts.values():
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
            del loss
        out, kept = {}, {uid for uid, _ in grads.values()}
        for z in self.optimizers:
            step, step_flops = parts[z]
            others = fused and z != FUSED_BACKWARD
            body = t.log[head:]
            if others:
                body = _without_inner_steps(body, [(a - head, b - head) for a, b, _ in inner], kept)
            r = replay(t.log[:head] + t.parts[("state", z)] + body + [_shifted(e, t.next_uid) for e in step])
            peak = _peak_dict(r.peak, dict(r.peak_by_category), r, r.peak_saved, r.peak_phase)
            n = None
            if counter is not None:
                n = body_flops - (sum(f for *_, f in inner) if others else 0) + step_flops
            out[z] = StepRun(batch_size, peak, n, r.events)
        return out

    def _step_inside_backward(self, t: TimelineTracker, inner: list, grads: dict) -> list:
        """fused-backward's hooks, put in its own's place (taken off until :meth:`run` attaches them again): each
        parameter is stepped and its gradient released, as that optimizer does. A parameter's step is run the first
        time; where it made and changed nothing in the timeline (no storage, no FLOP: the fused AdamW kernel updates
        in place), later steps of a parameter and gradient of the same layouts (:data:`QUIET`) are written down as
        what they are, the tracker's re-count of the gradient and its release, without running the step again."""
        opt = self.opts[FUSED_BACKWARD]
        opt.remove()

        def step(p):
            g = p.grad
            if g is None:
                return
            key = (_layout(p), _layout(g), _defaults(opt.optimizer_of(p)))
            grads[p] = (t.uid(g), _layout(g))
            if QUIET.get(key):
                with t.in_optimizer_step():  # as the tracker's hook at an optimizer step's start: the gradient
                    t.track(g, "gradients")    # re-counted
                del g
                p.grad = None
                return
            del g
            opt.step_param(p)
            a, b, flops = inner[-1]
            if t.flops is not None:  # learnt only where its FLOPs are counted
                QUIET[key] = flops == 0 and all(e[0] == COUNT and e[2] is None for e in t.log[a:b])

        return [p.register_post_accumulate_grad_hook(step) for p in opt.param_groups[0]["params"]]

    def _record_steps(self, t: TimelineTracker, params, grads, optimizers) -> dict:
        """``{optimizer: (its step's part of the timeline, the step's FLOPs)}`` of ``optimizers`` after this
        backward, each part's new storages numbered from 0 (the part is the same at any batch). Where fused-backward
        released the gradients, the others step on fresh ones of the same layout, standing for them."""
        from lowmembp.measurement.flops import step_flop_counter

        cats = {uid: t.category_of(key) for key, uid in t._uids.items()}
        cats.update({uid: "gradients" for uid, _ in grads.values()})
        parts, flops = {}, t.flops
        for z in optimizers:
            opt = self.opts[z]
            fresh = []
            if opt is not None and z != FUSED_BACKWARD and grads:
                observer, self.mode.observer = self.mode.observer, None  # not counted: stand-ins
                try:
                    for p in params:
                        if p in grads:
                            uid, (shape, stride, dtype) = grads[p]
                            p.grad = torch.empty_strided(shape, stride, dtype=dtype, device=p.device)
                            t.alias[t.key_of(p.grad)] = uid
                            fresh.append(p)
                finally:
                    self.mode.observer = observer
            counter = t.flops = step_flop_counter()
            try:
                with t.part(("step", z)):
                    if opt is not None:
                        opt.step()
            finally:
                t.flops = flops
            for p in fresh:
                t.alias.pop(t.key_of(p.grad), None)
                p.grad = None
            parts[z] = (_own_part(t.parts.pop(("step", z)), cats), counter.get_total_flops())
        return parts

    def shard(self, peak: dict, optimizer: str, weights: str | None = None) -> dict:
        """``peak`` with the weights as stored (NF4) and as one rank's under FSDP2 (:meth:`Steps.shard`)."""
        if (weights or self.weights) == "nf4":
            peak = nf4_peak(peak, self.model)
        if self.world_size > 1:
            return fsdp_peak(peak, self.model, self.opts[optimizer], self.blocks, self.world_size)
        return peak


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


def _defaults(opt) -> tuple:
    """An optimizer's class and settings, as a key."""
    return (type(opt),) + tuple(sorted((k, repr(v)) for k, v in opt.defaults.items()))


def _step_key(name: str, opt, params, layouts) -> tuple:
    """What an optimizer's step does depends on: the optimizer and its settings, and each parameter's, gradient's
    (``layouts``) and state tensors' shapes, strides and dtypes."""
    if opt is None:
        return (name,)
    state = tuple(tuple(sorted((k, _layout(v)) for k, v in opt.state.get(p, {}).items()
                               if isinstance(v, torch.Tensor))) for p in params)
    return (name, _defaults(opt), tuple(_layout(p) for p in params), tuple(layouts), state)


def _own_part(entries: list, cats: dict) -> list:
    """``entries`` (an optimizer step's part) with the storages it made numbered from 0, and without its re-tags of
    storages that were there before, each of which must leave the storage under the category it has (the tracker's
    re-tag of a gradient, its re-count of the optimizer's state); anything else done to an older storage raises
    :class:`NotShared`."""
    own, out = {}, []
    for e in entries:
        kind, uid = e[0], e[1]
        if kind == COUNT and e[2] is not None:
            own[uid] = len(own)
        if uid in own:
            out.append((kind, own[uid]) + tuple(e[2:]))
        elif not (kind == COUNT and cats.get(uid) == e[3]):
            raise NotShared(f"an optimizer step changes a storage it did not make ({e})")
    return out


def _shifted(e: tuple, base: int) -> tuple:
    """A part's entry with its storage numbered from ``base`` (past every storage of the run it is added to)."""
    return (e[0], e[1] + base) + tuple(e[2:])


def _without_inner_steps(body: list, inner: list, grads: set) -> list:
    """``body`` (a fused-backward run's timeline) as the other optimizers' steps give it: without what fused-backward's
    steps inside the backward made and freed (``inner``: their start and end in ``body``), and with every gradient
    (``grads``, uids) alive to the end of the step. NotShared if an inner step leaves a storage of its own behind
    or changes another's other than re-counting it under its category."""
    drop, out = set(), []
    for a, b in inner:
        made = set()
        for i in range(a, b):
            e = body[i]
            if e[0] == COUNT and e[2] is not None:
                made.add(e[1])
            elif e[0] == FREE and e[1] in made:
                made.discard(e[1])
            elif e[0] != COUNT or e[2] is not None:
                raise NotShared(f"fused-backward's step inside the backward changes a storage ({e})")
            drop.add(i)
        if made:
            raise NotShared("fused-backward's step inside the backward leaves a storage behind")
    for i, e in enumerate(body):
        if i in drop or (e[0] == FREE and e[1] in grads):
            continue
        out.append(e)
    return out


def _watch_inner(t: TimelineTracker, inner: list) -> list:
    """Global optimizer hooks marking fused-backward's per-parameter steps inside the backward in ``inner`` (start
    and end indices of ``t.log``, the step's FLOPs). Registered after the tracker's own hooks: a step's part starts
    after the tracker's re-count of the gradient, which the others' timelines keep (their watch hook makes the same
    re-count at the same moment)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def flops():
        return t.flops.get_total_flops() if t.flops is not None else 0

    def pre(opt, args, kwargs):
        inner.append([len(t.log), None, flops()])

    def post(opt, args, kwargs):
        inner[-1][1] = len(t.log)
        inner[-1][2] = flops() - inner[-1][2]

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
