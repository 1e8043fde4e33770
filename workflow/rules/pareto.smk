# The Pareto figure (issue #15): peak memory against step time for every method of one run, per task
# (workflow/scripts/plots_pareto.py). Part of the default targets: all_targets() (common.smk) is extended here, as
# this file is included before `rule all`; the catalogue (workflow/catalogue.py) may list it instead later.

PARETO_FIGURE = f"{R}/figures/pareto.png"


rule pareto_figure:
    input:
        runs=f"{R}/runs.csv",
    output:
        report(PARETO_FIGURE, caption="../report/pareto.rst", category="Sweep", labels={"figure": "pareto"}),
    log:
        f"{R}/logs/figures/pareto.log",
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/plots_pareto.py"


_targets_before_pareto = all_targets


def all_targets(wc=None):
    return _targets_before_pareto(wc) + ([PARETO_FIGURE] if CELLS else [])
