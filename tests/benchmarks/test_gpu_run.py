"""benchmarks/gpu_run.py: its CPU dry run writes every file with its columns; the llama part has a row for each peer
and each optimizer, and the CUDA-only peers are refused on the CPU with the library's reason; the official-ops adapter
builds the right command, keeps their tensor layouts, and imports their Python package; a wrong kernel fails its
row."""
import csv
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowmembp.methods.liger import NO_GPU
from lowmembp.methods.optimizers import DEFAULT_OPTIMIZER
from lowmembp.plan.combos import NOT_ESTIMATED

pytestmark = pytest.mark.slow  # the full suite only: the prepared GPU run's CPU smoke

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

gpu_run = importlib.import_module("gpu_run")
kernels = importlib.import_module("gpu_run_kernels")
steps = importlib.import_module("gpu_run_steps")
official = importlib.import_module("official_lomem")
OPTIMIZERS = steps.LLAMA_FULL_OPTIMIZERS  # the full fine-tuning rows: AdamW and its two levers


def _csv(path):
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        return r.fieldnames, list(r)


def _cce_refusal() -> str:
    """The library's message when CCE's Triton kernel is asked for on the CPU."""
    from lowmembp.methods.cce import resolve_impl
    with pytest.raises(RuntimeError) as refused:
        resolve_impl("cce", torch.device("cpu"))
    return str(refused.value)


def _smoke_llama():
    from lowmembp.estimator.step import MODELS, build
    cfg = next(c for c in steps.step_configs(True) if c.part == "llama")
    return build(MODELS[cfg.model], layers=cfg.layers, overrides=cfg.overrides, device="meta")


