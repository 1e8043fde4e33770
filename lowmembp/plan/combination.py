"""One combination's peak at any batch, at the model's full depth, from as few fake steps as exactness allows.

    peaks = Peaks(spec, "lora", shallow=(2, 3), depth=32, seq_len=2048, dtype="bf16")
    first = peaks.direct(4, flops=True)    # {"peak": estimate's peak at batch 4, "flops": ...}: 2 steps
    peaks.fit_line(4)                      # one more step per depth at batch 5: the batch line (steps.BatchLine)
    peaks.at(37)                           # the peak at 37 from the line (no step), or from steps when no line

Depth as :func:`lowmembp.estimator.step.estimate_by_depth` does it: the same steps on a 2- and a 3-block build, every
count extended to the full depth (:func:`lowmembp.estimator.step.extend_by_depth`); ``shallow=None``: the model as it
is.
Each depth's model is built once (:class:`StepSource`) and runs every batch asked for, for every optimizer planned
with the combination (one forward and backward for all of them: :mod:`lowmembp.plan.shared`) and for weights
stored alike.
"""
from __future__ import annotations

from lowmembp.estimator.step import extend_by_depth
from lowmembp.estimator.zoo import ModelSpec
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER
from lowmembp.plan.steps import MIN_BATCH, BatchLine, Steps

__all__ = ["Peaks", "StepSource"]


class StepSource:
    """The fake steps of one combination (each depth's model built once) for one or several optimizers, and for
    weights stored alike (``nf4`` is a ``bf16`` step, :func:`lowmembp.estimator.weights.nf4_peak` applied after).
    With one optimizer each depth is a :class:`lowmembp.plan.steps.Steps`; with several, a
    :class:`lowmembp.plan.shared.SharedSteps` (one forward and backward for all of them), or, where that cannot
    serve (:class:`lowmembp.plan.shared.NotShared`, or any failure, so that each optimizer's own error is
    reported), a :class:`Steps` per optimizer. Built on first use."""

    def __init__(self, spec: ModelSpec, method: str, *, layers: tuple, seq_len: int | None, dtype: str,
                 optimizers=(DEFAULT_OPTIMIZER,), weights: str = "fp32", overrides: dict | None = None,
                 world_size: int = 1, **method_options):
        self.layers, self.optimizers = tuple(layers), list(dict.fromkeys(optimizers))
        self._kw = dict(spec=spec, method=method, seq_len=seq_len, dtype=dtype, overrides=overrides,
                        world_size=world_size, weights=weights, **method_options)
        self._shared = {} if len(self.optimizers) > 1 else None   # depth -> SharedSteps (None: not shared)
        self._direct: dict[tuple, Steps] = {}                       # (depth, optimizer) -> Steps
        self._runs: dict[tuple, dict] = {}                          # (depth, batch, seq_len) -> {optimizer: StepRun}

    def run(self, depth, batch_size: int, optimizer: str, flops: bool = False, seq_len: int | None = None):
        """``optimizer``'s :class:`lowmembp.plan.steps.StepRun` at ``depth``, ``batch_size`` (``seq_len``)."""
        key = (depth, batch_size, seq_len)
        got = self._runs.get(key, {}).get(optimizer)
        if got is not None and (got.flops is not None or not flops):
            return got
        if self._shared is not None:
            try:
                runs = self._shared_steps(depth).run(batch_size, flops=flops, seq_len=seq_len)
            except Exception:  # noqa: BLE001  each optimizer stepped directly, its own error its own
                self._shared = None
            else:
                self._runs.setdefault(key, {}).update(runs)
                return runs[optimizer]
        run = self.steps(depth, optimizer).run(batch_size, flops=flops, seq_len=seq_len)
        self._runs.setdefault(key, {})[optimizer] = run
        return run

    def steps(self, depth, optimizer: str):
        """The model ``optimizer``'s steps at ``depth`` run on (shared or its own)."""
        if self._shared is not None:
            try:
                return self._shared_steps(depth)
            except Exception:  # noqa: BLE001
                self._shared = None
        key = (depth, optimizer)
        if key not in self._direct:
            self._direct[key] = Steps(layers=depth, optimizer=optimizer, **self._kw)
        return self._direct[key]

    def shard(self, depth, peak: dict, optimizer: str, weights: str) -> dict:
        """``peak`` as stored (NF4) and as one rank's under FSDP2, for ``optimizer``'s state."""
        s = self.steps(depth, optimizer)
        if isinstance(s, Steps):
            return s.shard(peak, weights)
        return s.shard(peak, optimizer, weights)

    def _shared_steps(self, depth):
        if depth not in self._shared:
            from lowmembp.plan.shared import SharedSteps
            self._shared[depth] = SharedSteps(layers=depth, optimizers=self.optimizers, **self._kw)
        return self._shared[depth]


