# Tokenize: exact ids and loss masks, and the data-quality gate (dflash_pipeline.stages.tokenize).


rule tokenize:
    input:
        unpack(target_model_input),
        generated=shard_output("generate"),
    output:
        tokenized=shard_output("tokenize"),
        stats=shard_output("tokenize", "stats.json"),
        # The shard's held-out rows on their own: evaluate reads these, not every shard.
        heldout=shard_output("tokenize", layout.TOKENIZE_HELDOUT_EXT),
    log:
        log_path("tokenize"),
    benchmark:
        benchmark_path("tokenize")
    # A finished generate shard is judged before more are generated: a shard that fails the
    # quality gate halts the run's generation (dflash_pipeline.core.jobstate).
    priority: 10
    conda:
        "../envs/pipeline.yaml"
    # Rendering and tokenizing run in this many worker processes (scaled down to --cores).
    threads: 4
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["tokenize"],
        runtime=config["resources"]["runtime_minutes"]["tokenize"],
    params:
        run_url=lambda wildcards: RUN_URL,
        model=config["target"]["model"],
        thinking=config["generation"]["thinking"],
        settings=rule_params(config, "tokenize"),
    script:
        "../scripts/tokenize.py"
