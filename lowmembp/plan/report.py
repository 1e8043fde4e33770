"""A plan for reading and for tools: the ranked terminal table, JSON (everything), CSV (one row per combination)."""
from __future__ import annotations

import csv
import json

from lowmembp.plan.breakdown import BREAKDOWN, LEGEND, compact
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER
from lowmembp.plan.sources import GiB

__all__ = ["text_table", "verdict", "to_json", "write_csv", "CSV_COLUMNS"]

CSV_COLUMNS = ["rank", "label", "method", "optimizer", "weights", "status", "peak_bytes", "need_bytes", "fits",
               "largest_batch", "largest_batch_how", "largest_batch_by_gpu", "largest_seq_len", "peak_phase",
               *(f"peak_{k}_bytes" for k in BREAKDOWN), "flops", "flops_ratio", "measured_ratio",
               "measured_where", "batch_line", "estimates", "seconds", "cpu_seconds", "reason"]


UNITS = (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10))


def unit_for(sizes) -> tuple[str, int]:
    """``(name, bytes)``: the largest unit in which the largest of ``sizes`` is at least 1 (one unit per table, so
    a tiny model's peaks read 0.40 MiB, not 0.000396 GiB)."""
    top = max((b for b in sizes if b is not None), default=0)
    return next(((n, u) for n, u in UNITS if top >= u), UNITS[-1])


def _in(b, unit: int) -> str:
    return "-" if b is None else f"{b / unit:.1f}" if b >= 10 * unit else f"{b / unit:.3g}"


def _size(b) -> str:
    name, unit = unit_for([b])
    return f"{b / unit:.1f} {name}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def text_table(p) -> str:
    s = p.settings
    head = (f"What fits: {s['model_source']}, batch {s['batch_size']}, "
            + (f"{s['seq_len']} tokens, " if s.get("seq_len") else "") + f"{s['dtype']} autocast, "
            f"weights {', '.join(_as_list(s.get('weights', 'fp32')))}, "
            f"{', '.join(_as_list(s.get('optimizer', DEFAULT_OPTIMIZER)))}, "
            f"{_size(s['gpu_memory_bytes'])} GPU (tensors up to {_size(s['capacity_bytes'])} after the margin), "
            f"{s['world_size']} GPU")
    more = next((list(r.get("largest_batch_by_gpu", {})) for r in p.rows if r["status"] == "ok"), [])
    seq = "seq-len" in s.get("find", ())
    unit_name, unit = unit_for(r["need_bytes"] for r in p.rows if r["status"] == "ok")
    cols = ["#", "method", "weights, optimizer", f"peak {unit_name}", "+margin", "fits", "max batch"] + \
        [f"@{g}" for g in more] + (["max seq len"] if seq else []) + ["FLOPs x", "measured x", "peak at"]
    body = []
    for r in p.rows:
        if r["status"] != "ok":
            continue
        meas = "-" if r.get("measured_ratio") is None else f"{r['measured_ratio']:.2f} ({len(r['measured'])})"
        best = str(r["largest_batch"]) + ("+" if r["largest_batch_how"].startswith("at least") else "")
        how = f"{r.get('weights', 'fp32')}, {r.get('optimizer', DEFAULT_OPTIMIZER)}"
        body.append([str(r["rank"]), _label_only(r), how,
                     _in(r["peak_bytes"], unit), _in(r["need_bytes"], unit),
                     "yes" if r["fits"] else "no", best] + [str(r["largest_batch_by_gpu"][g]) for g in more]
                    + ([_most(r.get("largest_seq_len"), r.get("largest_seq_len_how", ""))] if seq else [])
                    + [_x(r.get("flops_ratio")), meas, compact(r)])
    widths = [max(len(c), *(len(row[i]) for row in body)) if body else len(c) for i, c in enumerate(cols)]
    right = {i for i, c in enumerate(cols) if c not in ("method", "weights, optimizer", "fits", "peak at")}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [head, verdict(p), "", line(cols), line(["-" * w for w in widths])] + [line(b) for b in body]
    bad = [r for r in p.rows if r["status"] != "ok"]
    if bad:
        out += ["", "Not estimated:"] + [f"  {r['label']}: {r['reason']}" for r in bad]
    if p.skipped:
        by_reason: dict[str, list[str]] = {}
        for m, why in sorted(p.skipped.items()):
            by_reason.setdefault(why, []).append(m)
        out += ["", "Methods left out:"] + [f"  {', '.join(ms)}: {why}" for why, ms in by_reason.items()]
    src = p.sources
    out += ["", "Where the figures come from:",
            f"  peak: {src['peak']}",
            f"  +margin: {src['margin']}",
            f"  max batch: {src['largest_batch']}",
            *([f"  max seq len: {src['largest_seq_len']}"] if "largest_seq_len" in src else []),
            f"  FLOPs x: {src['flops']}, over the baseline's",
            f"  measured x: {src['measured']} (median over the (task, model, batch) groups; count in brackets)",
            f"  {LEGEND}",
            f"  weights: {s.get('weights_source', 'given')}",
            f"{len(body)} combinations" + (f" of up to {s['max_methods']} methods (--max-methods N or all: more)"
                                           if s.get("max_methods") else "")
            + f" in {p.elapsed_s:.1f} s ({s['jobs']} job(s)"
            + (f", load average {p.load[0]:.2f}" if p.load else "")
            + f"; the rows took {sum(r.get('cpu_seconds', 0) for r in p.rows):.1f} CPU s)"]
    return "\n".join(out)