class Peaks:
    """Peaks of one combination with one optimizer and weights (see the module doc); ``steps_run`` counts the fake
    steps its answers rest on (run for it, or shared with another optimizer's rows through ``source``)."""

    def __init__(self, spec: ModelSpec, method: str, *, shallow: tuple[int, int] | None, depth: int | None,
                 seq_len: int | None, dtype: str, overrides: dict | None = None, world_size: int = 1,
                 optimizer: str = DEFAULT_OPTIMIZER, weights: str = "fp32", source: StepSource | None = None,
                 **method_options):
        self.shallow, self.depth = shallow, depth
        self.optimizer, self.weights = optimizer, weights
        if weights == "nf4" and world_size > 1:
            raise ValueError("weights='nf4' with world_size > 1 is not modelled (FSDP2 of 4-bit weights)")
        self.layers = shallow if shallow is not None else (None,)
        self.source = source or StepSource(spec, method, layers=self.layers, seq_len=seq_len, dtype=dtype,
                                           optimizers=(optimizer,), weights=weights, overrides=overrides,
                                           world_size=world_size, **method_options)
        self.runs: dict[int, dict] = {}      # batch -> {depth: StepRun}
        self.lines: dict | None = None       # depth -> BatchLine, once fitted
        self.by_seq_len: dict[tuple, dict] = {}  # (batch, seq_len) -> {depth: StepRun}
        self.steps_run = 0

    @property
    def model(self):
        """The model of the first depth's steps (its config: the position table)."""
        return self.source.steps(self.layers[0], self.optimizer).model

    # -- steps ----------------------------------------------------------------------------------------------
    def direct(self, batch_size: int, flops: bool = False) -> dict:
        """``{"peak", "flops"}`` at ``batch_size`` from steps (one per depth): what estimate_by_depth says."""
        if batch_size not in self.runs or (flops and any(r.flops is None for r in self.runs[batch_size].values())):
            self.runs[batch_size] = {d: self.source.run(d, batch_size, self.optimizer, flops=flops)
                                     for d in self.layers}
            self.steps_run += len(self.layers)
        runs = self.runs[batch_size]
        return self._combine({d: {"peak": self._shard(d, r.peak), "flops": r.flops} for d, r in runs.items()})

    def _shard(self, depth, peak: dict) -> dict:
        return self.source.shard(depth, peak, self.optimizer, self.weights)

    # -- the batch line -------------------------------------------------------------------------------------
    def fit_line(self, batch_size: int) -> bool:
        """Steps at ``batch_size + 1`` beside those at ``batch_size`` (at 2 and 3 when ``batch_size`` is 1: the
        line starts at batch 2, :data:`lowmembp.plan.steps.MIN_BATCH`); True when every depth gives a line."""
        batch_size = max(batch_size, MIN_BATCH)
        self.direct(batch_size)
        self.direct(batch_size + 1)
        lines = {d: BatchLine(self.runs[batch_size][d], self.runs[batch_size + 1][d]) for d in self.layers}
        self.lines = lines if all(line.ok for line in lines.values()) else None
        return self.lines is not None

    def from_line(self, batch_size: int) -> dict | None:
        """The peak at ``batch_size`` from the line (no step), or None without one."""
        if self.lines is None:
            return None
        per = {}
        for d, line in self.lines.items():
            pk = line.peak(batch_size)
            if pk is None:
                return None
            per[d] = {"peak": self._shard(d, pk), "flops": None}
        return self._combine(per)["peak"]

    def at(self, batch_size: int) -> dict:
        """The peak at ``batch_size``: from the line if there is one, else from steps."""
        got = self.from_line(batch_size)
        return got if got is not None else self.direct(batch_size)["peak"]

    def at_seq_len(self, batch_size: int, seq_len: int) -> dict:
        """The peak at ``batch_size`` and ``seq_len`` tokens, from steps (one per depth) of the same models."""
        key = (batch_size, seq_len)
        if key not in self.by_seq_len:
            self.by_seq_len[key] = {d: self.source.run(d, batch_size, self.optimizer, seq_len=seq_len)
                                    for d in self.layers}
            self.steps_run += len(self.layers)
        runs = self.by_seq_len[key]
        return self._combine({d: {"peak": self._shard(d, r.peak), "flops": None} for d, r in runs.items()})["peak"]

    def drop_line(self) -> None:
        self.lines = None

    def _combine(self, per: dict) -> dict:
        if self.shallow is None:
            return per[None]
        a, b = self.shallow
        out = extend_by_depth(per[a], per[b], self.shallow, self.depth)
        lo, hi = per[a]["peak"], per[b]["peak"]
        if lo.get("phase") != hi.get("phase"):
            # the peak falls at another moment of the step in the two builds: its split by category does not extend
            # by depth (only the bytes alive through the whole step do); lowmembp.plan.breakdown uses the deeper
            # build's split for the rest
            out["peak"] = dict(out["peak"], split_from=hi)
        return out
