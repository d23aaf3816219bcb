"""The target's weights digest (dflash_pipeline.model.target_identity): what it tells apart, what
it reads, and the check evaluate makes with it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_pipeline.model import target_identity
from dflash_pipeline.model.target_identity import (
    TargetMismatch,
    check_at_evaluate,
    recorded_in_safetensors,
    stored_target_weights,
    weights_digest,
)

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}


def tiny_target(folder: Path, seed: int = 0, dtype=torch.float32) -> Path:
    """A target folder: config.json and one safetensors file larger than the sampled windows
    (so the digest samples it rather than reading it all)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(512, 256, generator=generator).to(dtype),
        "model.norm.weight": torch.ones(256, dtype=dtype),
    }
    assert target_identity.SAMPLES * target_identity.WINDOW < 512 * 256 * 4
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def drafter_recording(folder: Path, digest: str | None) -> Path:
    """An exported drafter's weights file whose metadata records ``digest`` (none: not recorded)."""
    folder.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **({target_identity.KEY: digest} if digest else {})}
    save_file({"fc.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"), metadata=metadata)
    return folder / "model.safetensors"


def test_the_digest_is_the_same_for_the_same_weights_and_reads_no_config(tmp_path):
    first = tiny_target(tmp_path / "a")
    second = tiny_target(tmp_path / "b")
    (second / "config.json").write_text(json.dumps({**CONFIG, "note": "edited"}))
    assert weights_digest(first) == weights_digest(second)
    assert weights_digest(first).startswith(f"{target_identity.SCHEME}:")


def test_re_released_weights_under_the_same_config_change_the_digest(tmp_path):
    before = weights_digest(tiny_target(tmp_path / "t", seed=0))
    after = weights_digest(tiny_target(tmp_path / "t", seed=1))
    assert after != before


def test_a_quantized_copy_under_the_same_config_changes_the_digest(tmp_path):
    full = weights_digest(tiny_target(tmp_path / "full", dtype=torch.float32))
    half = weights_digest(tiny_target(tmp_path / "half", dtype=torch.bfloat16))
    assert half != full


def test_a_hub_cache_file_is_named_by_its_content_hash(tmp_path):
    """A link to blobs/<sha256> is the whole file's hash: two blobs of equal bytes but other
    names (other content in the hub's record) differ, at no read."""
    target = tiny_target(tmp_path / "plain")
    digests = []
    for name in ("a" * 64, "b" * 64):
        blobs, snapshot = tmp_path / name / "blobs", tmp_path / name / "snapshot"
        blobs.mkdir(parents=True)
        snapshot.mkdir()
        shutil.copyfile(target / "model.safetensors", blobs / name)
        (snapshot / "model.safetensors").symlink_to(blobs / name)
        digests.append(weights_digest(snapshot))
    assert digests[0] != digests[1]


def test_a_folder_without_weight_files_has_no_digest(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert weights_digest(tmp_path) is None
    assert weights_digest(tmp_path / "absent") is None


def test_evaluate_refuses_a_target_whose_weights_changed_under_the_same_config(tmp_path):
    target = tiny_target(tmp_path / "target", seed=0)
    drafter = drafter_recording(tmp_path / "drafter", weights_digest(target))
    assert check_at_evaluate(drafter, target)["match"] is True
    trained_against = weights_digest(target)
    config_before = (target / "config.json").read_bytes()
    tiny_target(target, seed=1)  # the same config.json, other weights
    assert (target / "config.json").read_bytes() == config_before
    with pytest.raises(TargetMismatch) as refused:
        check_at_evaluate(drafter, target, "refuse")
    line = str(refused.value)
    assert "\n" not in line
    assert trained_against in line and weights_digest(target) in line
    assert "evaluate.target_mismatch: refuse" in line


def test_warn_evaluates_a_mismatched_target_with_one_line(tmp_path, caplog):
    target = tiny_target(tmp_path / "target")
    drafter = drafter_recording(tmp_path / "drafter", weights_digest(tiny_target(tmp_path / "other", seed=1)))
    with caplog.at_level(logging.WARNING, logger=target_identity.__name__):
        record = check_at_evaluate(drafter, target, "warn")
    assert record == {
        "trained_against": weights_digest(tmp_path / "other"),
        "evaluated": weights_digest(target),
        "match": False,
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "evaluate.target_mismatch: warn" in warnings[0]


def test_a_drafter_exported_without_a_digest_is_compared_with_nothing(tmp_path):
    target = tiny_target(tmp_path / "target")
    drafter = drafter_recording(tmp_path / "drafter", None)
    assert recorded_in_safetensors(drafter) is None
    assert check_at_evaluate(drafter, target, "refuse") == {
        "trained_against": None,
        "evaluated": weights_digest(target),
        "match": None,
    }


def test_the_evaluate_job_refuses_before_it_loads_anything(tmp_path):
    """evaluate_job's first act is the check: nothing of the prompts, held-out rows or engine is
    read (they do not exist here)."""
    from dflash_pipeline.core.config import schema_defaults
    from dflash_pipeline.stages.evaluate import evaluate_job

    target = tiny_target(tmp_path / "target")
    drafter = drafter_recording(tmp_path / "drafter", f"{target_identity.SCHEME}:0000000000000000")
    with pytest.raises(TargetMismatch, match="evaluate.target_mismatch: refuse"):
        evaluate_job(
            str(target), str(drafter.parent / "config.json"), str(tmp_path / "none.parquet"), [],
            tmp_path / "metrics.json", {**schema_defaults("evaluate"), "target_mismatch": "refuse"}, False,
            tmp_path / "failed.json",
        )  # fmt: skip
    assert not (tmp_path / "metrics.json").exists()


def test_stored_taps_of_other_weights_are_refused_and_old_taps_stand_for_the_folder():
    a, b = f"{target_identity.SCHEME}:{'a' * 16}", f"{target_identity.SCHEME}:{'b' * 16}"
    with pytest.raises(TargetMismatch, match="shard 00000: .*shard 00001: "):
        stored_target_weights({"00000": {"target_weights": a}, "00001": {"target_weights": b}}, a)
    assert stored_target_weights({"00000": {"target_weights": b}, "00001": {}}, a) == b
    assert stored_target_weights({"00000": {}}, a) == a


def test_the_generated_shard_names_the_weights(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.stages.generate import with_target_weights

    target = tiny_target(tmp_path / "target")
    table = with_target_weights(pa.table({"x": [1]}), str(target))
    pq.write_table(table, tmp_path / "shard.parquet")
    metadata = pq.read_schema(tmp_path / "shard.parquet").metadata
    assert metadata[b"target_weights"].decode() == weights_digest(target)
