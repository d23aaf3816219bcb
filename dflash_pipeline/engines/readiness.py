"""The engines a run will launch, checked when the workflow is planned (``snakemake -n`` included),
before any job: each is installed where ``engines.<engine>.python`` says, and the evaluation
engine's installed version serves the drafter the config trains (``engines.limits``). A wrong
setting fails the plan in one line per problem instead of a job days later.
"""

from __future__ import annotations

from dflash_pipeline.core.layout import stages_built
from dflash_pipeline.engines.environments import EngineSetupError, configured_engine, engine_env
from dflash_pipeline.engines.limits import DrafterShape, downgrades, refusals

# Generation engines are launched from `generate` on, the serving engine by `evaluate`.
SERVING_ENGINES = ("vllm", "sglang")


def engines_in_use(config: dict) -> dict[str, str]:
    """{engine: the config key that uses it} for the engines the stages the run builds launch
    (``layout.stages_built``)."""
    built = stages_built(config)
    used: dict[str, str] = {}
    generation = config["generation"]["engine"]
    if "generate" in built and generation != "endpoint":
        used[generation] = "generation.engine"
    evaluation = config["evaluate"]["engine"]
    if "evaluate" in built and evaluation in SERVING_ENGINES:
        used.setdefault(evaluation, "evaluate.engine")
    return used


def check_engines(config: dict) -> tuple[list[str], list[str]]:
    """(problems, one line each; the engines that are ready, one line each) for the engines of
    a validated config."""
    problems, ready = [], []
    shape = DrafterShape.from_train_config(config["train"])
    evaluates = "evaluate" in stages_built(config)
    for engine, key in engines_in_use(config).items():
        try:
            install = configured_engine(engine, config["engines"])
        except EngineSetupError as err:
            problems.append(f"{key}: {err}")
            continue
        serves = engine in SERVING_ENGINES and evaluates and config["evaluate"]["engine"] == engine
        refused = refusals(engine, install.version, install.build, shape) if serves else []
        # The server's environment as launch builds it (this process's, engines.<engine>.env on top).
        if serves:
            refused += downgrades(engine, install.version, shape, engine_env(engine, config["engines"]))
        problems += [f"evaluate.engine: {text} (engines.{engine}.python: {install.python})" for text in refused]
        if not refused:
            served = f", serves the {shape.describe()}" if serves else ""
            ready.append(f"{key}: {install.describe()}{served}")
    return problems, ready
