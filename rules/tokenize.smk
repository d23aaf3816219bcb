# Tokenize: exact ids and loss masks, and the data-quality gate (dflash_pipeline.tokenization).


rule tokenize:
    input:
        unpack(target_model_input),
        generated=shard_output("generated"),
    output:
        tokenized=shard_output("tokenized"),
        stats=shard_output("tokenized", "stats.json"),
    log:
        log_path("tokenize"),
    benchmark:
        benchmark_path("tokenize")
    conda:
        "../envs/cpu.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        model=config["target"]["model"],
        thinking=config["generation"]["thinking"],
        settings=config["tokenize"],
    script:
        "../scripts/tokenize.py"
