"""A stage given another stage's shard refuses it in one line naming the file, what it is and
what the stage reads (``dflash_pipeline.data.shard_kinds``), before any model or engine loads."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.data.shard_kinds import MARKERS, ShardKindError, require_file_kind, shard_kind
from dflash_pipeline.data.tokenized import TOKENIZED_SCHEMA
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA
from dflash_pipeline.stages.prepare import PROMPT_SCHEMA

SCHEMAS = {"prepare": PROMPT_SCHEMA, "generate": GENERATED_SCHEMA, "tokenize": TOKENIZED_SCHEMA}


def shard(tmp_path, stage: str) -> str:
    path = tmp_path / f"{stage}-00000.parquet"
    pq.write_table(SCHEMAS[stage].empty_table(), path)
    return str(path)


def test_the_markers_are_the_writers_columns_and_no_other_stages():
    for stage, schema in SCHEMAS.items():
        assert set(MARKERS[stage]) <= set(schema.names), stage
        assert shard_kind(schema.names) == stage
        for other, other_schema in SCHEMAS.items():
            if other != stage:
                assert not set(MARKERS[stage]) & set(other_schema.names), (stage, other)
    assert shard_kind(["id", "text"]) is None


def test_require_file_kind_names_the_file_its_stage_and_the_reader(tmp_path):
    require_file_kind(shard(tmp_path, "generate"), "generate", "tokenize")
    path = shard(tmp_path, "prepare")
    with pytest.raises(ShardKindError) as err:
        require_file_kind(path, "generate", "tokenize")
    assert str(err.value) == (
        f"{path}: a prepare shard (columns id, shard, split, messages, source), tokenize reads generate shards"
    )
    other = tmp_path / "other.parquet"
    pq.write_table(pq.read_table(path).select(["id"]), other)
    with pytest.raises(ShardKindError, match=r"other.parquet: not a shard of any stage \(columns id\), tokenize"):
        require_file_kind(str(other), "generate", "tokenize")


def test_tokenize_given_a_prepare_shard_fails_before_the_tokenizer_loads(tmp_path):
    from dflash_pipeline.stages.tokenize import tokenize_file

    path = shard(tmp_path, "prepare")
    with pytest.raises(ShardKindError, match="tokenize reads generate shards") as err:
        # No such model folder: the check must come first.
        tokenize_file(path, str(tmp_path / "no-model"), str(tmp_path / "t.parquet"), str(tmp_path / "s"), True, {})
    assert "\n" not in str(err.value)


def test_generate_given_a_tokenize_shard_fails_before_any_engine(tmp_path):
    from dflash_pipeline.stages.generate import run_job

    path = shard(tmp_path, "tokenize")
    (tmp_path / "run").mkdir()
    with pytest.raises(ShardKindError, match=r"a tokenize shard \(columns .*\), generate reads prepare shards"):
        run_job(
            path, str(tmp_path / "g.parquet"), str(tmp_path / "run"), 0, str(tmp_path / "no-model"), {}, "e.log", "."
        )


def test_training_data_given_a_generate_shard_names_it(tmp_path):
    from dflash_pipeline.training.data import TrainingDataError, local_arrow_copy

    path = shard(tmp_path, "generate")
    with pytest.raises(TrainingDataError, match=r"a generate shard \(columns .*\), train reads tokenize shards"):
        local_arrow_copy(path, tmp_path / "cache")
