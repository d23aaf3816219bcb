"""What offline mode would store, and the refusals: above ``train.offline_max_bytes``, and float32
storage of taps the target computes in bfloat16 (``stored_dtype_problem``).

Offline training reads the target's taps from the hidden-state shards of rule ``extract``, and
every rank of every training job downloads all of them to its local temp folder
(``dflash_pipeline.data.hidden``). That is fine for the demo and ruinous at scale (the 27B example:
~3B tokens x 50 KiB per token), so the run refuses offline mode above the limit, once when
Snakemake plans it (``rules/run_control.smk``) and again when a training job starts, with what online
mode would cost instead. The estimate is

    bytes = taps K x target hidden H x bytes per element x training tokens

with K the tapped layers (``train.target_layer_ids``, else one per drafter layer), H from the
target's ``config.json``, and the tokens, best source first: the tokenized shards' stats
(``tokens_total``; a sample of them when there are many, so that planning a big run does not read
thousands of objects), the ingest summary's prompt count, or the local dataset files' row count,
each prompt counted at the config's expected length min(``tokenize.max_length``,
``generation.max_new_tokens``). Nothing here imports torch: the Snakefile runs it while planning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import Storage, StorageError, open_storage
from dflash_pipeline.model.config import default_target_layer_ids
from dflash_pipeline.model.target import target_compute_dtype

HIDDEN_DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
STATS_SAMPLE = 64  # tokenized shards' stats read at most, evenly spread over the shards

# Online mode's price, measured on one H200 for the 27B example (27B target, S=4096, 5-layer
# drafter): bench/results/train_step-h200.json, cases qwen3.6-27b "online" and "drafter".
ONLINE_REFERENCE = {
    "source": "bench/results/train_step-h200.json (qwen3.6-27b, one H200)",
    "online_step_s": 0.724,
    "stored_taps_step_s": 0.277,
    "target_tokens_per_s": 9134.3,
}


class OfflineBudgetError(ValueError):
    """Offline mode would store more hidden-state bytes than ``train.offline_max_bytes``."""


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    num_layers: int


def read_target_shape(model_dir: str | Path) -> TargetShape | None:
    """Hidden size and layer count from the target's ``config.json`` (its ``text_config`` for
    multimodal wrappers); None while the folder does not exist yet (the demo target is built by a
    rule)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    text = config.get("text_config") or config
    try:
        return TargetShape(int(text["hidden_size"]), int(text["num_hidden_layers"]))
    except KeyError as err:
        raise OfflineBudgetError(f"{path}: no {err.args[0]} (needed to size offline hidden states)") from None


def tap_count(train: dict, target: TargetShape) -> int:
    if train.get("target_layer_ids"):
        return len(train["target_layer_ids"])
    return len(default_target_layer_ids(target.num_layers, train["num_layers"]))


def hidden_bytes_per_token(train: dict, hidden_size: int) -> int:
    """Stored bytes per training token of offline mode: one tap per target layer the drafter
    reads (by default one per drafter layer), ``hidden_size`` values of ``hidden_dtype`` each."""
    taps = len(train.get("target_layer_ids") or [None] * train["num_layers"])
    return taps * hidden_size * HIDDEN_DTYPE_BYTES[train["hidden_dtype"]]


def expected_tokens_per_sample(config: dict) -> int:
    return min(config["tokenize"]["max_length"], config["generation"]["max_new_tokens"])


@dataclass(frozen=True)
class TokenCount:
    tokens: int
    sequences: int
    source: str


def tokens_from_stats(stats: list[dict], num_shards: int, source: str) -> TokenCount:
    """Tokens of the run from the stats of some (or all) of its tokenized shards."""
    tokens = sum(int(s["tokens_total"]) for s in stats)
    sequences = sum(int(s.get("sequences_out", 0)) for s in stats)
    if len(stats) == num_shards:
        return TokenCount(tokens, sequences, f"the {num_shards} tokenized shards' stats ({source})")
    scale = num_shards / len(stats)
    return TokenCount(
        round(tokens * scale),
        round(sequences * scale),
        f"{len(stats)} of {num_shards} tokenized shards' stats ({source}), scaled to all shards",
    )