@pytest.mark.slow
def test_cpu_smoke_writes_every_file_with_its_columns(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_run.py"), "--cpu-smoke", "--out", str(out),
                           "--third-party", str(tmp_path / "absent")],  # as in CI: nothing prepared
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    cols, rows = _csv(out / "kernels.csv")
    assert cols == kernels.COLUMNS
    ops = {"regelu2", "resilu2", "geglu", "swiglu", "ms_layernorm", "ms_rmsnorm"}
    assert {r["op"] for r in rows} == ops
    for op in ops:
        for dt in ("float16", "bfloat16"):
            got = {r["impl"]: r for r in rows if r["op"] == op and r["dtype"] == dt}
            assert got["ours"]["status"] == "ok" and got["torch"]["status"] == "ok", got
            assert got["official-stand-in"]["status"] == "ok" and "stand-in" in got["official-stand-in"]["note"]
            assert int(got["ours"]["saved_bytes"]) > 0
    acts = [r for r in rows if r["op"] == "regelu2" and r["impl"] == "ours"]
    assert all(float(r["saved_bytes_per_element"]) < 0.3 for r in acts)  # 2-bit codes, not the input
    assert all(r["status"] == "skipped" for r in rows if r["impl"] == "liger")
    assert not any(r["fwd_ms"] for r in rows), "the dry run claims no timing"

    refused_here = {"liger": NO_GPU, "cce": _cce_refusal()}  # the CUDA-only kernels: the library's own messages
    for part, methods in (("fig1", steps.FIG1_METHODS), ("bound", steps.BOUND_METHODS),
                          ("llama", steps.LLAMA_METHODS)):
        cols, rows = _csv(out / f"{part}.csv")
        assert cols == steps.STEP_COLUMNS
        assert [r["method"] for r in rows if r["config"] == rows[0]["config"]] == methods
        assert [steps.row_key(r) for r in rows] == [steps.row_key(c) for c in steps.step_configs(True)
                                                    if c.part == part]
        for r in rows:
            names = r["method"].split("+")
            refused = [n for n in names if n in refused_here]
            want = "ok" if not refused else ("not applicable" if part == "fig1" else "refused")  # fig1: timm
            if r["config"] == "fig1-qkv-cuda-graphs":  # the job refuses --capture off CUDA: recorded, not failed
                assert r["status"] == "skipped" and "needs CUDA" in r["note"], r
                continue
            assert r["status"] == want, r
            if want == "ok":
                assert int(r["peak_bytes"]) > 0 and int(r["steps"]) >= 2
            elif want == "refused":  # the refusal reason of the library, not a failure
                assert refused_here[refused[0]] in r["note"], r
    fig1 = _csv(out / "fig1.csv")[1]
    assert {r["lora_targets"] for r in fig1} == {"qkv, proj, fc1, fc2", "qkv", "qkv (cuda-graphs)",
                                                 "qkv (official ops)"}
    # fig1 and bound ran through the training job: one valid job record per cell beside the CSV
    for r in fig1 + _csv(out / "bound.csv")[1]:
        if r["status"] == "ok":
            path = out / r["note"].split("record ")[1].split(";")[0]
            rec = json.loads(path.read_text())
            assert rec["status"] == "ok" and rec["run"]["synthetic_data"] and rec["run"]["method"] == r["method"]
            assert rec["peak"]["device"]["bytes"] == int(r["peak_bytes"])
    official = next(r for r in fig1 if r["config"] == "fig1-qkv-official")
    assert official["status"] == "ok" and "stand-in" in official["note"]
    assert fig1[0]["lora_targets"] == "qkv"  # Fig. 1's setting (the official lora_qv) is measured first
    llama = {steps.row_key(r): r for r in _csv(out / "llama.csv")[1]}
    full_rows = [r for k, r in llama.items() if k[0] == "llama7b-4layers-full"]
    assert [r["optimizer"] for r in full_rows] == list(OPTIMIZERS) and {r["method"] for r in full_rows} == {"baseline"}

    cols, rows = _csv(out / "estimates.csv")
    assert cols == steps.ESTIMATE_COLUMNS
    est = {steps.row_key(r): r for r in rows}
    assert set(est) == {steps.row_key(c) for c in steps.step_configs(True)}  # every row has its estimate's row
    for k, r in est.items():  # the methods the estimator cannot follow: its own reason
        if k[1] in ("lora+liger", "lora+cce"):
            assert r["status"] == "no estimate" and NOT_ESTIMATED[k[1].split("+")[1]] in r["note"], r
        else:
            assert r["status"] == "ok" and int(r["estimate_bytes"]) > 0, r

    cols, rows = _csv(out / "estimator_error.csv")
    assert cols == steps.ERROR_COLUMNS
    ratios = {steps.row_key(r): float(r["ratio"]) for r in rows if r["ratio"]}
    # 2 x 4 ViT + the official ops' row + 4 at batch 256 (the captured rows: skipped on the CPU) + 8 LLaMA: lora,
    # +lowmembp, +checkpointing, velora, +tiled-mlp, full FT with 3 optimizers (Liger and CCE: refused on the CPU,
    # and no estimate)
    bound = _csv(out / "bound.csv")[1]
    assert len(ratios) == 21 and set(ratios) == {k for k, r in llama.items() if r["status"] == "ok"} | {
        steps.row_key(r) for r in fig1 + bound if r["status"] == "ok"}
    eightbit = ("llama7b-4layers-full", "baseline", "adamw8bit")
    full = {k: x for k, x in ratios.items() if k[0] == "llama7b-4layers-full" and k != eightbit}
    exact = {k: x for k, x in ratios.items() if k != eightbit and k not in full}
    assert all(0.95 < x < 1.05 for x in exact.values()), exact  # CPU storage tracker vs the fake-tensor estimate
    # full fine-tuning through the job: its AdamW is torch's default (foreach, with temporaries the size of the
    # parameters), the estimate's the fused one; above the estimate by less than an fp32 copy of the weights
    numel = sum(p.numel() for p in _smoke_llama().parameters())
    for k in full:
        e, m = int(est[k]["estimate_bytes"]), int(llama[k]["peak_bytes"])
        assert e <= m <= e + 4 * numel, (k, e, m, numel)
    # bitsandbytes' CPU fallback dequantises a parameter's two 8-bit states to fp32 scratch inside its step (the
    # allocator's events see it); the estimate keeps CUDA's in-place update: above it, by less than fp32 copies of
    # both states of every parameter
    numel = sum(p.numel() for p in _smoke_llama().parameters())
    e, m = int(est[eightbit]["estimate_bytes"]), int(llama[eightbit]["peak_bytes"])
    assert e < m <= e + 2 * 4 * numel, (e, m, numel)

    mg = json.loads((out / "margin.json").read_text())
    assert isinstance(mg["fraction"], float) and isinstance(mg["reserved_bytes"], int)
    assert "NOT a measurement" in mg["source"] and mg["fraction"] >= 0
    try:  # the planner reads it as its margin file
        from lowmembp.plan.sources import margin
    except ImportError:
        margin = None
    if margin is not None:
        assert "NOT a measurement" in margin(margin_file=out / "margin.json")["source"]

    machine = json.loads((out / "machine.json").read_text())
    for key in ("gpu", "cuda_torch", "nvcc", "versions", "command", "git", "parts", "started", "seconds"):
        assert key in machine
    assert machine["smoke"] is True and "--cpu-smoke" in machine["command"]
    assert set(gpu_run.PARTS) | {"estimates"} == set(machine["parts"])
    assert all(p["status"] == "ok" for n, p in machine["parts"].items() if n != "host_time"), machine["parts"]
    assert machine["parts"]["host_time"]["status"] in ("ok", "skipped")
    gc = json.loads((out / "gpu_check" / "gpu_check.json").read_text())
    assert gc["rows"] and gc["meta"]["complete"] is True and gc["meta"]["pending"] == []
    assert "collected" in (out / "pytest_gpu.txt").read_text()
    assert "CPU DRY RUN" in (out / "summary.md").read_text()
    # the paper's Fig. 1 values stand beside the rows of their setting (LoRA on q, v: qkv) only
    lines = (out / "summary.md").read_text().splitlines()
    every = [x for x in lines if x.startswith("| qkv, proj, fc1, fc2 |")]
    assert every and not any("3827" in x or "2717" in x for x in every)
    assert any(x.startswith("| qkv | lora |") and "3827" in x for x in lines)
    # the optimizer rows stand beside full fine-tuning with adamw (their configuration's first row), not beside LoRA
    section = lines[lines.index(next(x for x in lines if x.startswith("## LLaMA"))):]
    section = section[:section.index(next(x for x in section if x.startswith("## Estimator")))]
    full = {x.split(" | ")[2]: x for x in section if x.startswith("| llama7b-4layers-full | baseline |")}
    assert list(full) == list(OPTIMIZERS) and "| +0.0 % |" in full["adamw"]
    peak = {r["optimizer"]: int(r["peak_bytes"]) for r in full_rows}
    assert f"| {100 * (peak['adamw8bit'] / peak['adamw'] - 1):+.1f} % |" in full["adamw8bit"]


