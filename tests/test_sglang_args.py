"""Every SGLang command line the project launches, through SGLang's real argument parser.

SGLang cannot serve on this CPU machine, but its argument handling runs: ``make sglang-args-envs``
installs SGLang 0.5.17 and 0.5.23 (envs/sglang-<version>-args.txt) next to .venv-vllm's CPU torch,
and ``tests/support/sglang_parse.py``, run by that interpreter, does to each command line what
``python -m sglang.launch_server`` does before it starts anything (argparse, SGLang's defaults,
aliases, checks and model-config lookups). The command lines come from the project's own builders
(``ServerSpec.from_config`` / ``sglang_command`` for generation, ``serving_server_spec`` for the
DFlash evaluation servers) with tiny fake model folders: a dense Qwen3 target, a hybrid
Qwen3.5-shaped target with an MTP layer (the shape of config/examples/qwen3.6-27b.yaml's
Qwen3.6-27B) and a drafter exported by the project's own ``DrafterConfig``. Each test checks that
SGLang accepts the command, that every value the project set reads back as set, and that SGLang
resolved what the project expects (DFLASH: num_draft_tokens = B, 1 step, top-k 1; NEXTN -> EAGLE
3/1/4; a hybrid target's DFlash server on the extra_buffer mamba cache).

``--device cuda`` is added to every command (in the extra args, as a user would): SGLang's DFLASH
checks refuse any other device ("DFLASH speculative decoding only supports CUDA and NPU devices"),
and parsing needs no GPU. Hybrid targets are also parsed with the parse script's extra_buffer
allowance (``allow_extra_buffer_on_cpu``: SGLang asks torch, not ``--device``, whether the platform
can snapshot mamba state); each hybrid command is parsed without it too, and the only refusal
allowed there is that platform check.

The reply and request tests read the installed SGLang's source: the fields the project reads from
a ``/generate`` reply must be written there, the fields it sends must be declared.

After a version bump, re-measure envs/sglang-<version>-args.txt: run the parse script with
``--report-imports`` over this module's items (``parse_version``) and install what it lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from dflash_pipeline.engines.tuning import mtp_speculative
from dflash_pipeline.core.config import load_run_config
from dflash_pipeline.engines.client import Sampling, SglangAdapter
from dflash_pipeline.engines.launch import ServerSpec, server_command
from dflash_pipeline.evaluation.engine_counters import SGLANG_HISTOGRAM_FIELDS
from dflash_pipeline.evaluation.serving import serving_server_spec
from dflash_pipeline.model.config import DrafterConfig
from tests.support.ci import skip_unless_ci
from tests.support.engine_envs import REPO, vllm_python

VERSIONS = ("0.5.17", "0.5.23")
ENVS = REPO / ".sglang-args"
PARSER = REPO / "tests" / "support" / "sglang_parse.py"
TORCHVISION_STUB = REPO / "tests" / "support" / "torchvision_stub"
EXAMPLE = REPO / "config" / "examples" / "qwen3.6-27b.yaml"
PARSE_TIMEOUT = 900  # import + one fork per command line; generous for a loaded 2-core machine

# SGLang refuses DFLASH on any device but CUDA and NPU; parsing needs no GPU.
DEVICE = ["--device", "cuda"]
BLOCK_SIZE = 8  # not SGLang's default (16), so an inferred block size is told from the default
PORT = 30000
# The MTP setting tune measures and generate then runs (dflash_pipeline.engines.tuning).
MTP = mtp_speculative(3)

# Each flag the project passes: the ServerArgs field it sets and the type argparse gives it.
# --mamba-scheduler-strategy is the old name of --mamba-radix-cache-strategy (sglang 0.5.14-0.5.19
# keep it as a deprecated alias; the field of <= 0.5.13 was mamba_scheduler_strategy).
FLAG_FIELDS = {
    "--model-path": ("model_path", str),
    "--host": ("host", str),
    "--port": ("port", int),
    "--tp-size": ("tp_size", int),
    "--dp-size": ("dp_size", int),
    "--mem-fraction-static": ("mem_fraction_static", float),
    "--reasoning-parser": ("reasoning_parser", str),
    "--speculative-algorithm": ("speculative_algorithm", str),
    "--speculative-num-steps": ("speculative_num_steps", int),
    "--speculative-eagle-topk": ("speculative_eagle_topk", int),
    "--speculative-num-draft-tokens": ("speculative_num_draft_tokens", int),
    "--speculative-draft-model-path": ("speculative_draft_model_path", str),
    "--speculative-dflash-block-size": ("speculative_dflash_block_size", int),
    "--mamba-scheduler-strategy": ("mamba_radix_cache_strategy", str),
    "--mamba-radix-cache-strategy": ("mamba_radix_cache_strategy", str),
    "--context-length": ("context_length", int),
    "--device": ("device", str),
}
# tests/support/sglang_parse.py EXTRA_BUFFER_PLATFORM_REFUSALS, as the AssertionError reads.
PLATFORM_REFUSALS = {
    "AssertionError: extra_buffer needs CUDA/MUSA/NPU/ROCm (FLA).",
    "AssertionError: extra_buffer requires platform support for Mamba cache state snapshots.",
}

# Problems the parser finds in what the project builds, marked (strict xfail) until fixed. None is
# open: the hybrid DFlash server's --mamba-scheduler-strategy (removed in SGLang 0.5.20) became
# --mamba-radix-cache-strategy (serving.sglang_mamba_flag).
KNOWN: dict = {}


# --- environments ---------------------------------------------------------------------------------


def parser_env(version: str) -> Path:
    """The SGLang ``version`` parser folder, built from the current requirement file; skipped with
    the reason where it is not, failed in CI (``CI=true``), where `make test` builds it (as
    ``vllm_python``)."""
    folder = ENVS / version
    requirements = REPO / "envs" / f"sglang-{version}-args.txt"
    stamp = folder / f".installed-{hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]}"
    if stamp.exists():
        return folder
    state = "is out of date" if folder.exists() else "is not built"
    skip_unless_ci(f"{folder} {state}: `make sglang-args-envs` installs SGLang {version}'s parser")


def run_parser(version: str, items: list) -> list[dict]:
    """SGLang ``version``'s verdict on each item: an argv, or ``{"argv": [...],
    "allow_extra_buffer_on_cpu": true}`` (tests/support/sglang_parse.py)."""
    python = vllm_python()  # skipped (failed in CI) without .venv-vllm, whose torch the env links
    folder = parser_env(version)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=f"{folder}{os.pathsep}{TORCHVISION_STUB}", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [str(python), "-S", str(PARSER), "-"],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        env=env,
        timeout=PARSE_TIMEOUT,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"the SGLang {version} parser failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["sglang_version"] == version, f"{folder} holds SGLang {answer['sglang_version']}"
    return answer["results"]


# --- fake models ----------------------------------------------------------------------------------


# The tiny language-model shape both fake targets share.
TINY_TEXT = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
}


def qwen3_target() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **TINY_TEXT,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def qwen3_5_target() -> dict:
    """Qwen3.6-27B's shape (Qwen3_5ForConditionalGeneration: Gated-DeltaNet layers, every 4th one
    full attention, one MTP layer), tiny."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            **TINY_TEXT,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "full_attention_interval": 4,
            "attn_output_gate": True,
            "mtp_num_hidden_layers": 1,
            "dtype": "bfloat16",
            "eos_token_id": 2,
        },
        "vision_config": {
            "model_type": "qwen3_5_vision",
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 256,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 256,
        },
        "image_token_id": 1000,
        "video_token_id": 1001,
        "vision_start_token_id": 1002,
        "vision_end_token_id": 1003,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Fake model folders (config.json only): the two targets and the drafter, exported as the
    project exports it (the qwen3.6-27b example's shape: sliding and full layers mixed)."""
    root = tmp_path_factory.mktemp("sglang-models")
    drafter = root / "drafter"
    drafter.mkdir()
    DrafterConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        block_size=BLOCK_SIZE,
        mask_token_id=1010,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=256,
    ).save(drafter / "config.json")
    return {
        "dense": write_config(root / "qwen3", qwen3_target()),
        "hybrid": write_config(root / "qwen3.5", qwen3_5_target()),
        "drafter": drafter,
    }


