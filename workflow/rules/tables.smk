# Tables: paper value, ours and ours/paper side by side (Markdown for reading, CSV for tools).


rule run_tables:
    input:
        runs=f"{R}/runs.csv",
        claims=Path(workflow.basedir) / "workflow" / "resources" / "paper_claims.yaml",
    output:
        md=[f"{R}/tables/memory.md", f"{R}/tables/speed.md", f"{R}/tables/accuracy.md"],
        csv=[f"{R}/tables/memory.csv", f"{R}/tables/speed.csv", f"{R}/tables/accuracy.csv"],
    log:
        f"{R}/logs/tables/runs.log",
    params:
        kind="runs",
        names=["memory", "speed", "accuracy"],
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/tables.py"


rule repro_table:
    input:
        lambda wc: f"{R}/repro/{REPRO_NAME[wc.table]}.csv",
    output:
        md=f"{R}/tables/{{table}}.md",
        csv=f"{R}/tables/{{table}}.csv",
    log:
        f"{R}/logs/tables/{{table}}.log",
    wildcard_constraints:
        table="|".join(REPRO_TABLES.values()),
    params:
        kind="repro",
        name=lambda wc: wc.table,
        title=lambda wc: REPRO_TITLES[wc.table],
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/tables.py"
