"""lowmembp: sweep -> JSON records -> runs.csv -> tables, figures, notebooks, report.

    snakemake --cores all                                   # default CPU sweep (config/config.yaml)
    snakemake --report results/report.html                  # HTML report with the figures
    snakemake --configfile config/paper/vit-cifar.yaml --profile workflow/profiles/slurm   # a paper sweep on SLURM
    snakemake --cores all --configfile config/evidence.yaml  # convergence with 5 seeds per method (about an hour)
"""
from snakemake.utils import min_version, validate

min_version("8.0")


# The default sweep, unless a config file is given on the command line: a paper sweep replaces it (no merging).
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/sweep.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/repro.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/plots.smk"
include: "workflow/rules/pareto.smk"
include: "workflow/rules/capacity.smk"
include: "workflow/rules/evidence.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/notebooks.smk"
include: "workflow/rules/reference.smk"


rule all:
    input:
        all_targets,
        CAPACITY_TARGETS,
        EVIDENCE_TARGETS,
        HEADLINE_TARGETS,
    default_target: True
