"""Choosing a method: one page per model family (ViT, BERT-style, LLaMA-style), written from the results alone.

For each family, every method the results measured, in one table: what it saves and costs on a GPU (added to LoRA:
benchmarks/gpu_run.py's fig1.csv and llama.csv, the rerun's step time beside the complete run's), on a CPU (alone,
against full fine-tuning: the default sweep's headline table), what it does to the metric (the evidence run's
verdict over 5 paired seeds, else the default sweep's change), and against checkpointing; then "use X when ..."
lines drawn from those figures, and the registry's methods with no figure yet for that family. A method or a GPU row
added to the results lands in the page by itself; the docs include it (docs/choosing.md).

    python workflow/scripts/guide.py [REFERENCE_DIR [GPU_DIR [OUT.md]]]   # default: results/reference results/gpu
                                                                          # -> results/reference/tables/guide.md
Run it after refreshing any of those results (the reference set, the evidence run, a GPU run);
tests/workflow/test_guide.py checks that the committed page is what this script writes from the committed results.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER

ROOT = Path(__file__).resolve().parents[2]
CHEAP = 1.10   # a step time within 10 % of the compared method's counts as keeping its speed
CKPT = "checkpointing"


class Family(NamedTuple):
    name: str
    cpu: tuple[str, str]                  # (task, model) of the default sweep and the evidence run
    cpu_words: str
    gpu: tuple[str, str] | None = None    # (file, config) of the GPU run
    gpu_words: str = ""


FAMILIES = [
    Family("ViT", ("mnist5k", "vit-mnist"), "a small ViT on mnist5k",
           ("fig1.csv", "fig1-qkv"), "ViT-B/16, batch 64, fp16 autocast, LoRA r4 on qkv"),
    Family("BERT-style", ("tweets-sentiment", "minilm-l6"), "MiniLM-L6 on the tweets' sentiment"),
    Family("LLaMA-style", ("tweets-lm", "llama-tiny"), "a tiny LLaMA on the tweets",
           ("llama.csv", "llama7b-4layers"), "LLaMA-7B width, 4 layers, batch 4 × 640, bf16 autocast, LoRA r64"),
]


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def _lever(method: str, compared: str) -> str:
    """``lora+X`` against ``lora`` is the lever ``X`` (added to LoRA); any other row is its own method."""
    return method[len("lora+"):] if compared == "lora" and method.startswith("lora+") else method


def gpu_rows(gpu: Path, fam: Family) -> dict[str, dict]:
    """lever -> {saved (fraction of LoRA's peak), time (step time / LoRA's), rerun time} from the GPU run."""
    if fam.gpu is None:
        return {}
    out = {}
    for run in (gpu, gpu / "rerun"):
        df = _read(run / fam.gpu[0])
        if df.empty:
            continue
        df = df[(df["config"] == fam.gpu[1]) & (df["status"] == "ok")].set_index("method")
        if "lora" not in df.index:
            continue
        lora = df.loc["lora"]
        for method, r in df.iterrows():
            if method == "lora":
                continue
            key = _lever(method, "lora")
            row = out.setdefault(key, {})
            time = float(r["step_ms_p50"]) / float(lora["step_ms_p50"])
            if run == gpu:
                row.update(saved=1 - float(r["peak_bytes"]) / float(lora["peak_bytes"]), time=time)
            else:
                row["rerun_time"] = time
    return {k: v for k, v in out.items() if "saved" in v}


def cpu_rows(reference: Path, fam: Family) -> dict[str, dict]:
    """lever -> {saved, time, noise, metric, seeds} from the default sweep's headline table: the method alone against
    full fine-tuning, or ``lora+X`` against LoRA where the method has no row alone."""
    df = _read(reference / "tables" / "headline.csv")
    if df.empty:
        return {}
    df = df[(df["task"] == fam.cpu[0]) & (df["model"] == fam.cpu[1]) & (df["status"] == "ok")]
    out: dict[str, dict] = {}
    for r in df.to_dict("records"):
        key = _lever(r["method"], r["compared_with"])
        if key in out and r["compared_with"] != "baseline":
            continue
        out[key] = dict(saved=r["peak_saved_%_ours"] / 100, time=1 + r["step_time_change_%_ours"] / 100,
                        noise=str(r.get("within_noise")) == "yes", vs=r["compared_with"],
                        metric=r.get("metric_change_ours"), unit=r.get("unit"), seeds=r.get("seeds"))
    return out


def accuracy_rows(reference: Path, fam: Family) -> dict[str, dict]:
    """lever -> the evidence run's verdict (equivalent / worse / better / undecided) against its compared method."""
    df = _read(reference / "evidence" / "evidence.csv")
    if df.empty:
        return {}
    df = df[(df["task"] == fam.cpu[0]) & (df["model"] == fam.cpu[1])]
    out: dict[str, dict] = {}
    for r in df.to_dict("records"):  # the method alone against full fine-tuning first, as on the CPU columns
        key = _lever(r["method"], r["compared_with"])
        if key not in out or r["compared_with"] == "baseline":
            out[key] = r
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _x(t: float) -> str:
    return f"{t:.2f}×"


