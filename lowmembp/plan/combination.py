"""One combination's peak at any batch, at the model's full depth, from as few fake steps as exactness allows.

    peaks = Peaks(spec, "lora", shallow=(2, 3), depth=32, seq_len=2048, dtype="bf16")
    first = peaks.direct(4, flops=True)    # {"peak": estimate's peak at batch 4, "flops": ...}: 2 steps
    peaks.fit_line(4)                      # one more step per depth at batch 5: the batch line (steps.BatchLine)
    peaks.at(37)                           # the peak at 37 from the line (no step), or from steps when no line

Depth as :func:`lowmembp.estimator.step.estimate_by_depth` does it: the same steps on a 2- and a 3-block build, every
count extended to the full depth (:func:`lowmembp.estimator.step.extend_by_depth`); ``shallow=None``: the model as it
is.
Each depth's model is built once (:class:`lowmembp.plan.steps.Steps`) and runs every batch asked for.
"""
from __future__ import annotations

from lowmembp.estimator.step import ModelSpec, extend_by_depth
from lowmembp.plan.steps import MIN_BATCH, BatchLine, Steps

__all__ = ["Peaks"]


class Peaks:
    """Peaks of one combination (see the module doc); ``steps_run`` counts the fake steps taken."""

    def __init__(self, spec: ModelSpec, method: str, *, shallow: tuple[int, int] | None, depth: int | None,
                 seq_len: int | None, dtype: str, overrides: dict | None = None, world_size: int = 1,
                 optimizer: str = "adamw", **method_options):
        self.shallow, self.depth = shallow, depth
        layers = shallow if shallow is not None else (None,)
        self.steps = {d: Steps(spec, method, layers=d, seq_len=seq_len, dtype=dtype, overrides=overrides,
                               world_size=world_size, optimizer=optimizer, **method_options) for d in layers}
        self.runs: dict[int, dict] = {}      # batch -> {depth: StepRun}
        self.lines: dict | None = None       # depth -> BatchLine, once fitted
        self.by_seq_len: dict[tuple, dict] = {}  # (batch, seq_len) -> {depth: StepRun}
        self.steps_run = 0

    # -- steps ----------------------------------------------------------------------------------------------
    def direct(self, batch_size: int, flops: bool = False) -> dict:
        """``{"peak", "flops"}`` at ``batch_size`` from steps (one per depth): what estimate_by_depth says."""
        if batch_size not in self.runs or (flops and any(r.flops is None for r in self.runs[batch_size].values())):
            self.runs[batch_size] = {d: s.run(batch_size, flops=flops) for d, s in self.steps.items()}
            self.steps_run += len(self.steps)
        runs = self.runs[batch_size]
        return self._combine({d: {"peak": self.steps[d].shard(r.peak), "flops": r.flops} for d, r in runs.items()})

    # -- the batch line -------------------------------------------------------------------------------------
    def fit_line(self, batch_size: int) -> bool:
        """Steps at ``batch_size + 1`` beside those at ``batch_size`` (at 2 and 3 when ``batch_size`` is 1: the
        line starts at batch 2, :data:`lowmembp.plan.steps.MIN_BATCH`); True when every depth gives a line."""
        batch_size = max(batch_size, MIN_BATCH)
        self.direct(batch_size)
        self.direct(batch_size + 1)
        lines = {d: BatchLine(self.runs[batch_size][d], self.runs[batch_size + 1][d]) for d in self.steps}
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
            per[d] = {"peak": self.steps[d].shard(pk), "flops": None}
        return self._combine(per)["peak"]

    def at(self, batch_size: int) -> dict:
        """The peak at ``batch_size``: from the line if there is one, else from steps."""
        got = self.from_line(batch_size)
        return got if got is not None else self.direct(batch_size)["peak"]

    def at_seq_len(self, batch_size: int, seq_len: int) -> dict:
        """The peak at ``batch_size`` and ``seq_len`` tokens, from steps (one per depth) of the same models."""
        key = (batch_size, seq_len)
        if key not in self.by_seq_len:
            self.by_seq_len[key] = {d: s.run(batch_size, seq_len=seq_len) for d, s in self.steps.items()}
            self.steps_run += len(self.steps)
        runs = self.by_seq_len[key]
        return self._combine({d: {"peak": self.steps[d].shard(r.peak), "flops": None} for d, r in runs.items()})["peak"]

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
