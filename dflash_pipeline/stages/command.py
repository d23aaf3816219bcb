"""``dflash-pipeline``: the pipeline's tools under one command (the console script of the
package, installed editable or not). Each subcommand hands its arguments to the tool's own
command line, so ``dflash-pipeline plan --help`` is the plan tool's help.

    dflash-pipeline plan --configfile config.yaml [--gpus 8] [--default-storage-prefix s3://…]
    dflash-pipeline status start|serve|stop …     dflash-pipeline stop
    dflash-pipeline verify …    dflash-pipeline fetch …    dflash-pipeline clear-halt …
    dflash-pipeline tune …      (rule tune of the workflow in this folder, through Snakemake)
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

# Subcommand: (module whose main() takes the arguments, arguments put first, one-line help).
TOOLS = {
    "plan": (
        "dflash_pipeline.stages.plan",
        [],
        "what the run will cost: prompts, shards, tokens, GPU-hours, wall time",
    ),
    "status": ("dflash_pipeline.status.__main__", [], "the live status page: start | serve | stop"),
    "stop": ("dflash_pipeline.status.__main__", ["stop"], "stop the status page started in this folder"),
    "verify": ("dflash_pipeline.stages.verify", [], "check every shard object against its recorded checksum"),
    "fetch": ("dflash_pipeline.stages.fetch", [], "copy a run's results (drafter, metrics, report) to a folder"),
    "clear-halt": ("dflash_pipeline.stages.tokenize", ["clear-halt"], "clear the run's data-quality halt"),
}
TUNE_HELP = "measure the generation engine on the run's prompts (Snakemake's rule tune, this folder's workflow)"


def usage() -> str:
    lines = ["usage: dflash-pipeline COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, _, help_) in TOOLS.items()]
    lines.append(f"  {'tune':<11} {TUNE_HELP}")
    lines.append("\n`dflash-pipeline COMMAND --help` describes a command's arguments.")
    return "\n".join(lines)


def tune(args: list[str]) -> int:
    """Snakemake's target ``tune`` of the workflow in the working directory (a checkout: the
    rules are not part of the installed package)."""
    if not Path("Snakefile").is_file():
        print("dflash-pipeline tune: no Snakefile here: run it in the pipeline's checkout", file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, "-m", "snakemake", "--cores", "all", *args, "--", "tune"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "tune":
        return tune(rest)
    if command not in TOOLS:
        print(f"dflash-pipeline: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, first, _ = TOOLS[command]
    return importlib.import_module(module).main([*first, *rest]) or 0


if __name__ == "__main__":
    sys.exit(main())
