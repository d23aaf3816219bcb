"""The run plan (python -m dflash_pipeline.stages.plan): figures from the config, the benchmark
results and what a run root already holds; the CLI on the 27B example config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import ConfigError, layered_config, load_run_config, load_schema, validate_config
from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.core.bench_records import (
    IN_PROCESS_FP8,
    OFFLINE,
    pick_capture_benchmark,
    pick_train_benchmark,
    read_capture_benchmarks,
    training_options,
)
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.stages.plan import (
    Measured,
    PlanError,
    count_dataset_rows,
    format_plan,
    make_plan,
    measure_run,
    model_case,
)

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "config/examples/qwen3.6-27b.yaml"


def seeds_config(**plan):
    config = load_run_config([EXAMPLE])
    config["plan"].update(plan)
    return config


BENCH = [
    {
        "case": "qwen3.6-27b",
        "mode": "online",
        "seq_len": 4096,
        "tokens_per_s": 5657.4,
        "drafter_params": 1730213120,
        "file": "train_step-h200.json",
        "device": "NVIDIA H200",
    },
    {"case": "qwen3.6-27b", "mode": "online", "seq_len": 1024, "tokens_per_s": 9999.0, "file": "x", "device": "x"},
    {"case": "qwen3.6-27b", "mode": "drafter", "seq_len": 4096, "tokens_per_s": 14787.3, "file": "x", "device": "x"},
    {"case": "qwen3-8b", "mode": "online", "seq_len": 4096, "tokens_per_s": 11559.2, "file": "x", "device": "x"},
]


def test_benchmark_pick_matches_target_mode_and_context():
    assert model_case("/models/Qwen3.6-27B/") == "qwen3.6-27b"
    assert pick_train_benchmark(BENCH, "qwen3.6-27b", "online", 4096)["tokens_per_s"] == 5657.4
    assert pick_train_benchmark(BENCH, "qwen3.6-27b", "offline", 4096)["tokens_per_s"] == 14787.3
    assert pick_train_benchmark(BENCH, "llama", "online", 4096) is None  # never another model's


def test_benchmark_pick_takes_the_configs_algorithm_and_averages_files_of_one_context():
    dflash2 = {
        "case": "qwen3.6-27b",
        "mode": "online",
        "seq_len": 4096,
        "tokens_per_s": 5043.1,
        "algorithm": "dflash2",
        "file": "train_step-dflash2-h200.json",
        "device": "NVIDIA H200",
    }
    again = {**dflash2, "algorithm": "dflash", "tokens_per_s": 5576.6}  # DFlash, measured beside it
    records = [*BENCH, dflash2, again]
    picked = pick_train_benchmark(records, "qwen3.6-27b", "online", 4096, "dflash2")
    assert picked["tokens_per_s"] == 5043.1 and picked["file"] == "train_step-dflash2-h200.json"
    picked = pick_train_benchmark(records, "qwen3.6-27b", "online", 4096)
    assert picked["tokens_per_s"] == round((5657.4 + 5576.6) / 2, 1)
    assert picked["file"] == "train_step-dflash2-h200.json, train_step-h200.json"
    # Another card's record of the same context joins the average, and the source names both cards.
    h100 = {**again, "tokens_per_s": 5000.0, "file": "train_step-h100.json", "device": "NVIDIA H100 80GB HBM3"}
    picked = pick_train_benchmark([*records, h100], "qwen3.6-27b", "online", 4096)
    assert picked["device"] == "NVIDIA H100 80GB HBM3, NVIDIA H200"


FP8_ONLINE = {
    "case": "qwen3.6-27b",
    "mode": "online",
    "seq_len": 4096,
    "tokens_per_s": 4360.1,
    "peak_gib": 63.18,
    "target_quantization": "fp8",
    "file": "train_step-fp8-h100.json",
    "device": "NVIDIA H100 80GB HBM3",
}


def test_the_online_step_is_the_record_of_the_targets_quantization():
    """An FP8 target's online step is another cost on other cards: a bf16 run is never priced
    from it, nor an FP8 run from the bf16 record; the drafter step alone is the same for both."""
    records = [*BENCH, FP8_ONLINE]
    assert pick_train_benchmark(records, "qwen3.6-27b", "online", 4096)["tokens_per_s"] == 5657.4
    fp8 = pick_train_benchmark(records, "qwen3.6-27b", "online", 4096, quantization="fp8")
    assert fp8["tokens_per_s"] == 4360.1 and fp8["file"] == "train_step-fp8-h100.json"
    assert pick_train_benchmark(BENCH, "qwen3.6-27b", "online", 4096, quantization="fp8") is None
    drafter = pick_train_benchmark(records, "qwen3.6-27b", "offline", 4096, quantization="fp8")
    assert drafter["tokens_per_s"] == 14787.3


def test_the_newest_capture_record_of_a_target_replaces_the_older_engines(tmp_path):
    for name, date, rate in (
        ("engine_taps-old.json", "2026-12-06", 18000.0),
        ("engine_taps-new.json", "2026-12-07", 30000.0),
    ):
        (tmp_path / name).write_text(
            json.dumps({"device": "H100", "date": date, "cases": [{"case": "qwen3-8b", "capture_tokens_per_s": rate}]})
        )
    picked = pick_capture_benchmark(read_capture_benchmarks(tmp_path), "qwen3-8b")
    assert picked["capture_tokens_per_s"] == 30000.0 and picked["file"] == "engine_taps-new.json"


def test_the_plan_prices_each_way_to_train_the_target_from_its_records():
    """In-process (bf16 and FP8), engine-fed and offline, each at its measured rate with its
    records named; a way without a record says so; offline also stores the taps."""
    captures = [
        {"case": "qwen3.6-27b", "capture_tokens_per_s": 2000.0, "file": "engine_taps-h100.json", "device": "H100"}
    ]
    options = training_options([*BENCH, FP8_ONLINE], captures, "qwen3.6-27b", 4096, "dflash")
    rates = {option["option"]: option["tokens_per_s_per_gpu"] for option in options}
    assert rates[IN_PROCESS_FP8] == 4360.1
    assert rates[OFFLINE] == round(1 / (1 / 14787.3 + 1 / 2000.0), 1)
    config = seeds_config()
    plan = make_plan(config, Measured(bench_train=BENCH[0], training_options=options), gpus=8)
    priced = {option["option"]: option for option in plan["training_options"]}
    epoch = plan["train"]["epoch_tokens"]
    assert priced[IN_PROCESS_FP8]["gpu_hours_per_epoch"] == pytest.approx(epoch / 4360.1 / 3600)
    assert priced[OFFLINE]["stored_bytes"] == plan["hidden_bytes_per_token"] * epoch
    text = format_plan(plan)
    assert "FP8 (train.target_quantization: fp8): 4,360 tok/s per GPU, peak 63.18 GiB" in text
    assert "train_step-fp8-h100.json on NVIDIA H100 80GB HBM3" in text
    unmeasured = training_options(BENCH, [], "qwen3.6-27b", 4096, "dflash")
    assert [o["source"] for o in unmeasured if o["option"] == IN_PROCESS_FP8] == ["not measured"]


def test_with_taps_from_an_engine_the_plan_trains_at_the_drafter_step_plus_the_engines_forward(tmp_path):
    """train.taps_from engine: the trainer steps the drafter alone and the taps server runs on
    the same GPUs, so a GPU's time per token is the drafter step's plus its share of the engine's
    forward; the figures come from train_step's drafter row and engine_taps' capture rate of the
    same target, both named. Without an engine_taps record: the in-process rate, said so."""
    assert pick_train_benchmark(BENCH, "qwen3.6-27b", "online", 4096, taps_from="engine")["tokens_per_s"] == 14787.3
    (tmp_path / "engine_taps-h100.json").write_text(
        json.dumps({
            "device": "NVIDIA H100 80GB HBM3",
            "cases": [
                {"case": "qwen3.6-27b", "seq_len": 4096, "capture_tokens_per_s": 20000.0},
                {"case": "qwen3-8b", "seq_len": 3072, "error": "EngineError: the server died"},
            ],
        })
    )  # fmt: skip
    captures = read_capture_benchmarks(tmp_path)
    assert pick_capture_benchmark(captures, "qwen3-8b") is None  # a failed case says nothing
    capture = pick_capture_benchmark(captures, "qwen3.6-27b")
    config = seeds_config()
    config["train"]["taps_from"] = "engine"
    drafter = pick_train_benchmark(BENCH, "qwen3.6-27b", "online", 4096, taps_from="engine")
    fed = make_plan(config, Measured(bench_train=BENCH[0], bench_drafter=drafter, bench_capture=capture), gpus=8)
    rate = fed["train"]["tokens_per_s_per_gpu"]
    assert rate["value"] == pytest.approx(1 / (1 / 14787.3 + 1 / 20000.0))
    assert "engine_taps-h100.json" in rate["source"] and "drafter step" in rate["source"]
    alone = make_plan(config, Measured(bench_train=BENCH[0], bench_drafter=drafter), gpus=8)
    assert alone["train"]["tokens_per_s_per_gpu"]["value"] == 5657.4
    assert "no engine_taps record" in alone["train"]["tokens_per_s_per_gpu"]["source"]


def test_seeds_case_from_config_and_benchmark():
    config = seeds_config()
    plan = make_plan(config, Measured(bench_train=BENCH[0]), gpus=8)
    rows = round(902000 * (1 - config["dataset"]["heldout_fraction"]))
    assert plan["prompts"]["value"] == 902000 and plan["train_rows"] == rows
    assert plan["generated_tokens"] == 902000 * 3000
    seq = 200 + 3000
    assert plan["train"]["epoch_tokens"] == rows * seq
    # ~140 GPU-hours per epoch of online training at ~5.7k tok/s per H200.
    assert plan["train"]["gpu_hours_per_epoch"] == pytest.approx(rows * seq / 5657.4 / 3600)
    assert 130 < plan["train"]["gpu_hours_per_epoch"] < 150
    assert plan["generation"]["gpu_hours"] == pytest.approx(902000 * 3000 / 3000 / 3600)
    # Hidden states: 5 taps x 5120 x 2 bytes per token; online mode stores none.
    assert plan["hidden_bytes_per_token"] == 5 * 5120 * 2
    assert plan["bytes"]["extract"]["value"] == 0
    assert "offline would store" in plan["bytes"]["extract"]["source"]
    # 8 GPUs: 8 one-GPU generate jobs at once; training on its 8-GPU job.
    assert plan["wall"]["generate_h"] == pytest.approx(plan["generation"]["gpu_hours"] / 8)
    assert plan["wall"]["train_h"] == pytest.approx(plan["train"]["gpu_hours"] / 8)
    assert plan["train"]["steps"] == 20 * 2000 and plan["train"]["sequences"] == 40000 * 8
    assert make_plan(config, Measured(bench_train=BENCH[0]), gpus=16)["wall"]["generate_h"] == pytest.approx(
        plan["wall"]["generate_h"] / 2
    )


def test_offline_mode_counts_the_hidden_state_bytes():
    config = seeds_config()
    config["train"]["mode"] = "offline"
    plan = make_plan(config, Measured(), gpus=8)
    assert plan["bytes"]["extract"]["value"] == plan["train"]["epoch_tokens"] * 5 * 5120 * 2
    assert plan["train"]["gpu_hours"] is None  # no drafter benchmark given: unknown, not guessed


def test_measured_figures_replace_the_assumptions(tmp_path):
    config = seeds_config()
    run = open_storage(tmp_path / "run")
    run.write_text(layout.INGEST_SUMMARY, json.dumps({"samples": 1000, "heldout_samples": 10}))
    for shard, size in ((0, 300), (1, 500)):
        run.write_bytes(layout.shard_key("generate", shard), b"g" * size)
        ShardProgress(run, "generate", shard).write_telemetry(
            {
                "state": "done",
                "samples_done": 100,
                "samples_resumed": 0,
                "tokens_generated": 250_000,
                "elapsed_s": 100.0,
            }
        )
    ShardProgress(run, "generate", 2).write_telemetry(  # still running: not a measurement
        {"state": "running", "samples_done": 5, "tokens_generated": 9, "elapsed_s": 1.0}
    )
    run.write_text(layout.train_progress_prefix(0) + "telemetry.json", json.dumps({"tokens_per_s": 40000.0}))
    measured = measure_run(str(tmp_path / "run"), config)
    plan = make_plan(config, measured, gpus=8)
    assert plan["prompts"] == {"value": 1000, "source": "the run's ingest summary"}
    assert plan["train_rows"] == 990
    assert plan["mean_response_tokens"]["value"] == 2500  # 500k tokens / 200 samples
    assert plan["generation"]["tokens_per_s_per_gpu"]["value"] == 2500  # per GPU-second
    assert plan["train"]["tokens_per_s_per_gpu"]["value"] == 5000  # 40k over the job's 8 GPUs
    assert plan["bytes"]["generate"]["value"] == 400 * config["num_shards"]
    assert "2 finished shards" in plan["bytes"]["generate"]["source"]


def test_a_tune_result_replaces_the_assumed_generation_rate_until_shards_have_finished(tmp_path):
    from dflash_pipeline.engines.tuning import RESULT_SCHEMA, tune_defining, tune_key

    config = seeds_config(generation_tokens_per_s_per_gpu=3000)
    run = open_storage(tmp_path / "run")
    result = {
        "schema": RESULT_SCHEMA, "key": tune_key(tune_defining(config)), "engine": config["generation"]["engine"],
        "engine_version": "0.5.17", "device": "1 x NVIDIA H200", "created_utc": "2026-12-05T10:00:00Z",
        "choice": {"concurrency": 128, "mtp": True, "speculative": {"algorithm": "NEXTN"},
                   "tokens_per_s_per_gpu": 4321.0, "why": "the best throughput within the bounds"},
    }  # fmt: skip
    run.write_text(layout.TUNE_RESULT, json.dumps(result))
    rate = make_plan(config, measure_run(str(tmp_path / "run"), config), gpus=8)["generation"]["tokens_per_s_per_gpu"]
    assert rate == {
        "value": 4321.0,
        "source": f"measured by tune: {config['generation']['engine']} 0.5.17 at concurrency 128, MTP "
        "on 1 x NVIDIA H200, 2026-12-05",
    }
    # Measured for other settings: the assumption again.
    other = seeds_config(generation_tokens_per_s_per_gpu=3000)
    other["generation"]["max_new_tokens"] += 1
    rate = make_plan(other, measure_run(str(tmp_path / "run"), other), gpus=8)["generation"]["tokens_per_s_per_gpu"]
    assert rate["value"] == 3000 and "assumed" in rate["source"]


def test_missing_prompt_count_is_a_clear_error():
    config = seeds_config(prompts=None)
    with pytest.raises(PlanError, match="plan.prompts"):
        make_plan(config, Measured(), gpus=8)


# --- the config: what Snakemake sees ------------------------------------------------------------


def write_yaml(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_configfile_is_a_complete_config_not_layered_over_config_yaml(tmp_path):
    """The Snakefile reads config.yaml only without --configfile: a given file's missing keys
    take the schema's defaults, never the demo's."""
    mine = write_yaml(tmp_path / "mine.yaml", {"run": "mine", "tokenize": {"max_length": 2048}})
    config = load_run_config([mine])
    assert config == validate_config({"run": "mine", "tokenize": {"max_length": 2048}})
    schema = load_schema()["properties"]
    demo = yaml.safe_load((REPO / "config.yaml").read_text())
    # Keys the demo sets to other values than the schema's defaults: the schema's here.
    assert demo["train"]["intermediate_size"] != schema["train"]["properties"]["intermediate_size"]["default"]
    assert config["train"]["intermediate_size"] == schema["train"]["properties"]["intermediate_size"]["default"]
    default_tokens = schema["generation"]["properties"]["max_new_tokens"]["default"]
    assert config["generation"]["max_new_tokens"] == default_tokens != demo["generation"]["max_new_tokens"]
    # Without --configfile: config.yaml, as a plain `snakemake` run reads it.
    assert layered_config(None) == yaml.safe_load((REPO / "config.yaml").read_text())
    assert load_run_config(None)["run"] == "demo"
    # A single path is the list of that one path.
    assert load_run_config(mine) == config


def test_several_configfiles_are_layered_by_snakemakes_own_update(tmp_path):
    from snakemake.settings.types import ConfigSettings

    base = write_yaml(
        tmp_path / "a.yaml",
        {
            "run": "a",
            "num_shards": 4,
            "generation": {"max_new_tokens": 64, "sampling": {"temperature": 0.6, "top_p": 0.9}},
            "dataset": {"paths": ["x.jsonl", "y.jsonl"]},
        },
    )
    over = write_yaml(
        tmp_path / "b.yaml",
        {
            "generation": {"sampling": {"temperature": 0}},
            "dataset": {"paths": ["z.jsonl"]},
            "plan": {"prompts": 5},
        },
    )
    layered = layered_config([base, over])
    assert layered == {
        "run": "a",
        "num_shards": 4,
        "generation": {"max_new_tokens": 64, "sampling": {"temperature": 0, "top_p": 0.9}},  # nested: merged
        "dataset": {"paths": ["z.jsonl"]},  # lists: replaced
        "plan": {"prompts": 5},
    }
    # What `snakemake --configfile a.yaml b.yaml` builds (snakemake.settings.types.ConfigSettings).
    assert layered == ConfigSettings(configfiles=[base, over]).overwrite_config
    assert layered_config([over, base])["generation"]["sampling"]["temperature"] == 0.6  # order matters
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        layered_config([base, tmp_path / "nope.yaml"])
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml"):
        layered_config([tmp_path / "list.yaml"])


CONFIG_DUMP = """\
# Test only: what Snakemake has in `config` when rules/common.smk validates it, and that
# validation, dumped; then the parse stops (nothing after this needs to run).
import json as _json
import os as _os