def _accuracy(lever: str, ev: dict, cpu: dict) -> str:
    e = ev.get(lever)
    if e is not None:
        unit = " %" if e["unit"] == "%" else " pt"
        within = f" (±{e['equivalent_within']:.1f}{unit})" if e["verdict"] in ("equivalent", "undecided") else ""
        return f"{e['verdict']}{within}, {int(e['seeds'])} seeds"
    c = cpu.get(lever, {})
    if c.get("metric") is None or (isinstance(c["metric"], float) and math.isnan(c["metric"])):
        return "-"
    unit = " pt" if c.get("unit") == "%" else ""
    seeds = int(c["seeds"]) if c.get("seeds") == c.get("seeds") and c.get("seeds") else 0
    return f"{c['metric']:+.2f}{unit}, {seeds} seed{'s' if seeds != 1 else ''}"


def _against_checkpointing(lever: str, figures: dict) -> str:
    ck, r = figures.get(CKPT), figures.get(lever)
    if lever == CKPT or ck is None or r is None or ck["saved"] <= 0:
        return "-"
    return f"{_pct(r['saved'] / ck['saved'])} of its saving at {r['time'] / ck['time']:.2f}× its time"


def family_section(fam: Family, reference: Path, gpu: Path, registry: list[str]) -> list[str]:
    g, c, ev = gpu_rows(gpu, fam), cpu_rows(reference, fam), accuracy_rows(reference, fam)
    levers = sorted(set(g) | set(c), key=lambda k: (k != CKPT, -(g.get(k) or c.get(k))["saved"], k))
    lines = [f"## {fam.name}", ""]
    where = [f"GPU: {fam.gpu_words}, each method added to LoRA (`lora+X` against `lora`)" if g else "",
             f"CPU: {fam.cpu_words}, each method alone against full fine-tuning" if c else ""]
    lines += ["; ".join(w for w in where if w) + ".", ""]
    head = ["method"] + (["GPU peak saved", "GPU step time"] if g else []) + ["CPU peak saved", "CPU step time",
                                                                            "accuracy", "against checkpointing"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in levers:
        cells = [k]
        if g:
            r = g.get(k)
            rerun = f" ({_x(r['rerun_time'])})" if r and "rerun_time" in r else ""
            cells += [_pct(r["saved"]), _x(r["time"]) + rerun] if r else ["-", "-"]
        r = c.get(k)
        cells += ([_pct(r["saved"]), _x(r["time"]) + (" ≈" if r["noise"] else "")] if r else ["-", "-"])
        cells += [_accuracy(k, ev, c), _against_checkpointing(k, g if g else c)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + optimizer_line(gpu, fam) + use_lines(g or c, ev, "GPU" if g else "CPU") + [""]
    shown = {k.split("@", 1)[0] for k in levers}
    missing = [m for m in registry if m not in shown and m not in ("baseline", "lora")]
    if missing:
        lines += [f"No figures yet for this family: {', '.join(f'`{m}`' for m in missing)}.", ""]
    return lines


def optimizer_line(gpu: Path, fam: Family) -> list[str]:
    """The GPU run's optimizer rows (full fine-tuning, one configuration, each optimizer against AdamW)."""
    if fam.gpu is None:
        return []
    df = _read(gpu / fam.gpu[0])
    if df.empty or "optimizer" not in df:
        return []
    df = df[(df["config"] == f"{fam.gpu[1]}-full") & (df["status"] == "ok")].set_index("optimizer")
    if DEFAULT_OPTIMIZER not in df.index or len(df) < 2:
        return []
    ref = df.loc[DEFAULT_OPTIMIZER]
    parts = [f"`{o}` {_pct(1 - float(r['peak_bytes']) / float(ref['peak_bytes']))} of the peak at "
             f"{_x(float(r['step_ms_p50']) / float(ref['step_ms_p50']))} the step time"
             for o, r in df.iterrows() if o != DEFAULT_OPTIMIZER]
    return [f"- The optimizer (GPU, full fine-tuning of the same model at batch 1 × {int(ref['seq_len'])}, against "
            f"AdamW): {'; '.join(parts)} (`--optimizer`; [Optimizers](methods/optimizers.md)).", ""]


def use_lines(figures: dict, ev: dict, device: str) -> list[str]:
    """"Use X when ..." from the figures: the most memory, the most memory at about the same speed, checkpointing
    and what comes closest to it more cheaply, and the methods the evidence run finds worse."""
    worse = sorted(k for k, e in ev.items() if e["verdict"] == "worse" and k in figures)
    ok = {k: v for k, v in figures.items() if k not in worse}
    out = []
    if ok:
        most = max(ok, key=lambda k: ok[k]["saved"])
        out.append(f"- Use `{most}` when memory is what stops you: the most saved on the {device} "
                   f"({_pct(ok[most]['saved'])} of the peak) at {_x(ok[most]['time'])} the step time.")
    cheap = {k: v for k, v in ok.items() if v["time"] <= CHEAP and v["saved"] > 0}
    if cheap:
        best = max(cheap, key=lambda k: cheap[k]["saved"])
        out.append(f"- Use `{best}` when speed matters too: {_pct(cheap[best]['saved'])} off the peak at "
                   f"{_x(cheap[best]['time'])} the step time on the {device}.")
    ck = figures.get(CKPT)
    if ck is not None:
        rivals = {k: v for k, v in ok.items() if k != CKPT and v["time"] < ck["time"] and v["saved"] > 0}
        line = (f"- Checkpointing saves {_pct(ck['saved'])} at {_x(ck['time'])} the step time on the {device} and "
                f"keeps the exact gradients")
        if rivals:
            near = max(rivals, key=lambda k: rivals[k]["saved"])
            line += (f"; `{near}` keeps {_pct(rivals[near]['saved'] / ck['saved'])} of that saving at "
                     f"{rivals[near]['time'] / ck['time']:.2f}× checkpointing's step time: use it when checkpointing's "
                     f"recomputation costs more than the memory it frees is worth, checkpointing when it does not")
        out.append(line + ".")
    if worse:
        out.append(f"- Avoid {', '.join(f'`{k}`' for k in worse)} where the metric matters: worse than the compared "
                   f"method in the evidence run (5 paired seeds).")
    return out


def render(reference: Path = ROOT / "results" / "reference", gpu: Path = ROOT / "results" / "gpu",
           registry: list[str] | None = None) -> str:
    if registry is None:
        from lowmembp.methods.registry import list_methods
        registry = list(list_methods())
    machine = json.loads((gpu / "machine.json").read_text()) if (gpu / "machine.json").is_file() else {}
    device = (machine.get("gpu") or {}).get("name", "no GPU run")
    cpu_head = (reference / "MACHINE.md").read_text().splitlines()[0].lstrip("# ") if (
        reference / "MACHINE.md").is_file() else "not stated"
    lines = [
        "Peak saved: the fraction of the compared method's peak memory; step time: the method's median over the "
        "compared method's (below 1: faster; ≈ within the CPU timing's noise); GPU: "
        f"{device} (`results/gpu/`, `benchmarks/gpu_run.py`; in brackets the rerun of the step parts alone); CPU: "
        f"{cpu_head} (`results/reference/`, the default sweep). Accuracy: the evidence run's verdict against an "
        "equivalence margin of 1 point (accuracy) or 1 % (perplexity), with the 95 % interval's reach, else the "
        "default sweep's change; against checkpointing: the method's saving as a share of checkpointing's, and its "
        "step time over checkpointing's (GPU where measured, else CPU). Pairs with LoRA are the GPU columns; "
        "the planner gives any other combination at your scale (`python -m lowmembp.plan`).",
        "",
    ]
    for fam in FAMILIES:
        lines += family_section(fam, reference, gpu, registry)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> None:
    reference = Path(argv[0]) if argv else ROOT / "results" / "reference"
    gpu = Path(argv[1]) if len(argv) > 1 else ROOT / "results" / "gpu"
    out = Path(argv[2]) if len(argv) > 2 else reference / "tables" / "guide.md"
    from lowmembp.atomic import atomic_write
    atomic_write(out, render(reference, gpu).encode())


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1:])
