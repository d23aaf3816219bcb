# The workflow's anchor: the config, validated, the shards, and the paths and input functions the
# rules share. Each job's resources: rules/slurm.smk; run control: rules/run_control.smk.
import os
import sys

# Import the package from this checkout even where it is not pip-installed (e.g. conda envs).
sys.path.insert(0, workflow.basedir)

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import ConfigError, rule_params, validate_config
from dflash_pipeline.core.refusal import EnvironmentProblem, refusal_text
from dflash_pipeline.core.storage import is_s3_url
from dflash_pipeline.snakemake_patches.refusals import install_refusal_patch
from dflash_pipeline.snakemake_patches.rerun_checks import install_rerun_checks
from dflash_pipeline.core.credentials import protect_storage_credentials

# The driver and each job's Snakemake process hold the storage credentials in their environment:
# non-dumpable, so that no engine (same user) reads them from their /proc files; it also means no
# core dump and no debugger attach (py-spy) for them except as root (dflash_pipeline.core.credentials).
protect_storage_credentials()


def refuse(*problems):
    """Stop the workflow with ``problems`` and the config they were read from, nothing else: an
    exception raised while the workflow is parsed comes wrapped in Snakemake's frame (file,
    line, stack) under an "in file rules/...smk" headline that hides the file to fix. Problems
    of the environment (credentials, the endpoint, the command line) do not name the config
    (dflash_pipeline.core.refusal).
    """
    files = [
        os.path.relpath(p) if not os.path.relpath(p).startswith("..") else str(p)
        for p in workflow.overwrite_configfiles
    ] or ["config.yaml"]
    given = " and ".join(files) + (
        " and --config" if workflow.config_settings.config else ""
    )
    print(refusal_text(problems, given), file=sys.stderr)
    sys.exit(1)


try:
    config.update(validate_config(config))
except ConfigError as err:
    refuse(str(err))


RUN_ROOT = layout.run_root(config["results_dir"], config["run"])
SHARDS = [layout.shard_name(i) for i in range(config["num_shards"])]
DEFAULT_STORAGE = workflow.storage_settings.default_storage_provider
# Where jobs write objects that Snakemake does not track (_progress/, checkpoints, big shards):
# the same place Snakemake puts the run's outputs, local or S3. Jobs get it as a parameter.
try:
    RUN_URL = layout.run_url(
        RUN_ROOT, DEFAULT_STORAGE, workflow.storage_settings.default_storage_prefix
    )
except layout.StoragePrefixMissing as err:
    refuse(EnvironmentProblem(str(err)))
# A job that refused a damaged input is not retried: every attempt would fail alike
# (dflash_pipeline.snakemake_patches.refusals).
install_refusal_patch(RUN_URL)
# A job about to run again over its earlier outputs has its inputs checked before Snakemake removes
# those outputs: refused, it keeps them (dflash_pipeline.snakemake_patches.rerun_checks).
install_rerun_checks(RUN_URL, config)


wildcard_constraints:
    shard=r"\d{5}",
    segment=r"\d{4}",


def run_path(key):
    """Path of an artifact of this run (mapped to S3 by the s3 profile)."""
    return f"{RUN_ROOT}/{key}"


def shard_output(stage, ext=None):
    return run_path(layout.shard_key(stage, "{shard}", ext))


def segment_manifest(segment):
    return run_path(layout.segment_manifest_key(segment))


def log_path(rule_name, per_shard=True):
    name = f"{rule_name}/{{shard}}.log" if per_shard else f"{rule_name}.log"
    return run_path(f"{layout.LOGS_DIR}/{name}")


def benchmark_path(rule_name, per_shard=True):
    # In the outputs folder: Snakemake checks benchmark files during a dry-run, and only that
    # folder is covered by the S3 plugin's one listing (dflash_pipeline.core.layout).
    return run_path(layout.benchmark_key(rule_name, "{shard}" if per_shard else None))


def local_dataset_files():
    """Local dataset files, as inputs that stay local even in S3 runs (so edits trigger a new
    ingest). s3:// dataset URLs are read by the job itself through the storage layer."""
    return [local(path) for path in config["dataset"]["paths"] if not is_s3_url(path)]


def target_model_input(wildcards):
    """The demo target is built by a rule; a real target is a folder the user provides."""
    return (
        {"model": local(config["target"]["model"])}
        if config["target"]["build_demo"]
        else {}
    )