from dflash_pipeline.core.config import validate_config as _validate

with open(_os.environ["DFLASH_TEST_CONFIG_DUMP"], "w") as _fh:
    _json.dump({"raw": config, "validated": _validate(config)}, _fh)
raise SystemExit("config dumped for the test")
"""


def snakemakes_config(workflow, tmp_path, *configfiles) -> dict:
    """The config `snakemake -n [--configfile ...]` sees in the workflow copy: the Snakefile
    includes a dump of it right before rules/common.smk."""
    snakefile = workflow.root / "Snakefile"
    text = snakefile.read_text()
    include = 'include: "rules/common.smk"\n'
    assert text.count(include) == 1
    if "dump_config.smk" not in text:
        snakefile.write_text(text.replace(include, 'include: "dump_config.smk"\n' + include))
        (workflow.root / "dump_config.smk").write_text(CONFIG_DUMP)
    dump = tmp_path / f"dump-{len(list(tmp_path.glob('dump-*')))}.json"
    args = ("--configfile", *map(str, configfiles)) if configfiles else ()
    proc = workflow.snakemake("-n", *args, env={"DFLASH_TEST_CONFIG_DUMP": str(dump)}, check=False)
    output = proc.stdout + proc.stderr
    assert "config dumped for the test" in output and dump.is_file(), output[-3000:]
    return json.loads(dump.read_text())


def differences(got, want, key: str = "") -> list[str]:
    """Dotted keys whose values differ (a key missing on one side included)."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [
            d
            for k in sorted(set(got) | set(want), key=str)
            for d in differences(got.get(k, "<missing>"), want.get(k, "<missing>"), f"{key}.{k}".lstrip("."))
        ]
    return [] if got == want and type(got) is type(want) else [f"{key}: plan {got!r}, snakemake {want!r}"]


