"""Measure a DFlash drafter's acceptance length in a real speculative-decoding loop.

    python -m dflash_pipeline.stages.evaluate --target DIR --drafter DIR --prompts FILE --out metrics.json
        [--max-new-tokens N --temperature T --block-size B --thinking on|off --engine transformers|vllm|sglang]

Prompts are JSONL rows with OpenAI ``messages`` (and optionally ``id`` and ``prompt_set``), or the
prepare stage's prompts parquet (``--split heldout`` selects the held-out rows), rendered with the
target's chat template. With the default engine the target runs in transformers and the
exported drafter proposes blocks through ``dflash_pipeline.model.inference``; every prompt is also
decoded plainly, which gives the speedup estimate and, in greedy mode, the lossless check (the loop
must reproduce plain greedy decoding token for token). ``--engine vllm`` (or ``sglang``) also
serves the exported drafter in that engine (``dflash_pipeline.evaluation.serving``): acceptance per
prompt from the engine's own counters, losslessness against the engine's plain greedy output, and
the cross-engine parity gate (the engine's tau within ``--engine-parity-tolerance`` of the
loop's). The metrics JSON is written before any gate fails, so a failed run still shows what it
measured. A drafter whose export records other target weights than ``--target``'s
(``model.target_identity``) is refused before anything loads, or evaluated with a one-line
warning (``--target-mismatch warn``).

Its length (over 400 lines): the evaluate job runs the loop, the serving engine and both parity gates over
several prompt sets, and the stage's whole command line is here; the loop itself
(``evaluation.transformers_loop``) and the engines' measurement (``evaluation.serving``) are not.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, replace
from pathlib import Path

from dflash_pipeline.core.config import quantized_engine_problem
from dflash_pipeline.core.storage import write_atomically
from dflash_pipeline.evaluation.serving import ENGINES
from dflash_pipeline.model.target_identity import TargetMismatch, check_at_evaluate
from dflash_pipeline.evaluation.transformers_loop import (
    DEFAULTS,
    EvalOptions,
    eval_options,
    render_prompts,
    resolve_device_dtype,
    run_transformers_loop,
)

log = logging.getLogger(__name__)


def _write_json(path: Path, document: dict) -> None:
    with write_atomically(path) as tmp:
        tmp.write_text(json.dumps(document, indent=2) + "\n")


def _settings(target, drafter, prompts_path, options: EvalOptions, **resolved) -> dict:
    import torch
    import transformers

    settings = asdict(options)
    settings["engine_extra_args"] = list(options.engine_extra_args)
    settings.update(
        target=str(target),
        drafter=str(drafter),
        prompts=str(prompts_path),
        transformers=transformers.__version__,
        torch=torch.__version__,
        **resolved,
    )
    return settings


def run_evaluation(
    target: str | Path,
    drafter: str | Path,
    prompts_path: str | Path,
    out: str | Path,
    options: EvalOptions | None = None,
    load_proposer=None,
    heldout: list[str] = (),
    simulated_rows: int = DEFAULTS["simulated_rows"],
    benchmark_prompts: list[str] = (),
) -> dict:
    """Evaluate and write the metrics JSON; raises TargetMismatch before anything loads, and
    LosslessError, ParityError or EngineParityError after writing it.

    The one path of the command line and the evaluate job, in this order: the drafter's target
    weights checked against ``target``'s (``options.target_mismatch``); with ``options.engine``
    vllm or sglang the exported drafter measured inside that engine (``measure_engine``), before
    the target is loaded here (both want the GPU's memory); the target loaded once for all that
    follows: the simulated tau on the tokenized ``heldout`` rows where there are any (at most
    ``simulated_rows``; else ``options.simulated_tau`` is the parity gate's), the loop on the
    prompts (lossless check, parity gate against the simulated tau, the engine's tau gated against
    the loop's), then, once the gates passed, each of ``benchmark_prompts`` in the loop only (its
    lossless check gated too), added to the prompt sets. ``load_proposer(drafter_dir,
    target_model)`` defaults to the DFlash drafter's loader.
    """
    from dflash_pipeline.evaluation.prompts import read_eval_prompts
    from dflash_pipeline.model.target import load_target

    options = options or EvalOptions()
    if options.engine not in ("transformers", *ENGINES):
        raise ValueError(f"unknown engine {options.engine!r} (transformers, {', '.join(ENGINES)})")
    out = Path(out)
    # A drafter trained against other weights is refused here rather than measured at a
    # fraction of its acceptance.
    identity = check_at_evaluate(
        Path(drafter) / "model.safetensors", target, options.target_mismatch, options.target_quantization
    )
    engine_section = measure_engine(target, drafter, prompts_path, options, out) if options.engine in ENGINES else None
    prompts = read_eval_prompts(prompts_path, options.limit, options.split)
    # One copy of the target for all that follows, quantized where evaluate.target_quantization says.
    model = load_target(target, *resolve_device_dtype(options), options.target_quantization)
    simulated = None
    if heldout:
        from dflash_pipeline.evaluation.simulated import simulated_tau

        simulated = simulated_tau(str(drafter), str(target), list(heldout), max_rows=simulated_rows, target=model)
        log.info("simulated (teacher-forced, held-out) acceptance length: %s", simulated)
        options = replace(options, simulated_tau=simulated["tau"])
    results, sections, resolved = run_transformers_loop(target, drafter, prompts, options, load_proposer, model)

    from dflash_pipeline.evaluation.metrics import metrics_document
    from dflash_pipeline.evaluation.parity import engine_parity_report, parity_report, same_output_taus

    document = metrics_document(results, _settings(target, drafter, prompts_path, options, **resolved), **sections)
    loop_tau = document["overall"]["tau"]
    if options.simulated_tau is not None and loop_tau is not None:
        document["parity"] = parity_report(options.simulated_tau, loop_tau, options.parity_tolerance)
    if engine_section is not None:
        document["engine"] = engine_section
        if loop_tau is not None and engine_section["overall"]["tau"] is not None:
            document["engine_parity"] = engine_parity_report(
                loop_tau,
                engine_section["overall"]["tau"],
                options.engine_parity_tolerance,
                engine=engine_section["name"],
                engine_version=engine_section["version"],
                drafter_fields=engine_section["drafter_fields"],
                same_output=same_output_taus(document["per_prompt"], engine_section["per_prompt"]),
            )
    if simulated is not None:
        document["simulated"] = simulated
    document["target_weights"] = identity
    document["target_quantization"] = options.target_quantization
    _write_json(out, document)
    overall = document["overall"]
    log.info(
        "tau %s over %d verify steps, %d tokens; speedup estimate %s; metrics in %s",
        overall["tau"],
        overall["verify_steps"],
        overall["generated_tokens"],
        overall["speedup_estimate"],
        out,
    )
    _check_gates(document, options)
    if benchmark_prompts:
        _add_benchmark_sets(document, target, drafter, benchmark_prompts, options, load_proposer, model)
        _write_json(out, document)
    return document


def _check_gates(document: dict, options: EvalOptions) -> None:
    from dflash_pipeline.evaluation.lossless import LosslessError, failure_message
    from dflash_pipeline.evaluation.parity import check_engine_parity, check_parity

    for where, lossless in (("loop", document.get("lossless")), ("engine", document.get("engine", {}).get("lossless"))):
        if lossless and lossless.get("checked") and not lossless["passed"]:
            raise LosslessError(f"{where}: {failure_message(lossless)}")
    if "parity" in document:
        check_parity(options.simulated_tau, document["overall"]["tau"], options.parity_tolerance)
    if "engine_parity" in document:
        check_engine_parity(document["engine_parity"])


def _add_benchmark_sets(document, target, drafter, paths, options: EvalOptions, load_proposer, model) -> None:
    """Each prompt file of ``paths`` decoded in the loop on the target already loaded, its prompt
    sets and prompts added to ``document``; a set the loop does not decode losslessly fails the
    job as the main prompts would (the engine and the parity gates are the main prompts' alone)."""
    from dflash_pipeline.evaluation.lossless import LosslessError, failure_message
    from dflash_pipeline.evaluation.metrics import metrics_document
    from dflash_pipeline.evaluation.prompts import read_eval_prompts

    options = replace(options, split=None, simulated_tau=None)
    for path in paths:
        prompts = read_eval_prompts(path, options.limit, options.split)
        results, sections, _ = run_transformers_loop(target, drafter, prompts, options, load_proposer, model)
        extra = metrics_document(results, {}, **sections)
        document["prompt_sets"].update(extra["prompt_sets"])
        document["per_prompt"] += extra["per_prompt"]
        lossless = sections["lossless"]
        if lossless.get("checked") and not lossless["passed"]:
            raise LosslessError(f"loop ({path}): {failure_message(lossless)}")


def generation_config_of(target: str | Path):
    """The target folder's generation config (its stop tokens), or None where it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target)
    except OSError:
        return None


def check_engine_serves(drafter: str | Path, engine: str, engines: dict | None):
    """The engine installed where ``engines`` says (``engines.environments``), or
    EngineUnsupportedError (one line) when the engine-limits table says that version cannot serve
    the exported drafter; None for the project's loop. Checked before any server starts."""
    if engine not in ENGINES:
        return None
    from dflash_pipeline.engines.environments import configured_engine, engine_env
    from dflash_pipeline.evaluation.serving import check_served

    install = configured_engine(engine, engines)
    check_served(engine, install.version, install.build, drafter, engine_env(engine, engines))
    return install


def measure_engine(target, drafter, prompts_path, options: EvalOptions, out: str | Path) -> dict:
    """The exported drafter inside vLLM or SGLang, on the same prompts as the loop: launched
    through the pipeline's own launch code, prompts sent as token ids, acceptance read per
    prompt, outputs compared with the same engine's plain greedy decoding. Returns the metrics
    JSON's ``engine`` section (the loop's format: overall, prompt sets, per prompt). The engine
    environment and the drafter's shape are checked before anything is loaded."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash_pipeline.engines.environments import engine_env
    from dflash_pipeline.engines.launch import free_port
    from dflash_pipeline.evaluation.metrics import metrics_document, trajectory_digest
    from dflash_pipeline.evaluation.prompts import read_eval_prompts
    from dflash_pipeline.evaluation.runner import target_stop_token_ids
    from dflash_pipeline.evaluation.serving import drafter_block_size, measure_in_engine, target_is_hybrid

    install = check_engine_serves(drafter, options.engine, options.engines)
    # The loop's dtype: the engine decodes what the loop decodes.
    dtype = str(resolve_device_dtype(options)[1]).removeprefix("torch.")
    prompts = read_eval_prompts(prompts_path, options.limit, options.split)
    tokenizer = AutoTokenizer.from_pretrained(target)
    block_size = options.block_size or drafter_block_size(drafter)
    prompt_ids = render_prompts(tokenizer, prompts, options.thinking)
    measured = measure_in_engine(
        options.engine,
        target,
        drafter,
        [(p.id, p.prompt_set, ids) for p, ids in zip(prompts, prompt_ids)],
        block_size,
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        log_dir=Path(options.runtime_dir or Path(out).parent),
        port=options.engine_port or free_port(),
        hybrid=target_is_hybrid(AutoConfig.from_pretrained(target)),
        seed=options.seed,
        tp=options.engine_tp,
        mem_fraction=options.engine_mem_fraction,
        extra_args=options.engine_extra_args,
        install=install,
        env=engine_env(options.engine, options.engines),
        reference_url=options.engine_reference_url,
        dtype=dtype,
        margin_tolerance=options.lossless_margin,
        hung_after_s=options.engine_hung_after_s,
    )
    stop = target_stop_token_ids(tokenizer, generation_config_of(target))
    for result in measured.results:
        result.trajectory = trajectory_digest(measured.outputs[result.id], stop)
    document = metrics_document(measured.results, measured.settings(), lossless=measured.lossless)
    section = {
        "name": measured.engine,
        "version": measured.engine_version,
        "distribution": install.distribution,
        "dtype": dtype,
        "drafter_fields": measured.drafter_fields,
        **{k: document[k] for k in ("overall", "prompt_sets", "per_prompt", "lossless")},
        "settings": document.get("settings"),
    }
    log.info(
        "%s %s: tau %s, lossless %s",
        measured.engine,
        measured.engine_version,
        section["overall"]["tau"],
        measured.lossless.get("passed"),
    )
    return section


def evaluate_job(
    target: str,
    drafter_config: str,
    prompts: str,
    heldout: list[str],
    out: str | Path,
    settings: dict,
    thinking: bool,
    failed_copy: str | Path,
    runtime_dir: str | Path | None = None,
    engines: dict | None = None,
    tracker: tuple[dict, str] | None = None,
) -> dict:
    """What the `evaluate` rule runs (``run_evaluation``): the simulated tau on held-out tokenized
    rows, the loop on the held-out prompts (gated on losslessness and parity), then the extra
    prompt sets; one target load for all of it, of the drafter exported as ``drafter_config``
    (its folder's config.json). A failed job's metrics are kept at ``failed_copy`` (Snakemake
    removes the output of a failed job); a serving engine's logs and raw counters go to
    ``runtime_dir``. ``tracker`` (the ``train`` section and the run root) is the experiment
    tracker that gets the headline figures, a failed gate's too: the metrics JSON is written
    before a gate fails."""
    import shutil

    options = eval_options(
        settings,
        thinking=thinking,
        split="heldout",
        runtime_dir=None if runtime_dir is None else str(runtime_dir),
        engines=engines,
    )
    try:
        return run_evaluation(
            target,
            str(Path(drafter_config).parent),
            prompts,
            out,
            options,
            heldout=heldout,
            simulated_rows=settings["simulated_rows"],
            benchmark_prompts=settings["benchmark_prompts"],
        )
    except Exception:
        if Path(out).exists():
            shutil.copyfile(out, failed_copy)
        raise
    finally:
        if tracker is not None:
            from dflash_pipeline.training.tracker import log_evaluation

            log_evaluation(*tracker, out)


def build_parser() -> argparse.ArgumentParser:
    from dflash_pipeline.stages.cli import (
        existing_file,
        float_range,
        int_range,
        model_dir,
        non_negative_float,
        non_negative_int,
        port,
        positive_float,
        positive_int,
    )

    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.stages.evaluate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", type=model_dir, required=True, help="target model folder (Hugging Face format)")
    parser.add_argument("--drafter", type=model_dir, required=True, help="exported drafter folder (z-lab format)")
    parser.add_argument(
        "--prompts",
        type=existing_file,
        required=True,
        help="JSONL rows with OpenAI `messages`, or the prepare stage's prompts parquet",
    )
    parser.add_argument("--split", help="only rows whose `split` is this (e.g. heldout)")
    parser.add_argument("--out", required=True, help="metrics JSON to write")
    parser.add_argument("--max-new-tokens", type=positive_int, default=EvalOptions.max_new_tokens)
    parser.add_argument("--temperature", type=non_negative_float, default=EvalOptions.temperature)
    parser.add_argument("--block-size", type=int_range(2), help="block size B (default: the drafter's)")
    parser.add_argument("--thinking", choices=("on", "off"), default="on")
    parser.add_argument("--seed", type=non_negative_int, default=EvalOptions.seed, help="sampling seed")
    parser.add_argument(
        "--engine",
        choices=("transformers", *ENGINES),
        default=EvalOptions.engine,
        help="vllm, sglang: also measure the drafter inside that engine and gate on parity with the loop",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32 ...")
    parser.add_argument(
        "--lossless-margin",
        type=non_negative_float,
        help="logit margin under which a greedy divergence counts as rounding (default 0 in fp32, 0.25 in bf16)",
    )
    parser.add_argument("--limit", dest="max_prompts", type=positive_int, help="evaluate only the first N prompts")
    parser.add_argument("--simulated-tau", type=positive_float, help="training's simulated tau (parity gate)")
    parser.add_argument("--parity-tolerance", type=non_negative_float, default=EvalOptions.parity_tolerance)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up decode")
    parser.add_argument(
        "--engine-parity-tolerance",
        type=non_negative_float,
        default=EvalOptions.engine_parity_tolerance,
        help="largest relative gap between the engine's tau and the loop's",
    )
    parser.add_argument("--engine-port", type=port, help="the engine's port (default: a free one)")
    parser.add_argument("--engine-tp", type=positive_int, default=EvalOptions.engine_tp)
    parser.add_argument(
        "--engine-mem-fraction", type=float_range(0.0, 1.0, low_open=True), help="the engine's GPU memory share"
    )
    parser.add_argument(
        "--engine-arg",
        dest="engine_extra_args",
        action="append",
        default=[],
        help="extra engine argument (repeatable)",
    )
    parser.add_argument(
        "--engine-hung-after-s",
        type=positive_float,
        default=EvalOptions.engine_hung_after_s,
        help="stop when the engine's server has given no healthy answer (to /health: none, or a 5xx) for this long",
    )
    parser.add_argument("--runtime-dir", help="engine log/pid folder (default: beside --out)")
    parser.add_argument(
        "--engine-python",
        help="the Python of the engine's own environment (vllm, sglang; default for transformers: this one)",
    )
    parser.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable of the engine process (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=1",
    )
    parser.add_argument(
        "--engine-reference-url",
        help="a running plain server of the engine with the same target: the lossless reference",
    )
    parser.add_argument(
        "--target-mismatch",
        choices=("refuse", "warn"),
        default="refuse",
        help="when the drafter's export records other target weights than --target's: refuse, or warn in one line",
    )
    parser.add_argument(
        "--target-quantization",
        choices=("fp8",),
        default=None,
        help="measure against the target quantized as train.target_quantization does it (the project's loop only)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    bad_env = [item for item in args.engine_env if "=" not in item or item.startswith("=")]
    if bad_env:
        from dflash_pipeline.stages.cli import shown

        parser.error(f"argument --engine-env: expected KEY=VALUE, got {shown(bad_env[0])}")
    env = dict(item.partition("=")[::2] for item in args.engine_env)
    quantized = quantized_engine_problem(args.engine, args.target_quantization, "--engine")
    if quantized:
        parser.error(f"argument --target-quantization: {quantized}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    options = eval_options(
        vars(args),
        thinking=args.thinking == "on",
        warmup=not args.no_warmup,
        engines={args.engine: {"python": args.engine_python, "env": env}},
    )
    from dflash_pipeline.engines.environments import EngineSetupError
    from dflash_pipeline.engines.limits import EngineUnsupportedError
    from dflash_pipeline.evaluation.lossless import LosslessError
    from dflash_pipeline.evaluation.parity import ParityError
    from dflash_pipeline.evaluation.prompts import PromptFileError
    from dflash_pipeline.evaluation.parity import EngineParityError

    try:
        run_evaluation(args.target, args.drafter, args.prompts, args.out, options)
    except (
        TargetMismatch,
        LosslessError,
        ParityError,
        EngineParityError,
        PromptFileError,
        EngineUnsupportedError,
        EngineSetupError,
    ) as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
