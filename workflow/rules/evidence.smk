# The convergence evidence (config `evidence:`; config/evidence.yaml): the records of the sweeps it names -> a table
# of paired differences against the compared method with 95 % intervals and a verdict per method, and the learning
# curves (the records' `curve`, from --eval-every). A config without `evidence:` makes neither. Not part of `all`:
# `snakemake --cores 1 evidence_reference` copies the table and the figure to the config's `reference:` folder.
import os

EVIDENCE = config.get("evidence") or {}
if EVIDENCE:
    _unknown = [s for s in EVIDENCE["sweeps"] if s not in config["sweeps"]]
    if _unknown:
        raise WorkflowError(f"evidence.sweeps: {', '.join(_unknown)} not under `sweeps:` (sweeps: "
                            f"{', '.join(config['sweeps'])})")
    _one_seed = [s for s in EVIDENCE["sweeps"] if len(config["sweeps"][s]["seeds"]) < 2]
    if _one_seed:
        raise WorkflowError(f"evidence.sweeps: {', '.join(_one_seed)} have fewer than 2 seeds; a paired interval "
                            "needs 2 or more (5 or more to decide anything)")

EVIDENCE_TABLE = cat.table_paths(R, cat.EVIDENCE_TABLE.name)
EVIDENCE_FIGURE = cat.figure_path(R, cat.EVIDENCE_FIGURE.name)
# in `rule all` (Snakefile)
EVIDENCE_TARGETS = [*EVIDENCE_TABLE.values(), EVIDENCE_FIGURE] if EVIDENCE else []
# the records of the cells of the sweeps `evidence:` names
EVIDENCE_RECORDS = [sweep_config.record_path(R, *key) for key, (name, _) in sorted(CELLS.items())
                    if name in EVIDENCE.get("sweeps", ())]
EVIDENCE_REFERENCE = EVIDENCE.get("reference") or f"{R}/reference/evidence"
EVIDENCE_COMMAND = " ".join(["snakemake --cores all"] + [f"--configfile {os.path.relpath(f, workflow.basedir)}"
                                                        for f in workflow.overwrite_configfiles])


rule evidence_table:
    input:
        records=EVIDENCE_RECORDS,
    output:
        md=EVIDENCE_TABLE["md"],
        csv=EVIDENCE_TABLE["csv"],
        html=report(EVIDENCE_TABLE["html"], caption="../report/table.rst", category="Evidence",
                    labels={"table": cat.EVIDENCE_TABLE.name}),
    log:
        f"{R}/logs/evidence/table.log",
    params:
        margins=lambda wc: EVIDENCE["margins"],
        command=EVIDENCE_COMMAND,
        label=lambda wc: EVIDENCE.get("label", ""),
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/evidence_table.py"


rule evidence_figure:
    input:
        records=EVIDENCE_RECORDS,
    output:
        report(EVIDENCE_FIGURE, caption="../report/figure.rst", category="Evidence",
               labels={"figure": cat.EVIDENCE_FIGURE.name}),
    log:
        f"{R}/logs/evidence/figure.log",
    params:
        label=lambda wc: EVIDENCE.get("label", ""),
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/evidence_plots.py"


rule evidence_reference:
    """The evidence table (Markdown, CSV) and figure, copied to the config's `reference:` folder (kept in git)."""
    input:
        EVIDENCE_TABLE["md"],
        EVIDENCE_TABLE["csv"],
        EVIDENCE_FIGURE,
    output:
        [f"{EVIDENCE_REFERENCE}/{Path(p).name}"
         for p in (EVIDENCE_TABLE["md"], EVIDENCE_TABLE["csv"], EVIDENCE_FIGURE)],
    log:
        f"{R}/logs/evidence/reference.log",
    run:
        from lowmembp.atomic import atomic_write

        for src, dst in zip(input, output):
            atomic_write(dst, Path(src).read_bytes())
