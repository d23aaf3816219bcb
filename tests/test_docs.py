"""The project cites only its own documents: every ``*.md`` file named in its text files exists.

A citation of a file the reader cannot open (a private spec, a note outside the repository) is
a dead end; the project's docs/ say the same things in its own words.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The text files a reader meets: code, docs, configs, the workflow.
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".smk", ".toml", ".txt", ".sh", ".cfg", ".ini", ".json"}
TEXT_NAMES = {"Snakefile", "Makefile"}
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
# A file name ending in .md, with an optional relative folder (docs/training.md, ../README.md).
CITED_MD = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*[\w-]+(?:/[\w.-]+)*\.md)\b")


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def _cited_md(text: str) -> set[str]:
    return {match.group(1) for match in CITED_MD.finditer(URL.sub(" ", text))}


def test_the_citation_pattern_finds_names_and_skips_urls():
    missing = "spec" + ".md"  # split, so that this file cites no missing file itself
    text = f"see docs/training.md, ../README.md and {missing}; https://example.org/x/notes.md is a URL"
    assert _cited_md(text) == {"docs/training.md", "../README.md", missing}


def test_every_cited_markdown_file_is_in_the_repository():
    tracked = _tracked_files()
    md_files = [path for path in tracked if path.endswith(".md")]
    missing = []
    for path in tracked:
        file = REPO / path
        if (file.suffix not in TEXT_SUFFIXES and file.name not in TEXT_NAMES) or not file.is_file():
            continue
        if path.startswith("tests/fixtures/"):
            continue  # data that imitates users' files, not the project's text
        for name in sorted(_cited_md(file.read_text(errors="replace"))):
            # A name resolves against the citing file's folder, the repository root, or, cited
            # bare, as any tracked markdown file of that name (docs cite each other by name).
            relative = (file.parent / name).resolve()
            bare = name.lstrip("./")
            if relative.is_file() or (REPO / bare).is_file() or any(md.endswith("/" + bare) for md in md_files):
                continue
            missing.append(f"{path}: {name}")
    assert not missing, "cited markdown files that are not in the repository:\n" + "\n".join(missing)


def test_the_27b_example_states_one_prompt_count():
    """The example config, the README and docs/running.md give the same number of prompts:
    the config's plan.prompts, written as thousands (902K)."""
    import yaml

    example = REPO / "config/examples/qwen3.6-27b.yaml"
    count = f"{yaml.safe_load(example.read_text())['plan']['prompts'] // 1000}K prompts"
    for path in (example, REPO / "README.md", REPO / "docs/running.md"):
        text = path.read_text()
        stated = set(re.findall(r"\d[\d,.]*[KM] prompts", text))
        assert stated == {count}, f"{path.name}: {sorted(stated)} (expected only {count})"


def _make(*args: str) -> str:
    return subprocess.run(["make", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_make_help_lists_every_phony_target_with_one_line():
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    phony = {name for line in re.findall(r"^\.PHONY:(.*)$", makefile, re.MULTILINE) for name in line.split()}
    listed = dict(re.findall(r"^  ([\w-]+) +(\S.*)$", _make("-s", "help"), re.MULTILINE))
    assert phony and not phony - set(listed), f"not in make help: {sorted(phony - set(listed))}"


def test_make_dryrun_plans_an_s3_run_under_prefix_as_the_other_targets_do():
    # -n: make prints the recipe (and setup's, where .venv is missing) and runs nothing.
    s3 = _make("-n", "dryrun", "CONFIG=my-run.yaml", "PREFIX=s3://bucket/prefix").replace("\\\n", " ")
    assert re.search(
        r"-m snakemake -n .*--configfile my-run\.yaml\s+--profile profiles/s3 --default-storage-prefix s3://bucket/prefix",
        s3,
    ), s3
    local = _make("-n", "dryrun").replace("\\\n", " ")
    assert "-m snakemake -n" in local and "--profile" not in local and "--default-storage-prefix" not in local
