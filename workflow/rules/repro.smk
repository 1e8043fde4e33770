# Paper-scale reproductions (lowmembp.repro): estimated on fake tensors on the CPU, one CSV each.


rule repro:
    output:
        f"{R}/repro/{{name}}.csv",
    log:
        f"{R}/logs/repro/{{name}}.log",
    benchmark:
        f"{R}/benchmarks/repro/{{name}}.tsv"
    params:
        options=lambda wc: config["repro"]["options"].get(wc.name, {}),
    threads: 1
    conda:
        "../envs/lowmembp.yaml"
    script:
        "../scripts/repro.py"