def tokens_from_samples(samples: int, config: dict, source: str) -> TokenCount:
    per_sample = expected_tokens_per_sample(config)
    train_samples = round(samples * (1 - config["dataset"]["heldout_fraction"]))
    return TokenCount(
        train_samples * per_sample,
        train_samples,
        f"{train_samples:,} training prompts ({source}) x {per_sample:,} tokens each "
        "(the config's expected length: min of tokenize.max_length and generation.max_new_tokens)",
    )


def read_stats_sample(storage: Storage, num_shards: int, limit: int = STATS_SAMPLE) -> list[dict]:
    """The stats of up to ``limit`` tokenized shards that exist, evenly spread (one listing)."""
    present = {o.key for o in storage.list(f"{layout.OUTPUTS_DIR}/tokenize-") if o.key.endswith(".stats.json")}
    keys = [layout.shard_key("tokenize", s, "stats.json") for s in range(num_shards)]
    keys = [k for k in keys if k in present]
    if len(keys) > limit:
        keys = [keys[round(i * (len(keys) - 1) / (limit - 1))] for i in range(limit)]
    stats = []
    for key in keys:
        try:
            stats.append(json.loads(storage.read_text(key)))
        except (StorageError, json.JSONDecodeError, KeyError) as err:
            raise OfflineBudgetError(f"{storage.join(key)}: unreadable tokenize stats ({err})") from None
    return stats


def count_local_rows(paths: list[str]) -> int | None:
    """Rows of local .jsonl/.parquet dataset files; None if any is remote or missing (then the
    count waits for the ingest summary)."""
    total = 0
    for path in paths:
        p = Path(path)
        if path.startswith("s3://") or not p.is_file():
            return None
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(p).metadata.num_rows
        else:
            with open(p, "rb") as fh:
                total += sum(1 for line in fh if line.strip())
    return total


def count_tokens(config: dict, storage: Storage) -> TokenCount | None:
    """The run's training tokens from the best source available now (module docstring)."""
    stats = read_stats_sample(storage, config["num_shards"])
    if stats:
        return tokens_from_stats(stats, config["num_shards"], storage.join(layout.OUTPUTS_DIR))
    if storage.exists(layout.INGEST_SUMMARY):
        summary = json.loads(storage.read_text(layout.INGEST_SUMMARY))
        return tokens_from_samples(int(summary["samples"]), config, storage.join(layout.INGEST_SUMMARY))
    rows = count_local_rows(config["dataset"]["paths"])
    if rows is not None:
        return tokens_from_samples(rows, config, "rows of dataset.paths")
    return None


@dataclass(frozen=True)
class OfflineEstimate:
    taps: int
    hidden_size: int
    element_bytes: int
    count: TokenCount

    @property
    def bytes_per_token(self) -> int:
        return self.taps * self.hidden_size * self.element_bytes

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.count.tokens


