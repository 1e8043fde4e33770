"""summary.md of a benchmarks/gpu_run.py run: the machine, each part's status, and the tables a reader needs
(kernel time ratios and saved bytes, Fig. 1 beside the paper, the LLaMA step, the estimator's error, the margin)."""
from __future__ import annotations

import csv
import json
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _table(head: list[str], rows: list[list], section: str = "") -> list[str]:
    """A Markdown table; ``section``: wrapped in pymdownx.snippets' section markers, so that a docs page includes it
    by name (``--8<-- "benchmarks/gpu_run.md:fig1"``), not by line numbers."""
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join("" if v is None else str(v).replace("|", "\\|") for v in r) + " |" for r in rows]
    if section:
        out = [f"<!-- --8<-- [start:{section}] -->", *out, f"<!-- --8<-- [end:{section}] -->"]
    return out + [""]


def write_summary(out: Path, facts: dict, paper_fig1: dict) -> str:
    """Write ``out/summary.md`` (:func:`render_summary`) and return its text."""
    text = render_summary(out, facts, paper_fig1)
    (out / "summary.md").write_text(text)
    return text


def render_summary(out: Path, facts: dict, paper_fig1: dict) -> str:
    """The summary of the run in ``out`` from its files alone (``facts``: its machine.json), so that a committed
    summary can be written again from the committed data: ``python benchmarks/gpu_run_summary.py results/gpu``."""
    smoke = facts.get("smoke")
    gpu = facts.get("gpu") or {}
    v = facts.get("versions", {})
    lines = [f"# GPU evidence run{' — CPU DRY RUN (nothing here is a measurement)' if smoke else ''}", "",
             f"{gpu.get('name', 'no GPU')} (driver {gpu.get('driver', '-')}, CUDA {facts.get('cuda_torch')}, "
             f"{facts.get('nvcc') or 'no nvcc'}); torch {v.get('torch')}, triton {v.get('triton')}, timm "
             f"{v.get('timm')}, transformers {v.get('transformers')}, peft {v.get('peft')}, liger-kernel "
             f"{v.get('liger-kernel')}; commit {str((facts.get('git') or {}).get('commit'))[:10]}"
             f"{' (dirty)' if (facts.get('git') or {}).get('dirty') else ''}; {facts.get('started')}, "
             f"{facts.get('seconds')} s of a {facts.get('budget_s')} s budget.", "",
             f"Command: `{facts.get('command')}`", "", "## Parts", ""]
    lines += _table(["part", "status", "rc", "seconds", "limit s", "note"],
                    [[k, s.get("status"), s.get("rc"), s.get("seconds"), s.get("limit_s", "background"),
                      s.get("note", "")] for k, s in (facts.get("parts") or {}).items()], "parts")
    gc = out / "gpu_check" / "gpu_check.json"
    if gc.is_file():
        try:
            report = json.loads(gc.read_text())
            rows, meta = report["rows"], report.get("meta") or {}
            bad = [r for r in rows if not r.get("ok")]
            left = "" if meta.get("complete", True) else \
                f"; INCOMPLETE: not checked {', '.join(meta.get('pending') or []) or '?'} (the part stopped)"
            lines += [f"gpu_check: {len(rows) - len(bad)}/{len(rows)} checks passed (gpu_check/gpu_check.md){left}"] + \
                     [f"- FAIL {r['op']} {r['dir']} {r['shape']} {r['dtype']}: {r['detail']}" for r in bad[:10]] + [""]
        except Exception as e:
            lines += [f"gpu_check: report unreadable ({e})", ""]
    pt = out / "pytest_gpu.txt"
    if pt.is_file():
        tail = [x for x in pt.read_text(errors="ignore").strip().splitlines() if x.strip()]
        lines += [f"pytest -m gpu: {tail[-1] if tail else '(no output)'}", ""]

    kern = _rows(out / "kernels.csv")
    if kern:
        lines += ["## Kernels: ours, official LowMemoryBP, Liger, PyTorch (kernels.csv)", "",
                  "Times: forward / backward median ms; ×ours: impl time / ours (below 1: faster than ours). "
                  "Saved: bytes kept for backward per input element. Errors against the reference of its semantics.",
                  ""]
        lines += _table(["op, shape, dtype", "impl", "status", "fwd ms", "bwd ms", "fwd ×ours", "bwd ×ours",
                         "saved B/elem", "err y / dx", "note"],
                        [[f"{r['op']} {r['shape']} {_short_dtype(r['dtype'])}", r["impl"], r["status"],
                          _sig(r["fwd_ms"]), _sig(r["bwd_ms"]), _sig(r["fwd_vs_ours"], 2), _sig(r["bwd_vs_ours"], 2),
                          _sig(r["saved_bytes_per_element"]), f"{_err(r['y_err'])} / {_err(r['dx_err'])}",
                          r["note"][:80]] for r in kern], "kernels")
    fig1 = _rows(out / "fig1.csv")
    if fig1:
        lines += ["## Fig. 1: ViT-B/16, batch 64, fp16 autocast, LoRA r4 (fig1.csv)", "",
                  "Paper: LowMemoryBP Fig. 1 (their ViT and LoRA code, one GPU; docs/design.md#papers), "
                  "shown beside the "
                  "rows of its setting only: LoRA on q and v (here qkv, the official lora_qv); the all-linear rows "
                  "(lora_all) have no paper value."
                  + (" Dry run: tiny model, no timing." if smoke else ""), ""]
        lines += _table(["LoRA on", "method", "status", "peak MiB", "peak vs lora", "img/s", "speed vs lora",
                         "paper MiB", "paper img/s", "note"],
                        [[r["lora_targets"], r["method"], r["status"], r["peak_mib"], *_vs_first(r, fig1),
                          *(paper_fig1.get(r["method"], ("", "")) if r["lora_targets"] == "qkv" else ("", "")),
                          r["note"][:80]] for r in fig1], "fig1")
    llama = _rows(out / "llama.csv")
    if llama:
        lines += ["## LLaMA-7B width, 4 layers, bf16 autocast (llama.csv)", "",
                  "llama7b-4layers: batch 4 x 640, LoRA r64 α16 dropout 0.1 on all linears (velora: dropout 0); "
                  "llama7b-4layers-full: full fine-tuning, batch 1 x 640, one row per optimizer. "
                  "vs ref: against the first row of the same configuration (lora; baseline with adamw).", ""]
        lines += _table(["config", "method", "optimizer", "status", "peak MiB", "peak vs ref", "tokens/s",
                         "speed vs ref", "step ms p50", "note"],
                        [[r["config"], r["method"], r.get("optimizer", ""), r["status"], r["peak_mib"],
                          *_vs_first(r, llama), r["step_ms_p50"], r["note"][:80]] for r in llama], "llama")
    err = _rows(out / "estimator_error.csv")
    if err:
        lines += ["## Estimator error: measured peak / fake-tensor estimate (estimator_error.csv)", ""]
        lines += _table(["config", "method", "optimizer", "estimate MiB", "measured MiB", "ratio", "note"],
                        [[r["config"], r["method"], r.get("optimizer", ""), _mib(r["estimate_bytes"]),
                          _mib(r["measured_bytes"]), r["ratio"], r.get("note", "")[:80]] for r in err], "estimator")
    m = next((f for f in (out / "margin.json", out / "margin.candidate.json") if f.is_file()), None)
    if m is not None:
        mg = json.loads(m.read_text())
        kept = "" if m.name == "margin.json" else ", kept as a candidate, not installed"
        lines += [f"Planner margin ({m.name}{kept}): fraction {mg['fraction']}, reserved "
                  f"{mg['reserved_bytes'] / 2 ** 30:.2f} GiB — {mg['source']}", ""]
    return "\n".join(lines) + "\n"


