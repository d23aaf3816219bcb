"""The message that refuses a run before its first job: one line per problem, and the config files
to fix named once, after the problems the config causes.

A problem the config does not cause (no S3 credentials, an unreachable endpoint, storage that
denies access, a flag missing from the command line) is an ``EnvironmentProblem``: no edit of the
config fixes it, so its line is not followed by the config's name.
"""

from __future__ import annotations

from collections.abc import Iterable


class EnvironmentProblem(str):
    """A problem line of the environment the run is planned in (credentials, network, storage,
    command line), not of the config."""


def refusal_text(problems: Iterable[str], config_files: str) -> str:
    """The config's problems, then ``(check <config_files>)``, then the environment's problems;
    the tail only where a config problem is listed."""
    problems = list(problems)
    of_config = [line for line in problems if not isinstance(line, EnvironmentProblem)]
    of_environment = [line for line in problems if isinstance(line, EnvironmentProblem)]
    tail = [f"(check {config_files})"] if of_config else []
    return "\n".join([*of_config, *tail, *of_environment])