def verdict(p) -> str:
    """The decision in one line: what fits at the requested batch (cheapest, and the largest batch), else what fits
    a smaller batch, else why nothing fits (the smallest weights + optimizer state over the usable memory)."""
    s, ok = p.settings, [r for r in p.rows if r["status"] == "ok"]
    if not ok:
        return "Nothing could be estimated (see below)."
    cap, bs = s["capacity_bytes"], s["batch_size"]
    fit = [r for r in ok if r["fits"]]
    weights = _as_list(s.get("weights", "fp32"))
    said = "auto weights" if weights == ["auto"] else f"weights {', '.join(weights)}"
    if fit:  # rows are ranked: fitting ones first, by FLOP ratio
        most = max(fit, key=lambda r: r["largest_batch"])
        return (f"{len(fit)} of {len(ok)} combinations fit batch {bs} ({said}); the least compute: {_name(fit[0])} "
                f"(FLOPs {_x(fit[0].get('flops_ratio'))}x); the largest batch: {_name(most)} "
                f"({most['largest_batch']}{'+' if most['largest_batch_how'].startswith('at least') else ''}).")
    smaller = [r for r in ok if r["largest_batch"] > 0]
    if smaller:
        most = max(smaller, key=lambda r: r["largest_batch"])
        return (f"No combination fits batch {bs} ({said}); {len(smaller)} fit a smaller batch, the largest "
                f"{most['largest_batch']} with {_name(most)}.")
    low = min(ok, key=lambda r: (r["floor_bytes"], len(r["label"])))  # a tie: the plainest combination
    hint = ("" if "nf4" in weights else
            " --weights nf4 plans the LoRA-family combinations with QLoRA's 4-bit base (a quarter of bf16's bytes).")
    if _as_list(s.get("optimizer", DEFAULT_OPTIMIZER)) == [DEFAULT_OPTIMIZER]:
        hint += (" The optimizer is AdamW with fp32 states: --optimizer adamw,adamw8bit,adamw-fused-backward plans "
                 "8-bit states and the step inside the backward too.")
    if low["floor_bytes"] > cap:
        return (f"Nothing fits at any batch ({said}): the smallest weights + optimizer state ({_name(low)}: "
                f"{_size(low['floor_bytes'])}) already exceed the {_size(cap)} the tensors may use.{hint}")
    least = min(ok, key=lambda r: r["peak_bytes"])
    return (f"Nothing fits, not even batch 1 ({said}): the weights and optimizer state would ({_name(low)}: "
            f"{_size(low['floor_bytes'])} of {_size(cap)}), the activations do not; the least memory at batch {bs}: "
            f"{_name(least)} ({_size(least['peak_bytes'])}).{hint}")


def _most(n, how: str) -> str:
    return "-" if n is None else f"{n}{'+' if how.startswith('at least') else ''}"


def _name(r: dict) -> str:
    """A row as the verdict names it: its label and the weights it was planned with."""
    return f"{r['label']} with {r.get('weights', 'fp32')} weights"


def _as_list(v) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


def _label_only(r: dict) -> str:
    """The row's label without the optimizer (a column of its own in the table)."""
    tail = f" [{r.get('optimizer', DEFAULT_OPTIMIZER)}]"
    return r["label"][:-len(tail)] if r["label"].endswith(tail) else r["label"]


def to_json(p) -> str:
    return json.dumps({"settings": p.settings, "verdict": verdict(p), "rows": p.rows, "skipped": p.skipped,
                       "sources": p.sources,
                       "elapsed_s": p.elapsed_s, "load_average": list(p.load)}, indent=1, default=str)


def write_csv(p, path) -> None:
    """The rows as CSV, written atomically (temp file + rename)."""
    from lowmembp.atomic import atomic_open

    with atomic_open(path, "w") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in p.rows:
            parts = {f"peak_{k}_bytes": v for k, v in (r.get("peak_breakdown") or {}).items()}
            w.writerow(dict(r, **parts, largest_batch_by_gpu=json.dumps(r.get("largest_batch_by_gpu", {})),
                            measured_where="; ".join(f"{m['where']} {m['ratio']:.2f}"
                                                       for m in r.get("measured", []))))
