# The demo target: a tiny Qwen3 trained locally on a synthetic arithmetic task, so the whole
# pipeline runs on a CPU with no model download (dflash_pipeline.demo.build_model). It is cached
# by the hash of its build code, so it is trained once per machine.


rule build_demo_model:
    output:
        model=local(directory(config["target"]["model"])),
    log:
        local("logs/build_demo_model.log"),
    benchmark:
        local("benchmarks/build_demo_model.tsv")
    conda:
        "../envs/pipeline.yaml"
    threads: 2
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["build_demo_model"],
        runtime=config["resources"]["runtime_minutes"]["build_demo_model"],
    script:
        "../scripts/build_demo_model.py"
