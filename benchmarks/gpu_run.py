"""The GPU evidence run: one command on one GPU writes every measurement into one folder.

    bash benchmarks/prepare_gpu_run.sh                       # once, here: fills the git-ignored third_party/
    python benchmarks/gpu_run.py --out results/gpu/          # on the GPU machine (benchmarks/gpu_run.sh wraps it)
    python benchmarks/gpu_run.py --cpu-smoke --out /tmp/gr   # no GPU: the same script, tiny, nothing measured

First, before anything is timed ("prepare", in the foreground: nothing runs in the background while a part is
timed): the official ops' nvcc build (when a part uses them and third_party/lomem is there) and, beside it on the CPU,
lowmembp's fake-tensor estimate of every fig1 / bound / llama configuration (-> estimates.csv, as far as the build's
time allows). Then the parts, in priority order, each in its own process with its own time limit inside
``--budget-s`` (default 480 s; a crash or a hang loses that part only; each writes its results as it finishes):
  fig1       Fig. 1 through the training job (experiments.interleave, --synthetic-data): ViT-B/16, batch 64, fp16,
             LoRA r4 on qkv then on all linears — eager; captured in a CUDA graph (--capture cuda-graphs); and
             LowMemoryBP with the official CUDA ops swapped into the same ViT -> fig1.csv, fig1_runs/*.json
  bound      the device-bound setting through the training job: ViT-B/16 at batch 256 -> bound.csv, bound_runs/
  profile    benchmarks/profile_step.py on Fig. 1's LoRA and LowMemoryBP (qkv, eager): host time per op, device
             time per kernel, the device's busy share -> profile/
  host_time  benchmarks/host_time.py --device cuda --autocast (host time per op call: ours, torch's, the official
             extension's) -> host_time/
  smoke      the GPU smoke sweep (config/gpu-smoke.yaml) through Snakemake -> smoke/ (runs, runs.csv, tables)
  llama      LLaMA-7B width, 4 layers, through the training job (bf16 weights, as the job's alpaca task loads them):
             LoRA and its peers, full fine-tuning per optimizer -> llama.csv, llama_runs/
  full_ft    the full-fine-tuning levers (benchmarks/gpu_full_ft_levers.py, most wanted first: paged AdamW, GaLore
             layer-wise, torchao's CPU offload and low-bit states, CompAct with and without LowMemoryBP, ...), each
             row built and stepped alone through the training job -> full_ft.csv, full_ft_runs/
  gpu_check  benchmarks/gpu_check.py: every Triton kernel against its reference, GB/s and % of a device copy
  kernels    ours vs the official LowMemoryBP CUDA ops vs Liger vs PyTorch (benchmarks/gpu_run_kernels.py)
  pytest     ``pytest -m gpu`` over the test files that hold gpu tests -> pytest_gpu.txt, pytest_gpu.xml
At the end: estimator_error.csv (measured / estimated peak per configuration), margin.json (the planner's allocator
margin, read by lowmembp.plan from results/gpu/margin.json), machine.json (GPU, driver, CUDA, versions, the
command, the commit the tree was sent from, each part's status and time) and summary.md. Exit status 0 when every
part passed, 1 otherwise.

The commit: ``$GPU_RUN_COMMIT``, else third_party/COMMIT (written by prepare_gpu_run.sh on the machine that has the
repository), else the tree's own .git (which a copied tree may have stale: machine.json says which).

Liger-Kernel and cut-cross-entropy (pure-Python wheels, gpu_machine.CARRIED): if one is not importable, its wheel in
third_party/wheels/ is installed with ``pip install --no-deps --no-index --target`` into a temporary folder put on
the path. bitsandbytes (``adamw8bit``) is not carried (a platform wheel): where it is missing, that row is skipped
with the reason.
``--cpu-smoke``: TRITON_INTERPRET=1 (set before triton is imported), tiny shapes, our kernels through the
interpreter, fig1 / bound through the training job on the CPU (the captured rows skipped: CUDA only), the official
ops replaced by a flagged stand-in (our reference), Liger skipped, the smoke sweep as ``snakemake -n``, gpu_check on
one op and pytest collecting only; no timing claims. tests/benchmarks/test_gpu_run.py runs it.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_machine import commit_sent, ensure_carried, ensure_liger, machine_facts, nvidia_smi, set_build_arch

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# part: (limit cap on a GPU in s, cap in the CPU dry run); the order is the run's order, the issues' priority: Fig. 1
# (eager, captured, official), the device-bound setting, the kernels' host time, the smoke sweep, then the rest.
# Times of the earlier parts on an H200 (torch 2.11; results/gpu/machine.json): gpu_check 27 s, fig1 31-44 s (10
# rows on the old step harness), llama 39-40 s for its 10 rows, kernels 32 s, pytest 46 s. fig1 now builds 15 cells
# (about 2 s each) and takes 20 interleaved rounds of 13 (about 25-40 ms a step): some 60-80 s; bound 4 cells at
# 80-120 ms a step: 30-40 s; the smoke sweep 5 job processes of 15-30 s each. The caps add up to more than the
# budget: a part gets its cap while the budget lasts, each later part keeps FLOOR_S, and the last ones get what
# is left.
PARTS = {"fig1": (130, 600), "bound": (70, 300), "profile": (40, 300), "host_time": (60, 300), "smoke": (150, 300),
         "llama": (120, 300), "full_ft": (120, 300), "gpu_check": (65, 300), "kernels": (80, 300),
         "pytest": (75, 300)}
PREPARE_S = (240, 300)  # the official build and the estimates, before any timed part: the most they may take
OFFICIAL_PARTS = ("fig1", "host_time", "kernels")  # the parts that use the official ops
ESTIMATED_PARTS = ("fig1", "bound", "llama")  # the parts whose configurations get a fake-tensor estimate
FLOOR_S = 20  # what each later part keeps back from an earlier one's limit
PAPER_FIG1 = {"lora": (3827, 288), "lora+checkpointing": (1252, 229), "lora+mesa-gelu-ln": (2853, 226),
              "lora+lowmembp": (2717, 290)}  # docs/design.md#papers: peak MiB, img/s


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/gpu", help="output folder (default results/gpu/)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="total seconds for the preparation and all parts (default 480)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts to run (default all: {','.join(PARTS)}); estimates run with "
                        "fig1/bound/llama")
    p.add_argument("--third-party", default=str(ROOT / "third_party"),
                   help="the folder benchmarks/prepare_gpu_run.sh filled (default third_party/)")
    p.add_argument("--build-dir", default=None, help="nvcc build folder of the official ops (default: a temp dir)")
    p.add_argument("--estimate-workers", type=int, default=None, help="processes for the estimates (GPU: 3)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)        # internal: run one part here
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    bad = [x for x in a.parts if x not in PARTS]
    if bad or not a.parts:
        p.error(f"unknown part(s) {bad}; choose from {list(PARTS)}" if bad else
                f"--parts names no part: nothing to run; choose from {list(PARTS)}")
    if a.budget_s <= 0:
        p.error("--budget-s must be positive")
    return a


class Ctx:
    def __init__(self, a):
        self.out = Path(a.out).resolve()
        self.smoke = a.cpu_smoke
        self.third_party = Path(a.third_party).resolve()
        self.build_dir = Path(a.build_dir).resolve() if a.build_dir else \
            Path(os.environ.get("TMPDIR", "/tmp")) / "lowmembp_lomem_build"
        self.args = a


class CsvSink:
    """A CSV with fixed columns, one flushed row at a time (a killed part keeps its rows)."""

    def __init__(self, path: Path, columns: list[str]):
        self.path, self.columns = path, columns
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, columns, extrasaction="ignore", restval="")
        self._w.writeheader()
        self._f.flush()

    def write(self, row: dict):
        self._w.writerow({k: ("" if v is None else v) for k, v in row.items()})
        self._f.flush()

    def rewrite(self, rows: list[dict]):
        self._f.close()
        self.__init__(self.path, self.columns)
        for r in rows:
            self.write(r)

    def close(self):
        self._f.close()


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------------- one part, here
def run_part(name: str, ctx: Ctx, deadline: float) -> int:
    """Run part ``name`` in this process; 0 when it completed with every row ok."""
    sys.path[:0] = [str(ROOT), str(HERE)]
    if name == "kernels":
        from gpu_run_kernels import COLUMNS, run_kernels
        sink = CsvSink(ctx.out / "kernels.csv", COLUMNS)
        rows, stopped = run_kernels(ctx, sink, deadline)
        sink.rewrite(rows)
        sink.close()
        return 1 if kernel_rows_failing(rows) or stopped else 0
    if name in ("fig1", "bound", "llama", "full_ft"):
        from gpu_run_steps import STEP_COLUMNS, run_job_part
        sink = CsvSink(ctx.out / f"{name}.csv", STEP_COLUMNS)
        facts = run_job_part(ctx, name, sink, deadline)
        sink.close()
        (ctx.out / f"{name}_allocator.json").write_text(json.dumps(facts, indent=1))
        rows = read_csv(ctx.out / f"{name}.csv")
        return 1 if any(r["status"] in ("error", "oom") for r in rows) else 0
    if name == "estimates":
        from gpu_run_steps import ESTIMATE_COLUMNS, run_estimates
        sink = CsvSink(ctx.out / "estimates.csv", ESTIMATE_COLUMNS)
        workers = ctx.args.estimate_workers or (1 if ctx.smoke else 3)
        run_estimates(ctx, sink, deadline, workers=workers)
        sink.close()
        return 0
    raise ValueError(f"unknown part {name!r}")


PEERS = ("liger", "official")  # kernels.csv implementations that are not ours nor the exact reference (torch)


def kernel_rows_failing(rows: list[dict]) -> list[dict]:
    """The kernels.csv rows that fail the part: any row that raised ("error"), and a "FAIL" of ours or of torch (the
    exact op: a FAIL there is the harness's fault). A peer's FAIL (Liger, the official ops: their output against the
    reference of their semantics) is what the comparison found, recorded in its row and in the part's note."""
    return [r for r in rows if r.get("status") == "error"
            or (r.get("status") == "FAIL" and not str(r.get("impl", "")).startswith(PEERS))]


def part_note(name: str, ctx: Ctx) -> str:
    """What the part's files add to its status: gpu_check's report incomplete (the ops it did not reach); the
    kernels' peer rows that FAIL."""
    if name == "gpu_check":
        try:
            meta = json.loads((ctx.out / "gpu_check" / "gpu_check.json").read_text())["meta"]
        except (OSError, ValueError, KeyError):
            return "no gpu_check.json"
        if not meta.get("complete", True):
            return f"gpu_check.json incomplete: not checked {', '.join(meta.get('pending') or []) or '?'}"
        return ""
    if name == "kernels":
        counts = {}
        for r in read_csv(ctx.out / "kernels.csv"):
            if r.get("status") == "FAIL" and r.get("impl", "").startswith(PEERS):
                key = f"{r['impl']} {r['op']}"
                counts[key] = counts.get(key, 0) + 1
        return ("peer rows FAIL (recorded; not a failure of the part): "
                + ", ".join(f"{k} x{n}" for k, n in counts.items())) if counts else ""
    return ""


# ---------------------------------------------------------------------------------------------- processes
def _env(ctx: Ctx, extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    sent = commit_sent(ctx)
    if sent and "LOWMEMBP_GIT_COMMIT" not in env:  # the job records of the parts name the commit sent, too
        env["LOWMEMBP_GIT_COMMIT"] = sent["sent"]
    paths = [str(ROOT), str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env


class Proc:
    """A child process whose output goes, line by line, to the console (prefixed) and to a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict, cwd: Path = ROOT):
        self.name, self.cmd, self.t0 = name, cmd, time.time()
        self.log = open(log, "w")
        self.p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()
        self.timed_out = False

    def _pump(self):
        for line in self.p.stdout:
            self.log.write(line)
            self.log.flush()
            print(f"[{self.name}] {line}", end="", flush=True)

    def wait(self, limit: float) -> int:
        try:
            rc = self.p.wait(timeout=max(0.1, limit))
        except subprocess.TimeoutExpired:
            self.kill()
            self.timed_out = True
            rc = self.p.wait()
        self.reader.join(timeout=5)
        self.log.close()
        return rc

    def kill(self):
        try:
            os.killpg(self.p.pid, 9)  # its own session: the part and its children, nothing else
        except ProcessLookupError:
            pass

    @property
    def seconds(self):
        return time.time() - self.t0


HOST_TIME = HERE / "host_time.py"
SMOKE_CONFIG = ROOT / "config" / "gpu-smoke.yaml"


def smoke_command(ctx: Ctx) -> list[str]:
    """The smoke sweep through Snakemake into ``<out>/smoke`` (the dry run: ``-n``, nothing trained): one GPU, so
    the five cells run one after the other."""
    cmd = [sys.executable, "-m", "snakemake", "--cores", "all", "--configfile", str(SMOKE_CONFIG), "--config",
           f"results={ctx.out / 'smoke'}", "--resources", "gpu=1", "--keep-going", "--rerun-incomplete",
           "--printshellcmds"]
    return cmd + (["-n"] if ctx.smoke else [])


def part_command(name: str, ctx: Ctx, deadline: float) -> list[str]:
    """The command line of a part that runs in a process of its own."""
    py = sys.executable
    if name == "host_time":  # every op, fp32 / bf16 / fp16 and fp16 autocast, ours / native / official (if built)
        cmd = [py, str(HOST_TIME), "--device", "cpu" if ctx.smoke else "cuda", "--rounds", "5", "--calls", "100",
               "--autocast", "--out", str(ctx.out / "host_time")]
        official = ctx.third_party / "lomem"
        return cmd + (["--official", str(official), "--build-dir", str(ctx.build_dir)] if official.is_dir() else [])
    if name == "profile":  # where Fig. 1's step time goes: LoRA and LowMemoryBP on qkv, eager
        from gpu_run_steps import job_argv, step_configs

        cmd = [py, str(HERE / "profile_step.py"), "--out", str(ctx.out / "profile"), "--warmup", "5", "--steps", "3"]
        for c in step_configs(ctx.smoke):
            if c.config == "fig1-qkv" and c.method in ("lora", "lora+lowmembp"):
                cmd += ["--cell", f"{c.method}={shlex.join(job_argv(c, ctx.smoke))}"]
        return cmd
    if name == "smoke":
        return smoke_command(ctx)
    if name == "gpu_check":
        cmd = [py, str(HERE / "gpu_check.py"), "--out", str(ctx.out / "gpu_check")]
        return cmd + (["--cpu-smoke", "--skip-large", "--ops", "approx_act"] if ctx.smoke else [])
    if name == "pytest":
        files = gpu_test_files()
        cmd = [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={ctx.out / 'pytest_gpu.xml'}"]
        return cmd + (["--collect-only"] if ctx.smoke else ["-rfEs"]) + files
    cmd = [py, str(Path(__file__).resolve()), "--part", name, "--out", str(ctx.out), "--deadline", f"{deadline:.1f}",
           "--third-party", str(ctx.third_party), "--build-dir", str(ctx.build_dir)]
    if ctx.args.estimate_workers:
        cmd += ["--estimate-workers", str(ctx.args.estimate_workers)]
    return cmd + (["--cpu-smoke"] if ctx.smoke else [])


def skip_reason(name: str, ctx: Ctx) -> str | None:
    """Why part ``name`` cannot run here (it is then recorded "skipped" with the reason), or None."""
    if name == "host_time" and not HOST_TIME.is_file():
        return f"benchmarks/{HOST_TIME.name} is not in this tree"
    if name == "host_time" and ctx.smoke:
        return "CPU dry run: the host-time benchmark runs on the GPU machine"
    return None


def smoke_without_snakemake(ctx: Ctx, deadline: float) -> int:
    """The smoke sweep's cells where snakemake is not installed: each cell's command as the pipeline builds it
    (``workflow/sweep_config.py``), run one after the other through ``workflow/scripts/run_cell.py`` into
    ``<out>/smoke/runs/``; 0 when every cell has an ``ok`` record."""
    import yaml
    sys.path[:0] = [str(ROOT), str(ROOT / "workflow")]
    import sweep_config
    config = sweep_config.fill_defaults(yaml.safe_load(SMOKE_CONFIG.read_text()))
    results = ctx.out / "smoke"
    bad = 0
    for (task, model, method, bs, seed, opt), (_, sw) in sorted(sweep_config.cells(config).items()):
        out = Path(sweep_config.record_path(str(results), task, model, method, bs, seed, opt))
        argv = sweep_config.cell_argv(sw, task, model, method, bs, seed, optimizer=opt)
        log = results / "logs" / out.relative_to(results / "runs").with_suffix(".log")
        if time.time() > deadline:
            print(f"  smoke {out.relative_to(results)}: not run (the part's time limit)", flush=True)
            bad += 1
            continue
        cmd = [sys.executable, str(ROOT / "workflow" / "scripts" / "run_cell.py"), "--nproc", "1", "--log", str(log),
               "--out", str(out), "--", *argv]
        t = time.time()
        rc = subprocess.run(cmd, cwd=ROOT, env=_env(ctx)).returncode
        status = json.loads(out.read_text())["status"] if out.is_file() else f"no record (rc {rc})"
        bad += status != "ok"
        print(f"  smoke {out.relative_to(results)}: {status} in {time.time() - t:.0f} s", flush=True)
    return 1 if bad else 0


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="ignore"))


# --------------------------------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported, here and in every child
    ctx = Ctx(a)
    if a.part:
        ctx.out.mkdir(parents=True, exist_ok=True)
        return run_part(a.part, ctx, a.deadline or time.time() + 600)
    if ctx.smoke and ctx.out == (ROOT / "results" / "gpu").resolve():
        print("gpu_run: --cpu-smoke would overwrite the GPU results in results/gpu/ (the planner reads its "
              "margin.json); choose another --out", file=sys.stderr)
        return 2
    t0 = time.time()
    end = t0 + a.budget_s
    ctx.out.mkdir(parents=True, exist_ok=True)
    smi = nvidia_smi()
    if not ctx.smoke and not smi.get("name"):
        print("gpu_run: no NVIDIA GPU here (nvidia-smi). Run it on the GPU machine, or --cpu-smoke.", file=sys.stderr)
        return 2
    arch_note = None
    if not ctx.smoke and smi.get("compute_capability"):
        arch_note = set_build_arch(smi["compute_capability"])
        # nothing is timed while it builds: every core but those of the estimates beside it
        os.environ.setdefault("MAX_JOBS", str(max(1, (os.cpu_count() or 2) - 4)))
    print(f"gpu_run: {'CPU dry run' if ctx.smoke else smi.get('name')}; budget {a.budget_s:.0f} s; out {ctx.out}",
          flush=True)
    liger_line = ensure_liger(ctx)
    print(f"gpu_run: {liger_line}", flush=True)
    cce_line = ensure_carried(ctx, "cce")
    print(f"gpu_run: {cce_line}", flush=True)
    status = {}
    prepare(ctx, a, status, t0, end)
    todo = [p for p in PARTS if p in a.parts]
    for i, name in enumerate(todo):
        why = skip_reason(name, ctx)
        if why:
            status[name] = dict(status="skipped", seconds=0, note=why)
            print(f"gpu_run: {name}: skipped: {why}", flush=True)
            continue
        cap = PARTS[name][1 if ctx.smoke else 0]
        left = end - time.time() - FLOOR_S * (len(todo) - i - 1) - 10
        limit = min(cap, left)
        if limit < 5:
            status[name] = dict(status="skipped", seconds=0, limit_s=round(limit), note="no budget left")
            print(f"gpu_run: {name}: skipped, no budget left", flush=True)
            continue
        deadline = time.time() + limit - 8  # the part stops itself before it is killed
        print(f"\ngpu_run: === {name} (limit {limit:.0f} s, {time.time() - t0:.0f} s in) ===", flush=True)
        log = ctx.out / (f"{name}.log" if name != "pytest" else "pytest_gpu.txt")
        extra = {}
        build = status.get("official_build")
        if name in OFFICIAL_PARTS and build is not None and build["status"] != "ok":
            extra["GPU_RUN_OFFICIAL_FAILED"] = f"the official build {build['status']} (rc {build.get('rc')}), see " \
                                               "official_build.log"
        no_snakemake = name == "smoke" and importlib.util.find_spec("snakemake") is None
        if no_snakemake and not ctx.smoke:  # the cells as Snakemake would run them, one after the other
            t = time.time()
            print("gpu_run: snakemake is not installed here: the smoke sweep's cells run through run_cell.py",
                  flush=True)
            rc = smoke_without_snakemake(ctx, deadline)
            status[name] = dict(status="ok" if rc == 0 else "failed", rc=rc, seconds=round(time.time() - t, 1),
                                limit_s=round(limit), note="snakemake not installed: the cells ran through "
                                                           "workflow/scripts/run_cell.py, as Snakemake runs them")
            continue
        if ctx.smoke and name in ("kernels", "fig1", "bound", "llama"):
            t = time.time()
            try:
                rc = run_part(name, ctx, deadline)
                note = ""
            except Exception as e:
                import traceback
                traceback.print_exc()
                rc, note = 1, f"{type(e).__name__}: {e}"
            status[name] = dict(status="ok" if rc == 0 else "failed", rc=rc, seconds=round(time.time() - t, 1),
                                limit_s=round(limit), note="; ".join(n for n in (part_note(name, ctx), note) if n))
            continue
        proc = Proc(name, part_command(name, ctx, deadline), log, _env(ctx, extra))
        rc = proc.wait(limit)
        ok = rc == 0 or (name == "pytest" and rc == 5)  # 5: no gpu tests collected
        status[name] = dict(status="timeout" if proc.timed_out else ("ok" if ok else "failed"), rc=rc,
                            seconds=round(proc.seconds, 1), limit_s=round(limit), note=part_note(name, ctx))
        print(f"gpu_run: {name}: {status[name]['status']} (rc {rc}) in {proc.seconds:.0f} s", flush=True)
    finish(ctx, status, argv, t0, liger_line, cce_line, arch_note)
    failed = [n for n, s in status.items() if s["status"] != "ok" and not (s["status"] == "skipped" and
                                                                          s.get("note") != "no budget left")]
    print(f"\ngpu_run: done in {time.time() - t0:.0f} s; parts not ok: {failed or 'none'}; "
          f"see {ctx.out / 'summary.md'}",
          flush=True)
    return 1 if failed else 0


def prepare(ctx: Ctx, a, status: dict, t0: float, end: float) -> None:
    """Before any timed part, in the foreground: the official ops' nvcc build (where a part of this run uses them and
    their sources are carried) and, beside it on the CPU, the fake-tensor estimates (as far as the build's time, or
    a minute without a build, allows). Fills ``status["official_build"]`` / ``status["estimates"]``."""
    procs = {}
    lomem = ctx.third_party / "lomem"
    limit = min(PREPARE_S[1 if ctx.smoke else 0], max(30.0, 0.5 * (end - time.time())))
    if not ctx.smoke and set(OFFICIAL_PARTS) & set(a.parts):
        if (lomem / "csrc").is_dir():
            arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
            procs["official_build"] = Proc(
                "official_build", [sys.executable, str(HERE / "official_lomem.py"), "build", "--src", str(lomem),
                                   "--build-dir", str(ctx.build_dir)] + (["--arch", arch] if arch else []),
                ctx.out / "official_build.log", _env(ctx, {"CUDA_VISIBLE_DEVICES": ""}))
        else:
            print(f"gpu_run: no official sources at {lomem}: their rows are recorded as skipped "
                  "(run benchmarks/prepare_gpu_run.sh and carry third_party)", flush=True)
    if set(ESTIMATED_PARTS) & set(a.parts):
        # beside the build, about as long as it takes; alone, a minute (the rest: "no estimate", time limit)
        est_limit = limit if ctx.smoke else min(limit, 150.0 if "official_build" in procs else 60.0)
        procs["estimates"] = Proc("estimates", part_command("estimates", ctx, time.time() + est_limit - 5),
                                  ctx.out / "estimates.log",
                                  _env(ctx, {"CUDA_VISIBLE_DEVICES": "", "GPU_RUN_EST_THREADS": "2"}))
    if procs:
        print(f"\ngpu_run: === prepare: {', '.join(procs)} (limit {limit:.0f} s; nothing timed meanwhile) ===",
              flush=True)
    for name, proc in procs.items():
        rc = proc.wait(max(1.0, limit - proc.seconds))
        status[name] = dict(status="timeout" if proc.timed_out else ("ok" if rc == 0 else "failed"), rc=rc,
                            seconds=round(proc.seconds, 1), prepare=True)
        print(f"gpu_run: {name}: {status[name]['status']} (rc {rc}) in {proc.seconds:.0f} s", flush=True)


def finish(ctx: Ctx, status: dict, argv: list[str], t0: float, liger_line: str, cce_line: str = "",
           arch_note: str | None = None) -> None:
    """estimator_error.csv, margin.json, machine.json, summary.md from what the parts wrote."""
    sys.path[:0] = [str(ROOT), str(HERE)]
    from gpu_run_steps import ERROR_COLUMNS, estimator_error, margin_from
    measured = read_csv(ctx.out / "fig1.csv") + read_csv(ctx.out / "bound.csv") + read_csv(ctx.out / "llama.csv")
    estimates = read_csv(ctx.out / "estimates.csv")
    errors = estimator_error(measured, estimates)
    sink = CsvSink(ctx.out / "estimator_error.csv", ERROR_COLUMNS)
    for r in errors:
        sink.write(r)
    sink.close()
    allocator = {}
    for part in ("fig1", "bound", "llama"):
        p = ctx.out / f"{part}_allocator.json"
        if p.is_file():
            allocator[part] = json.loads(p.read_text() or "{}")
    where = f"benchmarks/gpu_run.py {time.strftime('%Y-%m-%d', time.gmtime())}"
    margin = margin_from(errors, allocator, ctx.smoke, where)
    if margin is not None:
        (ctx.out / "margin.json").write_text(json.dumps(margin, indent=1) + "\n")
    facts = machine_facts(ctx, argv)
    facts.update(started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)), seconds=round(time.time() - t0, 1),
                 budget_s=ctx.args.budget_s, liger=liger_line, cce=cce_line, official_arch=arch_note, parts=status,
                 allocator=allocator)
    (ctx.out / "machine.json").write_text(json.dumps(facts, indent=1) + "\n")
    from gpu_run_summary import write_summary
    write_summary(ctx.out, facts, PAPER_FIG1)


if __name__ == "__main__":
    sys.exit(main())