@pytest.mark.workflow
def test_plan_reads_the_config_snakemake_reads(workflow, tmp_path):
    example = workflow.root / "config/examples/qwen3.6-27b.yaml"
    over = write_yaml(
        tmp_path / "over.yaml",
        {
            "num_shards": 8,
            "generation": {"sampling": {"temperature": 0}},
            "tokenize": {"max_length": 2048},
        },
    )
    seen = {}
    for name, files in (("example", [example]), ("layered", [example, over]), ("plain", [])):
        seen[name] = snakemakes_config(workflow, tmp_path, *files)
        raw = layered_config(files, workdir=workflow.root)
        config = load_run_config(files, workdir=workflow.root)
        assert differences(json.loads(json.dumps(raw)), seen[name]["raw"]) == [], name
        assert differences(json.loads(json.dumps(config)), seen[name]["validated"]) == [], name
        assert len(seen[name]["validated"]) > len(seen[name]["raw"])  # the schema's defaults filled in
    # The example alone: its own values and the schema's defaults, nothing of the demo's.
    example_config = seen["example"]["validated"]
    assert example_config["run"] == "qwen36-27b" and example_config["target"]["build_demo"] is False
    assert (
        example_config["evaluate"]["simulated_rows"]
        == load_schema()["properties"]["evaluate"]["properties"]["simulated_rows"]["default"]
        != seen["plain"]["validated"]["evaluate"]["simulated_rows"]
    )
    assert seen["layered"]["validated"]["generation"]["sampling"] == {
        **example_config["generation"]["sampling"],
        "temperature": 0,
    }
    assert seen["plain"]["validated"]["run"] == "demo"


