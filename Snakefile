# DFlash drafter pipeline: prompts -> target responses -> loss-masked tokens -> drafter -> report.
# A table of contents: the logic lives in the dflash_pipeline package, paths in rules/common.smk,
# each job's resources in rules/slurm.smk.
from snakemake.utils import min_version

min_version("9.27.1")


# The CPU demo is the default only. A file given with --configfile is a complete config of its
# own: keys it leaves out take dflash_pipeline/config/schema.yaml's defaults (rules/common.smk), never the
# demo's. To layer over the demo instead, name it first: --configfile config.yaml mine.yaml
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/slurm.smk"
include: "rules/inputs.smk"
include: "rules/run_control.smk"
include: "rules/demo.smk"
include: "rules/prepare.smk"
include: "rules/generate.smk"
include: "rules/tokenize.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        get_final_output(),
