"""The CPU demo trained with each drafter algorithm: the same generated and tokenized shards, the
same drafter layers, steps and seed, the same held-out prompts; only ``train.algorithm`` differs.

Runs the real workflow (``snakemake --cores N``) in a copy of this checkout, once per algorithm
on the same run root: the first run builds everything, the next ones rerun only train, export,
evaluate and report (their params changed), so generation is shared. Records per algorithm the
evaluate stage's loop tau (held-out prompts, greedy), its simulated tau, losslessness and the
workflow's wall time.

    python bench/demo_algorithms.py --out bench/results/demo_algorithms-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import cpu_model, copy_workflow, emit, provenance, run_snakemake  # noqa: E402

from dflash_pipeline.core import layout  # noqa: E402


def copy_checkout(workdir: Path) -> None:
    """The workflow files the tests copy, and the built demo target where it exists; the
    package is imported from this checkout (PYTHONPATH), as in the workflow tests."""
    copy_workflow(workdir, extra=("resources",))


def run_workflow(workdir: Path, algorithm: str, cores: str, log: Path) -> float:
    config = ["--config", f"train={{algorithm: {algorithm}}}"]
    return run_snakemake(workdir, ["--cores", cores, *config], log, f"{algorithm} run")


def evaluation_summary(workdir: Path) -> dict:
    run = workdir / layout.run_root("results", "demo")
    document = json.loads((run / layout.EVAL_METRICS).read_text())
    overall = document["overall"]
    return {
        "loop_tau": overall["tau"],
        "simulated_tau": (document.get("simulated") or {}).get("tau"),
        "lossless": document.get("lossless"),
        "prompts": overall.get("prompts"),
        "algorithm": document["settings"].get("algorithm"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["dflash", "dflash2"])
    parser.add_argument("--cores", default="all")
    parser.add_argument("--workdir", help="where the checkout is copied (default: a temp folder)")
    parser.add_argument("--out")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="demo-algorithms-"))
    if not (workdir / "Snakefile").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        copy_checkout(workdir)
    results = {}
    for algorithm in args.algorithms:
        wall = run_workflow(workdir, algorithm, args.cores, workdir / f"snakemake-{algorithm}.log")
        results[algorithm] = {**evaluation_summary(workdir), "workflow_wall_s": round(wall, 1)}
        print(algorithm, json.dumps(results[algorithm]), flush=True)
    record = {
        "benchmark": "demo_algorithms",
        **provenance(f"CPU: {cpu_model()} ({os.cpu_count()} cores)"),
        "note": "the first algorithm's wall time includes generation and tokenization; later ones rerun train onward",
        "results": results,
    }
    emit(record, args.out)


if __name__ == "__main__":
    main()