def test_cli_prints_the_seeds_case():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.stages.plan",
            "--configfile",
            str(EXAMPLE),
            "--gpus",
            "8",
            "--run-url",
            str(REPO / "no-such-run"),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    plan = json.loads(proc.stdout)
    assert plan["shards"] == 400 and plan["prompts"]["value"] == 902000
    assert 130 < plan["train"]["gpu_hours_per_epoch"] < 150
    assert "bench/results/train_step-h200.json" in plan["train"]["tokens_per_s_per_gpu"]["source"]
    text = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.stages.plan", "--configfile", str(EXAMPLE), "--gpus", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "GPU-hours" in text and "per epoch" in text and "Wall time on 8 GPUs" in text


def test_cli_names_a_missing_config_file():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.stages.plan", "--configfile", "nope.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr


def test_cli_names_an_invalid_config_key(tmp_path):
    bad = write_yaml(tmp_path / "bad.yaml", {"tokenize": {"max_lenght": 100}})
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.stages.plan", "--configfile", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "tokenize.max_lenght" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("gpus", ["0", "-3"])
def test_cli_refuses_fewer_than_one_gpu_in_one_line(gpus):
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.stages.plan", "--configfile", str(EXAMPLE), "--gpus", gpus],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"plan: --gpus must be at least 1, got {gpus}\n"


