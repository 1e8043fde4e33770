# The Pareto figure: peak memory against step time for every method of one run, per task
# (workflow/scripts/plots_pareto.py). Listed in workflow/catalogue.py (RUN_FIGURES), which puts it in `all`.

PARETO_FIGURE = cat.figure_path(R, "pareto")


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

