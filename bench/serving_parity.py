"""The demo workflow with vLLM for generation and evaluation: the loop's tau beside the tau vLLM's
own counters give for the exported drafter, both lossless checks and the engine parity gate, for a
full-attention drafter and sliding-window ones.

    python bench/serving_parity.py --vllm-python V/bin/python --variant full --out bench/results/serving_parity-full-h200.json
    python bench/serving_parity.py --vllm-python V/bin/python --variant swa  --out bench/results/serving_parity-swa-h200.json

On a CPU, with vLLM's CPU build in its own environment (`make vllm-env`), every variant in one
record (what the pipeline refuses before launching is recorded with its one-line reason):

    python bench/serving_parity.py --cpu-vllm .venv-vllm/bin/python \
        --variant full --variant sliding --variant swa --variant dflash2 \
        --out bench/results/serving_parity-vllm-cpu.json

Runs `snakemake` in a copy of the workflow (its own results folder) with `generation.engine: vllm`
and `evaluate.engine: vllm`, training and evaluation on the GPU, and records what the evaluate rule
wrote (also when its gate failed: the metrics are kept beside the log). The raw `/metrics` text
vLLM served around the first prompt is copied next to ``--out`` (the parsing tests' fixture).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from benchlib import REPO, cpu_model, copy_workflow, emit, provenance

sys.path.insert(0, str(REPO))

from dflash_pipeline.core import checksums  # noqa: E402


VARIANTS = {
    # The demo's drafter: every layer full attention (bidirectional within the block).
    "full": {"num_layers": 2},
    # Two sliding-window layers (causal in the block, window well below the ~100-250-token
    # sequences) and one full layer: where engines disagree most.
    "swa": {
        "num_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 16,
    },
    # Every layer sliding-window (what vLLM >= 0.25 serves, the CPU build included).
    "sliding": {
        "num_layers": 2,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "sliding_window": 16,
    },
    "dflash2": {"num_layers": 2, "algorithm": "dflash2"},
    # The demo's drafter trained online from a vLLM taps server on the training job's GPU
    # (train.taps_from: engine) instead of the in-process target: the GPU path of engine taps
    # (preflight, the per-run check's reference before the server, the server beside the trainer).
    "engine-taps": {"num_layers": 2, "taps_from": "engine"},
}
# The taps server's share of the training job's GPU in the engine-taps variant (the demo target
# and its captured layers need little; the trainer and the check's other servers share the card).
TAPS_SERVER_MEM_FRACTION = 0.1


def train_overrides(variant: str, taps_server: dict) -> dict:
    """The variant's ``train`` settings, with ``taps_server`` where it trains from engine taps."""
    train = dict(VARIANTS[variant])
    if train.get("taps_from") == "engine":
        train["taps_server"] = taps_server
    return train


# vLLM's CPU build: a bounded share of host memory and KV cache (its GPU default, 0.92 of host
# RAM, refuses to start), one CPU job at a time.
CPU_VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
CPU_VLLM_MEM_FRACTION = 0.1


def gpu_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variant", choices=sorted(VARIANTS), action="append", help="drafter variant (repeatable; default full)"
    )
    parser.add_argument("--out", help="result JSON")
    parser.add_argument("--max-prompts", type=int, default=64, help="held-out prompts evaluated")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per evaluated prompt (default: config's)")
    parser.add_argument("--workdir", help="keep the run here (default: a temporary folder)")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra vLLM argument")
    parser.add_argument("--target", help="a built demo target folder (default: the run builds one)")
    parser.add_argument(
        "--vllm-python", required=True, metavar="PYTHON", help="the Python of vLLM's environment (engines.vllm.python)"
    )
    parser.add_argument("--cpu", action="store_true", help="no GPU: vLLM's CPU build")
    parser.add_argument(
        "--misexport",
        action="store_true",
        help="after a run of this variant (same --workdir): drop the capture indices "
        "from its exported config.json, as the export wrote it before, and "
        "evaluate again (a deliberately mis-exported drafter for the gate)",
    )
    parser.add_argument(
        "--reuse-data-of",
        metavar="VARIANT",
        help="start from that variant's prompts, generations and tokenized shards "
        "(same --workdir): only training, export and evaluation run",
    )
    args = parser.parse_args()
    variants = args.variant or ["full"]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="serving-parity-"))
    copy_workflow(work)
    records = []
    for index, variant in enumerate(variants):
        reuse = args.reuse_data_of or (variants[0] if index else None)
        records.append(run_variant(args, variant, work, reuse))
    if len(records) == 1:
        emit(records[0], args.out)
    else:
        emit({"benchmark": "serving_parity", **provenance(records[0]["device"]), "runs": records}, args.out)
    return 0 if all(r.get("loop_tau") or r.get("refused") for r in records) else 1