def test_llama_rows_cover_the_peers_and_the_optimizers():
    """The llama part's rows, on the GPU and in the dry run alike: the LoRA configuration with the peers, and full
    fine-tuning once per optimizer of the library; VeLoRA's groups divide both input widths."""
    from lowmembp.estimator.step import MODELS, build

    for smoke in (False, True):
        cfgs = [c for c in steps.step_configs(smoke) if c.part == "llama"]
        lora = [c for c in cfgs if c.config == "llama7b-4layers"]
        full = [c for c in cfgs if c.config == "llama7b-4layers-full"]
        assert [c.method for c in lora] == steps.LLAMA_METHODS and len(lora) + len(full) == len(cfgs)
        for m in ("lora+cce", "velora", "lora+tiled-mlp"):
            assert m in steps.LLAMA_METHODS
        assert {c.optimizer for c in lora} == {DEFAULT_OPTIMIZER}
        assert [(c.method, c.optimizer) for c in full] == [("baseline", o) for o in OPTIMIZERS]
        assert len({steps.row_key(c) for c in steps.step_configs(smoke)}) == len(steps.step_configs(smoke))
        by = {c.method: c for c in lora}
        assert by["lora+cce"].options["impl"] == "cce"  # the Triton kernel, never a silent torch.compile
        vel = by["velora"].options
        assert "dropout" not in vel and by["lora"].options["dropout"] == 0.1
        model = build(MODELS["llama-7b"], layers=1, overrides=by["velora"].overrides, device="meta")
        widths = (model.config.hidden_size, model.config.intermediate_size)
        assert widths == ((64, 172) if smoke else (4096, 11008))
        assert all(w % vel["num_groups"] == 0 and vel["num_groups"] < w for w in widths), (widths, vel)


def _one(method, optimizer=DEFAULT_OPTIMIZER):
    return next(c for c in steps.step_configs(True)
                if c.part == "llama" and c.method == method and c.optimizer == optimizer)


def test_cuda_only_peers_are_refused_on_the_cpu_with_the_library_reason(tmp_path):
    from experiments.interleave import run_cells
    for method, reason in (("lora+cce", _cce_refusal()), ("lora+liger", NO_GPU)):
        cfg = _one(method)
        records, _ = run_cells({"x": steps.job_argv(cfg, smoke=True)}, rounds=1, out_dir=tmp_path,
                               progress=lambda m: None)
        row = steps.record_row(cfg, records["x"], None, True, "x.json")
        assert row["status"] == "refused" and reason in row["note"], row
    assert steps.refusal_status(_one("lora+liger"), ValueError("liger: no patch for timm")) == "not applicable"
    assert steps.refusal_status(_one("lora"), RuntimeError("boom")) == "error"
    assert steps.refusal_status(_one("lora"), RuntimeError("CUDA out of memory. Tried")) == "oom"


def test_adamw8bit_without_bitsandbytes_is_skipped_with_the_jobs_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now raises ImportError
    row = steps.job_refuses(_one("baseline", "adamw8bit"), smoke=True)
    assert row["status"] == "skipped" and "needs bitsandbytes: pip install" in row["note"], row
    assert steps.job_refuses(_one("baseline"), smoke=True) is None


def test_each_full_fine_tuning_row_is_the_job_with_its_optimizer():
    """Each full fine-tuning row is the training job's cell with that --optimizer, every weight trained, the model
    in bf16 as the job's alpaca task loads it (and the estimate beside it counts it so: weights bf16)."""
    from experiments.args import parse_args
    for opt in OPTIMIZERS:
        cfg = _one("baseline", opt)
        if opt == "adamw8bit":
            pytest.importorskip("bitsandbytes")
        job, _ = parse_args(steps.job_argv(cfg, smoke=True) + ["--out", os.devnull])
        assert (job.optimizer, job.method, job.task, job.dtype) == (opt, "baseline", "alpaca", "bf16")
        assert job.synthetic_data and job.layers == cfg.layers and job.max_len == cfg.seq_len
        assert cfg.weights == "bf16" and steps.cell_name(cfg).endswith("" if opt == DEFAULT_OPTIMIZER else opt)


def test_configurations_past_the_time_limit_are_recorded_not_built(tmp_path):
    rows = []
    ctx = SimpleNamespace(smoke=True, out=tmp_path, third_party=tmp_path / "tp", build_dir=tmp_path / "b")
    steps.run_job_part(ctx, "llama", SimpleNamespace(write=rows.append), deadline=0.0)
    cfgs = [c for c in steps.step_configs(True) if c.part == "llama"]
    assert [steps.row_key(r) for r in rows] == [steps.row_key(c) for c in cfgs]
    assert all(r["status"] == "error" and r["note"].startswith("not built: the part's time limit") for r in rows)


def test_smoke_refuses_to_write_into_results_gpu():
    assert gpu_run.main(["--cpu-smoke", "--out", str(ROOT / "results" / "gpu")]) == 2


def _fake_lomem(root: Path, with_python: bool) -> Path:
    pkg = root / "lomem"
    (pkg / "csrc" / "include").mkdir(parents=True)
    for f in ("regelu2.cpp", "module.cpp", "regelu2_cuda.cu", "layer_norm_cuda.cu"):
        (pkg / "csrc" / f).write_text("// stub\n")
    if with_python:  # the shape of their package: functional re-exports, autograd functions over _C
        (pkg / "__init__.py").write_text("import lomem.functional as functional\n")
        (pkg / "functional.py").write_text(
            "import torch\nfrom . import _C\n\n"
            "class _Act(torch.autograd.Function):\n"
            "    @staticmethod\n    def forward(ctx, x, fw, bw):\n"
            "        out, p = fw(x)\n        ctx.save_for_backward(p)\n        ctx.bw = bw\n        return out\n"
            "    @staticmethod\n"
            "    def backward(ctx, g):\n        return ctx.bw(g, ctx.saved_tensors[0]), None, None\n\n"
            "MARK = 'theirs'\n"
            "def regelu2(x):\n    return _Act.apply(x, _C.regelu2_fw, _C.regelu2_bw)\n"
            "def resilu2(x):\n    return _Act.apply(x, _C.resilu2_fw, _C.resilu2_bw)\n"
            "def layer_norm(x, shape, eps):\n    raise NotImplementedError\n"
            "def rms_norm(x, shape, eps):\n    raise NotImplementedError\n")
    return pkg


