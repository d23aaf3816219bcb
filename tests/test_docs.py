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


# --- links of the README and docs/: every relative file and #anchor resolves -----------------------

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) or [text](target "title"), not an image's inner text; inline code is blanked first.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (links as their text, code as its content),
    lower-cased, without punctuation other than hyphens and underscores, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose_lines(path.read_text()):
        anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
        match = HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")  # GitHub numbers repeats
    return anchors


def test_the_slug_of_a_heading_is_githubs():
    assert _slug("The GPU check (`gpu_check.py`, `make gpu-check`, `results/gpu_check-<device>.json`)") == (
        "the-gpu-check-gpu_checkpy-make-gpu-check-resultsgpu_check-devicejson"
    )
    assert _slug("One driver per run: the run lease") == "one-driver-per-run-the-run-lease"
    assert _slug("1b. tune (before the first generate job; `tune.enabled`)") == (
        "1b-tune-before-the-first-generate-job-tuneenabled"
    )


def test_every_relative_link_and_anchor_of_the_readme_and_docs_resolves():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        # Joined: a link's text may wrap onto the next line.
        prose = " ".join(_prose_lines(page.read_text()))
        for target in LINK.findall(INLINE_CODE.sub("``", prose)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # a URL (https:, mailto:)
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            name = f"{page.relative_to(REPO)}: {target}"
            if not file.exists():
                broken.append(f"{name} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{name} (no such heading in {file.relative_to(REPO)})")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_the_readme_fits_on_a_few_screens():
    # The two commands, the demo, your data and model, GPUs and clusters in short; the rest in docs/.
    assert len((REPO / "README.md").read_text().splitlines()) <= 300