# --- the project's command lines ------------------------------------------------------------------

# name: (target, what SGLang should resolve: "none" | "mtp" | "dflash")
CASES = {
    "generation-dense": ("dense", "none"),
    "generation-hybrid": ("hybrid", "none"),
    "generation-hybrid-mtp": ("hybrid", "mtp"),
    "dflash-dense": ("dense", "dflash"),
    "dflash-hybrid": ("hybrid", "dflash"),
    "plain-dense": ("dense", "none"),
    "plain-hybrid": ("hybrid", "none"),
}


def generation_spec(model: Path, speculative: dict, reasoning_parser: str | None = None) -> ServerSpec:
    """The generation server of config/examples/qwen3.6-27b.yaml (its `generation.server` and
    `engines` sections, schema defaults filled), as generate jobs build it."""
    config = load_run_config([EXAMPLE])
    server = dict(config["generation"]["server"])
    server["speculative"] = speculative
    server["reasoning_parser"] = reasoning_parser
    server["extra_args"] = [*server["extra_args"], *DEVICE]
    return ServerSpec.from_config("sglang", str(model), PORT, server, config["engines"])


def project_command(case: str, models: dict[str, Path]) -> list[str]:
    """The project's full command line of ``case``."""
    target = models[CASES[case][0]]
    kind, _, rest = case.partition("-")
    if kind == "generation" and rest.endswith("mtp"):
        # The MTP server also passes a reasoning parser (null in the example; Qwen's when set).
        spec = generation_spec(target, MTP, reasoning_parser="qwen3")
    elif kind == "generation":
        spec = generation_spec(target, {})
    else:
        spec = serving_server_spec(
            "sglang", target, models["drafter"], BLOCK_SIZE, PORT, hybrid=rest == "hybrid",
            speculative=kind == "dflash", extra_args=DEVICE, python="/sglang/bin/python",
        )  # fmt: skip
    return server_command(spec)