def estimate(config: dict, target: TargetShape, count: TokenCount) -> OfflineEstimate:
    train = config["train"]
    return OfflineEstimate(
        taps=tap_count(train, target),
        hidden_size=target.hidden_size,
        element_bytes=HIDDEN_DTYPE_BYTES[train["hidden_dtype"]],
        count=count,
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def trained_tokens(train: dict, mean_length: float, ranks: int | None = None) -> int:
    """Tokens the schedule trains on: segments x steps x sequences per step x mean length."""
    ranks = max(1, train["gpus_per_job"]) if ranks is None else ranks
    return round(train["segments"] * train["steps_per_segment"] * train["batch_size"] * ranks * mean_length)


def refusal_message(train: dict, total_bytes: int, how: str, trained: int) -> str:
    """Why offline mode is refused and what online mode would cost instead."""
    ranks = max(1, train["gpus_per_job"])
    ref = ONLINE_REFERENCE
    online_hours = trained / ref["target_tokens_per_s"] / 3600
    return (
        f"train.mode offline would store {human_bytes(total_bytes)} of hidden states, above "
        f"train.offline_max_bytes ({human_bytes(train['offline_max_bytes'])}): {how}. Every rank "
        f"of a training job downloads all of it to its local temp folder ({ranks} x "
        f"{human_bytes(total_bytes)} per job, every segment).\n"
        f"Online mode (train.mode: online) stores no hidden states: it runs the target's forward "
        f"on each training batch instead. Measured for the 27B case on one H200 that is "
        f"{ref['online_step_s']} s per step instead of {ref['stored_taps_step_s']} s "
        f"({ref['online_step_s'] / ref['stored_taps_step_s']:.1f}x; {ref['source']}); for the "
        f"{trained:,} tokens this schedule trains on (segments x steps_per_segment x batch_size x "
        f"GPUs x mean sequence length) the target's forward adds ~{online_hours:,.0f} GPU-hours at "
        f"its measured {ref['target_tokens_per_s']:,.0f} tokens/s (scale with the target's size).\n"
        f"Use train.mode: online, or raise train.offline_max_bytes (null: no limit) if the "
        f"storage and every rank's local disk can hold it."
    )


def check_offline_budget(config: dict, target: TargetShape, count: TokenCount) -> OfflineEstimate:
    """The plan-time check: the estimate; OfflineBudgetError above ``train.offline_max_bytes``."""
    est = estimate(config, target, count)
    train = config["train"]
    limit = train["offline_max_bytes"]
    if limit is not None and est.total_bytes > limit:
        how = (
            f"{est.taps} taps x hidden {est.hidden_size} x {est.element_bytes} bytes "
            f"({train['hidden_dtype']}) = {human_bytes(est.bytes_per_token)} per token x "
            f"{est.count.tokens:,} tokens ({est.count.source})"
        )
        mean = count.tokens / count.sequences if count.sequences else expected_tokens_per_sample(config)
        raise OfflineBudgetError(refusal_message(train, est.total_bytes, how, trained_tokens(train, mean)))
    return est


def check_offline_run(config: dict, run_url: str) -> OfflineEstimate | None:
    """The plan-time check of a run that extracts taps (``layout.stages_built``: offline, up to
    train or evaluate); None when it cannot be sized yet (no target config.json, or no token
    count) or the run extracts none. The run root at ``run_url`` is opened only to count tokens."""
    if "extract" not in layout.stages_built(config):
        return None
    target = read_target_shape(config["target"]["model"])
    count = count_tokens(config, open_storage(run_url)) if target else None
    if target is None or count is None:
        return None
    return check_offline_budget(config, target, count)


def stored_dtype_problem(hidden_dtype: str, device: str) -> str | None:
    """Why ``train.hidden_dtype`` is refused for taps extracted on ``device``; None when it is
    not. The target computes in ``target_compute_dtype(device)``, so on a GPU every tap is a
    bf16 value: float32 storage would hold the same values in twice the bytes."""
    compute = target_compute_dtype(device)
    if hidden_dtype != "float32" or compute == "float32":
        return None
    return (
        f"train.hidden_dtype: float32 would store taps that extract computes in {compute} on "
        f"{device} (the target's dtype there, as in online training): the same values in twice "
        f"the bytes of bfloat16. Set train.hidden_dtype: bfloat16 (or float8_e4m3fn), or "
        f"train.gpus_per_job: 0 to extract and train on CPU, where the target computes in float32."
    )


def extract_device(train: dict) -> str:
    """The device type rule ``extract`` runs the target on: a GPU when ``train.gpus_per_job`` > 0."""
    return "cuda" if train["gpus_per_job"] > 0 else "cpu"


def check_stored(train: dict, manifests: dict[str, dict], ranks: int) -> int:
    """The train-start check: the stored hidden-state bytes, exactly, from the extract shards'
    manifests (``size``, ``tokens``, ``rows``); OfflineBudgetError above the limit, before any
    rank downloads them. Returns the bytes."""
    total = sum(int(m["size"]) for m in manifests.values())
    limit = train["offline_max_bytes"]
    if limit is not None and total > limit:
        tokens = sum(int(m["tokens"]) for m in manifests.values())
        rows = sum(int(m["rows"]) for m in manifests.values())
        width = next(iter(manifests.values()))["width"]
        how = (
            f"the {len(manifests)} extract shards' manifests: {tokens:,} tokens x {width:,} "
            f"values (taps x hidden) in {train['hidden_dtype']}"
        )
        raise OfflineBudgetError(
            refusal_message(train, total, how, trained_tokens(train, tokens / max(1, rows), ranks))
        )
    return total
