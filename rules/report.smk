# Report: figures and tables of each stage, flagged with report() for `snakemake --report`
# (dflash_pipeline.report.figures); their inputs: rules/inputs.smk.
from dflash_pipeline.report import headline as headline_figures
from dflash_pipeline.report import targets as report_targets


# Small and quick: they run in the driver process, not as cluster jobs.
localrules:
    all,
    report_headline,
    report_prompts,
    report_generation,
    report_tune,
    report_tokenization,
    report_training,
    report_evaluation,
    report_storage,


# The run's headline figures: the first item of the first category, and shown on the
# report's landing page itself (report/workflow.rst includes this table).
rule report_headline:
    input:
        unpack(headline_inputs),
    output:
        table=report(
            run_path(layout.report_key(report_targets.HEADLINE_ITEM)),
            caption="../report/headline.rst",
            category="0. Headline",
        ),
    log:
        log_path("report_headline", per_shard=False),
    benchmark:
        benchmark_path("report_headline", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_headline"],
        runtime=config["resources"]["runtime_minutes"]["report_headline"],
    params:
        run_url=lambda wildcards: RUN_URL,
        # The generate shards whose counts give samples and tokens (none before generate).
        shards=lambda wildcards: (
            SHARDS if "generated" in headline_inputs(wildcards) else []
        ),
        gpu_hours_of=headline_figures.GPU_HOURS_OF,
    script:
        "../scripts/report_headline.py"


rule report_prompts:
    input:
        summary=run_path(layout.INGEST_SUMMARY),
        quarantine=run_path(layout.QUARANTINE),
    output:
        figure=report(
            run_path(layout.report_key("prompts.svg")),
            caption="../report/prompts.rst",
            category="1. Prompts",
        ),
        table=report(
            run_path(layout.report_key("prompts.html")),
            caption="../report/quarantine.rst",
            category="1. Prompts",
        ),
    log:
        log_path("report_prompts", per_shard=False),
    benchmark:
        benchmark_path("report_prompts", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_prompts"],
        runtime=config["resources"]["runtime_minutes"]["report_prompts"],
    script:
        "../scripts/report_prompts.py"


rule report_generation:
    input:
        generated=expand(shard_output("generate"), shard=SHARDS),
        benchmarks=expand(benchmark_path("generate"), shard=SHARDS),
    output:
        throughput=report(
            run_path(layout.report_key("generation-throughput.svg")),
            caption="../report/generation-throughput.rst",
            category="2. Generation",
        ),
        lengths=report(
            run_path(layout.report_key("generation-lengths.svg")),
            caption="../report/generation-lengths.rst",
            category="2. Generation",
        ),
        finish=report(
            run_path(layout.report_key("generation-finish.svg")),
            caption="../report/generation-finish.rst",
            category="2. Generation",
        ),
    log:
        log_path("report_generation", per_shard=False),
    benchmark:
        benchmark_path("report_generation", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_generation"],
        runtime=config["resources"]["runtime_minutes"]["report_generation"],
    params:
        run_url=lambda wildcards: RUN_URL,
    script:
        "../scripts/report_generation.py"


rule report_tune:
    input:
        result=run_path(layout.TUNE_RESULT),
    output:
        table=report(
            run_path(layout.report_key("tune.html")),
            caption="../report/tune.rst",
            category="2. Generation",
        ),
    log:
        log_path("report_tune", per_shard=False),
    benchmark:
        benchmark_path("report_tune", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_tune"],
        runtime=config["resources"]["runtime_minutes"]["report_tune"],
    script:
        "../scripts/report_tune.py"


rule report_tokenization:
    input:
        stats=expand(shard_output("tokenize", "stats.json"), shard=SHARDS),
    output:
        supervised=report(
            run_path(layout.report_key("tokenization-supervised.svg")),
            caption="../report/tokenization-supervised.rst",
            category="3. Tokenization",
        ),
        degenerate=report(
            run_path(layout.report_key("tokenization-degenerate.svg")),
            caption="../report/tokenization-degenerate.rst",
            category="3. Tokenization",
        ),
        table=report(
            run_path(layout.report_key("tokenization.html")),
            caption="../report/tokenization-table.rst",
            category="3. Tokenization",
        ),
    log:
        log_path("report_tokenization", per_shard=False),
    benchmark:
        benchmark_path("report_tokenization", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_tokenization"],
        runtime=config["resources"]["runtime_minutes"]["report_tokenization"],
    params:
        # It checks the stats' records; no rerun trigger (see rule ingest).
        run_url=lambda wildcards, input: RUN_URL,
    script:
        "../scripts/report_tokenization.py"


rule report_training:
    input:
        segments=[segment_manifest(k) for k in range(config["train"]["segments"])],
        # Each segment's τ in the loop (rule segment_tau), drawn beside the loss.
        segment_taus=[run_path(key) for key in report_targets.segment_tau_keys(config)],
    output:
        figure=report(
            run_path(layout.report_key("training.svg")),
            caption="../report/training.rst",
            category="4. Training",
        ),
    log:
        log_path("report_training", per_shard=False),
    benchmark:
        benchmark_path("report_training", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_training"],
        runtime=config["resources"]["runtime_minutes"]["report_training"],
    params:
        run_url=lambda wildcards: RUN_URL,
        segments=config["train"]["segments"],
    script:
        "../scripts/report_training.py"


rule report_evaluation:
    input:
        metrics=run_path(layout.EVAL_METRICS),
    output:
        figure=report(
            run_path(layout.report_key("acceptance.svg")),
            caption="../report/acceptance.rst",
            category="5. Evaluation",
        ),
    log:
        log_path("report_evaluation", per_shard=False),
    benchmark:
        benchmark_path("report_evaluation", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_evaluation"],
        runtime=config["resources"]["runtime_minutes"]["report_evaluation"],
    script:
        "../scripts/report_evaluation.py"


rule report_storage:
    input:
        # Everything else the run produces, so the listing is taken once it is all there.
        stage_outputs=lambda wildcards: report_storage_inputs(),
    output:
        figure=report(
            run_path(layout.report_key(report_targets.STORAGE_ITEM)),
            caption="../report/storage.rst",
            category="6. Storage",
        ),
    log:
        log_path("report_storage", per_shard=False),
    benchmark:
        benchmark_path("report_storage", per_shard=False)
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    resources:
        **slurm(0),
        mem_mb=config["resources"]["mem_mb"]["report_storage"],
        runtime=config["resources"]["runtime_minutes"]["report_storage"],
    params:
        run_url=lambda wildcards: RUN_URL,
    script:
        "../scripts/report_storage.py"