def server_argv(command: list[str]) -> list[str]:
    """The server arguments of a project command: after ``<python> -m sglang.launch_server``."""
    assert command[1:3] == ["-m", "sglang.launch_server"], command
    return command[3:]


def flag_values(argv: list[str]) -> dict[str, str]:
    """{flag: value} of a command line of single-valued flags; an unknown flag fails here, so a
    flag the builders start passing gets its check added to FLAG_FIELDS."""
    values = {}
    tokens = iter(argv)
    for flag in tokens:
        assert flag in FLAG_FIELDS, (
            f"the project passes {flag!r}, which this test does not check yet: add it to FLAG_FIELDS"
        )
        values[flag] = next(tokens)
    return values


# --- parsing, once per version --------------------------------------------------------------------


def inferred_block_size_argv(models: dict[str, Path]) -> list[str]:
    """DFLASH with no block flag: SGLang infers B from the drafter's config.json (not a command
    the project launches: it shows SGLang reads the project's export)."""
    return [
        "--model-path", str(models["dense"]), "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(models["drafter"]), *DEVICE,
    ]  # fmt: skip


def parse_version(version: str, models: dict[str, Path]) -> dict:
    """Each case's command and SGLang ``version``'s verdict (for hybrid targets: with the
    extra_buffer platform allowance, and without it in ``without_allowance``), plus the inferred
    block size run. One parser run (one import of SGLang)."""
    commands = {case: project_command(case, models) for case in CASES}
    hybrid = [case for case, (target, _) in CASES.items() if target == "hybrid"]
    items = [server_argv(commands[case]) for case in CASES]
    items += [{"argv": server_argv(commands[case]), "allow_extra_buffer_on_cpu": True} for case in hybrid]
    items += [inferred_block_size_argv(models)]
    results = run_parser(version, items)
    plain = dict(zip(CASES, results[: len(CASES)]))
    allowed = dict(zip(hybrid, results[len(CASES) : len(CASES) + len(hybrid)]))
    return {
        "version": version,
        "commands": commands,
        "results": {**plain, **allowed},
        "without_allowance": plain,
        "inferred_block_size": results[-1],
    }


class _ByVersion(dict):
    """parse_version of a version on first use."""

    def __init__(self, models):
        super().__init__()
        self.models = models

    def __missing__(self, version):
        self[version] = parse_version(version, self.models)
        return self[version]


@pytest.fixture(scope="module")
def sglang(models) -> dict:
    """{version: parse_version(version)}, each computed once, when a test first needs it."""
    return _ByVersion(models)


def describe(result: dict) -> str:
    return f"{result.get('error')}\nargparse: {result.get('argparse_error')}\n{result.get('traceback') or ''}"


def cases():
    """(version, case) pairs, the KNOWN problems marked."""
    for version in VERSIONS:
        for case in CASES:
            marks = [KNOWN[version, case]] if (version, case) in KNOWN else []
            yield pytest.param(version, case, marks=marks, id=f"{version}-{case}")