def misexport(exported: dict, kind: str) -> None:
    """Break an exported drafter config the way real exports went wrong. ``no-aux-ids``: the
    capture indices dropped (the export before they were written; vLLM 0.20.1 then tapped other
    layers); ``reversed-taps``: the target layers in the opposite order in every field an engine
    reads (the drafter's fc then mixes its features in the wrong order, for every engine)."""
    if kind == "no-aux-ids":
        exported.pop("eagle_aux_hidden_state_layer_ids", None)
    elif kind == "reversed-taps":
        dflash = exported.get("dflash_config") or {}
        for holder, key in ((dflash, "target_layer_ids"), (exported, "eagle_aux_hidden_state_layer_ids")):
            if holder.get(key):
                holder[key] = list(reversed(holder[key]))
    else:
        raise ValueError(f"unknown misexport kind {kind!r}")


def reuse_data(source: Path, dest: Path) -> None:
    """Copy a finished run's data (ingest, prepare, generate, tokenize outputs) into another run's
    folder, each object with its checksum record: a tracked object without one is refused by its
    reader, so the run would rebuild nothing and fail instead."""
    if not (source / "outputs").is_dir():
        return
    (dest / "outputs").mkdir(parents=True, exist_ok=True)
    for path in sorted((source / "outputs").iterdir()):
        if not path.name.startswith(("ingest-", "prepare-", "generate-", "tokenize-")):
            continue
        shutil.copy2(path, dest / "outputs" / path.name)
        sidecar = checksums.sidecar_key(checksums.object_key(path))
        if (source / sidecar).exists():
            (dest / sidecar).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / sidecar, dest / sidecar)


def break_export(run: Path, kind: str) -> None:
    """Rewrite a run's exported drafter config the way real exports went wrong (``misexport``),
    recorded as export records what it writes: an export that is wrong, for evaluate to refuse or
    its gates to catch, not a damaged object for the checksum to refuse. Newer than the drafter's
    evaluation, so (``--rerun-triggers mtime``) evaluate runs again."""
    config_path = run / "drafter" / "config.json"
    exported = json.loads(config_path.read_text())
    misexport(exported, kind)
    config_path.write_text(json.dumps(exported, indent=2) + "\n")
    checksums.record_checksum(str(run), config_path, "export", "-")