def _short_dtype(name: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def _err(v) -> str:
    try:
        return f"{float(v):.1e}"
    except (TypeError, ValueError):
        return "" if v is None else str(v)


def _sig(v, digits: int = 3) -> str:
    """A measured figure to ``digits`` significant digits (3 for times: a median of repeated timings; 2 for
    ratios' and errors' last digits that the timing noise or the tolerance does not support)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return "" if v is None else str(v)
    return f"{x:.{digits}g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.{max(digits - 1, 1)}e}"


def _mib(b):
    try:
        return f"{int(b) / 2 ** 20:.0f}"
    except (TypeError, ValueError):
        return ""


def _vs_first(r: dict, rows: list[dict]) -> list:
    """[peak change vs the first row of r's configuration (lora; full fine-tuning: baseline with adamw), throughput,
    throughput ratio to that row]; blank where that row is not ok."""
    base = next((b for b in rows if b["config"] == r["config"]), None)
    base = base if base is not None and base["status"] == "ok" else None
    peak, speed = "", ""
    try:
        peak = f"{100 * (int(r['peak_bytes']) / int(base['peak_bytes']) - 1):+.1f} %"
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        pass
    try:
        speed = f"{float(r['throughput']) / float(base['throughput']):.3f}x"
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        pass
    try:
        throughput = f"{float(r['throughput']):.0f}"
    except (TypeError, ValueError, KeyError):
        throughput = r.get("throughput", "")
    return [peak, throughput, speed]


if __name__ == "__main__":  # write a run's summary.md again from its files: python benchmarks/gpu_run_summary.py DIR
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_run import PAPER_FIG1

    run = Path(sys.argv[1] if len(sys.argv) > 1 else "results/gpu")
    write_summary(run, json.loads((run / "machine.json").read_text()), PAPER_FIG1)
    print(run / "summary.md")
