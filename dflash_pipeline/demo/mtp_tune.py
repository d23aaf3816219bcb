"""`tune` with MTP on the MTP test target (``dflash_pipeline.demo.mtp_target``): the GPU check's
MTP part (``bench/gpu_check.py --mtp``).

Runs the stage as a user runs it by hand (``python -m dflash_pipeline.stages.tune``), with
``tune.mtp: true`` and a few demo prompts in a prepared shard of their own, and says what came of
it: whether each server configuration (plain, MTP) started and was measured, and its output
tokens per second at each concurrency. A tune that fails (an MTP server that does not start, a
replay that fails) writes no result; the settings measured before the failure are read from the
stage's log, and its last lines are kept.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

# tune's log line per measured setting (dflash_pipeline.stages.tune.run_job), and the server's
# start and health lines (dflash_pipeline.engines.launch.ManagedServer).
SETTING_LINE = re.compile(r"\b(plain|MTP), concurrency (\d+): ([0-9.]+) output tokens/s")
STARTING_LINE = re.compile(r"starting \w+ server: (.*)")
HEALTHY_LINE = re.compile(r"\w+ server healthy at ")


def write_prompt_shard(path: str | Path, count: int, seed: int = 0) -> Path:
    """A prepared shard (the columns tune reads: ``id``, ``messages``) of ``count`` demo prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_pipeline.demo.task import prompt_messages, sample_problem

    rng = random.Random(seed)
    rows = [{"id": f"mtp-{i:04d}", "messages": prompt_messages(sample_problem(rng))} for i in range(count)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def tune_config(
    engine: str,
    python: str,
    *,
    gpus: int = 1,
    mem_fraction: float | None = None,
    extra_args: list[str] | None = None,
    sampling: dict | None = None,
    tune: dict | None = None,
) -> dict:
    """The config sections tune reads (generation, tune, engines), MTP on."""
    server = {"tp": 1, "dp": 1, "mem_fraction": mem_fraction, "extra_args": list(extra_args or [])}
    server["startup_timeout_s"] = 900
    settings = {"prompts": 16, "concurrencies": [1, 8], "max_new_tokens": 128, "seconds_per_setting": 60}
    return {
        "generation": {"engine": engine, "gpus_per_job": gpus, "server": server, "sampling": dict(sampling or {})},
        "tune": {**settings, **(tune or {}), "enabled": True, "mtp": True},
        "engines": {engine: {"python": python}},
    }


def run_tune_with_mtp(target: str | Path, work: str | Path, config: dict, timeout: float = 3600) -> dict:
    """Run the tune stage on ``target`` under ``work`` and summarize it (``summarize``)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = write_prompt_shard(work / "prepare-00000.parquet", config["tune"]["prompts"])
    out, engine_log = work / "tune-result.json", work / "tune-engine.log"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "dflash_pipeline.stages.tune", "--prompts", str(prompts), "--out", str(out)]
    command += ["--model", str(target), "--config-json", json.dumps(config)]
    command += ["--engine-log", str(engine_log), "--runtime-dir", str(work)]
    started = time.time()
    try:
        # From the folder that holds this package, so `-m` finds it installed or not.
        package_root = Path(__file__).resolve().parents[2]
        proc = subprocess.run(command, cwd=package_root, capture_output=True, text=True, timeout=timeout)
        code, log_text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, log_text = None, _text(err.stdout) + _text(err.stderr) + f"\n(tune killed after {timeout:.0f} s)"
    (work / "tune.log").write_text(log_text)
    result = json.loads(out.read_text()) if code == 0 and out.exists() else None
    summary = summarize(result, log_text)
    summary.update(exit_code=code, seconds=round(time.time() - started, 1), engine_log=str(engine_log))
    if code != 0:
        summary["log_tail"] = log_text[-3000:]
    return summary


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def servers_started(log_text: str) -> dict[str, bool]:
    """Per variant, whether tune's server of it started (became healthy): each start line of
    the log opens a server, speculative when its command line has a speculative flag."""
    started = {"plain": False, "MTP": False}
    current = None
    for line in log_text.splitlines():
        starting = STARTING_LINE.search(line)
        if starting:
            current = "MTP" if "--speculative" in starting.group(1) else "plain"
        elif current and HEALTHY_LINE.search(line):
            started[current] = True
    return started


def summarize(result: dict | None, log_text: str) -> dict:
    """Per variant (plain, MTP): whether its server started, whether it was measured and its
    output tokens/s per concurrency; MTP's ratio to plain where both were measured; tune's
    choice."""
    tokens: dict[str, dict[int, float]] = {"plain": {}, "MTP": {}}
    if result is not None:
        for setting in result["settings"]:
            variant = "MTP" if setting["mtp"] else "plain"
            tokens[variant][setting["concurrency"]] = setting["output_tokens_per_s"]
    else:
        for variant, concurrency, rate in SETTING_LINE.findall(log_text):
            tokens[variant][int(concurrency)] = float(rate)
    plain, mtp = tokens["plain"], tokens["MTP"]
    ratio = {c: round(mtp[c] / plain[c], 3) for c in sorted(mtp) if plain.get(c)}
    started = servers_started(log_text)
    return {
        "mtp_line": result["mtp"] if result else None,
        "plain_started": started["plain"],
        "mtp_started": started["MTP"],
        "mtp_measured": bool(mtp),
        "plain_tokens_per_s": {str(c): plain[c] for c in sorted(plain)},
        "mtp_tokens_per_s": {str(c): mtp[c] for c in sorted(mtp)},
        "mtp_to_plain": {str(c): r for c, r in ratio.items()},
        "choice": result["choice"] if result else None,
        "engine_version": result["engine_version"] if result else None,
        "device": result["device"] if result else None,
    }
