# The headline the HTML report opens with (category "1 Headline", before the sweep's detail): per method, what it
# saves in memory, costs in step time and changes in the metric against the method it is compared with, ours beside
# the papers' (workflow/scripts/headline.py; listed in workflow/catalogue.py as HEADLINE). Part of `all`.

HEADLINE_TABLE = cat.table_paths(R, cat.HEADLINE.name)
HEADLINE_FIGURE = cat.figure_path(R, cat.HEADLINE.name)
# in `rule all` (Snakefile); only for a config with a sweep (runs.csv)
HEADLINE_TARGETS = [HEADLINE_FIGURE, *HEADLINE_TABLE.values()] if CELLS else []


rule headline:
    input:
        runs=f"{R}/runs.csv",
        claims=Path(workflow.basedir) / "workflow" / "resources" / "paper_claims.yaml",
    output:
        md=HEADLINE_TABLE["md"],
        csv=HEADLINE_TABLE["csv"],
        html=report(HEADLINE_TABLE["html"], caption="../report/headline.rst", category="1 Headline",
                    labels={"table": "headline"}),
        png=report(HEADLINE_FIGURE, caption="../report/headline.rst", category="1 Headline",
                   labels={"figure": "headline"}),
    log:
        f"{R}/logs/headline.log",
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/headline.py"
