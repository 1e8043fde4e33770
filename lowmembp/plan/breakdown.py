"""Where a step's peak is and what it holds: the phase it falls in and its bytes by category, as the planner reports
them (a row's ``peak_phase`` and ``peak_breakdown``, the table's "peak at" column, :func:`plot_breakdown`'s bars).

    split_peak(peak)   # {"weights", "gradients", "optimizer_states", "saved_activations", "temporaries", "host"}
    compact(row)      # "bwd W55 S30 T15": the phase, then each category's share of the peak in % (>= 5 %)

From the peak tracker's split (:class:`lowmembp.measurement.peak.StorageTracker`, taken at the moment of the peak):
weights = parameters and buffers; gradients = ``.grad`` alive; optimizer_states = the optimizer's state;
saved_activations = storages autograd saved for backward still alive (a block's inputs kept by checkpointing, and
the batch where an op saves it, included); temporaries = everything else alive on the device (forward values not
saved, the backward's and the optimizer's temporaries, the batch). The five add up to the peak. host = bytes an
offloading method keeps in host memory at that moment (not part of the device peak).
"""
from __future__ import annotations

__all__ = ["BREAKDOWN", "DEVICE_PARTS", "PHASE_SHORT", "compact", "split_peak", "plot_breakdown"]

BREAKDOWN = ("weights", "gradients", "optimizer_states", "saved_activations", "temporaries", "host")
DEVICE_PARTS = BREAKDOWN[:-1]  # the parts of the device peak (host memory is apart)
PHASE_SHORT = {"forward": "fwd", "loss": "loss", "backward": "bwd", "optimizer": "opt"}
_LETTER = {"weights": "W", "gradients": "G", "optimizer_states": "O", "saved_activations": "S", "temporaries": "T"}
LEGEND = ("peak at: the phase of the step the peak falls in (fwd: forward through the blocks; loss: head and loss "
          "after the last block; bwd: backward incl. recomputation; opt: optimizer step), then % of the peak held by "
          "W weights, G gradients, O optimizer states, S activations saved for backward, T temporaries (>= 5 % shown); "
          "~: the 2- and 3-block builds peak in different phases, G/S/T split as the deeper build's")


def split_peak(peak: dict) -> dict[str, int]:
    """The peak's bytes by :data:`BREAKDOWN` category (module doc) from an estimate's ``"peak"`` dict.

    A peak extended by depth from builds whose peaks fall in different phases (``peak["split_from"]``: the deeper
    build's peak) has only the bytes alive through the whole step (weights, optimizer states) extended; the rest of
    its bytes is split as the deeper build's rest is (a proportional split, not a measured one)."""
    if peak.get("split_from") is not None:
        return _proportional(peak, split_peak(peak["split_from"]))
    c = peak["by_category"]
    saved = int(peak.get("saved_bytes") or 0)
    rest = sum(v for k, v in c.items() if k not in ("parameters", "gradients", "optimizer_state"))
    host = (peak.get("host") or {}).get("at_device_peak") or 0
    return {"weights": int(c.get("parameters", 0)), "gradients": int(c.get("gradients", 0)),
            "optimizer_states": int(c.get("optimizer_state", 0)), "saved_activations": saved,
            "temporaries": int(rest - saved), "host": int(host)}


def _proportional(peak: dict, shallow: dict[str, int]) -> dict[str, int]:
    c = peak["by_category"]
    out = {"weights": int(c.get("parameters", 0)), "optimizer_states": int(c.get("optimizer_state", 0))}
    rest = int(peak["bytes"]) - out["weights"] - out["optimizer_states"]
    moving = ("gradients", "saved_activations", "temporaries")
    total = sum(shallow[k] for k in moving)
    for k in moving[:-1]:
        out[k] = rest * shallow[k] // total if total else 0
    out["temporaries"] = rest - sum(out[k] for k in moving[:-1])
    out["host"] = shallow["host"]
    return {k: out[k] for k in BREAKDOWN}


def compact(row: dict) -> str:
    """The table's "peak at" cell: the phase, then each category's share of the peak (``LEGEND``)."""
    parts, total = row.get("peak_breakdown") or {}, row.get("peak_bytes") or 0
    shares = [f"{_LETTER[k]}{round(100 * parts.get(k, 0) / total)}" for k in DEVICE_PARTS
              if total and parts.get(k, 0) >= 0.05 * total]
    approx = "~" if row.get("peak_breakdown_how") == "proportional" else ""
    return " ".join([PHASE_SHORT.get(row.get("peak_phase"), "-") + approx] + shares)


def plot_breakdown(p, path) -> None:
    """One horizontal stacked bar per estimated row of plan ``p`` (its rank order): the peak's bytes by category (in
    the table's unit: GiB, MiB or KiB), the GPU's usable memory as a line; written to ``path`` (PNG/PDF/SVG by its
    suffix), atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lowmembp.atomic import atomic_open
    from lowmembp.plan.report import _size, unit_for

    s, rows = p.settings, [r for r in p.rows if r["status"] == "ok"]
    if not rows:
        raise ValueError("plot_breakdown: no estimated row to plot")
    labels = [f"{r['label']} ({r['weights']})" for r in rows]
    unit_name, unit = unit_for([s["capacity_bytes"], *(r["peak_bytes"] for r in rows)])
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.22 * len(rows)))
    left = [0.0] * len(rows)
    for k in DEVICE_PARTS:
        v = [r["peak_breakdown"][k] / unit for r in rows]
        ax.barh(range(len(rows)), v, left=left, label=k.replace("_", " "))
        left = [a + b for a, b in zip(left, v)]
    ax.axvline(s["capacity_bytes"] / unit, color="k", ls="--", lw=1, label="usable GPU memory")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"peak memory of one training step ({unit_name})")
    seq = f", {s['seq_len']} tokens" if s.get("seq_len") else ""
    ax.set_title(f"Where the peak is: {s['model']}, batch {s['batch_size']}{seq}, "
                 f"{_size(s['gpu_memory_bytes'])} GPU\n(fake-tensor estimates of one step on the CPU; lowmembp.plan)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fmt = str(path).rsplit(".", 1)[-1] if "." in str(path) else "png"
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=fmt, dpi=120)
    plt.close(fig)
