"""The DFlash authors' package (`dflash` on PyPI) in a virtualenv of its own.

Its `local` extra pins torch 2.13.0 and transformers 5.15.0; installing it into the project's
environment would downgrade transformers, so it goes with --no-deps into a separate virtualenv
that holds dflash, transformers 5.15.0 (and the tokenizers it accepts) and borrows everything else (torch, tokenizers,
safetensors, ...) from the project's environment through a .pth file placed after its own
site-packages. The virtualenv is cached by the pinned versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import subprocess
import sys
from pathlib import Path

DFLASH = "dflash==0.1.0"
TRANSFORMERS = "transformers==5.15.0"
# transformers 5.15 refuses, at import time, the newer tokenizers and huggingface-hub of the
# project environment: pin the newest releases inside its accepted ranges.
COMPANIONS = ("tokenizers==0.22.2", "huggingface-hub==1.27.0")
PINS = (DFLASH, TRANSFORMERS, *COMPANIONS)


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_DEMO_CACHE") or Path.home() / ".cache" / "dflash-pipeline")


def reference_python() -> Path:
    key = hashlib.sha256(f"{PINS} {sys.version}".encode()).hexdigest()[:12]
    venv = cache_root() / f"dflash-reference-{key}"
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    target = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target,
         *PINS],
        check=True,
    )  # fmt: skip
    # After its own packages: torch and the rest from the project's environment.
    Path(target, "zz_project_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (venv / ".complete").write_text("ok")
    return python


RUN_REFERENCE = r"""
import json, sys, time
from pathlib import Path
import torch
import dflash.model as dm
from dflash import DFlash2DraftModel, DFlashDraftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers

args = json.loads(sys.argv[1])
# Its timing helper synchronizes CUDA; on a CPU the plain clock is the same measurement.
dm._cuda_time = time.perf_counter
target = AutoModelForCausalLM.from_pretrained(args["target"], dtype=torch.float32).eval()
# Dispatch on architectures, as the authors' benchmark does.
architectures = json.loads(Path(args["drafter"], "config.json").read_text())["architectures"]
cls = DFlash2DraftModel if architectures == ["DFlash2DraftModel"] else DFlashDraftModel
drafter, info = cls.from_pretrained(
    args["drafter"], dtype=torch.float32, output_loading_info=True
)
drafter.eval()
# Whatever the checkpoint did not fill stays torch.empty garbage (DFlash2's base_kernel).
nonfinite = sorted(n for n, t in drafter.state_dict().items() if not torch.isfinite(t).all())
# The drafts of every verify step, as the loop computed them.
proposals = []
if isinstance(drafter, DFlash2DraftModel):
    propose = drafter.propose
    def recording_propose(*a, **k):
        out = propose(*a, **k)
        proposals.append(out[0][0].tolist())
        return out
    drafter.propose = recording_propose
else:
    compute_logits = drafter.compute_logits
    def recording_logits(*a, **k):
        logits = compute_logits(*a, **k)
        proposals.append(logits[0].argmax(-1).tolist())
        return logits
    drafter.compute_logits = recording_logits
tokenizer = AutoTokenizer.from_pretrained(args["target"])
stop = [tokenizer.convert_tokens_to_ids(t) for t in args["stop_tokens"]]
results = []
for prompt_ids in args["prompts"]:
    ids = torch.tensor([prompt_ids])
    proposals.clear()
    stats = dm.dflash_generate(drafter, target, ids, args["max_new_tokens"], stop,
                               temperature=0.0, return_stats=True)
    results.append({"output_ids": stats.output_ids[0].tolist(),
                    "acceptance_lengths": list(map(int, stats.acceptance_lengths)),
                    "proposals": list(proposals)})
layers = list(drafter.layers)
dflash2 = {}
if isinstance(drafter, DFlash2DraftModel):
    conv = layers[0].attention_conv
    dflash2 = {"conv_kernel_size": conv.kernel_size, "conv_group_size": conv.group_size,
               "selector_rank": drafter.candidate_selector.hidden_projection.out_features,
               "selector_top_k": drafter.candidate_selector.top_k}
print(json.dumps({
    "transformers": transformers.__version__,
    "class": type(drafter).__name__,
    "missing_keys": sorted(info["missing_keys"]),
    "unexpected_keys": sorted(info["unexpected_keys"]),
    "mismatched_keys": [list(map(str, k)) for k in info.get("mismatched_keys", [])],
    "nonfinite": nonfinite,
    "block_size": drafter.block_size, "mask_token_id": drafter.mask_token_id,
    "target_layer_ids": list(drafter.target_layer_ids),
    "is_causal": [bool(layer.self_attn.is_causal) for layer in layers],
    "sliding_window": [layer.self_attn.sliding_window for layer in layers],
    "dflash2": dflash2,
    "results": results,
}))
"""


def run_reference_loop(
    target: Path, drafter: Path, prompts: list[list[int]], max_new_tokens: int, stop_tokens: list[str]
) -> dict:
    python = reference_python()
    args = {
        "target": str(target),
        "drafter": str(drafter),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "stop_tokens": stop_tokens,
    }
    proc = subprocess.run(
        [str(python), "-c", RUN_REFERENCE, json.dumps(args)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the dflash package failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
