"""Snakemake glue for rule `train`: dflash_pipeline.stages.train."""

from dflash_pipeline.core.jobstate import RunHalted
from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.train import TrainingDiverged, train_job

smk = snakemake  # noqa: F821 (injected by Snakemake)
# A diverged segment (it halted the run) and a job refused by the halt end in their one line.
with stage_job(smk, "train", refusals=(TrainingDiverged, RunHalted)) as job:
    # Every tokenize shard, extract manifest and segment K-1's manifest, before a GPU is taken.
    job.verify(smk.input.tokenized, smk.input.get("hidden", []), smk.input.get("previous", []))
    job.torch_threads(smk.threads)  # as many compute threads as Snakemake granted
    with job.devices():
        train_job(
            job.run_url,
            int(smk.wildcards.segment),
            job.settings(),  # with the operational keys (checkpoint, metrics intervals) from the config
            smk.params.model,
            list(smk.input.tokenized),
            list(smk.input.get("hidden", [])),
            smk.output.manifest,
            smk.resources.gpu,
            logs=[job.log_file, job.attempt.local("job")],
            engines=smk.config.get("engines"),  # train.taps_from engine: where vLLM is installed
        )
    job.record(smk.output.manifest)  # names the segment's checkpoint and its index's sha256s
