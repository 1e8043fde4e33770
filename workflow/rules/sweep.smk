# One training job per cell: python -m experiments.train ... --out <record>. The job writes its record atomically
# (status ok/oom/error; exit 1 for oom/error) and run_cell.py counts a cell with a record as done, so the sweep goes
# on; run_cell.py records a crash that left no record (a segfault, an import error) as status "error" too. Usage
# errors (exit 2) fail the job loudly.
# A SIGINT to Snakemake alone (not a terminal's Ctrl-C) reaches the running jobs too, instead of Snakemake waiting
# for them to finish (workflow/interrupts.py).
import interrupts  # noqa: E402  (workflow/, on the path from common.smk)

if workflow.is_main_process:
    interrupts.install()


rule base:
    """A pre-trained starting point (config `bases:`): one training run that also writes its weights."""
    output:
        weights=BASE,
        record=f"{R}/bases/{{base}}.json",
    log:
        f"{R}/logs/bases/{{base}}.log",
    benchmark:
        f"{R}/benchmarks/bases/{{base}}.tsv"
    params:
        args=base_args,
        py=PY_JOB,
    threads: config["threads_per_run"]
    priority: 10  # first: the cells that start from it wait for it
    conda:
        "../envs/lowmembp.yaml"
    shell:
        "OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} "
        "{params.py} -m experiments.train {params.args} --no-progress --save-model {output.weights} "
        "--out {output.record} > {log} 2>&1"


rule train:
    input:
        init_input,
    output:
        RECORD,
    log:
        f"{R}/logs/train/{sweep_config.CELL}.log",
    benchmark:
        f"{R}/benchmarks/train/{sweep_config.CELL}.tsv"
    params:
        args=train_args,
        py=PY_JOB,
        runner=SCRIPTS / "run_cell.py",
    threads: config["threads_per_run"]
    resources:
        gpu=res("gpu", GPU_PER_CELL),
        runtime=res("runtime", 30),
        mem_mb=res("mem_mb", 4000),
        slurm_extra=slurm_extra,
    conda:
        "../envs/lowmembp.yaml"
    shell:
        "OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} "
        "{params.py} {params.runner} --nproc {resources.gpu} --log {log} --out {output} -- {params.args}"