# --- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version,case", list(cases()))
def test_sglang_accepts_the_projects_server(sglang, version, case):
    """The project's command line of ``case`` is accepted by SGLang ``version`` without a
    deprecation warning, every value it sets reads back as set, and SGLang resolves what the
    project expects."""
    parsed = sglang[version]
    command = parsed["commands"][case]
    result = parsed["results"][case]
    shown = " ".join(command)
    assert result["ok"], f"SGLang {version} refuses the project's {case} server:\n{shown}\n{describe(result)}"

    # Round trip: every flag the project set reads back from SGLang's argparse as set.
    got = result["parsed"]
    for flag, value in flag_values(server_argv(command)).items():
        field, kind = FLAG_FIELDS[flag]
        assert field in got, f"SGLang {version} has no field {field} for {flag}"
        assert got[field] == kind(value), (
            f"SGLang {version}: {flag} {value} reads back as {field}={got[field]!r}\n{shown}"
        )

    # Resolution: what the server would run with.
    resolved = result["resolved"]
    for field in ("model_path", "host", "port", "tp_size", "dp_size", "device", "context_length"):
        assert resolved[field] == got[field], f"SGLang {version} changed {field}: {resolved[field]!r}"
    if got["mem_fraction_static"] is not None:
        assert resolved["mem_fraction_static"] == got["mem_fraction_static"]
    target, expect = CASES[case]
    steps = {k: resolved[f"speculative_{k}"] for k in ("num_steps", "eagle_topk", "num_draft_tokens")}
    if expect == "dflash":
        assert resolved["speculative_algorithm"] == "DFLASH", resolved
        assert steps == {"num_steps": 1, "eagle_topk": 1, "num_draft_tokens": BLOCK_SIZE}, steps
        assert resolved["speculative_draft_model_path"] == str(parsed_drafter(command))
    elif expect == "mtp":
        assert resolved["speculative_algorithm"] == "EAGLE", resolved  # NEXTN is EAGLE's alias
        assert steps == {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}, steps
        assert resolved["reasoning_parser"] == "qwen3"
    else:
        assert resolved["speculative_algorithm"] is None, resolved
    if target == "hybrid":
        # A hybrid target rolls its GDN state back after rejected drafts with extra_buffer (the
        # DFlash server asks for it; the others get it from SGLang's "auto", overlap being on).
        assert resolved["mamba_radix_cache_strategy"] == "extra_buffer", resolved
        without = parsed["without_allowance"][case]
        assert without["ok"] or without["error"] in PLATFORM_REFUSALS, (
            f"SGLang {version} refuses the {case} server on this CPU machine for a reason other "
            f"than the extra_buffer platform check:\n{shown}\n{describe(without)}"
        )

    # Last, so that a known deprecation (KNOWN) is reached only once all else holds.
    assert not result["deprecations"], (
        f"SGLang {version} deprecates a flag of the project's {case} server:\n{shown}\n"
        + "\n".join(result["deprecations"])
    )


def parsed_drafter(command: list[str]) -> str:
    return command[command.index("--speculative-draft-model-path") + 1]


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_reads_the_exported_block_size(sglang, version):
    """Without block flags SGLang takes B from the exported drafter's config.json (its
    dflash_config parser accepts the export: a config it cannot read falls back to 16)."""
    result = sglang[version]["inferred_block_size"]
    assert result["ok"], describe(result)
    resolved = result["resolved"]
    assert resolved["speculative_num_draft_tokens"] == BLOCK_SIZE, (
        f"SGLang {version} resolved {resolved['speculative_num_draft_tokens']} draft tokens, not "
        f"the exported block size {BLOCK_SIZE}:\n{result}"
    )
    assert (resolved["speculative_num_steps"], resolved["speculative_eagle_topk"]) == (1, 1)


# --- the reply fields -----------------------------------------------------------------------------

