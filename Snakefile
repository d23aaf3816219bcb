# DFlash drafter pipeline: prompts -> target responses -> loss-masked tokens -> drafter -> report.
# A table of contents: the logic lives in the dflash_pipeline package, paths in rules/common.smk.
from snakemake.utils import min_version

min_version("9.27.1")


configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
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
