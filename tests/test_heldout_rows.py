"""Evaluate reads only held-out rows: tokenize writes each shard's held-out rows to an object of
their own, and the simulated tau picks the same rows from those objects as from whole shards."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA
from dflash_pipeline.evaluation.simulated import simulated_tau, split_rows
from dflash_pipeline.stages.tokenize import heldout_rows, tokenize_file
from tests.support.train_data import write_tokenized_shard
from tests.test_evaluate_cli import export_untrained_drafter
from tests.support.generated_rows import healthy


def test_tokenize_writes_the_shards_heldout_rows_on_their_own(demo_model, tmp_path):
    rows = [healthy(i) for i in range(30)]
    for row in rows[::4]:
        row["split"] = "heldout"
    generated = tmp_path / "generate-00003.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), generated)
    out, heldout = tmp_path / layout.shard_key("tokenize", 3), tmp_path / layout.heldout_key(3)
    tokenize_file(
        str(generated),
        str(demo_model),
        str(out),
        str(tmp_path / "stats.json"),
        True,
        {},
        workers=1,
        heldout_out=str(heldout),
    )
    assert heldout.name == "tokenize-00003.heldout.parquet"
    full, small = pq.read_table(out), pq.read_table(heldout)
    assert small.schema == full.schema
    assert small.num_rows == 8
    # Exactly the shard's held-out rows, in shard order.
    assert small.equals(full.filter(pc.equal(full["split"], "heldout")))


@pytest.fixture(scope="module")
def shards(demo_model, tmp_path_factory):
    """Three tokenized shards and their held-out objects, as the tokenize stage writes them."""
    root = tmp_path_factory.mktemp("heldout")
    full, small = [], []
    for shard, (count, every) in enumerate([(30, 4), (20, 3), (25, 5)]):
        path = write_tokenized_shard(
            demo_model, root / layout.shard_key("tokenize", shard), count, seed=shard, heldout_every=every
        )
        pq.write_table(heldout_rows(pq.read_table(path)), root / layout.heldout_key(shard))
        full.append(str(path))
        small.append(str(root / layout.heldout_key(shard)))
    return full, small


def test_the_heldout_objects_hold_the_rows_of_the_whole_shards_in_order(shards):
    full, small = shards
    assert list(split_rows(full)) == list(split_rows(small))
    assert len(list(split_rows(small))) == 8 + 7 + 5


@pytest.mark.parametrize("max_rows", [10, 64])  # within the first two shards / every row
def test_simulated_tau_selects_the_same_rows_from_the_heldout_objects(demo_model, shards, tmp_path, max_rows):
    full, small = shards
    drafter = export_untrained_drafter(demo_model, tmp_path / "drafter")
    # As before: the first max_rows held-out rows of the whole tokenized shards.
    before = simulated_tau(str(drafter), str(demo_model), full, max_rows=max_rows, device="cpu")
    # Now: the held-out objects alone (the whole shards are not there to be opened); a file is
    # opened only while rows are still needed, so a path after them is never touched.
    tail = [str(tmp_path / "never-opened.parquet")] if max_rows == 10 else []
    after = simulated_tau(
        str(drafter), str(demo_model), small[:2] + tail if tail else small, max_rows=max_rows, device="cpu"
    )
    assert after == before
    assert after["rows"] == min(max_rows, 20) and len(after["row_ids"]) == after["rows"]


def test_evaluate_plans_only_heldout_objects_as_its_inputs(workflow, demo_model):
    workflow.write_config(num_shards=3, target={"model": str(demo_model), "build_demo": False})
    out = workflow.snakemake("-n").stdout
    evaluate = re.search(r"rule evaluate:\n    input: (.*)\n", out)
    tokenize = re.findall(r"rule tokenize:\n    input: .*\n    output: (.*)\n", out)
    assert evaluate and tokenize, out
    inputs = evaluate.group(1).split(", ")
    assert [p.rsplit("/", 1)[-1] for p in inputs if "tokenize-" in p] == [
        f"tokenize-0000{i}.heldout.parquet" for i in range(3)
    ]
    assert all(any(p.endswith(".heldout.parquet") for p in outputs.split(", ")) for outputs in tokenize)
