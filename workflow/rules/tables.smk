# Tables (workflow/catalogue.py): paper value, ours and ours/paper side by side. One job writes a table's Markdown
# (for reading), CSV (for tools) and HTML (for the report) together, so the three never disagree and a failed job
# leaves none of them (Snakemake removes a failed job's outputs).


rule run_tables:
    input:
        runs=f"{R}/runs.csv",
        claims=Path(workflow.basedir) / "workflow" / "resources" / "paper_claims.yaml",
    output:
        md=[cat.table_paths(R, t.name)["md"] for t in cat.RUN_TABLES],
        csv=[cat.table_paths(R, t.name)["csv"] for t in cat.RUN_TABLES],
        html=[
            report(
                cat.table_paths(R, t.name)["html"],
                caption="../report/table.rst",
                category="Tables",
                labels={"table": t.name},
            )
            for t in cat.RUN_TABLES
        ],
    log:
        f"{R}/logs/tables/runs.log",
    params:
        kind="runs",
        names=[t.name for t in cat.RUN_TABLES],
        titles=[t.title for t in cat.RUN_TABLES],
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/tables.py"


rule repro_table:
    input:
        repro_table_inputs,
    output:
        md=f"{R}/tables/{{table}}.md",
        csv=f"{R}/tables/{{table}}.csv",
        html=report(
            f"{R}/tables/{{table}}.html",
            caption="../report/table.rst",
            category="Tables",
            labels={"table": "{table}"},
        ),
    log:
        f"{R}/logs/tables/{{table}}.log",
    wildcard_constraints:
        table="|".join(r.stem for r in cat.REPRODUCTIONS),
    params:
        kind="repro",
        name=lambda wc: wc.table,
        title=lambda wc: repro_of_stem(wc.table).title,
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/tables.py"
