"""Host memory (``mem_mb``) each job asks for, from the sizes of the target and the drafter.

A scheduler (SLURM) kills a job that outgrows its request, and a fixed request is wrong both
ways: 16 GB is far too little for the ranks of a 27B target's training job and far too much for
the CPU demo. The figures follow what each job holds in host memory at its peak:

* generate: the engine loads the target's weights through host memory (``LOAD_FACTOR`` x the
  checkpoint's bytes), beside the job's own client;
* extract, evaluate and segment_tau: the target loaded by the job (bf16 on a GPU; on a CPU the loop runs fp32,
  twice a bf16 checkpoint's bytes); evaluate's engine runs before the target is loaded, so the two
  do not add up;
* train: every rank of the job loads its own copy of the target (online mode) and stages its
  share of the drafter's checkpoint state (fp32 weights and both AdamW moments) in pinned buffers;
* export: the drafter's fp32 weights read from the final checkpoint (the optimizer state stays on
  disk, memory-mapped) and their copy in the export dtype (measured for the 27B case: 15.2 GiB
  peak RSS within 17.8 GB, ``bench/results/export_memory-27b.json``); for a drafter the
  speculators format expresses, also the target's embedding and LM head, read and written.

Each figure has a floor, the config's ``resources.mem_mb.<rule>`` (enough for the demo and small
models). Where the target folder does not exist yet (the demo builds it), the floors apply.
Override one job's figure with ``--set-resources train:mem_mb=N``.
"""

from __future__ import annotations

import json
from pathlib import Path

MB = 1_000_000
LOAD_FACTOR = 1.2  # weights read through host memory: the file's bytes plus the loader's slack
JOB_OVERHEAD_MB = 4000  # Python, torch, CUDA context and the job's own buffers
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two moments
# The rules whose memory follows the model's size (tune asks for generate's).
MODEL_SIZED_RULES = ("generate", "extract", "train", "export", "evaluate", "segment_tau")


def checkpoint_bytes(model: str | Path) -> int | None:
    """Bytes of a Hugging Face folder's weights (the safetensors index's total, else the files'
    sizes); None when the folder has none (yet)."""
    folder = Path(model)
    for index in folder.glob("*.safetensors.index.json"):
        try:
            return int(json.loads(index.read_text())["metadata"]["total_size"])
        except (OSError, ValueError, KeyError, TypeError):
            break
    files = list(folder.glob("*.safetensors")) or list(folder.glob("pytorch_model*.bin"))
    return sum(f.stat().st_size for f in files) or None


def drafter_params(model: str | Path, train: dict) -> int | None:
    """The drafter's parameter count, roughly: per layer attention (4 h^2) and MLP (3 h i), plus
    the fc that projects the K target taps; the embedding and LM head are the target's."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    hidden = text.get("hidden_size")
    if not hidden:
        return None
    inner = train.get("intermediate_size") or text.get("intermediate_size") or 4 * hidden
    layers = train.get("num_layers") or 1
    taps = len(train.get("target_layer_ids") or ()) or layers
    return layers * (4 * hidden * hidden + 3 * hidden * inner) + taps * hidden * hidden


def verifier_head_bytes(model: str | Path) -> int:
    """Bytes of the target's embedding and LM head (vocab x hidden each, in the checkpoint's
    dtype; a tied head is written as a copy): what the speculators-format export carries."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    text = config.get("text_config") or config
    dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    element = 4 if "32" in dtype else 2
    return 2 * int(text.get("vocab_size") or 0) * int(text.get("hidden_size") or 0) * element


def job_memory_mb(config: dict, speculators_export: bool = False) -> dict[str, int]:
    """``mem_mb`` per rule of a validated config; ``speculators_export``: the export job also
    writes the speculators format (``dflash_pipeline.model.speculators_format.refusal`` of the
    drafter's layer types is None)."""
    floors = {rule: config["resources"]["mem_mb"][rule] for rule in MODEL_SIZED_RULES}
    model = config["target"]["model"]
    weights = checkpoint_bytes(model)
    params = drafter_params(model, config["train"])
    if weights is None:
        return floors
    target_mb = LOAD_FACTOR * weights / MB
    ranks = max(1, config["train"]["gpus_per_job"])
    on_cpu = config["train"]["gpus_per_job"] == 0
    loop_mb = target_mb * (2 if on_cpu else 1)  # the CPU loop runs fp32 (bf16 checkpoints)
    state_mb = (params or 0) * CHECKPOINT_BYTES_PER_PARAM / MB
    # The speculators-format export (a drafter the format expresses) reads the target's embedding
    # and LM head and holds them again while its file is written.
    speculators_mb = 2 * verifier_head_bytes(model) / MB if speculators_export else 0.0
    figures = {
        "generate": JOB_OVERHEAD_MB + target_mb,
        "extract": JOB_OVERHEAD_MB + target_mb,
        "train": ranks * (JOB_OVERHEAD_MB + target_mb) + state_mb,
        "export": JOB_OVERHEAD_MB + (params or 0) * (4 + 4) / MB + speculators_mb,
        "evaluate": JOB_OVERHEAD_MB + max(target_mb, loop_mb),
        # One segment's checkpoint in evaluate's loop: the same target, a drafter of its size.
        "segment_tau": JOB_OVERHEAD_MB + max(target_mb, loop_mb) + (params or 0) * 4 / MB,
    }
    return {rule: max(floors[rule], int(round(mb, -3))) for rule, mb in figures.items()}
