# The HTML report: `snakemake --report results/report.html` after a run collects every output marked with report()
# (the figures, with captions from workflow/report/*.rst, and the tables below) into one self-contained file.


rule table_html:
    input:
        f"{R}/tables/{{t}}.csv",
    output:
        report(
            f"{R}/tables/{{t}}.html",
            caption="../report/table.rst",
            category="Tables",
            labels={"table": "{t}"},
        ),
    log:
        f"{R}/logs/tables/{{t}}.html.log",
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/table_html.py"
