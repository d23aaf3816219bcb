"""Acceptance length of drafters trained on a full-precision target's taps and on an FP8 target's
(``train.target_quantization: fp8``), each served against both targets: a 2x2 table of tau.

Runs the real workflow (``snakemake --cores N``) in a copy of this checkout twice on one run root,
as ``demo_algorithms.py`` does: first as configured, then with ``train.target_quantization: fp8``
and ``evaluate.target_quantization: fp8`` (the second run reruns only train onward: the generated
and tokenized shards, layers, steps and seed are the same). Each run's exported drafter is kept.
Then each drafter is evaluated with evaluate's own loop (``stages.evaluate.run_evaluation``: the
speculative loop, plain decoding beside it, the lossless check) on the workflow's held-out prompts
with the evaluate stage's options (max prompts, max new tokens, temperature, thinking), against the
demo target loaded as evaluate loads it and against the same target quantized as training
quantizes it (``model.quantized``). One thread, as the evaluate job decodes on a CPU.

The two cross cells (a drafter served against a target of another identity than it was trained
against) are what ``evaluate.target_mismatch`` refuses in the workflow; this script measures
them on purpose, with ``target_mismatch: warn`` (the loop runs, the mismatch is logged), and
records each cell's identity comparison. The diagonal cells are also what each workflow run's own evaluate measured; both are
recorded and must agree.

On a CPU the "full-precision" target computes in float32 (evaluate's dtype there; bfloat16 on a
GPU) and the FP8 one dequantizes its weights to float32 in each forward: tau depends on the
weights and the dtype, not on the device.

    python bench/quantized_tau.py --out bench/results/quantized_tau-cpu.json
        [--max-prompts N --max-new-tokens N --workdir DIR --cores N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import copy_workflow, cpu_model, emit, provenance, require_success, run_snakemake  # noqa: E402

from dflash_pipeline.core import layout  # noqa: E402

# The two trainings: the workflow's --config for each (evaluate quantized like the taps, so the
# workflow's own evaluate measures the drafter against the target it was trained against).
RUNS = {
    "full": [],
    "fp8": ["train={target_quantization: fp8}", "evaluate={target_quantization: fp8}"],
}
TARGETS = {"full": None, "fp8": "fp8"}


def run_workflow(workdir: Path, name: str, cores: str) -> float:
    config = ["--config", *RUNS[name]] if RUNS[name] else []
    return run_snakemake(
        workdir, ["--cores", cores, *config], workdir / f"snakemake-{name}.log", f"{name} training run"
    )


def keep_run(workdir: Path, name: str) -> tuple[Path, dict]:
    """The run's exported drafter, copied out of the run root (the next run replaces it), and its
    evaluate metrics."""
    run = workdir / layout.run_root("results", "demo")
    drafter = workdir / "drafters" / name
    shutil.rmtree(drafter, ignore_errors=True)
    shutil.copytree(run / layout.DRAFTER_DIR, drafter)
    return drafter, json.loads((run / layout.EVAL_METRICS).read_text())


def workflow_options(workflow_metrics: dict):
    """The options the workflow's evaluate ran with (its metrics' settings), for the loop here."""
    from dflash_pipeline.evaluation.transformers_loop import eval_options

    settings = workflow_metrics["settings"]
    names = {"max_new_tokens", "temperature", "thinking", "seed", "lossless_margin", "limit", "split", "dtype"}
    return eval_options({k: settings[k] for k in names if k in settings})


def measure_cell(target_dir: str, quantization: str | None, drafter: Path, prompts: str, options, out: Path) -> dict:
    from dataclasses import replace

    from dflash_pipeline.stages.evaluate import run_evaluation

    started = time.perf_counter()
    # target_mismatch warn: the cross cells are the mismatches evaluate refuses by default,
    # measured here on purpose; the comparison is recorded either way.
    options = replace(options, target_quantization=quantization, target_mismatch="warn")
    document = run_evaluation(target_dir, drafter, prompts, out, options)
    overall = document["overall"]
    return {
        "tau": overall["tau"],
        "prompts": overall.get("prompts"),
        "generated_tokens": overall.get("generated_tokens"),
        "verify_steps": overall.get("verify_steps"),
        "lossless": document["lossless"].get("passed"),
        "target_weights": document["target_weights"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", default="all")
    parser.add_argument("--workdir", help="where the checkout is copied (default: a temp folder)")
    parser.add_argument("--max-prompts", type=int, help="fewer held-out prompts than evaluate's (default: its)")
    parser.add_argument("--max-new-tokens", type=int, help="fewer tokens per prompt than evaluate's (default: its)")
    parser.add_argument("--out")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="quantized-tau-"))
    if not (workdir / "Snakefile").exists():
        copy_workflow(workdir, extra=("resources",))

    drafters, workflow_metrics, walls = {}, {}, {}
    for name in RUNS:
        walls[name] = round(run_workflow(workdir, name, args.cores), 1)
        drafters[name], workflow_metrics[name] = keep_run(workdir, name)
        print(name, "workflow tau", workflow_metrics[name]["overall"]["tau"], flush=True)

    import torch

    torch.set_num_threads(1)
    options = workflow_options(workflow_metrics["full"])
    if args.max_prompts:
        options.limit = min(args.max_prompts, options.limit or args.max_prompts)
    if args.max_new_tokens:
        options.max_new_tokens = min(args.max_new_tokens, options.max_new_tokens)
    target_dir = str(workdir / "resources" / "demo-target")
    prompts = str(workdir / layout.run_root("results", "demo") / layout.INGESTED_PROMPTS)
    cells: dict[str, dict[str, dict]] = {name: {} for name in drafters}
    for target_name, quantization in TARGETS.items():
        for drafter_name, drafter in drafters.items():
            out = workdir / f"metrics-{drafter_name}-drafter-{target_name}-target.json"
            cell = measure_cell(target_dir, quantization, drafter, prompts, options, out)
            cells[drafter_name][target_name] = cell
            print(f"drafter {drafter_name}, target {target_name}:", json.dumps(cell), flush=True)

    diagonal = {
        name: {"workflow_tau": workflow_metrics[name]["overall"]["tau"], "here": cells[name][name]["tau"]}
        for name in drafters
    }
    checks = {f"{d} drafter on {t} target lossless": cells[d][t]["lossless"] is True for d in cells for t in cells[d]}
    workflow_settings = workflow_metrics["full"]["settings"]
    if (options.limit, options.max_new_tokens) == (workflow_settings["limit"], workflow_settings["max_new_tokens"]):
        # Same loop, prompts, options and thread count: the workflow's evaluate and this one agree.
        checks |= {f"{name} diagonal equals the workflow's evaluate": d["workflow_tau"] == d["here"]
                   for name, d in diagonal.items()}  # fmt: skip
    require_success(checks)
    record = {
        "benchmark": "quantized_tau",
        **provenance(f"CPU: {cpu_model()} ({os.cpu_count()} cores)"),
        "note": (
            "rows: the drafter's training taps (full: the checkpoint's weights; fp8: train.target_quantization fp8); "
            "columns: the target it is served against in evaluate's loop. On a CPU both compute in float32. "
            "The off-diagonal cells are identity mismatches evaluate refuses by default, measured here on purpose"
        ),
        "options": {
            "max_prompts": options.limit,
            "max_new_tokens": options.max_new_tokens,
            "temperature": options.temperature,
            "thinking": options.thinking,
            "split": options.split,
            "torch_threads": 1,
        },
        "tau": {d: {t: cells[d][t]["tau"] for t in cells[d]} for d in cells},
        "cells": cells,
        "workflow_diagonal": diagonal,
        "workflow_simulated_tau": {n: (m.get("simulated") or {}).get("tau") for n, m in workflow_metrics.items()},
        "workflow_wall_s": walls,
    }
    emit(record, args.out)


if __name__ == "__main__":
    main()
