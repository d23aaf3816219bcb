"""Every stage CLI answers bad input with one error line naming the argument, the value and the
reason, exit code 2 and no traceback, before any model or engine is touched
(``dflash_pipeline.stages.cli``). No model is loaded here: every case fails while parsing."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.data.tokenized import TOKENIZED_SCHEMA
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA
from dflash_pipeline.stages import cli
from dflash_pipeline.stages.prepare import PROMPT_SCHEMA

# Placeholders in the argument lists below, made real per test by `paths`.
FILE, FOLDER, MODEL, MISSING, EMPTY_DIR, SETTINGS, MANIFEST, BAD_JSON_FILE = (
    "@file", "@folder", "@model", "@missing", "@empty-dir", "@settings", "@manifest", "@bad-json-file",
)  # fmt: skip
# Empty shards of each stage's schema: a shard reader reads its input's columns while parsing.
PREPARE_SHARD, GENERATE_SHARD, TOKENIZE_SHARD = "@prepare-shard", "@generate-shard", "@tokenize-shard"
# Train's shard lists (--shards), each a JSON file: the tokenize shard; a missing file; a prepare
# shard; a list that is no {SHARD: PATH} object; a key that is no list.
SHARD_LISTS = {
    "@lists-valid": {"tokenized": {"00000": TOKENIZE_SHARD}},
    "@lists-missing": {"tokenized": {"00000": TOKENIZE_SHARD}, "hidden": {"00000": MISSING}},
    "@lists-of-prepare": {"tokenized": {"00000": PREPARE_SHARD}},
    "@lists-not-object": {"tokenized": ["00000", TOKENIZE_SHARD]},
    "@lists-unknown": {"tokenized": {"00000": TOKENIZE_SHARD}, "extracted": {}},
    "@lists-empty": {"tokenized": {}},
}

# Valid arguments per stage (what one bad value replaces), as (option, value) pairs; an option
# starting with "<" is a positional.
VALID = {
    "generate": [("--prompts", PREPARE_SHARD), ("--out", "o.parquet"), ("--run-url", FOLDER), ("--shard", "0"),
                 ("--model", MODEL), ("--generation-json", "{}"), ("--engines-json", "{}")],
    "evaluate": [("--target", MODEL), ("--drafter", MODEL), ("--prompts", FILE), ("--out", "m.json")],
    "tokenize": [("<generated>", GENERATE_SHARD), ("--model", MODEL), ("--out", "t.parquet"), ("--stats", "s.json"),
                 ("--settings-json", "{}")],
    "prepare ingest": [("<paths>", FILE), ("--num-shards", "2"), ("--out-prompts", "a"),
                       ("--out-summary", "b"), ("--out-quarantine", "c")],
    "prepare select": [("<ingested>", FILE), ("--shard", "0"), ("--out", "x.parquet")],
    "train": [("--run-url", FOLDER), ("--segment", "0"), ("--settings", SETTINGS), ("--target", MODEL),
              ("--manifest", "m.json"), ("--shards", "@lists-valid")],
    "export": [("--run-url", FOLDER), ("--manifest", MANIFEST), ("--out", "drafter")],
    "segment_tau": [("--run-url", FOLDER), ("--segment", "0"), ("--manifest", MANIFEST), ("--target", MODEL),
                    ("--prompts", FILE), ("--out", "t.json")],
    "extract": [("<tokenized>", TOKENIZE_SHARD), ("--target", MODEL), ("--settings-json", "{}"), ("--run-url", FOLDER),
                ("--shard", "00000"), ("--manifest", "m.json")],
    "tokenize clear-halt": [("--run-url", FOLDER)],
}  # fmt: skip

BAD_JSON = '{"engine": "sglang",}'  # trailing comma: line 1 column 21

# (stage, argument, bad value, what the reason says)
CASES = [
    ("generate", "--prompts", MISSING, "no such file"),
    ("generate", "--prompts", FOLDER, "is a folder, not a file"),
    ("generate", "--model", MISSING, "no such folder"),
    ("generate", "--model", "Org/Some-Model-8B", "looks like a hub id"),
    ("generate", "--model", FILE, "is a file, not a folder"),
    ("generate", "--model", EMPTY_DIR, "no config.json"),
    ("generate", "--generation-json", BAD_JSON, "not valid JSON: Expecting property name"),
    ("generate", "--engines-json", "[1, 2]", "must be a JSON object"),
    ("generate", "--shard", "-1", "must be an integer >= 0"),
    ("generate", "--shard", "two", "is not an integer"),
    ("evaluate", "--target", MISSING, "no such folder"),
    ("evaluate", "--drafter", MISSING, "no such folder"),
    ("evaluate", "--drafter", EMPTY_DIR, "no config.json"),
    ("evaluate", "--prompts", MISSING, "no such file"),
    ("evaluate", "--prompts", FOLDER, "is a folder, not a file"),
    ("evaluate", "--max-new-tokens", "0", "must be an integer >= 1"),
    ("evaluate", "--limit", "0", "must be an integer >= 1"),
    ("evaluate", "--temperature", "-0.5", "must be a number >= 0"),
    ("evaluate", "--block-size", "1", "must be an integer >= 2"),
    ("evaluate", "--seed", "-3", "must be an integer >= 0"),
    ("evaluate", "--lossless-margin", "-1", "must be a number >= 0"),
    ("evaluate", "--simulated-tau", "nan", "is not a finite number"),
    ("evaluate", "--parity-tolerance", "-0.1", "must be a number >= 0"),
    ("evaluate", "--engine-parity-tolerance", "-0.1", "must be a number >= 0"),
    ("evaluate", "--engine-mem-fraction", "1.5", "must be a number > 0 and <= 1"),
    ("evaluate", "--engine-mem-fraction", "0", "must be a number > 0 and <= 1"),
    ("evaluate", "--engine-port", "70000", "must be an integer from 1 to 65535"),
    ("evaluate", "--engine-tp", "0", "must be an integer >= 1"),
    ("evaluate", "--engine-env", "NO_EQUALS", "expected KEY=VALUE"),
    ("tokenize", "<generated>", MISSING, "no such file"),
    ("tokenize", "<generated>", FOLDER, "is a folder, not a file"),
    ("tokenize", "--model", MISSING, "no such folder"),
    ("tokenize", "--settings-json", BAD_JSON, "line 1 column 21"),
    ("tokenize", "--shard", "-1", "must be an integer >= 0"),
    ("tokenize", "--workers", "0", "must be an integer >= 1"),
    ("prepare ingest", "<paths>", MISSING, "no such file"),
    ("prepare ingest", "<paths>", FOLDER, "is a folder, not a file"),
    ("prepare ingest", "--num-shards", "0", "must be an integer from 1 to 99999"),
    ("prepare ingest", "--heldout-fraction", "1.5", "must be a number >= 0 and <= 1"),
    ("prepare ingest", "--max-bad-fraction", "-0.1", "must be a number >= 0 and <= 1"),
    ("prepare ingest", "--max-row-bytes", "0", "must be an integer >= 1"),
    ("prepare select", "<ingested>", MISSING, "no such file"),
    ("prepare select", "--shard", "-1", "must be an integer >= 0"),
    ("train", "--settings", MISSING, "no such file"),
    ("train", "--settings", FOLDER, "is a folder, not a file"),
    ("train", "--settings", BAD_JSON_FILE, "is not valid JSON: Expecting property name"),
    ("train", "--target", MISSING, "no such folder"),
    ("train", "--shards", "@lists-missing", "hidden shard 00000: no such file"),
    ("train", "--shards", "@lists-not-object", "tokenized must be an object {SHARD: PATH}"),
    ("train", "--shards", "@lists-unknown", "unknown key 'extracted' (the lists are tokenized, hidden)"),
    ("train", "--shards", "@lists-empty", "no tokenized shards"),
    ("train", "--shards", MISSING, "no such file"),
    ("train", "--segment", "-1", "must be an integer >= 0"),
    ("export", "--run-url", MISSING, "no such folder"),
    ("segment_tau", "--segment", "-1", "must be an integer >= 0"),
    ("segment_tau", "--manifest", BAD_JSON_FILE, "is not valid JSON"),
    ("segment_tau", "--max-new-tokens", "0", "must be an integer >= 1"),
    ("export", "--manifest", MISSING, "no such file"),
    ("export", "--manifest", BAD_JSON_FILE, "is not valid JSON"),
    ("export", "--manifest", SETTINGS, "is not a segment manifest (no checkpoint_prefix, drafter_config)"),
    ("extract", "<tokenized>", MISSING, "no such file"),
    # Another stage's shard: one line naming the file, what it is and what the stage reads.
    (
        "tokenize",
        "<generated>",
        PREPARE_SHARD,
        "a prepare shard (columns id, shard, split, messages, source), tokenize reads generate shards",
    ),
    ("tokenize", "<generated>", FILE, "not a parquet file"),
    ("generate", "--prompts", TOKENIZE_SHARD, "a tokenize shard (columns id, split, turn, input_ids"),
    ("generate", "--prompts", GENERATE_SHARD, "a generate shard (columns id, shard, split, messages, turns"),
    ("extract", "<tokenized>", GENERATE_SHARD, "a generate shard (columns "),
    ("train", "--shards", "@lists-of-prepare", "a prepare shard (columns id, shard, split, messages, source), train"),
    ("extract", "--target", MISSING, "no such folder"),
    ("extract", "--settings-json", "[]", "must be a JSON object"),
    ("extract", "--shard", "-1", "is not a shard number"),
    ("tokenize clear-halt", "--run-url", MISSING, "no such folder"),
]


@pytest.fixture
def paths(tmp_path):
    """The placeholders' real paths: a file, a folder, a model folder (config.json only), ..."""
    (tmp_path / "data.parquet").write_text("not read: every case fails while parsing")
    (tmp_path / "run").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "settings.json").write_text('{"mode": "online"}')
    (tmp_path / "manifest.json").write_text('{"checkpoint_prefix": "c/", "drafter_config": {}}')
    (tmp_path / "bad.json").write_text('{"block_size": 4,\n "seed": 1,}\n')
    shards = {PREPARE_SHARD: PROMPT_SCHEMA, GENERATE_SHARD: GENERATED_SCHEMA, TOKENIZE_SHARD: TOKENIZED_SCHEMA}
    for placeholder, schema in shards.items():
        pq.write_table(schema.empty_table(), tmp_path / f"{placeholder.strip('@')}.parquet")
    found = {
        **{placeholder: str(tmp_path / f"{placeholder.strip('@')}.parquet") for placeholder in shards},
        FILE: str(tmp_path / "data.parquet"), FOLDER: str(tmp_path / "run"), MODEL: str(tmp_path / "model"),
        MISSING: str(tmp_path / "no-such-thing"), EMPTY_DIR: str(tmp_path / "empty"),
        SETTINGS: str(tmp_path / "settings.json"), MANIFEST: str(tmp_path / "manifest.json"),
        BAD_JSON_FILE: str(tmp_path / "bad.json"),
    }  # fmt: skip
    for placeholder, lists in SHARD_LISTS.items():
        path = tmp_path / f"{placeholder.strip('@')}.json"
        path.write_text(real(json.dumps(lists), found))
        found[placeholder] = str(path)
    return found


