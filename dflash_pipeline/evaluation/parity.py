"""Parity gate: the acceptance length simulated in training against the one of the real loop.

Training measures a teacher-forced acceptance length on held-out data; the real loop measures tau
with the served template, the exported checkpoint and the target's own outputs. A drafter that is
right in one and wrong in the other shows a gap; above the tolerance the gate fails with the usual
causes, so nobody trusts a training number the serving loop does not reproduce (train
accuracy is not evidence of a working drafter).
"""

from __future__ import annotations

import json


from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.engines.limits import DrafterShape, notes, refusals

# The config's evaluate.parity_tolerance and engine_parity_tolerance defaults.
DEFAULT_TOLERANCE = schema_defaults("evaluate")["parity_tolerance"]

CAUSES_LOOP_BELOW = (
    "chat template or thinking mode differs between training data and evaluation prompts",
    "target layer ids off by one (tap = output of layer id = HF hidden_states[id + 1])",
    "RoPE fields of the exported drafter differ from training (rope_theta, scaling, partial factor)",
    "weights skipped or renamed on export/load (missing tensors load as random)",
    "sliding-window drafter layers run as full attention (or the reverse)",
    "mask token id or block size in the exported config differ from training",
    "the loop's target differs from the one that produced the training data (checkpoint, dtype)",
)
CAUSES_LOOP_ABOVE = (
    "the simulation ran on other data than the evaluation prompts (held-out split, prompt sets)",
    "the simulation counts acceptance differently (positions, block size, loss-mask positions)",
)


class ParityError(AssertionError):
    """The loop's tau and the simulated tau disagree beyond the tolerance."""


# A gap exactly at the tolerance passes; this absorbs the rounding of the division.
_GAP_EPSILON = 1e-9


def relative_gap(reference: float, measured: float, tolerance: float, what: str) -> tuple[float, bool]:
    """(measured - reference) / reference and whether its size is within the tolerance
    (inclusive); ``what`` names the reference in the error for a non-positive one."""
    if reference <= 0:
        raise ValueError(f"{what} must be positive, got {reference}")
    gap = (measured - reference) / reference
    return gap, abs(gap) <= tolerance + _GAP_EPSILON