# --- prompts counted from the local dataset files ---------------------------------------------


def prompt_rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]}
        for i in range(start, start + n)
    ]


def test_the_plan_counts_the_prompts_of_local_dataset_files(tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    lines = [json.dumps(row) for row in prompt_rows(20)]
    lines[5:5] = ["", "   "]  # blank lines: skipped by the ingest, not rows
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n\n")
    parquet = tmp_path / "more.parquet"
    pq.write_table(pa.Table.from_pylist(prompt_rows(7, start=100)), parquet, row_group_size=3)
    assert count_dataset_rows([str(jsonl)]) == (
        20,
        "counted by the plan: non-empty JSONL lines of the local dataset files, before validation and deduplication",
    )
    rows, source = count_dataset_rows([str(jsonl), str(parquet)])
    assert rows == 27 and "non-empty JSONL lines and parquet rows from the metadata" in source
    assert count_dataset_rows([str(parquet)])[0] == 7
    assert count_dataset_rows(["prompts.jsonl"], workdir=tmp_path)[0] == 20  # relative to the workdir
    # Not countable here: the reason comes back instead.
    assert count_dataset_rows([str(jsonl), "s3://bucket/prompts.jsonl"]) == (
        None,
        "dataset file s3://bucket/prompts.jsonl is remote (not counted by the plan)",
    )
    assert count_dataset_rows([str(tmp_path / "gone.jsonl")])[1].endswith("gone.jsonl not found")
    (tmp_path / "prompts.csv").write_text("a,b\n")
    assert "unknown dataset format" in count_dataset_rows([str(tmp_path / "prompts.csv")])[1]

    # The CLI, without plan.prompts: the counted figure, named as such.
    config = write_yaml(
        tmp_path / "run.yaml",
        {
            "run": "counted",
            "num_shards": 3,
            "dataset": {"paths": [str(jsonl), str(parquet)]},
            "plan": {"generation_tokens_per_s_per_gpu": 100, "train_tokens_per_s_per_gpu": 1000},
        },
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.stages.plan",
            "--configfile",
            str(config),
            "--gpus",
            "1",
            "--run-url",
            str(tmp_path / "no-run"),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    plan = json.loads(proc.stdout)
    assert plan["prompts"] == {"value": 27, "source": source}
    assert plan["samples_per_shard"] == 9
    # plan.prompts, when given, is the figure (the files are not counted).
    with_prompts = write_yaml(tmp_path / "given.yaml", {**yaml.safe_load(config.read_text()), "plan": {"prompts": 500}})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.stages.plan",
            "--configfile",
            str(with_prompts),
            "--gpus",
            "1",
            "--run-url",
            str(tmp_path / "no-run"),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(proc.stdout)["prompts"] == {"value": 500, "source": "config plan.prompts"}


def test_without_a_count_the_error_says_why_the_files_were_not_counted():
    config = seeds_config(prompts=None)  # its dataset is in S3
    rows, source = count_dataset_rows(config["dataset"]["paths"])
    with pytest.raises(PlanError, match=r"plan\.prompts.*is remote"):
        make_plan(config, Measured(dataset_rows=rows, dataset_rows_source=source), gpus=8)


def test_a_run_whose_gpu_jobs_take_no_gpu_is_planned_on_the_cpu(monkeypatch):
    """The CPU demo (gpus_per_job: 0 for generation and training) is not a run "on 8 GPUs"."""
    from dflash_pipeline.stages import plan as plan_module

    monkeypatch.setattr(plan_module, "_cpu_cores", lambda: 2)
    demo = load_run_config([str(Path(__file__).parents[1] / "config.yaml")])
    assert demo["generation"]["gpus_per_job"] == 0 and demo["train"]["gpus_per_job"] == 0
    text = plan_module.format_plan(make_plan(demo, Measured(dataset_rows=160, dataset_rows_source="counted"), gpus=8))
    assert text.splitlines()[0] == "Plan of run 'demo' on the CPU (2 cores)"
    assert "Wall time on the CPU (2 cores)" in text and "GPUs" not in text
    # A GPU run keeps its GPUs.
    gpu_text = plan_module.format_plan(make_plan(seeds_config(), Measured(bench_train=BENCH[0]), gpus=8))
    assert "on 8 GPUs" in gpu_text.splitlines()[0] and "the CPU" not in gpu_text


def test_the_benchmark_records_are_the_working_checkouts_else_the_packages_and_a_named_folder_must_exist(
    tmp_path, capsys
):
    from dflash_pipeline.stages.plan import REPO as PACKAGE_CHECKOUT
    from dflash_pipeline.stages.plan import default_bench_dir, main

    (tmp_path / "bench" / "results").mkdir(parents=True)
    assert default_bench_dir(tmp_path) == tmp_path / "bench" / "results"
    assert default_bench_dir(tmp_path / "elsewhere") == PACKAGE_CHECKOUT / "bench" / "results"
    assert main(["--bench-dir", str(tmp_path / "gone"), "--configfile", str(EXAMPLE)]) == 2
    assert capsys.readouterr().err.strip() == f"plan: --bench-dir {tmp_path / 'gone'}: no such folder"
