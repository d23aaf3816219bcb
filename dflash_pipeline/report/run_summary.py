"""The lines a run prints when it ends (rules/run_control.smk, onsuccess): what it built, the
headline figures (τ of the loop and the engine, lossless, speed-up), where the drafter and
the report are, and the target weights evaluate compared with the drafter's. The per-prompt lines of evaluate are far above by then; these are the last."""

from __future__ import annotations

import json

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import StorageError
from dflash_pipeline.report import headline

# The headline rows the summary states, in this order.
SUMMARY_ROWS = ("tau_loop", "tau_engine", "lossless", "speedup")


def run_summary(config: dict, run_url: str, storage, report_command: str = "make report") -> list[str]:
    """The summary of the run of ``config`` whose root is ``storage`` (at ``run_url``)."""
    built = layout.stages_built(config)
    lines = [f"Run {config['run']} done: {', '.join(built)} ({config['num_shards']} shards) in {run_url}"]
    metrics = None
    try:
        metrics = json.loads(storage.read_text(layout.EVAL_METRICS))
    except (StorageError, ValueError):
        pass  # a run that stops before evaluate: its figures read "not measured yet"
    figures = headline.headline(metrics, evaluate_engine=config["evaluate"]["engine"])
    rows = {row["key"]: row for row in headline.headline_rows(figures)}
    for key in SUMMARY_ROWS:
        row = rows[key]
        lines.append(f"  {row['label']}: {row['text'] or headline.NOT_MEASURED}")
    if "evaluate" in built or "train" in built:
        drafter = f"{run_url.rstrip('/')}/{layout.DRAFTER_DIR}/"
        try:
            exported = storage.exists(layout.DRAFTER_CONFIG)
        except StorageError:
            exported = False
        lines.append(f"  drafter: {drafter}" if exported else "  drafter: not exported (the run stops before export)")
    identity = (metrics or {}).get("target_weights")
    if identity:  # evaluate's comparison (model.target_identity)
        verdict = {True: "the drafter's", False: "NOT the drafter's", None: "not compared"}[identity.get("match")]
        lines.append(f"  target weights: {identity.get('evaluated')} ({verdict}: {identity.get('trained_against')})")
    lines.append(f"  report: {report_command} (every stage's figures; the headline first)")
    return lines
