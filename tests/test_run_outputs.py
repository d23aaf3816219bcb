"""The table of what a run produces (``report.targets.run_outputs``), held to the rules: a dry run of
the workflow (``snakemake --summary``, which lists every output file of the DAG with its rule)
declares exactly the objects the table lists, rule by rule; and verify expects of a finished run
exactly the declared outputs that carry a checksum record. The table is never compared with itself.
"""

from __future__ import annotations

import pytest
import yaml

from dflash_pipeline.core import layout
from dflash_pipeline.core.checksums import is_checked_key
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.model import speculators_format
from dflash_pipeline.report import targets
from dflash_pipeline.stages import verify
from tests.conftest import copy_workflow

# Variations of the demo config, each a path through the rules: the demo as it ships (online, a
# drafter the speculators format expresses, so the export writes it, and each segment's τ);
# offline with its extract shards, a tuned engine, a drafter mixing sliding and full layers (no
# speculators export) and no segment measured (train.segment_eval off);
# a run that stops after tokenize, with more shards.
VARIANTS = {
    "demo": {},
    "offline-tuned-mixed-layers": {
        "train": {
            "mode": "offline",
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 16,
            "segment_eval": {"enabled": False},
        },
        "tune": {"enabled": True},
    },
    "until-tokenize": {"until": "tokenize", "num_shards": 3},
}


def declared_outputs(tmp_path, overrides: dict) -> tuple[dict, set[tuple[str, str]]]:
    """The validated config of a demo workflow with ``overrides``, and (rule, run-root key) of
    every output its dry run declares inside the run root."""
    workflow = copy_workflow(tmp_path / "wf")
    path = workflow.write_config(**overrides)
    config = validate_config(yaml.safe_load(path.read_text()))
    root = layout.run_root(config["results_dir"], config["run"]) + "/"
    proc = workflow.snakemake("--summary")
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("output_file\t")))
    declared = set()
    for line in lines[header + 1 :]:
        output, _date, rule, *_ = line.split("\t")
        if output.startswith(root):
            declared.add((rule, output.removeprefix(root)))
    return config, declared


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_run_outputs_table_is_what_the_rules_declare(tmp_path, variant):
    config, declared = declared_outputs(tmp_path, VARIANTS[variant])
    table = targets.run_outputs(config)
    listed = {(rule, key) for rule, keys in table.items() for key in keys}
    assert listed == declared
    # Each object once: a rule's list holds no key twice, and no two rules list one key.
    assert sum(map(len, table.values())) == len({key for _, key in listed})
    # verify expects exactly the declared outputs that carry a checksum record: the speculators
    # export included where the export writes it.
    expected = verify.expected_keys(config)
    assert set(expected) == {key for _, key in declared if is_checked_key(key)}
    assert len(expected) == len(set(expected))
    speculators = {speculators_format.RUN_CONFIG, speculators_format.RUN_WEIGHTS}
    exported = {key for rule, key in declared if rule == "export"}
    assert (speculators <= exported) == (variant == "demo")
    measured = {key for rule, key in declared if rule == "segment_tau"}
    assert measured == ({layout.segment_tau_key(0), layout.segment_tau_key(1)} if variant == "demo" else set())