def parity_report(simulated_tau: float, loop_tau: float, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """Both numbers side by side; ``gap`` is (loop - simulated) / simulated."""
    gap, passed = relative_gap(simulated_tau, loop_tau, tolerance, "simulated tau")
    return {
        "simulated_tau": round(simulated_tau, 4),
        "loop_tau": round(loop_tau, 4),
        "gap": round(gap, 4),
        "tolerance": tolerance,
        "passed": passed,
    }


def check_parity(simulated_tau: float, loop_tau: float, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """The report, or ParityError naming the gap and where to look."""
    report = parity_report(simulated_tau, loop_tau, tolerance)
    if report["passed"]:
        return report
    below = report["gap"] < 0
    causes = CAUSES_LOOP_BELOW if below else CAUSES_LOOP_ABOVE
    raise ParityError(
        f"acceptance parity failed: the real loop's tau {loop_tau:.3f} is "
        f"{abs(report['gap']):.0%} {'below' if below else 'above'} the simulated tau "
        f"{simulated_tau:.3f} from training (tolerance {tolerance:.0%}). Usual causes:\n"
        + "\n".join(f"  - {cause}" for cause in causes)
    )


# --- the serving engine's tau against the loop's ---------------------------------------------------
# The loop has the engines' semantics, so only implementation differences (and what the engine
# reads from the export) separate the two: a tighter tolerance than training parity's.
DEFAULT_ENGINE_PARITY_TOLERANCE = schema_defaults("evaluate")["engine_parity_tolerance"]
CAUSES_ENGINE_BELOW = (
    "target layer ids tapped one layer off: the project's id i is the OUTPUT of layer i "
    "(HF hidden_states[i + 1]); vLLM 0.20.1 hands dflash_config.target_layer_ids straight to its "
    "aux-hidden-state hook, which captures hidden_states[i] (fixed later by vLLM PR #40727)",
    "sliding-window fields not read: the engine runs sliding_attention drafter layers as full "
    "attention (layer_types / sliding_window / dflash_config.use_swa, swa_window_size, causal)",
    "mask token id: dflash_config.mask_token_id missing, different from training, or outside the target vocab",
    "RoPE: the engine builds the drafter's rotary embedding from rope_theta / rope_parameters "
    "(vLLM defaults theta to 1e6 when absent), not what training used",
    "dtype or target: the engine runs another dtype (bf16 vs the loop's fp32), a quantized or "
    "different target checkpoint",
    "block size: num_speculative_tokens (vLLM) / --speculative-num-draft-tokens (SGLang) differ from the loop's B",
)
CAUSES_ENGINE_ABOVE = (
    "the loop is wrong where the engine is right (loop verify, cache rollback, tap extraction)",
    "counting differs: SGLang's completion_tokens include the prefill token (short replies read "
    "high); the prompts, chat template or thinking mode differ between the two runs",
)


def known_engine_limitations(engine: str, version: str | None, fields: dict, build: str = "gpu") -> list[str]:
    """What this engine version does not serve of the drafter whose config fields are given,
    from the engine-limits table (``engines.limits``), plus its behaviours there; [] when none
    is known (or the version is unknown)."""
    shape = DrafterShape(layer_types=tuple(fields.get("layer_types") or ()))
    return refusals(engine, version, build, shape) + notes(engine, version)


def _all_prompts(report: dict) -> str:
    return f" (all prompts: {report['engine_tau']:.3f} against {report['loop_tau']:.3f}, gap {report['gap']:+.4f})"


class EngineParityError(AssertionError):
    """The engine's tau and the loop's tau disagree beyond the tolerance."""


# --- servers -------------------------------------------------------------------------------------


def same_output_taus(loop_rows: list[dict], engine_rows: list[dict]) -> dict:
    """Both taus over the prompts whose engine output is the loop's, token for token (equal
    ``trajectory`` digests in the two per-prompt lists). Where a bf16 near tie sends the engine's
    text another way, the two taus measure different texts; on the same text they measure the
    same drafts, and any gap left is the engine's implementation or what it read from the export."""
    engine_by_id = {row["id"]: row for row in engine_rows}
    same, differing = [], []
    for row in loop_rows:
        other = engine_by_id.get(row["id"])
        if other is not None and row.get("trajectory") and other.get("trajectory") == row["trajectory"]:
            same.append((row, other))
        else:
            differing.append(row["id"])

    def tau(rows: list[dict]) -> float | None:
        steps = sum(r["verify_steps"] for r in rows)
        return round(sum(r["committed_tokens"] for r in rows) / steps, 4) if steps else None

    return {
        "prompts": len(same),
        "of": len(loop_rows),
        "loop_tau": tau([pair[0] for pair in same]),
        "engine_tau": tau([pair[1] for pair in same]),
        "differing_ids": differing,
    }


def engine_parity_report(
    loop_tau: float,
    engine_tau: float,
    tolerance: float = DEFAULT_ENGINE_PARITY_TOLERANCE,
    *,
    engine: str,
    engine_version: str | None,
    drafter_fields: dict,
    same_output: dict | None = None,
) -> dict:
    """Both numbers side by side; ``gap`` is (engine - loop) / loop. The tolerance is tighter
    than training parity's: the loop has the engines' semantics, so only implementation
    differences (and what the engine reads from the export) separate them.

    With ``same_output`` (``same_output_taus``) the gate judges the prompts whose engine output
    is the loop's when they are at least half of all: a prompt whose text went another way at a
    near tie (bf16; the lossless check judges those) measures the drafter on another text, and
    on a few prompts one such text can move tau by more than the tolerance. Both gaps are
    reported."""
    gap, passed = relative_gap(loop_tau, engine_tau, tolerance, "loop tau")
    report = {
        "loop_tau": round(loop_tau, 4),
        "engine_tau": round(engine_tau, 4),
        "gap": round(gap, 4),
        "tolerance": tolerance,
        "passed": passed,
        "engine": engine,
        "engine_version": engine_version,
        "drafter_fields": dict(drafter_fields),
        "known_limitations": known_engine_limitations(engine, engine_version, drafter_fields),
    }
    if same_output is not None:
        report["same_output"] = dict(same_output)
        report["judged_on"] = "all prompts"
        loop_same, engine_same = same_output["loop_tau"], same_output["engine_tau"]
        if loop_same and engine_same is not None and 2 * same_output["prompts"] >= same_output["of"]:
            same_gap, same_passed = relative_gap(loop_same, engine_same, tolerance, "loop tau")
            report["same_output"]["gap"] = round(same_gap, 4)
            report["judged_on"] = f"the {same_output['prompts']} of {same_output['of']} prompts with the same output"
            report["passed"] = same_passed
    return report


def _all_prompts(report: dict) -> str:
    return f" (all prompts: {report['engine_tau']:.3f} against {report['loop_tau']:.3f}, gap {report['gap']:+.4f})"


def check_engine_parity(report: dict) -> dict:
    """The report, or EngineParityError naming both taus (of the prompts it judged, and of all
    where those are fewer), the gap, the engine and version, the drafter fields it read, and
    where to look."""
    if report["passed"]:
        return report
    judged = report["same_output"] if "gap" in report.get("same_output", {}) else report
    below = judged["gap"] < 0
    causes = CAUSES_ENGINE_BELOW if below else CAUSES_ENGINE_ABOVE
    fields = "\n".join(f"    {key}: {json.dumps(value)}" for key, value in report["drafter_fields"].items())
    version = report["engine_version"] or "(version unknown)"
    known = "".join(
        f"  Known limitation of this engine version (the likely cause):\n  - {limitation}\n"
        for limitation in report.get("known_limitations", ())
    )
    on = f" on {report['judged_on']}" if "judged_on" in report else ""
    raise EngineParityError(
        f"engine parity failed: {report['engine']} {version} "
        f"measured tau {judged['engine_tau']:.3f}, {abs(judged['gap']):.1%} "
        f"{'below' if below else 'above'} the project loop's tau {judged['loop_tau']:.3f} "
        f"(gap {judged['gap']:+.4f}, tolerance {report['tolerance']:.0%}){on}"
        f"{_all_prompts(report) if judged is not report else ''}.\n"
        f"  Drafter config fields the engine read:\n{fields}\n{known}  Usual causes:\n"
        + "\n".join(f"  - {cause}" for cause in causes)
    )