# What the project reads from an SGLang /generate reply (engines/client.py SglangAdapter.parse;
# evaluation/serving.py acceptance_from_response, output_ids), and where SGLang writes it: the file
# under sglang/srt/managers/, the literal that writes it.
REPLY_SOURCES = {
    "text": ("tokenizer_manager.py", '"text": state.get_text()'),
    "meta_info.prompt_tokens": ("tokenizer_manager.py", '"prompt_tokens": recv_obj.prompt_tokens[i]'),
    "meta_info.completion_tokens": ("tokenizer_manager.py", '"completion_tokens": recv_obj.completion_tokens[i]'),
    "meta_info.spec_verify_ct": ("tokenizer_manager.py", 'meta_info["spec_verify_ct"] = recv_obj.spec_verify_ct[i]'),
    "meta_info.spec_accept_length": ("tokenizer_manager.py", 'meta_info["spec_accept_length"] = ('),
    "meta_info.finish_reason": ("tokenizer_manager.py", '"finish_reason": recv_obj.finished_reasons[i]'),
    "meta_info.finish_reason.type": ("schedule_batch.py", '"type": "stop"'),
    "output_ids": ("tokenizer_manager.py", '"output_ids": state.output_ids'),
    "meta_info": ("tokenizer_manager.py", '"meta_info": meta_info'),
    # the counters on their way from the scheduler: the detokenizer passes them on
    "detokenizer: completion_tokens": ("detokenizer_manager.py", "completion_tokens=recv_obj.completion_tokens"),
    "detokenizer: spec_verify_ct": ("detokenizer_manager.py", "spec_verify_ct=recv_obj.spec_verify_ct"),
    "detokenizer: spec_num_correct_drafts": ("detokenizer_manager.py", "spec_num_correct_drafts=recv_obj.spec_num_correct_drafts"),
    "detokenizer: histogram": ("detokenizer_manager.py", "spec_correct_drafts_histogram=recv_obj.spec_correct_drafts_histogram"),
    "io_struct: spec_verify_ct": ("io_struct.py", "spec_verify_ct: Optional[List[int]]"),
    "io_struct: histogram": ("io_struct.py", "spec_correct_drafts_histogram: Optional[List[List[int]]]"),
    "io_struct: completion_tokens": ("io_struct.py", "completion_tokens: List[int]"),
    "io_struct: finished_reasons": ("io_struct.py", "finished_reasons: List[Optional[FinishReasonDict]]"),
}  # fmt: skip
# Which of SGLANG_HISTOGRAM_FIELDS each version writes into meta_info (the project takes the first
# one present): 0.5.17 writes spec_accept_histogram as a "backward-compat alias, remove in next
# release" of spec_correct_drafts_histogram; 0.5.23 no longer does.
HISTOGRAMS = {
    "0.5.17": {"spec_correct_drafts_histogram", "spec_accept_histogram"},
    "0.5.23": {"spec_correct_drafts_histogram"},
}


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_writes_the_reply_fields_the_project_reads(version):
    """Every reply field the project reads is written by the installed SGLang's source (read as
    text: the reply is built by the tokenizer manager, from the scheduler's output structs via the
    detokenizer), and the acceptance histogram under the names this version uses."""
    managers = parser_env(version) / "sglang" / "srt" / "managers"
    sources = {name: (managers / name).read_text() for name, _ in REPLY_SOURCES.values()}
    missing = [
        f"{field}: {literal!r} not in sglang/srt/managers/{name}"
        for field, (name, literal) in REPLY_SOURCES.items()
        if literal not in sources[name]
    ]
    assert not missing, f"SGLang {version} does not write what the project reads:\n" + "\n".join(missing)

    tokenizer_manager = sources["tokenizer_manager.py"]
    written = {h for h in SGLANG_HISTOGRAM_FIELDS if f'meta_info["{h}"]' in tokenizer_manager}
    assert written, f"SGLang {version} writes none of {SGLANG_HISTOGRAM_FIELDS} into meta_info"
    absent = sorted(set(SGLANG_HISTOGRAM_FIELDS) - written)
    assert written == HISTOGRAMS[version], (
        f"SGLang {version} writes meta_info[{sorted(written)}] (absent: {absent}); expected "
        f"{sorted(HISTOGRAMS[version])}"
    )
    # spec_verify_ct and spec_accept_length are only written while the scheduler reports correct
    # drafts (SGLang's guard on spec_num_correct_drafts): the project needs spec_verify_ct.
    assert 'hasattr(recv_obj, "spec_num_correct_drafts")' in tokenizer_manager


def class_body(path: Path, name: str) -> str:
    """The source of class ``name`` in ``path``: up to the next top-level statement."""
    text = path.read_text()
    match = re.search(rf"^class {name}\b.*?(?=^\S)", text + "\n.", re.M | re.S)
    assert match, f"{path}: no class {name}"
    return match.group(0)


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_takes_the_request_the_project_sends(version):
    """The /generate body the project sends (SglangAdapter.request, every sampling setting set)
    names only fields SGLang's GenerateReqInput and SamplingParams declare."""
    srt = parser_env(version) / "sglang" / "srt"
    path, body = SglangAdapter().request(
        "",
        [1, 2, 3],
        Sampling(max_new_tokens=8, temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, seed=0),
    )
    assert path == "/generate"
    declared = {
        "GenerateReqInput": class_body(srt / "managers" / "io_struct.py", "GenerateReqInput"),
        "SamplingParams": class_body(srt / "sampling" / "sampling_params.py", "SamplingParams"),
    }
    wanted = [("GenerateReqInput", key) for key in body]
    wanted += [("SamplingParams", key) for key in body["sampling_params"]]
    undeclared = [f"{cls}.{key}" for cls, key in wanted if not re.search(rf"^    {key}:", declared[cls], re.M)]
    assert not undeclared, f"SGLang {version} declares no field {undeclared} of the project's request"