def real(value: str, paths: dict) -> str:
    for placeholder, path in paths.items():
        value = value.replace(placeholder, path)
    return value


def argv_for(stage: str, paths: dict, replace: tuple[str, str] | None = None) -> list[str]:
    """The stage's valid arguments (sub-command first), with one value replaced."""
    argv = stage.split()[1:]
    pairs = list(VALID[stage])
    if replace and replace[0] not in dict(pairs):
        pairs.append(replace)
    for option, value in pairs:
        if replace and option == replace[0]:
            value = replace[1]
        argv += [real(value, paths)] if option.startswith("<") else [option, real(value, paths)]
    return argv


def stage_main(stage: str):
    return importlib.import_module(f"dflash_pipeline.stages.{stage.split()[0]}").main


def error_line(stderr: str) -> str:
    """The one error line of argparse's answer (after its usage lines); no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, stderr
    assert stderr.rstrip("\n").splitlines()[-1] == errors[0], stderr
    before = stderr.split(errors[0])[0].splitlines()
    assert not before or before[0].startswith("usage: "), stderr  # nothing but the usage before it
    return errors[0]


@pytest.mark.parametrize("stage", sorted(VALID))
def test_the_valid_arguments_pass_the_parser(stage, paths, monkeypatch):
    """The baseline of every case below: with nothing replaced, parsing succeeds (the stage's
    work is stubbed out here, so nothing runs)."""
    module = importlib.import_module(f"dflash_pipeline.stages.{stage.split()[0]}")
    seen = {}

    def parse_only(self, args=None, namespace=None):
        seen["args"] = original(self, args, namespace)
        raise SystemExit("parsed")

    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    with pytest.raises(SystemExit, match="^parsed$"):
        module.main(argv_for(stage, paths))
    assert seen["args"] is not None


@pytest.mark.parametrize("stage, option, value, reason", CASES, ids=[f"{s}{o}={v.strip('@')}" for s, o, v, _ in CASES])
def test_bad_input_is_one_error_line_with_exit_code_2(stage, option, value, reason, paths, capsys):
    with pytest.raises(SystemExit) as exit_info:
        stage_main(stage)(argv_for(stage, paths, (option, value)))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    line = error_line(captured.err)
    name = option.strip("<>")
    assert f"error: argument {name}: " in line, line
    shown_value = real(value, paths).split("=", 1)[1] if value.startswith("00000=") else real(value, paths)
    assert shown_value in line, line
    assert reason in line, line
    assert captured.out == ""


@pytest.mark.parametrize("stage", [*sorted(VALID), "prepare", "tokenize show-halt"])
def test_help_still_works(stage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        stage_main(stage)([*stage.split()[1:], "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m dflash_pipeline.stages.")


def test_show_halt_names_a_missing_or_bad_configfile(tmp_path, monkeypatch, capsys):
    from dflash_pipeline.stages.tokenize import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["show-halt"])
    assert exit_info.value.code == 2
    assert "argument --configfile: 'config.yaml' does not exist (or give --run-url)" in error_line(
        capsys.readouterr().err
    )
    (tmp_path / "config.yaml").write_text("run: 5\nresults_dir: res\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["show-halt"])
    assert exit_info.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert "argument --configfile: 'config.yaml': invalid configuration:" in line and "'run'" in line


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"dflash_pipeline.stages.{module}", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_end_to_end_a_missing_model_folder_never_reaches_transformers(paths):
    """`python -m ... --model DIR` with no such folder: the CLI's own line, not transformers'
    "Repo id must be in the form ..." (transformers is not even imported)."""
    argv = argv_for("generate", paths, ("--model", MISSING))
    probe = (
        "import sys\nfrom dflash_pipeline.stages.generate import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, 'transformers' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    line = error_line(proc.stderr)
    assert f"argument --model: no such folder: '{paths[MISSING]}'" in line
    assert "Repo id" not in proc.stderr


@pytest.mark.parametrize(
    "stage, option, value, reason",
    [
        ("tokenize", "--settings-json", BAD_JSON, "is not valid JSON: Expecting property name enclosed in "
         "double quotes: line 1 column 21 (char 20)"),
        ("evaluate", "--target", MISSING, "no such folder"),
        ("train", "--shards", "@lists-missing", "hidden shard 00000: no such file"),
        ("prepare ingest", "--num-shards", "0", "must be an integer from 1 to 99999"),
        # Before: KeyError: 'turns' from deep inside the tokenizer's rows.
        ("tokenize", "<generated>", PREPARE_SHARD, "a prepare shard (columns id, shard, split, messages, source), "
         "tokenize reads generate shards"),
    ],
)  # fmt: skip
def test_end_to_end_through_python_m(stage, option, value, reason, paths):
    proc = run_module(stage.split()[0], *argv_for(stage, paths, (option, value)))
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc.stderr)
    assert f"error: argument {option.strip('<>')}: " in line and reason in line, line


def test_a_failed_export_is_one_line_with_exit_code_1(paths):
    """A job that fails (here: no checkpoint where the manifest says) answers 1, without a trace."""
    proc = run_module("export", *argv_for("export", paths))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"python -m dflash_pipeline.stages.export: error: no checkpoint at {paths[FOLDER]}/c/"
    ]


# The shared types themselves.


@pytest.mark.parametrize(
    "check, value, expected",
    [
        (cli.positive_int, "3", 3),
        (cli.non_negative_int, "0", 0),
        (cli.int_range(2), "2", 2),
        (cli.port, "65535", 65535),
        (cli.probability, "0", 0.0),
        (cli.probability, "1", 1.0),
        (cli.non_negative_float, "0.7", 0.7),
        (cli.positive_float, "1e-3", 1e-3),
        (cli.json_object, ' {"a": [1]} ', {"a": [1]}),
        (cli.shard_name, "00003", "00003"),
        (cli.or_s3(cli.existing_file), "s3://bucket/data.jsonl", "s3://bucket/data.jsonl"),
        (cli.or_s3(cli.existing_dir), "s3://bucket/run", "s3://bucket/run"),
    ],
)
def test_types_accept_good_values(check, value, expected):
    assert check(value) == expected


@pytest.mark.parametrize(
    "check, value, message",
    [
        (cli.positive_int, "0", "'0' is out of range: must be an integer >= 1"),
        (cli.positive_int, "1.5", "'1.5' is not an integer"),
        (cli.port, "0", "'0' is out of range: must be an integer from 1 to 65535"),
        (cli.probability, "-0.01", "'-0.01' is out of range: must be a number >= 0 and <= 1"),
        (cli.probability, "inf", "'inf' is not a finite number"),
        (cli.positive_float, "0", "'0' is out of range: must be a number > 0"),
        (cli.non_negative_float, "x", "'x' is not a number"),
        (cli.json_object, "{'a': 1}", "is not valid JSON: Expecting property name enclosed in double quotes: "
                                      "line 1 column 2 (char 1)"),
        (cli.json_object, '"text"', "must be a JSON object ({...}), not str"),
        (cli.json_object, "", "is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        (cli.shard_name, "3a", "'3a' is not a shard number such as 00003"),
    ],
)  # fmt: skip
def test_types_refuse_bad_values_in_one_line(check, value, message):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        check(value)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_paths_kinds(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert cli.existing_file(str(tmp_path / "f")) == str(tmp_path / "f")
    assert cli.existing_dir(str(tmp_path)) == str(tmp_path)
    assert cli.model_dir(str(tmp_path / "m")) == str(tmp_path / "m")
    for check, value, message in [
        (cli.existing_file, tmp_path / "nope", "no such file"),
        (cli.existing_file, tmp_path, "is a folder, not a file"),
        (cli.existing_dir, tmp_path / "f", "is a file, not a folder"),
        (cli.model_dir, tmp_path, "is not a model folder (no config.json in it)"),
        (cli.json_file, tmp_path / "m", "is a folder, not a file"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check(str(value))


def test_a_long_or_multiline_value_is_shown_on_one_short_line():
    text = json.dumps({"key": "v" * 500}, indent=2) + "\n,"
    with pytest.raises(argparse.ArgumentTypeError) as err:
        cli.json_object(text)
    message = str(err.value)
    assert "\n" not in message and len(message) < 200 and message.startswith("'{\\n")


def test_verify_help_describes_the_command_in_full_sentences(capsys):
    from dflash_pipeline.stages import verify

    with pytest.raises(SystemExit):
        verify.main(["--help"])
    help_text = capsys.readouterr().out
    description = help_text.split("\n\n")[1]
    assert description.startswith("Check every stored object")
    assert " ".join(description.split()).endswith("exactly that."), description  # argparse wraps lines


def test_generate_train_and_tune_read_their_sections_from_the_runs_config_file(paths, tmp_path, monkeypatch):
    """By hand, a stage takes the run's config file (`--configfile`, as snakemake does) instead of
    a section copied out as JSON: each gets its validated section, the schema's defaults filled."""
    from dflash_pipeline.core.config import load_run_config
    from dflash_pipeline.stages import generate, train, tune

    config_file = tmp_path / "run.yaml"
    config_file.write_text("generation:\n  concurrency: 3\ntrain:\n  batch_size: 5\ntune:\n  prompts: 7\n")
    expected = load_run_config([config_file])
    seen = {}
    monkeypatch.setattr(generate, "run_job", lambda *args: seen.update(generate=args))
    monkeypatch.setattr(train, "run_segment", lambda args, settings: seen.update(train=settings))
    monkeypatch.setattr(tune, "run_job", lambda *args: seen.update(tune=args))

    argv = [a for a in argv_for("generate", paths) if a not in ("--generation-json", "--engines-json", "{}")]
    assert generate.main([*argv, "--configfile", str(config_file)]) == 0
    assert seen["generate"][5] == expected["generation"] and seen["generate"][5]["concurrency"] == 3
    assert seen["generate"][8] == expected["engines"]
    argv = argv_for("train", paths)
    argv = argv[: argv.index("--settings")] + argv[argv.index("--settings") + 2 :]
    assert train.main([*argv, "--configfile", str(config_file)]) == 0
    assert seen["train"] == expected["train"] and seen["train"]["batch_size"] == 5
    prompts = real(PREPARE_SHARD, paths)
    argv = ["--prompts", prompts, "--out", str(tmp_path / "t.json"), "--model", real(MODEL, paths)]
    assert tune.main([*argv, "--configfile", str(config_file)]) == 0
    assert seen["tune"][4]["prompts"] == 7  # the tune section, validated


