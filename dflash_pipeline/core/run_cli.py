"""How a command-line tool names a run and reads its config: the one meaning of ``--configfile``.

Every tool that works on a run (plan, preflight, verify, the halt and status commands) finds it as
Snakemake does, from the same arguments given to Snakemake:

- ``--configfile A [B ...]``: the run's config files as ``snakemake --configfile`` takes them:
  these files alone, later ones updating earlier ones, the keys they leave out taking the schema's
  defaults (``config.load_run_config``); without it, ``config.yaml`` in the working directory;
- ``--default-storage-prefix s3://BUCKET/PREFIX``: an S3 run's prefix, below which the run root
  ``results_dir/run`` lies (``layout.run_url``);
- ``--run-url``, where a tool takes it: the run root itself (a local folder or ``s3://``), instead of
  the one the config places.

A stage run by hand (generate, tune, train, extract) reads its sections from the same files with
the same meaning (``read_configfiles``). A problem is a ``RunArgumentError``: one line naming the
argument, the file and the reason, which a tool reports as argparse reports a bad argument.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import ConfigError, ConfigFileError, load_run_config, validate_config
from dflash_pipeline.core.storage import is_s3_url

CONFIGFILE_HELP = (
    "the run's config files, as snakemake's --configfile takes them: these files alone, later ones "
    "updating earlier ones, keys they leave out taking dflash_pipeline/config/schema.yaml's defaults"
)


class RunArgumentError(ValueError):
    """The arguments name no readable config or no run; the message is one line starting with
    ``argument --NAME:`` where one argument is at fault."""


def storage_prefix(value: str) -> str:
    """An ``--default-storage-prefix``: an ``s3://`` URL naming a bucket (an argparse type)."""
    if not is_s3_url(value) or not value[len("s3://") :].split("/")[0]:
        raise argparse.ArgumentTypeError(f"must be an s3:// URL naming a bucket, got {value!r}")
    return value


def run_location(value: str) -> str:
    """A ``--run-url``: an ``s3://`` URL, or a local path that is not a file (an argparse type).
    A local folder may not exist yet (a run to plan); tools that read it check it (``open_run``)."""
    if is_s3_url(value):
        return storage_prefix(value)
    if Path(value).exists() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a file, not a folder")
    return value


def add_configfile_argument(parser, use: str = "default: config.yaml in the working directory") -> None:
    """``--configfile A [B ...]`` (also spelled ``--configfiles``), as Snakemake's, on a parser
    or a group of one; ``use`` ends its help (what the tool reads of it, or its default)."""
    parser.add_argument(
        "--configfile", "--configfiles", nargs="+", default=None, metavar="FILE", help=f"{CONFIGFILE_HELP} ({use})"
    )


def add_run_arguments(parser: argparse.ArgumentParser, run_url: bool = False) -> None:
    """The arguments that name a run: ``--configfile``, ``--default-storage-prefix`` and, where
    the tool takes it, ``--run-url``."""
    add_configfile_argument(parser)
    parser.add_argument(
        "--default-storage-prefix",
        type=storage_prefix,
        default=None,
        metavar="s3://BUCKET/PREFIX",
        help="an S3 run's prefix, as given to snakemake (default: a local run)",
    )
    if run_url:
        parser.add_argument(
            "--run-url",
            type=run_location,
            default=None,
            metavar="URL",
            help="the run root itself (a local folder or s3://...), instead of the one the config places "
            "below --default-storage-prefix",
        )


@contextmanager
def _reported_by(parser: argparse.ArgumentParser | None) -> Iterator[None]:
    """A RunArgumentError reported by ``parser`` as a bad argument (usage, one line, exit 2);
    raised on without one."""
    try:
        yield
    except RunArgumentError as err:
        if parser is None:
            raise
        parser.error(str(err))


def read_configfiles(
    files: Sequence[str | Path] | None,
    parser: argparse.ArgumentParser | None = None,
    workdir: str | Path | None = None,
) -> dict:
    """The validated config of ``--configfile files`` (``config.yaml`` without them), relative
    paths below ``workdir`` (default: the working directory). A problem names the file; it is
    reported by ``parser`` as a bad argument, else raised (RunArgumentError)."""
    with _reported_by(parser):
        try:
            return load_run_config(files, Path.cwd() if workdir is None else Path(workdir))
        except ConfigFileError as err:
            raise RunArgumentError(f"argument --configfile: {err.path!r} {err.reason}") from None
        except ConfigError as err:
            shown = " ".join(repr(str(f)) for f in files or ["config.yaml"])
            raise RunArgumentError(f"argument --configfile: {shown}: {' '.join(str(err).split())}") from None


@dataclass(frozen=True)
class Run:
    """A run as the arguments name it: its validated config and where its objects live."""

    config: dict
    url: str
    # The run root relative to the working directory (``results_dir/run``), as the rules name it.
    root: str


def open_run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser | None = None,
    workdir: str | Path | None = None,
    config_needed: bool = True,
    must_exist: bool = False,
) -> Run:
    """The run that ``add_run_arguments``' arguments name; a problem is reported by ``parser``
    as a bad argument, else raised (RunArgumentError). With ``--run-url`` and a tool that needs
    nothing else of the config (``config_needed`` false), the config is read only where
    ``--configfile`` is given (config.yaml may be another run's), else it is the schema's
    defaults. A local run root is below ``workdir`` (default: the working directory, and then it
    stays relative); ``must_exist`` refuses one that is not there."""
    given_url = getattr(args, "run_url", None)
    with _reported_by(parser):
        if given_url and not config_needed and not args.configfile:
            config = validate_config({})
        else:
            try:
                config = read_configfiles(args.configfile, workdir=workdir)
            except RunArgumentError as err:
                hint = " (or give --run-url)" if hasattr(args, "run_url") and not config_needed else ""
                raise RunArgumentError(f"{err}{hint}") from None
        root = layout.run_root(config["results_dir"], config["run"])
        prefix = args.default_storage_prefix
        url = given_url or layout.run_url(root, "s3" if prefix else None, prefix)
        if not is_s3_url(url) and workdir is not None and not Path(url).is_absolute():
            url = str(Path(workdir) / url)
        if must_exist and not is_s3_url(url) and not Path(url).is_dir():
            if given_url:
                raise RunArgumentError(f"argument --run-url: no such folder: {url!r}")
            raise RunArgumentError(
                f"the run root {url} does not exist (run the workflow first, or give the run's "
                "--configfile and --default-storage-prefix)"
            )
        return Run(config, url, root)