def run_variant(args, variant: str, work: Path, reuse: str | None) -> dict:
    run_name = f"serving-{variant}"
    if args.cpu:
        device = f"CPU ({cpu_model()}), vLLM CPU build"
        overrides = {
            "run": run_name, "num_shards": 1,
            "engines": {"vllm": {"python": args.vllm_python, "env": CPU_VLLM_ENV}},
            "generation": {"engine": "vllm", "concurrency": 16,
                           "server": {"mem_fraction": CPU_VLLM_MEM_FRACTION, "extra_args": args.engine_arg}},
            "train": train_overrides(variant, {"mem_fraction": CPU_VLLM_MEM_FRACTION}),
            "evaluate": {"engine": "vllm", "max_prompts": args.max_prompts, "engine_extra_args": args.engine_arg,
                         "engine_mem_fraction": CPU_VLLM_MEM_FRACTION},
        }  # fmt: skip
        resources = []
    else:
        device = gpu_name()
        engine = getattr(args, "engine", "vllm")
        overrides = {
            "run": run_name,
            "gpus": 1,
            "engines": {engine: {"python": args.vllm_python if engine == "vllm" else args.engine_python}},
            "generation": {"engine": engine, "gpus_per_job": 1, "server": {"extra_args": args.engine_arg}},
            # An engine-taps variant's server on the training job's GPU: its own share, and the
            # check's vLLM arguments (a fixed KV budget beside other runs; the GPU check runs that
            # variant in vLLM's runs only, gpu_check.TAPS_SHAPES).
            "train": {"gpus_per_job": 1, **train_overrides(variant, {
                "mem_fraction": getattr(args, "mem_fraction", None) or TAPS_SERVER_MEM_FRACTION,
                "extra_args": args.engine_arg if engine == "vllm" else [],
            })},
            "evaluate": {"engine": engine, "max_prompts": args.max_prompts, "engine_extra_args": args.engine_arg},
        }  # fmt: skip
        if getattr(args, "reference_url", None):
            overrides["evaluate"]["engine_reference_url"] = args.reference_url
        if getattr(args, "mem_fraction", None):
            # Beside a plain reference server: each takes its share, not the engine's default ~0.9.
            overrides["generation"]["server"]["mem_fraction"] = args.mem_fraction
            overrides["evaluate"]["engine_mem_fraction"] = args.mem_fraction
        resources = ["--resources", "gpu=1"]
    if args.target:
        overrides["target"] = {"model": str(Path(args.target).resolve()), "build_demo": False}
    if args.max_new_tokens:
        overrides["evaluate"]["max_new_tokens"] = args.max_new_tokens
    (work / f"bench-{variant}.yaml").write_text(yaml.safe_dump(overrides))
    if reuse:
        reuse_data(work / "results" / f"serving-{reuse}", work / "results" / run_name)
    if args.misexport:
        break_export(work / "results" / run_name, getattr(args, "misexport_kind", "no-aux-ids"))
    # Beside other runs in the same folder (gpu_check --parallel): their outputs are apart, so
    # no Snakemake directory lock; and GPU slots of their own (core.gpu_slots keeps them under
    # the temporary folder), or the runs' GPU jobs would take turns.
    beside = getattr(args, "beside_others", None)
    nolock, env = (["--nolock"], {**os.environ, "TMPDIR": str(beside)}) if beside else ([], None)
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "all", *resources, *nolock,
         "--configfile", "config.yaml", f"bench-{variant}.yaml", "--rerun-triggers", "mtime"],
        cwd=work, capture_output=True, text=True, env=env,
    )  # fmt: skip
    seconds = time.time() - started
    run = work / "results" / run_name
    metrics_path = run / "outputs" / "evaluate-metrics.json"
    failed_copy = run / "logs" / "evaluate.failed-metrics.json"
    found = metrics_path if metrics_path.exists() else failed_copy
    metrics = json.loads(found.read_text()) if found.exists() else None
    engine_dir = run / "logs" / "evaluate-engine"
    if args.out and len(args.variant or []) <= 1:
        for name in ("vllm-metrics-before.txt", "vllm-metrics-after.txt"):
            if (engine_dir / name).exists():
                shutil.copyfile(engine_dir / name, Path(args.out).with_name(f"{Path(args.out).stem}.{name}"))
    output = proc.stdout + proc.stderr
    refused = [line for line in output.splitlines() if "cannot serve this" in line]
    record = {
        "benchmark": "serving_parity",
        **provenance(device),
        "variant": variant + ("-misexported" if args.misexport else ""),
        "drafter": VARIANTS[variant],
        "workflow_exit_code": proc.returncode,
        "workflow_seconds": round(seconds, 1),
        "refused": refused[0] if refused and not metrics else None,
        "workflow_log_tail": output[-3000:] if proc.returncode and not refused else None,
    }
    if metrics:
        engine = metrics.get("engine") or {}
        record.update({
            "prompts": metrics["overall"].get("prompts"),
            "max_new_tokens": metrics.get("settings", {}).get("max_new_tokens"),
            "loop_tau": metrics["overall"].get("tau"),
            "loop_lossless": metrics.get("lossless"),
            "loop_device": metrics.get("settings", {}).get("device"),
            "loop_dtype": metrics.get("settings", {}).get("dtype"),
            "simulated": metrics.get("simulated"),
            "engine": engine.get("name"),
            "engine_version": engine.get("version"),
            "engine_distribution": engine.get("distribution"),
            "engine_tau": (engine.get("overall") or {}).get("tau"),
            "engine_lossless": engine.get("lossless"),
            "engine_parity": metrics.get("engine_parity"),
            "ratio_engine_to_loop": (
                round(engine["overall"]["tau"] / metrics["overall"]["tau"], 4)
                if engine.get("overall", {}).get("tau") and metrics["overall"].get("tau") else None
            ),
            "drafter_fields": engine.get("drafter_fields"),
            "per_prompt": [
                {"id": a["id"], "loop_tau": a.get("tau"), "engine_tau": b.get("tau")}
                for a, b in zip(metrics.get("per_prompt", []), engine.get("per_prompt", []))
            ],
        })  # fmt: skip
    return record


if __name__ == "__main__":
    sys.exit(main())
