# Figures (workflow/catalogue.py), each registered in the HTML report with its caption (workflow/report/figure.rst,
# one section per figure).


rule run_figure:
    input:
        runs=f"{R}/runs.csv",
    output:
        report(
            f"{R}/figures/{{fig}}.png",
            caption="../report/figure.rst",
            category="Sweep",
            labels={"figure": "{fig}"},
        ),
    log:
        f"{R}/logs/figures/{{fig}}.log",
    wildcard_constraints:
        fig="|".join(f.name for f in cat.RUN_FIGURES + cat.OPTION_FIGURES if f.script == "plots.py"),
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/plots.py"


rule repro_figure:
    input:
        lambda wc: cat.repro_csv(R, repro_of_stem(wc.rfig).name),
    output:
        report(
            f"{R}/figures/{{rfig}}.png",
            caption="../report/figure.rst",
            category="Paper-scale reproductions",
            labels={"figure": "{rfig}"},
        ),
    log:
        f"{R}/logs/figures/{{rfig}}.log",
    wildcard_constraints:
        rfig="|".join(r.stem for r in cat.REPRODUCTIONS),
    params:
        title=lambda wc: repro_of_stem(wc.rfig).title,
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/plots_repro.py"