def test_a_bad_run_config_file_is_one_error_line_naming_it(paths, tmp_path, capsys):
    from dflash_pipeline.stages import generate

    config_file = tmp_path / "run.yaml"
    config_file.write_text("num_shards: 2.0\n")
    argv = [a for a in argv_for("generate", paths) if a not in ("--generation-json", "--engines-json", "{}")]
    with pytest.raises(SystemExit) as exit_info:
        generate.main([*argv, "--configfile", str(config_file)])
    assert exit_info.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert "argument --configfile" in line and str(config_file) in line and "num_shards" in line, line


def test_extract_reads_the_runs_config_file_and_its_taps_source(paths, tmp_path, monkeypatch, capsys):
    """extract by hand: `--configfile` gives its train section, `extract.taps_from` and the engines
    section (where vLLM is); `--taps-from` overrides the file's choice; engine taps without a config
    file (no engines section to find vLLM in) is one error line."""
    from dflash_pipeline.core.config import load_run_config
    from dflash_pipeline.stages import extract

    config_file = tmp_path / "run.yaml"
    config_file.write_text("train:\n  batch_size: 5\nextract:\n  taps_from: engine\n")
    expected = load_run_config([config_file])
    seen = []
    monkeypatch.setattr(extract, "extract_job", lambda *args, **kwargs: seen.append((args, kwargs)))

    argv = argv_for("extract", paths)
    without_settings = argv[: argv.index("--settings-json")] + argv[argv.index("--settings-json") + 2 :]
    assert extract.main([*without_settings, "--configfile", str(config_file)]) == 0
    args, kwargs = seen[-1]
    assert args[2] == expected["train"] and args[2]["batch_size"] == 5
    assert kwargs == {"taps_from": "engine", "engines": expected["engines"]}
    assert extract.main([*without_settings, "--configfile", str(config_file), "--taps-from", "target"]) == 0
    assert seen[-1][1]["taps_from"] == "target"
    assert extract.main(argv) == 0  # --settings-json: the target computes the taps
    assert seen[-1][1] == {"taps_from": "target", "engines": None}

    with pytest.raises(SystemExit) as exit_info:
        extract.main([*argv, "--taps-from", "engine"])
    assert exit_info.value.code == 2
    assert "--taps-from engine needs --configfile" in error_line(capsys.readouterr().err)