def test_build_command_of_the_official_ops(tmp_path):
    pkg = _fake_lomem(tmp_path / "repo", with_python=False)
    kw = official.build_kwargs(tmp_path / "repo", tmp_path / "build", std="-std=c++17")  # repo root or package
    assert kw == official.build_kwargs(pkg, tmp_path / "build", std="-std=c++17")
    names = [Path(s).name for s in kw["sources"]]
    assert names == ["module.cpp", "regelu2.cpp", "layer_norm_cuda.cu", "regelu2_cuda.cu"]
    assert all(Path(s).is_absolute() for s in kw["sources"])
    assert kw["extra_include_paths"] == [str((pkg / "csrc" / "include").resolve())]
    assert kw["name"].isidentifier() and kw["build_directory"] == str((tmp_path / "build").resolve())
    for flag in ("-O3", "-std=c++17", "--use_fast_math", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                 "--expt-extended-lambda"):
        assert flag in kw["extra_cuda_cflags"]
    assert kw["extra_cflags"] == ["-O3", "-std=c++17"]
    kw20 = official.build_kwargs(pkg, tmp_path / "build", std="-std=c++20")
    assert kw20["extra_cflags"] == ["-O3", "-std=c++20"] and "-std=c++17" not in kw20["extra_cuda_cflags"]
    header = tmp_path / "ATen.h"
    header.write_text("#error C++20 or later compatible compiler is required to use ATen.\n")
    assert official.cxx_standard(header) == "-std=c++20"
    header.write_text("#pragma once\n")
    assert official.cxx_standard(header) == "-std=c++17"
    assert official.build_env((9, 0), cpus=16) == {"TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "8"}
    assert official.build_env("8.6", cpus=2)["TORCH_CUDA_ARCH_LIST"] == "8.6"
    for bad in ("sm90", "8.0;9.0", "Hopper", "9.0b", "9", ""):
        with pytest.raises(ValueError, match="compute capability"):
            official.arch_of(bad)
    with pytest.raises(official.OfficialUnavailable, match="prepare_gpu_run.sh"):
        official.build_kwargs(tmp_path / "nothing", tmp_path / "build")
    for f in (pkg / "csrc").glob("*.cu"):
        f.unlink()
    with pytest.raises(official.OfficialUnavailable, match="no .cu"):
        official.find_sources(pkg)


def test_architecture_with_a_suffix_as_torch_takes_it(monkeypatch, tmp_path):
    """'9.0a' (sm_90a: the H200 image's TORCH_CUDA_ARCH_LIST) is one architecture of compute capability 9.0: the
    background build (--arch) and the kernels part's load (TORCH_CUDA_ARCH_LIST) ask for the same one, as torch's
    cpp_extension spells it."""
    assert official.arch_of("9.0a") == "9.0a" and official.arch_of(" 9.0a ") == "9.0a"
    assert official.arch_of("9.0+PTX") == "9.0+PTX" and official.arch_of("10.0a") == "10.0a"
    assert official.build_env("9.0a", cpus=16)["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert official.capability_of("9.0a") == official.capability_of("9.0+PTX") == "9.0"
    assert official.arch_for_gpu("9.0", "9.0a") == "9.0a"  # the environment's, where it is this GPU's
    assert official.arch_for_gpu("9.0", None) == official.arch_for_gpu("9.0", "") == "9.0"
    assert official.arch_for_gpu("9.0", "8.0") == "9.0"  # another GPU's: sm_80 code does not run on sm_90
    assert official.arch_for_gpu("9.0", "8.0;9.0") == official.arch_for_gpu("9.0", "Hopper") == "9.0"
    try:  # torch turns it into its own -gencode flags (the build's); here with the installed torch
        from torch.utils.cpp_extension import _get_cuda_arch_flags
    except ImportError:
        _get_cuda_arch_flags = None
    if _get_cuda_arch_flags is not None:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", official.arch_of("9.0a"))
        assert _get_cuda_arch_flags() == ["-gencode=arch=compute_90a,code=sm_90a"]
    # gpu_run sets it for every part from nvidia-smi's compute capability and the environment
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert "TORCH_CUDA_ARCH_LIST=9.0a" in gpu_run.set_build_arch("9.0")
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;8.6")
    gpu_run.set_build_arch("9.0")
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    # an arch the build cannot take is its refusal (OfficialUnavailable: rc 1 with the reason), not a traceback
    pkg = _fake_lomem(tmp_path / "repo", with_python=False)
    with pytest.raises(official.OfficialUnavailable, match="compute capability"):
        official.build(pkg, tmp_path / "build", capability="sm_90")


def test_cuda_home_is_the_toolkit_behind_a_wrapper_nvcc(tmp_path):
    """torch guesses CUDA_HOME as the folder above the nvcc on the path: /usr/local for a /usr/local/bin/nvcc wrapper
    script, whose include/ lacks cuda_runtime_api.h. The build takes the toolkit folder that has nvcc and the
    headers; pip's CUDA headers fill only what a toolkit lacks."""
    wrapper = tmp_path / "local" / "bin" / "nvcc"
    toolkit = tmp_path / "cuda-13.0"
    for f in (wrapper, toolkit / "bin" / "nvcc", toolkit / "include" / "cuda_runtime_api.h"):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("")
    (tmp_path / "local" / "include").mkdir()
    assert official.cuda_home({"CUDA_HOME": "/x"}, lambda _: str(wrapper)) == "/x"
    real = tmp_path / "real" / "bin" / "nvcc"  # a symlink to the toolkit's nvcc: its real path's folder
    real.parent.mkdir(parents=True)
    real.symlink_to(toolkit / "bin" / "nvcc")
    assert official.cuda_home({}, lambda _: str(real)) == str(toolkit)
    assert official.cuda_home({}, lambda _: str(wrapper)) != str(tmp_path / "local")  # never the wrapper's folder
    pip = tmp_path / "site" / "nvidia"
    for d, h in (("cu13", "cusparse.h"), ("cu13", "cublas_v2.h"), ("other", "nothing.h")):
        (pip / d / "include").mkdir(parents=True, exist_ok=True)
        (pip / d / "include" / h).write_text("")
    assert official.header_fallback_dirs(str(toolkit), [str(pip)]) == [str(pip / "cu13" / "include")]
    for h in official.TORCH_CUDA_HEADERS:
        (toolkit / "include" / h).write_text("")
    assert official.header_fallback_dirs(str(toolkit), [str(pip)]) == []


def test_stand_in_keeps_their_layouts_and_their_python_is_used(tmp_path):
    from lowmembp.ops import approx_act as aa
    C = official.stand_in_c()
    x = torch.randn(2, 3, 7, dtype=torch.bfloat16) * 3  # 42 elements: the last code byte is partly used
    y, packed = C.regelu2_fw(x)
    assert packed.dtype == torch.uint8 and packed.numel() == (x.numel() + 3) // 4  # theirs: no flag byte
    dy = torch.randn_like(x)
    assert torch.equal(C.regelu2_bw(dy, packed), aa.backward_reference(dy, aa.forward_reference(x, "gelu")[1], "gelu"))
    yn, rstd = C.rms_norm_fw(x, [7], 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (6,)

    pkg = _fake_lomem(tmp_path / "repo", with_python=True)
    ops = official.Official(C, "stand-in: test", pkg)
    assert ops.python.startswith("their lomem Python package") and ops.is_stand_in
    assert sys.modules["lomem.functional"].MARK == "theirs"
    xr = x.float().requires_grad_()
    out = ops.regelu2(xr)
    (g,) = torch.autograd.grad(out, xr, torch.ones_like(out))
    assert torch.equal(g, aa.backward_reference(torch.ones_like(xr), aa.forward_reference(xr.detach(), "gelu")[1],
                                                "gelu"))
    plain = official.Official(C, "stand-in: test", None)  # no copy: the adapter's own wrapper
    assert plain.python.startswith("adapter's") and torch.equal(plain.regelu2(xr), out)
    for k in [k for k in sys.modules if k == "lomem" or k.startswith("lomem.")]:
        del sys.modules[k]


def test_a_wrong_kernel_fails_its_row(torch_backend):
    from lowmembp.ops.approx_act import regelu2
    rows = []
    bench = kernels.KernelBench(SimpleNamespace(smoke=True), SimpleNamespace(write=rows.append))
    x = [torch.randn(4, 64, dtype=torch.bfloat16) * 3]
    good = bench.run("regelu2", "t", torch.bfloat16, "ours", "approx", regelu2, regelu2, x)
    bad_y = bench.run("regelu2", "t", torch.bfloat16, "x", "approx", lambda t: regelu2(t) * 1.05, regelu2, x)
    exact = bench.run("regelu2", "t", torch.bfloat16, "x", "approx", torch.nn.functional.gelu, regelu2, x)
    assert good["status"] == "ok" and good["saved_bytes"] == (256 + 3) // 4 + 1
    assert bad_y["status"] == "FAIL" and float(bad_y["y_err"]) > 0.04
    assert exact["status"] == "FAIL" and float(exact["dx_err"]) > 0.02  # exact GELU' is not the 2-bit derivative
    assert len(rows) == 3


class _GradIntoInputs(torch.autograd.Function):
    """act(a) * b whose backward writes the input gradients into the saved inputs, as Liger's GeGLU and SwiGLU do
    (liger_kernel 0.8.5 ops/geglu.py, swiglu.py: ``tl.store(a + col_offsets, da_row)``; the gradients returned are
    those tensors)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a.float()).to(a.dtype) * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        af = a.float()
        s = torch.sigmoid(af)
        da = dc.float() * b.float() * (s + af * s * (1 - s))
        db = dc.float() * af * s
        a.copy_(da)
        b.copy_(db)
        return a, b


def test_a_kernel_that_writes_its_gradients_into_its_inputs_is_checked_on_the_true_inputs():
    """The GPU run's Liger GeGLU / SwiGLU rows FAILed with errors ~0.9: the row's inputs were views of the shared
    inputs, Liger's backward overwrote them, and the reference then ran on gradients."""
    import torch.nn.functional as F
    rows = []
    bench = kernels.KernelBench(SimpleNamespace(smoke=True), SimpleNamespace(write=rows.append))
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 64, generator=g) * 3 for _ in range(2)]
    before = [x.clone() for x in inputs]
    ref = lambda a, b: F.silu(a) * b  # noqa: E731
    row = bench.run("swiglu", "t", torch.float32, "liger", "exact", _GradIntoInputs.apply, ref, inputs)
    assert row["status"] == "ok" and float(row["y_err"]) < 1e-5 and float(row["dx_err"]) < 1e-4, row
    assert all(torch.equal(x, y) for x, y in zip(inputs, before))  # the next row gets the same inputs
    again = bench.run("swiglu", "t", torch.float32, "torch", "exact", ref, ref, inputs)
    assert again["status"] == "ok" and float(again["y_err"]) == 0.0


def test_a_peer_fail_is_noted_not_a_failed_part(tmp_path):
    """kernels: a FAIL of ours or of torch (the exact op), or any row that raised, fails the part; a FAIL of Liger or
    of the official ops is their comparison's finding, noted in the part's status."""
    ok = dict(status="ok", impl="ours")
    assert not gpu_run.kernel_rows_failing([ok, dict(status="skipped", impl="official"),
                                            dict(status="FAIL", impl="liger"), dict(status="FAIL", impl="official")])
    for bad in (dict(status="FAIL", impl="ours"), dict(status="FAIL", impl="torch"),
                dict(status="error", impl="liger")):
        assert gpu_run.kernel_rows_failing([ok, bad]) == [bad]
    ctx = _ctx(tmp_path)
    ctx.out.mkdir(parents=True)
    sink = gpu_run.CsvSink(ctx.out / "kernels.csv", kernels.COLUMNS)
    for impl, status in (("ours", "ok"), ("liger", "FAIL"), ("liger", "FAIL"), ("official", "ok")):
        sink.write(dict(op="geglu", shape="s", dtype="float16", impl=impl, status=status))
    sink.close()
    assert gpu_run.part_note("kernels", ctx) == "peer rows FAIL (recorded; not a failure of the part): liger geglu x2"
    (ctx.out / "gpu_check").mkdir()
    (ctx.out / "gpu_check" / "gpu_check.json").write_text(json.dumps(
        {"meta": {"complete": False, "pending": ["mesa_quant"]}, "rows": []}))
    assert gpu_run.part_note("gpu_check", ctx) == "gpu_check.json incomplete: not checked mesa_quant"
    (ctx.out / "gpu_check" / "gpu_check.json").write_text(json.dumps({"meta": {"complete": True}, "rows": []}))
    assert gpu_run.part_note("gpu_check", ctx) == ""


def test_gpu_check_report_says_which_ops_it_did_not_reach(tmp_path):
    """A report written after an op (what a run stopped at its time limit keeps) is marked incomplete."""
    gpu_check = importlib.import_module("gpu_check")
    meta = dict(device="d", torch="t", triton="t", commit="c", when="w", seconds=1.0, smoke=True, complete=False,
                pending=["mesa_quant"])
    gpu_check.write_report(tmp_path, meta, [])
    assert "**Incomplete**: not checked (the run stopped before them): mesa_quant" in \
        (tmp_path / "gpu_check.md").read_text()
    gpu_check.write_report(tmp_path, dict(meta, complete=True, pending=[]), [])
    assert "Incomplete" not in (tmp_path / "gpu_check.md").read_text()


def off_device(model, device) -> list[str]:
    """Names of the parameters and buffers of ``model`` not on ``device``'s type."""
    import itertools
    kind = torch.device(device).type
    return [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.device.type != kind]


def test_every_step_method_applied_on_the_device_keeps_its_tensors_there():
    """The training job's synthetic cells build each model on its device, then apply the method (as a user who moved
    the model first would): every parameter and buffer must be on that device. Here ``meta`` stands for the GPU. The
    GPU run's fig1 "lora+mesa-gelu-ln" failed so ("Expected all tensors to be on the same device ... cuda:0 and
    cpu"): Mesa's activation layers kept their EMA ranges on the CPU."""
    import lowmembp
    from lowmembp.estimator.step import MODELS, build

    seen = set()
    for cfg in steps.step_configs(True):
        if cfg.method in seen or {"liger", "cce"} & set(cfg.method.split("+")):  # CUDA-only kernels: refused here
            continue
        seen.add(cfg.method)
        model = build(MODELS[cfg.model], layers=cfg.layers, overrides=cfg.overrides, device="meta")
        model = lowmembp.apply(model, cfg.method, **cfg.options)
        assert off_device(model, "meta") == [], cfg.method
    assert "lora+mesa-gelu-ln" in seen
    stray = torch.nn.Linear(2, 2, device="meta")
    stray.register_buffer("ema", torch.zeros(2))  # created on the CPU after the move
    assert off_device(stray, "meta") == ["ema"] and off_device(stray, "cuda") == ["weight", "bias", "ema"]


def test_estimator_error_and_margin():
    measured = [dict(config="c", method="lora", status="ok", peak_bytes="1100", measured_how="cuda"),
                dict(config="c", method="lora+liger", status="ok", peak_bytes="900"),
                dict(config="c", method="lora+x", status="oom", peak_bytes="")]
    estimates = [dict(config="c", method="lora", status="ok", estimate_bytes="1000"),
                 dict(config="c", method="lora+liger", status="no estimate", note="no fake-tensor path")]
    err = steps.estimator_error(measured, estimates)
    assert [r["ratio"] for r in err] == ["1.1000", "", ""]
    assert "no fake-tensor path" in err[1]["note"] and "oom" in err[2]["note"]
    alloc = {"fig1": dict(max_memory_allocated=100, max_memory_reserved=120, outside_allocator=500 << 20)}
    mg = steps.margin_from(err, alloc, smoke=False, where="test")
    assert mg["fraction"] == pytest.approx(round(1.1 * 1.2 - 1 + 0.005, 2)) and mg["reserved_bytes"] == 500 << 20
    assert steps.margin_from(err[1:], alloc, smoke=False, where="test") is None


def test_gpu_estimates_run_dropout_as_cuda():
    """The LLaMA rows train with LoRA dropout 0.1 (the official recipe); their estimates beside a GPU measurement keep
    CUDA's 1-byte masks (the CPU dropout of a fake step keeps masks of the input's dtype), and F.dropout is put back."""
    import torch.nn.functional as F

    plain = F.dropout
    cfg = next(c for c in steps.step_configs(True) if c.part == "llama" and c.method == "lora")
    assert cfg.options["dropout"] == 0.1 and cfg.seq_len == 16
    assert next(c for c in steps.step_configs(False) if c.part == "llama").seq_len == 640  # 512 + 128
    cpu, cuda = steps._estimate_one(cfg), steps._estimate_one(cfg, cuda_dropout=True)
    assert cpu["status"] == cuda["status"] == "ok" and F.dropout is plain
    assert int(cuda["saved_bytes"]) < int(cpu["saved_bytes"])


def _ctx(tmp_path, smoke=False):
    return gpu_run.Ctx(gpu_run.parse_args(["--out", str(tmp_path / "o"), "--third-party", str(tmp_path / "tp")]
                                          + (["--cpu-smoke"] if smoke else [])))


def test_part_commands_on_the_gpu(tmp_path):
    ctx = _ctx(tmp_path)
    gc = gpu_run.part_command("gpu_check", ctx, 0.0)
    assert (gc[1].endswith("gpu_check.py") and "--cpu-smoke" not in gc
            and gc[gc.index("--out") + 1].endswith("gpu_check"))
    pt = gpu_run.part_command("pytest", ctx, 0.0)
    assert pt[1:5] == ["-m", "pytest", "-m", "gpu"] and "--collect-only" not in pt
    files = gpu_run.gpu_test_files()
    assert ("tests/ops/test_ms_norm.py" in files and "tests/benchmarks/test_gpu_run.py" not in files
            and pt[-len(files):] == files)
    for part in ("kernels", "fig1", "llama", "estimates"):
        cmd = gpu_run.part_command(part, ctx, 123.0)
        assert cmd[cmd.index("--part") + 1] == part and cmd[cmd.index("--deadline") + 1] == "123.0"
        assert "--cpu-smoke" not in cmd and cmd[cmd.index("--third-party") + 1] == str(tmp_path / "tp")
    assert "--cpu-smoke" in gpu_run.part_command("fig1", _ctx(tmp_path, smoke=True), 0.0)
    for parts in ("fig1,nope", "", " , "):  # an unknown part; no part at all (nothing would run)
        with pytest.raises(SystemExit) as stop:
            gpu_run.parse_args(["--parts", parts])
        assert stop.value.code == 2


def test_a_part_past_its_limit_is_killed_and_keeps_its_output(tmp_path):
    code = "import time; print('started', flush=True); time.sleep(60)"
    proc = gpu_run.Proc("t", [sys.executable, "-c", code], tmp_path / "t.log", dict(os.environ))
    rc = proc.wait(3)
    assert proc.timed_out and rc != 0 and proc.seconds < 30
    assert "started" in (tmp_path / "t.log").read_text()


def test_prepare_copies_the_sources_and_the_wheel(tmp_path):
    import zipfile
    src = tmp_path / "LowMemoryBP"
    _fake_lomem(src, with_python=True)
    (src / "setup.py").write_text("# theirs\n")
    (src / "LICENSE").write_text("MIT\n")
    index = tmp_path / "index"
    index.mkdir()
    pins = dict(line.strip().lower().split("==") for line in (ROOT / ".ci" / "requirements-cpu.txt").read_text().split()
                if line.split("==")[0].lower() in ("peft", "timm", "bitsandbytes", "galore-torch", "apollo-torch",
                                                   "torchao", "jsonschema", "jsonschema-specifications",
                                                   "referencing", "rpds-py", "attrs"))
    assert len(pins) == 11  # the library wheels the GPU machine gets, at the CPU pins (jsonschema: the records)
    for dist, version in (("liger-kernel", "0.8.7"), ("cut-cross-entropy", "25.1.1"), *pins.items()):
        name = f"{dist.replace('-', '_')}-{version}"
        with zipfile.ZipFile(index / f"{name}-py3-none-any.whl", "w") as z:  # pip "downloads" it from a local folder
            z.writestr(f"{dist.replace('-', '_')}/__init__.py", "")
            z.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            z.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            z.writestr(f"{name}.dist-info/RECORD", "")
    dest = tmp_path / "tp"
    env = dict(os.environ, GPU_RUN_THIRD_PARTY=str(dest), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index),
               PYTHON=sys.executable)
    r = subprocess.run(["bash", str(BENCH / "prepare_gpu_run.sh"), str(src)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (dest / "lomem" / "csrc" / "regelu2_cuda.cu").is_file() and (dest / "lomem" / "functional.py").is_file()
    assert (dest / "setup.py").is_file() and (dest / "wheels" / "liger_kernel-0.8.7-py3-none-any.whl").is_file()
    assert (dest / "wheels" / "cut_cross_entropy-25.1.1-py3-none-any.whl").is_file()  # method cce's package
    assert "work tree" in (dest / "PREPARED.txt").read_text()
    assert sorted(w.name.split("-")[0] for w in (dest / "pywheels").iterdir()) == sorted(
        d.replace("-", "_") for d in pins)
    assert official.find_sources(dest / "lomem")["sources"]
    r = subprocess.run(["bash", str(BENCH / "prepare_gpu_run.sh"), str(tmp_path / "absent")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no LowMemoryBP sources" in r.stderr


# --- the prepared run's structure (issue 48 items 5-7, issue 49 items 1 and 4) -------------------------------------
def test_parts_run_in_priority_order_and_the_build_finishes_before_any(tmp_path, monkeypatch):
    assert list(gpu_run.PARTS)[:5] == ["fig1", "bound", "profile", "host_time", "smoke"]
    assert 0 < gpu_run.PREPARE_S[0] < 300
    events = []

    class FakeProc:
        def __init__(self, name, cmd, log, env):
            self.name, self.timed_out, self.seconds = name, False, 1.0
            events.append(("start", name))

        def wait(self, limit):
            events.append(("wait", self.name))
            return 0

    monkeypatch.setattr(gpu_run, "Proc", FakeProc)
    ctx = _ctx(tmp_path)
    (ctx.third_party / "lomem" / "csrc").mkdir(parents=True)
    status = {}
    t0 = __import__("time").time()
    gpu_run.prepare(ctx, ctx.args, status, t0, t0 + 480)
    # both started, then both waited for: prepare() returns (and the first part starts) when they are done
    assert events == [("start", "official_build"), ("start", "estimates"), ("wait", "official_build"),
                      ("wait", "estimates")]
    assert status["official_build"]["status"] == "ok" and status["official_build"]["prepare"]


def test_host_time_slot_runs_the_leads_benchmark_where_it_is(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    monkeypatch.setattr(gpu_run, "HOST_TIME", tmp_path / "host_time.py")
    assert "not in this tree" in gpu_run.skip_reason("host_time", ctx)
    (tmp_path / "host_time.py").write_text("")
    assert gpu_run.skip_reason("host_time", ctx) is None
    cmd = gpu_run.part_command("host_time", ctx, 0.0)
    assert cmd[1:3] == [str(tmp_path / "host_time.py"), "--device"] and cmd[3] == "cuda" and "--autocast" in cmd
    assert cmd[cmd.index("--out") + 1] == str(ctx.out / "host_time")
    # with the official sources prepared, their column too (built in the run's build folder)
    assert ("--official" in cmd) == (ctx.third_party / "lomem").is_dir()
    (ctx.third_party / "lomem").mkdir(parents=True, exist_ok=True)
    cmd = gpu_run.part_command("host_time", ctx, 0.0)
    assert cmd[cmd.index("--official") + 1] == str(ctx.third_party / "lomem")
    assert cmd[cmd.index("--build-dir") + 1] == str(ctx.build_dir)


def test_smoke_part_runs_the_smoke_sweep_through_snakemake(tmp_path):
    cmd = gpu_run.part_command("smoke", _ctx(tmp_path), 0.0)
    assert cmd[1:3] == ["-m", "snakemake"] and str(ROOT / "config" / "gpu-smoke.yaml") in cmd
    assert f"results={tmp_path / 'o' / 'smoke'}" in cmd and "gpu=1" in cmd and "-n" not in cmd
    assert gpu_run.part_command("smoke", _ctx(tmp_path, smoke=True), 0.0)[-1] == "-n"  # the dry run trains nothing


def test_fig1_cells_are_the_jobs_command_lines():
    cfgs = [c for c in steps.step_configs(False) if c.part in ("fig1", "bound")]
    captured = [c for c in cfgs if c.capture == "cuda-graphs"]
    assert [c.method for c in captured] == steps.CAPTURED_METHODS
    assert {c.batch_size for c in cfgs if c.part == "bound"} == {256}
    from experiments.args import build_parser
    for c in cfgs:
        argv = steps.job_argv(c, smoke=False)
        ns, extra = build_parser().parse_known_args(argv)
        assert ns.synthetic_data and ns.task == "cifar100" and ns.method == c.method and ns.dtype == "fp16"
        assert (ns.capture or "none") == c.capture and extra[:2] == ["--rank", "4"]
        assert ("--targets" in extra) == (c.options.get("targets") is not None)


def test_official_ops_swap_into_a_lowmembp_vit_and_run(tmp_path):
    import lowmembp
    from lowmembp.estimator.step import MODELS, build
    model = lowmembp.apply(build(MODELS["vit-b16"], layers=1, overrides=steps.VIT_SMOKE, device="cpu"),
                           "lora+lowmembp", rank=4)
    ops = official.load_official(tmp_path / "absent", tmp_path / "build", stand_in=True)
    calls = []
    ops._f.layer_norm = (lambda f: lambda *a: calls.append("ln") or f(*a))(ops._f.layer_norm)
    counts = official.swap_into(model, ops)
    assert counts == {"MSLayerNorm": 3, "ReGELU2": 1}  # two per block and the final norm; one GELU per block
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert calls.count("ln") == 3
    with pytest.raises(ValueError, match="apply lowmembp first"):
        official.swap_into(torch.nn.Linear(2, 2), ops)


def test_smoke_cells_run_through_run_cell_where_snakemake_is_missing(tmp_path, monkeypatch):
    """Without snakemake on the GPU machine, the smoke part runs the config's cells with the command lines the
    pipeline builds, through run_cell.py; here a tiny synthetic config on the CPU."""
    import yaml
    cfg = {"results": "unused", "sweeps": {"vit": {
        "tasks": [{"task": "cifar100", "model": "vit-b16"}], "methods": ["lora", "lora+lowmembp"], "batch_sizes": [2],
        "steps": 3, "synthetic_data": True,
        "train_args": ["--layers", "1", "--synthetic-overrides", json.dumps(steps.VIT_SMOKE), "--threads", "1"]}}}
    config = tmp_path / "smoke.yaml"
    config.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(gpu_run, "SMOKE_CONFIG", config)
    ctx = _ctx(tmp_path)
    assert gpu_run.smoke_without_snakemake(ctx, deadline=1e12) == 0
    for method in ("lora", "lora+lowmembp"):
        rec = json.loads((ctx.out / "smoke" / "runs" / "cifar100" / "vit-b16" / method / "bs2" / "seed0.json")
                         .read_text())
        assert rec["status"] == "ok" and rec["run"]["synthetic_data"] is True


def test_profile_part_profiles_fig1s_lora_and_lowmembp(tmp_path):
    """The profile part: benchmarks/profile_step.py on Fig. 1's eager LoRA and LoRA + LowMemoryBP cells (qkv)."""
    import shlex

    cmd = gpu_run.part_command("profile", _ctx(tmp_path), 0.0)
    assert cmd[1].endswith("profile_step.py") and cmd[cmd.index("--out") + 1] == str(tmp_path / "o" / "profile")
    cells = dict(c.split("=", 1) for c in (cmd[i + 1] for i, a in enumerate(cmd) if a == "--cell"))
    assert set(cells) == {"lora", "lora+lowmembp"}
    for method, job in cells.items():
        job = shlex.split(job)
        assert job[job.index("--method") + 1] == method and job[job.index("--batch-size") + 1] == "64"
        assert "--synthetic-data" in job and "--capture" not in job and "--device" not in job
