"""What a row of ours is set against: the papers' ratios and, beside a paper's GPU throughput claim, the FLOP ratio of
the row's setting and a GPU run's step-time ratio.

A paper's ratio (workflow/resources/paper_claims.yaml) belongs to one setting (its models and, for LoRA, its targets:
:func:`claim`) and is shown only beside rows of that setting: a CPU stand-in, LoRA on other targets or full
fine-tuning beside a LoRA-relative ratio get '-' (:func:`add_paper` puts ours, the paper's and ours/paper side by side).
The papers' throughput claims are GPU figures: beside them stand the FLOP ratio of the row's setting
(:func:`flop_ratio`, fake tensors, hardware-independent) and the step-time ratio of a GPU run (:func:`gpu_step_ratios`,
results/gpu/ from benchmarks/gpu_run.py), never a CPU step time.
"""
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # the library
    sys.path.insert(0, str(HERE.parents[1]))
from lowmembp.estimator.weights import FROZEN_BASE_METHODS  # noqa: E402

CLAIMS = HERE.parent / "resources" / "paper_claims.yaml"
GPU_RESULTS = HERE.parents[1] / "results" / "gpu"  # benchmarks/gpu_run.py --out (docs/gpu-run.md)


def load_claims(path: Path = CLAIMS) -> dict:
    return yaml.safe_load(Path(path).read_text())


def _targets_text(v) -> str | None:
    """A LoRA ``targets`` option as one comparable text: None / NaN -> None, a list (or its JSON) -> "a,b"."""
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return None
    if isinstance(v, str) and v.startswith("["):
        import json

        try:
            v = json.loads(v)
        except ValueError:
            pass
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return ",".join(t.strip() for t in str(v).split(","))


def claim(claims: dict, table: str, method: str, model: str, targets=None) -> tuple[float, str]:
    """The paper's ratio for this row and its source, or (NaN, "") where no paper value belongs to the row's setting:
    an entry of ``claims[table][plain method]`` whose ``models`` hold ``model`` and, where it names LoRA ``targets``,
    whose targets are the row's (``targets``: the row's option; one written into the spec wins)."""
    from lowmembp.methods.registry import plain_spec, spec_options

    try:
        plain, fixed = plain_spec(method), spec_options(method)
    except ValueError:  # not a spec (a hand-made row)
        plain, fixed = method, {}
    targets = _targets_text(fixed.get("targets", targets))
    for entry in claims.get(table, {}).get(plain, []):
        models = entry["models"]
        if models != "any" and model not in models:
            continue
        if "targets" in entry and _targets_text(entry["targets"]) != targets:
            continue
        return float(entry["value"]), f"{entry['source']} [setting: {entry['setting']}]"
    return np.nan, ""


def add_paper(df: pd.DataFrame, ours: str, table: str, claims: dict, prefix: str) -> pd.DataFrame:
    """``<prefix>_ratio_ours`` (= df[ours]), ``<prefix>_ratio_paper``, ``<prefix>_ratio_ours/paper``, source."""
    targets = df["opt_targets"] if "opt_targets" in df else [None] * len(df)
    vals = [claim(claims, table, x, m, t) for x, m, t in zip(df["method"], df["model"], targets)]
    df[f"{prefix}_ratio_ours"] = df[ours]
    df[f"{prefix}_ratio_paper"] = [v for v, _ in vals]
    df[f"{prefix}_ratio_ours/paper"] = df[f"{prefix}_ratio_ours"] / df[f"{prefix}_ratio_paper"]
    df[f"{prefix}_source"] = [s for _, s in vals]
    return df


def flop_ratio(model: str, method: str, compared: str, batch_size: int, dtype: str | None, targets=None,
               rank=None) -> float:
    """FLOPs of one training step of ``method`` over ``compared``'s at a paper model's setting (fake tensors,
    :func:`lowmembp.estimator.step.estimate_by_depth` with ``flops=True``): hardware-independent, pointwise work
    counted zero (lowmembp.measurement.flops). NaN for a model the estimator does not know (a CPU stand-in)."""
    return _flop_ratio(model, method, compared, int(batch_size), dtype if isinstance(dtype, str) else None,
                       _targets_text(targets), None if rank is None or pd.isna(rank) else int(rank))


@lru_cache(maxsize=None)
def _flop_ratio(model, method, compared, batch_size, dtype, targets, rank) -> float:
    from lowmembp.estimator.step import estimate_by_depth, paper_model_name

    if paper_model_name(model) is None:
        return np.nan
    kw = dict(batch_size=batch_size, flops=True, **({"dtype": dtype} if dtype else {}))

    def count(m):
        lora = m.split("+")[0].split("@")[0] in FROZEN_BASE_METHODS
        opts = {k: v for k, v in (("targets", targets), ("rank", rank)) if v and lora}
        return estimate_by_depth(model, m, **kw, **opts)["flops"]

    return count(method) / count(compared)


def gpu_step_ratios(gpu_dir: Path = GPU_RESULTS) -> dict[tuple[str, str], float]:
    """(setting, method) -> GPU step time / LoRA's from benchmarks/gpu_run.py's ``fig1.csv`` (``fig1-qkv`` ->
    lora_qv, ``fig1-all`` -> lora_all; p50 step ms); empty until a GPU run's results are there."""
    path = Path(gpu_dir) / "fig1.csv"
    if not path.is_file():
        return {}
    g = pd.read_csv(path)
    g = g[(g["status"] == "ok") & g["step_ms_p50"].notna()]
    out = {}
    for config, sub in g.groupby("config"):
        setting = {"fig1-qkv": "lora_qv", "fig1-all": "lora_all"}.get(config, config)
        ms = sub.set_index("method")["step_ms_p50"].astype(float)
        if "lora" in ms:
            out.update({(setting, m): v / ms["lora"] for m, v in ms.items()})
    return out
