"""The demo workflow on a GPU with vLLM for generation and evaluation: the loop's tau beside the
tau vLLM's own counters give for the exported drafter, both lossless checks and the engine parity
gate, for a full-attention drafter and a sliding-window one.

    python bench/serving_parity.py --variant full --out bench/results/serving_parity-full-h200.json
    python bench/serving_parity.py --variant swa  --out bench/results/serving_parity-swa-h200.json

Runs `snakemake` in a copy of the workflow (its own results folder) with `generation.engine: vllm`
and `evaluate.engine: vllm`, training and evaluation on the GPU, and records what the evaluate rule
wrote (also when its gate failed: the metrics are kept beside the log). The raw `/metrics` text
vLLM served around the first prompt is copied next to ``--out`` (the parsing tests' fixture).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from benchlib import REPO, emit, provenance

sys.path.insert(0, str(REPO))

from tests.conftest import WORKFLOW_FILES  # noqa: E402

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
}


def gpu_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="full")
    parser.add_argument("--out", help="result JSON")
    parser.add_argument("--max-prompts", type=int, default=64, help="held-out prompts evaluated")
    parser.add_argument("--workdir", help="keep the run here (default: a temporary folder)")
    parser.add_argument("--engine-arg", action="append", default=[], help="extra vLLM argument")
    parser.add_argument("--target", help="a built demo target folder (default: the run builds one)")
    parser.add_argument("--misexport", action="store_true",
                        help="after a run of this variant (same --workdir): drop the capture indices "
                             "from its exported config.json, as the export wrote it before, and "
                             "evaluate again (a deliberately mis-exported drafter for the gate)")
    parser.add_argument("--reuse-data-of", metavar="VARIANT",
                        help="start from that variant's prompts, generations and tokenized shards "
                             "(same --workdir): only training, export and evaluation run")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="serving-parity-"))
    for name in WORKFLOW_FILES:
        src = REPO / name
        dest = work / name
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    overrides = {
        "run": f"serving-{args.variant}",
        "gpus": 1,
        **({"target": {"model": str(Path(args.target).resolve()), "build_demo": False}} if args.target else {}),
        "generation": {"engine": "vllm", "gpus_per_job": 1, "server": {"extra_args": args.engine_arg}},
        "train": {"gpus_per_job": 1, **VARIANTS[args.variant]},
        "evaluate": {"engine": "vllm", "max_prompts": args.max_prompts, "engine_extra_args": args.engine_arg},
    }
    (work / "bench-config.yaml").write_text(yaml.safe_dump(overrides))
    if args.reuse_data_of:
        source = work / "results" / f"serving-{args.reuse_data_of}" / "outputs"
        dest = work / "results" / overrides["run"] / "outputs"
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.iterdir()):
            if path.name.startswith(("ingest-", "prepare-", "generate-", "tokenize-")):
                shutil.copy2(path, dest / path.name)
    if args.misexport:
        config_path = work / "results" / overrides["run"] / "drafter" / "config.json"
        exported = json.loads(config_path.read_text())
        exported.pop("eagle_aux_hidden_state_layer_ids", None)
        config_path.write_text(json.dumps(exported, indent=2) + "\n")  # newer: evaluate reruns
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "all", "--resources", "gpu=1",
         "--configfile", "config.yaml", "bench-config.yaml", "--rerun-triggers", "mtime"],
        cwd=work, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.time() - started
    run = work / "results" / overrides["run"]
    metrics_path = run / "outputs" / "evaluate-metrics.json"
    failed_copy = run / "logs" / "evaluate.failed-metrics.json"
    found = metrics_path if metrics_path.exists() else failed_copy
    metrics = json.loads(found.read_text()) if found.exists() else None
    engine_dir = run / "logs" / "evaluate-engine"
    if args.out:
        for name in ("vllm-metrics-before.txt", "vllm-metrics-after.txt"):
            if (engine_dir / name).exists():
                shutil.copyfile(engine_dir / name, Path(args.out).with_name(f"{Path(args.out).stem}.{name}"))
    record = {
        "benchmark": "serving_parity",
        **provenance(gpu_name()),
        "variant": args.variant + ("-misexported" if args.misexport else ""),
        "drafter": VARIANTS[args.variant],
        "workflow_exit_code": proc.returncode,
        "workflow_seconds": round(seconds, 1),
        "workflow_log_tail": (proc.stdout + proc.stderr)[-3000:] if proc.returncode else None,
    }
    if metrics:
        engine = metrics.get("engine") or {}
        record.update({
            "prompts": metrics["overall"].get("prompts"),
            "loop_tau": metrics["overall"].get("tau"),
            "loop_lossless": metrics.get("lossless"),
            "loop_device": metrics.get("settings", {}).get("device"),
            "loop_dtype": metrics.get("settings", {}).get("dtype"),
            "simulated": metrics.get("simulated"),
            "engine": engine.get("name"),
            "engine_version": engine.get("version"),
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
        })
    emit(record, args.out)
    return 0 if metrics else 1


if __name__ == "__main__":
    sys.exit(main())
