"""`tune` on the demo target, as a user runs it (`snakemake tune` in a copy of the workflow): the
engine's throughput, time to first token and per-token latency at several concurrencies, and the
setting tune chooses.

    python bench/tune.py --engine transformers --out bench/results/tune-cpu-transformers.json
    python bench/tune.py --engine vllm --vllm-python .venv-vllm/bin/python --out bench/results/tune-cpu-vllm.json

On a GPU machine pass the target (``--model``; e.g. Qwen3.6-27B with its MTP head, measured with
and without MTP) and the engine's environment; ``--concurrency`` repeats for each setting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from benchlib import REPO, cpu_model, copy_workflow, emit, provenance

sys.path.insert(0, str(REPO))

from tests.support.engine_envs import VLLM_CPU_ENV, VLLM_CPU_MEM_FRACTION  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["transformers", "vllm", "sglang"], required=True)
    parser.add_argument("--vllm-python", help="the Python of vLLM's environment (vllm engine)")
    parser.add_argument("--sglang-python", help="the Python of SGLang's environment (sglang engine)")
    parser.add_argument("--model", help="the target folder (default: the demo target, built here)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs of the server (its tensor parallelism)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, action="append", help="default: 1, 4, 16, 32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["tune"] = {
        "enabled": True,
        "prompts": args.prompts,
        "concurrencies": args.concurrency or [1, 4, 16, 32],
        "max_new_tokens": args.max_new_tokens,
        "seconds_per_setting": 600,
    }
    config["generation"]["engine"] = args.engine
    config["generation"]["concurrency"] = None
    config["generation"]["gpus_per_job"] = args.gpus
    if args.model:
        config["target"] = {"model": str(Path(args.model).resolve()), "build_demo": False}
    if args.engine == "vllm":
        config["engines"] = {"vllm": {"python": str(Path(args.vllm_python).absolute())}}
        config["generation"]["server"] = {"extra_args": []}
        if not args.gpus:
            config["engines"]["vllm"]["env"] = dict(VLLM_CPU_ENV)
            config["generation"]["server"]["mem_fraction"] = VLLM_CPU_MEM_FRACTION
    if args.engine == "sglang":
        config["engines"] = {"sglang": {"python": str(Path(args.sglang_python).absolute())}}
        config["generation"]["server"] = {"extra_args": []}
    if args.gpus:
        config["generation"]["server"]["tp"] = args.gpus
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "wf"
        root.mkdir()
        copy_workflow(root)
        (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        subprocess.run(
            [sys.executable, "-m", "snakemake", "--cores", "2", "--resources", f"gpu={args.gpus}", "--", "tune"],
            cwd=root,
            check=True,
        )
        result = json.loads((root / "results/demo/outputs/tune-result.json").read_text())
    device = result["device"] if args.gpus else f"CPU: {cpu_model()}"
    emit({**provenance(device), "engine": args.engine, "tune": config["tune"], "result": result}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
