"""How every command-line tool names a run and reads its config (dflash_pipeline.core.run_cli):
snakemake's `--configfile A [B ...]`, `--default-storage-prefix`, and `--run-url` where a tool
takes it; each problem one line naming the argument, the file and the reason."""

from __future__ import annotations

import argparse
import importlib

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.run_cli import (
    CONFIGFILE_HELP,
    RunArgumentError,
    add_run_arguments,
    open_run,
    read_configfiles,
)


def parser_with(run_url: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    add_run_arguments(parser, run_url=run_url)
    return parser


def opened(argv: list[str], **kwargs):
    parser = parser_with()
    return open_run(parser.parse_args(argv), parser, **kwargs)


def refusal(argv: list[str], capsys, **kwargs) -> str:
    """The one error line a tool prints for ``argv`` (argparse's form, exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        opened(argv, **kwargs)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[0].startswith("usage: tool"), err
    line = err.rstrip("\n").splitlines()[-1]
    assert line.startswith("tool: error: "), err
    return line


def test_without_configfile_the_run_is_config_yamls_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("run: mine\nresults_dir: out\n")
    run = opened([])
    assert (run.config["run"], run.url, run.root) == ("mine", "out/mine", "out/mine")
    assert run.config == validate_config({"run": "mine", "results_dir": "out"})  # the schema fills the rest


def test_several_configfiles_are_layered_and_replace_config_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("run: demo\nnum_shards: 7\n")
    (tmp_path / "a.yaml").write_text("run: a\nresults_dir: out\ntrain: {batch_size: 3, segments: 2}\n")
    (tmp_path / "b.yaml").write_text("run: b\ntrain: {batch_size: 5}\n")
    run = opened(["--configfile", "a.yaml", "b.yaml"])
    assert run.config["run"] == "b" and run.url == "out/b"
    assert run.config["train"]["batch_size"] == 5 and run.config["train"]["segments"] == 2  # merged
    assert run.config["num_shards"] == validate_config({})["num_shards"]  # never config.yaml's 7
    assert opened(["--configfiles", "b.yaml", "a.yaml"]).config["run"] == "a"  # order decides


def test_the_storage_prefix_places_the_run_below_it_and_must_be_an_s3_url(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("run: r\nresults_dir: out\n")
    run = opened(["--default-storage-prefix", "s3://bucket/pre/"])
    assert run.url == "s3://bucket/pre/out/r" and run.root == "out/r"
    assert layout.storage_prefix_of(run.url, run.root) == "s3://bucket/pre"  # run_url's inverse
    assert layout.storage_prefix_of("out/r", "out/r") is None
    for bad in ("bucket/pre", "s3://", "s3:///pre"):
        line = refusal(["--default-storage-prefix", bad], capsys)
        assert (
            line == f"tool: error: argument --default-storage-prefix: must be an s3:// URL naming a bucket, got {bad!r}"
        )


def test_run_url_names_the_run_whatever_the_config_and_prefix_say(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("run: other\nresults_dir: out\nnum_shards: 3\n")
    given = str(tmp_path / "elsewhere")
    run = opened(["--run-url", given, "--default-storage-prefix", "s3://b/p"])
    assert run.url == given and run.config["num_shards"] == 3  # the config still describes the run
    assert opened(["--run-url", "s3://b/p/x"]).url == "s3://b/p/x"
    # A tool that needs nothing else of the config reads none it was not given: config.yaml may
    # be another run's.
    assert opened(["--run-url", given], config_needed=False).config == validate_config({})
    (tmp_path / "mine.yaml").write_text("num_shards: 5\n")
    assert opened(["--run-url", given, "--configfile", "mine.yaml"], config_needed=False).config["num_shards"] == 5


@pytest.mark.parametrize(
    "write, argv, reason",
    [
        (None, ["--configfile", "gone.yaml"], "argument --configfile: 'gone.yaml' does not exist"),
        (None, [], "argument --configfile: 'config.yaml' does not exist"),
        ("folder", ["--configfile", "folder"], "argument --configfile: 'folder' is a folder, not a file"),
        ("a: [1\n", ["--configfile", "c.yaml"], "argument --configfile: 'c.yaml' cannot be read: while parsing"),
        ("- 1\n", ["--configfile", "c.yaml"], "argument --configfile: 'c.yaml' cannot be read: Config file must"),
        (
            "train: {batch_size: 0}\n",
            ["--configfile", "ok.yaml", "c.yaml"],
            "argument --configfile: 'ok.yaml' 'c.yaml': invalid configuration: config key 'train.batch_size': 0",
        ),
    ],
    ids=["missing", "missing-default", "folder", "bad-yaml", "not-a-mapping", "invalid-key"],
)
def test_each_config_problem_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys, write, argv, reason):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.yaml").write_text("run: ok\n")
    if write == "folder":
        (tmp_path / "folder").mkdir()
    elif write is not None:
        (tmp_path / "c.yaml").write_text(write)
    line = refusal(argv, capsys)
    assert line.startswith(f"tool: error: {reason}"), line
    # Without a parser (the status page reports its own way): raised, the same line.
    with pytest.raises(RunArgumentError) as raised:
        open_run(parser_with().parse_args(argv))
    assert f"tool: error: {raised.value}" == line
    # Where --run-url alone would do, the line says so.
    assert refusal(argv, capsys, config_needed=False) == f"{line} (or give --run-url)"


def test_a_run_root_that_must_exist_is_refused_by_where_it_came_from(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("run: r\nresults_dir: out\n")
    line = refusal([], capsys, must_exist=True)
    assert line == (
        "tool: error: the run root out/r does not exist (run the workflow first, or give the run's "
        "--configfile and --default-storage-prefix)"
    )
    line = refusal(["--run-url", "nowhere"], capsys, must_exist=True)
    assert line == "tool: error: argument --run-url: no such folder: 'nowhere'"
    (tmp_path / "out/r").mkdir(parents=True)
    assert opened([], must_exist=True).url == "out/r"
    assert opened(["--default-storage-prefix", "s3://b/p"], must_exist=True).url == "s3://b/p/out/r"  # not listed
    (tmp_path / "file").write_text("")
    assert refusal(["--run-url", "file"], capsys) == "tool: error: argument --run-url: 'file' is a file, not a folder"


def test_a_working_directory_holds_the_config_and_the_run_root(tmp_path):
    """The status page runs for a workflow folder (--workdir) other than where it starts."""
    (tmp_path / "config.yaml").write_text("run: r\nresults_dir: out\n")
    run = open_run(parser_with().parse_args([]), workdir=tmp_path)
    assert run.url == str(tmp_path / "out/r") and run.root == "out/r"
    with pytest.raises(RunArgumentError, match=f"'{tmp_path / 'gone.yaml'}' does not exist"):
        read_configfiles(["gone.yaml"], workdir=tmp_path)


TOOLS = {
    # tool: the arguments that reach its parser's --help
    "dflash_pipeline.stages.plan": [],
    "dflash_pipeline.stages.verify": [],
    "dflash_pipeline.stages.preflight": [],
    "dflash_pipeline.stages.tokenize": ["show-halt"],
    "dflash_pipeline.status.__main__": [],
    "dflash_pipeline.stages.generate": [],
    "dflash_pipeline.stages.tune": [],
    "dflash_pipeline.stages.train": [],
    "dflash_pipeline.stages.extract": [],
}


@pytest.mark.parametrize("module", sorted(TOOLS))
def test_every_command_line_means_snakemakes_configfile(module, capsys):
    """One meaning of --configfile across the tools and the stages run by hand: the files as
    snakemake takes them, several allowed."""
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main([*TOOLS[module], "--help"])
    assert exit_info.value.code == 0
    help_text = "".join(capsys.readouterr().out.split())  # as argparse wraps it: any line breaks
    assert "--configfileFILE[FILE...]" in help_text
    assert "".join(CONFIGFILE_HELP.split()) in help_text
