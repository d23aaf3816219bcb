"""The GPU recipe (envs/gpu/, `make gpu-env vllm-gpu-env sglang-env`), as far as a CPU machine can
check it: each engine in an environment of its own, pinned to versions that serve the drafter of
the 27B example, on the torch the pipeline's GPU environment installs."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dflash_pipeline.core.config import validate_config
from dflash_pipeline.engines.limits import DrafterShape, refusals
from tests.conftest import REPO

GPU = REPO / "envs" / "gpu"


def pins(name: str) -> dict[str, str]:
    found = {}
    for line in (GPU / name).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line)
        if match:
            found[match[1].lower()] = match[2]
    return found


def test_the_pinned_engines_serve_the_27b_example_drafter():
    example = validate_config(yaml.safe_load((REPO / "config/examples/qwen3.6-27b.yaml").read_text()))
    shape = DrafterShape.from_train_config(example["train"])
    assert "mixed" in shape.features()
    assert refusals("vllm", pins("vllm-0.34.0.txt")["vllm"], "gpu", shape) == []
    assert refusals("sglang", pins("sglang-0.5.23.txt")["sglang"], "gpu", shape) == []
    # ... and a DFlash2 drafter too (vLLM >= 0.28, SGLang >= 0.5.19: engines.limits, from their code).
    dflash2 = DrafterShape("dflash2", shape.layer_types)
    assert refusals("vllm", pins("vllm-0.34.0.txt")["vllm"], "gpu", dflash2) == []
    assert refusals("sglang", pins("sglang-0.5.23.txt")["sglang"], "gpu", dflash2) == []


def test_the_pipeline_gpu_env_takes_cuda_torch_from_pytorchs_index_and_the_gdn_kernels():
    text = (GPU / "pipeline-cu130.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cu130" in text
    assert pins("pipeline-cu130.txt")["torch"] == "2.11.0"  # the image's; the engines bring their own
    assert "flash-linear-attention" in pins("pipeline-cu130.txt")
    # vLLM 0.34.0's own pins do not resolve (flashinfer-python 0.7.3 is not on PyPI): its file is
    # the whole resolution, installed with --no-deps, on its own torch.
    vllm = pins("vllm-0.34.0.txt")
    assert (vllm["vllm"], vllm["torch"], vllm["flashinfer-python"]) == ("0.34.0", "2.14.0", "0.7.4")


def test_the_make_targets_build_each_environment_apart():
    def planned(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True).stdout

    assert "pip install --quiet -r envs/gpu/pipeline-cu130.txt" in planned("gpu-env")
    assert ".venv-vllm-gpu/bin/python -m pip install --quiet --no-deps -r envs/gpu/vllm-0.34.0.txt" in planned(
        "vllm-gpu-env"
    )
    assert ".venv-sglang/bin/python -m pip install --quiet -r envs/gpu/sglang-0.5.23.txt" in planned("sglang-env")
    # The CPU build is named explicitly for the demo and the tests.
    assert "torch==2.13.0+cpu" in (REPO / "Makefile").read_text()


def test_the_offline_wheel_targets_wire_the_script_with_empty_defaults():
    def planned(*args: str) -> str:
        return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True).stdout

    build = planned("gpu-wheels")
    assert "tools/gpu_wheels.py build --wheels .offline-wheels" in build
    assert '--sets "pipeline sglang-0.5.23 vllm-0.34.0"' in build
    assert '--allow-missing "llguidance"' in build
    # Nothing is skipped or repacked unless asked for.
    assert "--skip" not in build and "--no-fa3" not in build and "--base" not in build
    asked = planned("gpu-wheels", "WHEELS=w", "BASE=f.txt", "NO_FA3=1", "SKIP=^(py_spy|z3_solver)-")
    assert "--base f.txt --no-fa3 --skip '^(py_spy|z3_solver)-'" in asked
    install = planned("gpu-wheels-install", "WHEELS=w")
    assert f"tools/gpu_wheels.py install --wheels w --envs .gpu-envs --checkout {REPO}" in install
    # Every set the target builds by default has its lock.
    for name in re.search(r'--sets "([^"]+)"', build)[1].split():
        assert (GPU / "locks" / f"{name}.lock").exists()
    # The engines' lock pins agree with the index recipe's.
    locks = {name: pins(f"locks/{name}.lock") for name in ("sglang-0.5.23", "vllm-0.34.0")}
    assert locks["sglang-0.5.23"]["sglang"] == pins("sglang-0.5.23.txt")["sglang"]
    for name in ("vllm", "torch", "flashinfer-python", "transformers"):
        assert locks["vllm-0.34.0"][name] == pins("vllm-0.34.0.txt")[name], name
    makefile = (REPO / "Makefile").read_text()
    assert "--attention-backend triton --sampling-backend pytorch" in makefile


def test_the_gpu_check_runs_each_shape_an_engine_serves_and_says_why_not_the_others(monkeypatch):
    """bench/gpu_check.py (`make gpu-check`) asks the engine-limits table which drafter shapes an
    engine version serves: SGLang 0.5.17 serves full, sliding and mixed but not DFlash2, which the
    record names with the table's reason instead of running; 0.5.23 and vLLM 0.34 serve all four. The drafter trained from a vLLM
    taps server (train.taps_from: engine) is checked in vLLM's runs."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_check

    shapes = ["full", "sliding", "mixed", "dflash2", "engine_taps"]
    served, refused = gpu_check.served_shapes("sglang", "0.5.17", shapes)
    assert served == ["full", "sliding", "mixed"] and set(refused) == {"dflash2", "engine_taps"}
    assert "0.5.17" in refused["dflash2"] and "vLLM" in refused["engine_taps"]
    served, refused = gpu_check.served_shapes("vllm", "0.26.0", shapes)
    assert served == ["full", "sliding", "mixed", "engine_taps"] and set(refused) == {"dflash2"}
    assert gpu_check.served_shapes("vllm", "0.34.0", shapes) == (shapes, {})
    assert gpu_check.served_shapes("sglang", "0.5.23", shapes)[0] == ["full", "sliding", "mixed", "dflash2"]
    import serving_parity  # the variant's run trains from a taps server given its share; the others have none

    server = {"mem_fraction": 0.1, "extra_args": []}
    assert serving_parity.train_overrides("engine-taps", server) == {
        "num_layers": 2,
        "taps_from": "engine",
        "taps_server": server,
    }
    assert "taps_server" not in serving_parity.train_overrides("full", server)
    planned = subprocess.run(
        ["make", "-n", "gpu-check", "GPU_CHECK_ENGINES=sglang", "SGLANG_PYTHON=/envs/sglang/bin/python"],
        cwd=REPO, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert "bench/gpu_check.py --engine sglang=/envs/sglang/bin/python" in planned and "--engine vllm" not in planned


def test_the_gpu_check_runs_each_engine_in_a_workflow_folder_and_no_broken_export_without_a_drafter(
    monkeypatch, tmp_path
):
    """Each engine's runs get a copy of the workflow (Snakefile, config, rules...) in their own
    folder, as the workflow tests do (missed once on an H100: Snakemake found no config.yaml); a
    broken export is made of the first drafter whose own run succeeded, and of none when none did.
    The engine, its servers and Snakemake are stood in for: this is the check's wiring."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_check

    seen = []

    def run_variant(run_args, variant, work, reuse):
        seen.append((variant, run_args.misexport, sorted(p.name for p in work.iterdir())))
        return {"workflow_exit_code": exit_code, "workflow_seconds": 1.0}

    monkeypatch.setattr(gpu_check, "installed_engine", lambda engine, python: SimpleNamespace(version="0.5.17"))
    monkeypatch.setattr(
        gpu_check, "plain_reference", lambda *a: nullcontext(SimpleNamespace(spec=SimpleNamespace(url="http://ref")))
    )
    monkeypatch.setattr(gpu_check, "run_variant", run_variant)
    (tmp_path / "results" / "demo-target").mkdir(parents=True)  # no build
    args = SimpleNamespace(
        engine_args=[],
        shape=["full"],
        max_prompts=8,
        max_new_tokens=None,
        mem_fraction=0.3,
        no_broken=False,
        no_cuda_tests=False,
        parallel=False,
    )

    exit_code = 1
    result = gpu_check.check_engine("sglang", "/envs/sglang/bin/python", args, tmp_path)
    assert [(v, m) for v, m, _ in seen] == [("full", False)]
    assert {"Snakefile", "config.yaml", "rules", "scripts"} <= set(seen[0][2])
    assert result["broken_export"].startswith("not run: no drafter's own run succeeded")
    assert not gpu_check.passed({"cuda_tests": {"passed_all": True}, "engines": {"sglang": result}}, args)

    exit_code, seen[:] = 0, []
    result = gpu_check.check_engine("sglang", "/envs/sglang/bin/python", args, tmp_path)
    assert [(v, m) for v, m, _ in seen] == [("full", False), ("full", True)]
    # The stand-in's broken run "succeeded": the check says the broken export did not fail.
    assert result["broken_export"]["failed_as_it_should"] is False

    # A check of the sliding drafter alone breaks that one's export.
    args.shape, seen[:] = ["sliding"], []
    result = gpu_check.check_engine("sglang", "/envs/sglang/bin/python", args, tmp_path)
    assert [(v, m) for v, m, _ in seen] == [("sliding", False), ("sliding", True)]
    assert result["broken_export"]["of"] == "sliding"


def test_the_parallel_gpu_check_runs_the_later_shapes_and_the_broken_export_at_once_each_with_its_own_gpu_slots(
    monkeypatch, tmp_path
):
    """--parallel (a device's time is short): after the first shape (which makes the data), the
    other shapes and the broken export run at once, each with a temporary folder of its own (the
    GPU slot locks live there: in one folder the runs' GPU jobs took turns on an H100), and vLLM
    gets a fixed KV budget (its start-up memory profile fails while another process frees GPU
    memory). The stand-in runs meet at a barrier: they only pass it if they run at once."""
    import threading
    from contextlib import nullcontext
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_check

    seen, later = [], threading.Barrier(3, timeout=120)

    def run_variant(run_args, variant, work, reuse):
        seen.append((variant, run_args.misexport, reuse, run_args.beside_others, list(run_args.engine_arg)))
        if len(seen) > 1:
            later.wait()  # sliding, mixed and the broken export: all three in flight together
        return {"workflow_exit_code": 0 if not run_args.misexport else 1, "workflow_seconds": 1.0}

    monkeypatch.setattr(gpu_check, "installed_engine", lambda engine, python: SimpleNamespace(version="0.26.0"))
    monkeypatch.setattr(
        gpu_check, "plain_reference", lambda *a: nullcontext(SimpleNamespace(spec=SimpleNamespace(url="http://ref")))
    )
    monkeypatch.setattr(gpu_check, "run_variant", run_variant)
    (tmp_path / "results" / "demo-target").mkdir(parents=True)
    args = SimpleNamespace(
        engine_args=[], shape=["full", "sliding", "mixed"], max_prompts=8, max_new_tokens=None,
        mem_fraction=0.1, no_broken=False, no_cuda_tests=True, parallel=True,
    )  # fmt: skip
    result = gpu_check.check_engine("vllm", "/envs/vllm/bin/python", args, tmp_path)
    assert seen[0][:3] == ("full", False, None)  # alone first: it generates
    assert sorted((v, m, r) for v, m, r, _, _ in seen[1:]) == [
        ("full", True, None), ("sliding", False, "full"), ("swa", False, "full"),
    ]  # fmt: skip
    folders = [folder for _, _, _, folder, _ in seen]
    assert len(set(folders)) == 4 and all(folder.is_dir() and tmp_path in folder.parents for folder in folders)
    assert all(args_[-2:] == ["--kv-cache-memory-bytes", str(4 * 2**30)] for *_, args_ in seen)
    assert set(result["drafters"]) == {"full", "sliding", "mixed"}
    assert result["broken_export"]["of"] == "full" and result["broken_export"]["failed_as_it_should"]


def test_the_gpu_check_says_where_a_broken_export_failed(monkeypatch):
    """A refused export and one the parity gate caught both fail; the record tells them apart.
    The log tail is an H100 run's (vLLM 0.26, the reversed export refused at load)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_check

    tail = (
        '  File "dflash_pipeline/model/config.py", line 145, in validate\n'
        '    raise DrafterConfigError("invalid drafter config: " + "; ".join(problems))\n'
        "dflash_pipeline.model.config.DrafterConfigError: invalid drafter config: target_layer_ids [5, 1] must be "
        "strictly ascending\nRuleException:\nCalledProcessError in file rules/evaluate.smk, line 48:\n"
        "WorkflowError:\nAt least one job did not complete successfully.\n"
    )
    refused = {"workflow_exit_code": 1, "engine_parity_passed": None, "log_tail": tail}
    assert gpu_check.failed_at(refused) == (
        "DrafterConfigError: invalid drafter config: target_layer_ids [5, 1] must be strictly ascending"
    )
    caught = {"workflow_exit_code": 1, "engine_parity_passed": False, "log_tail": tail}
    assert gpu_check.failed_at(caught) == "the engine parity gate"
    assert gpu_check.failed_at({"workflow_exit_code": 0, "engine_parity_passed": True}) is None
    assert gpu_check.failed_at({"workflow_exit_code": 1, "engine_parity_passed": None, "log_tail": None}).startswith(
        "the workflow failed"
    )


def test_the_gpu_check_reuses_data_with_its_records_and_breaks_an_export_the_checksum_accepts(monkeypatch, tmp_path):
    """The check's later drafter shapes reuse the first one's data, each object with its checksum
    record (without it their readers refuse the object: missed once on an H100), and its broken
    export is recorded as export records what it writes, so that evaluate, not the checksum,
    must refuse it (missed once too: the checksum refused the edited config)."""
    import json

    from dflash_pipeline.core import checksums

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import serving_parity

    source, dest = tmp_path / "serving-full", tmp_path / "serving-sliding"
    (source / "outputs").mkdir(parents=True)
    (source / "drafter").mkdir()
    shard = source / "outputs" / "tokenize-00000.parquet"
    shard.write_bytes(b"rows")
    checksums.record_checksum(str(source), shard, "tokenize", 0)
    (source / "outputs" / "evaluate-metrics.json").write_text("{}")  # the drafter's own: not reused
    serving_parity.reuse_data(source, dest)
    assert sorted(p.name for p in (dest / "outputs").iterdir()) == ["tokenize-00000.parquet"]
    assert checksums.verify_local_copy(dest / "outputs" / "tokenize-00000.parquet", str(dest), "rule train")

    config = source / "drafter" / "config.json"
    config.write_text(
        json.dumps({"dflash_config": {"target_layer_ids": [1, 5]}, "eagle_aux_hidden_state_layer_ids": [2, 6]})
    )
    checksums.record_checksum(str(source), config, "export", "-")
    serving_parity.break_export(source, "reversed-taps")
    broken = json.loads(config.read_text())
    assert broken["dflash_config"]["target_layer_ids"] == [5, 1]
    assert broken["eagle_aux_hidden_state_layer_ids"] == [6, 2]
    assert checksums.verify_local_copy(config, str(source), "rule evaluate").producer() == "rule export (shard -)"


def test_the_taps_bench_scales_a_cut_target_and_prices_engine_fed_training_as_the_plan_does(monkeypatch):
    """bench/engine_taps.py: a target too big for the card is measured at fewer layers, its taps
    spread the same way and the 3:1 hybrid pattern kept; per trainer GPU, the engine on the
    training GPUs is priced by the plan's own rule, and a capture server apart feeds as many
    trainers as its rate over theirs (each trainer waits for the longer of its step and one
    sequence's taps)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import engine_taps

    from dflash_pipeline.core.bench_records import engine_on_the_training_gpus

    cut = engine_taps.fewer_layers(engine_taps.CASES["qwen3.6-27b"], 16)
    assert cut["target"]["num_hidden_layers"] == 16 and cut["drafter"]["target_layer_ids"] == [0, 4, 7, 11, 15]
    assert cut["target"]["hidden_size"] == 5120  # the width is the 27B's
    record = {"case": "qwen3-8b", "seq_len": 3000, "latency_s": 0.1, "capture_tokens_per_s": 60000.0}
    trainer = {
        "device": "card",
        "results": [
            {"case": "qwen3-8b", "mode": "drafter", "step_s": 0.2, "tokens_per_s": 15000.0},
            {"case": "qwen3-8b", "mode": "online", "step_s": 0.3, "tokens_per_s": 10000.0, "peak_gib": 38.0},
            {"case": "qwen3.6-27b", "mode": "drafter", "step_s": 9.0, "tokens_per_s": 1.0},
        ],
    }
    figures = engine_taps.trainer_figures(record, trainer)
    assert figures["engine_fed_tokens_per_s_per_gpu"] == round(engine_on_the_training_gpus(15000.0, 60000.0), 1)
    assert figures["engine_fed_tokens_per_s_per_gpu"] == 12000.0
    assert figures["capture_apart_trainer_tokens_per_s_per_gpu"] == 15000.0  # the step (0.2 s) is the longer
    assert figures["gpus_per_capture_server"] == 4.0
    assert figures["in_process_tokens_per_s_per_gpu"] == 10000.0
    assert engine_taps.trainer_figures({**record, "case": "qwen3.6-27b"}, trainer)["drafter_step_s"] == 9.0
    failed = {key: value for key, value in record.items() if key != "capture_tokens_per_s"}  # its server died
    assert engine_taps.trainer_figures(failed, trainer) == {}


def test_the_taps_bench_extrapolates_a_cut_target_with_a_fixed_and_a_per_layer_cost(monkeypatch):
    """Measured at two depths, a cut target's wait is a fixed cost (the taps file's copy, write,
    read: no deeper target makes it longer) plus one per layer, extrapolated to the whole depth;
    one depth scales in proportion. A failed depth extrapolates nothing."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import engine_taps

    assert engine_taps.whole_depth([(8, 0.3)], 64) == (pytest.approx(2.4), "in proportion to depth")
    fitted = "fixed + per-layer cost, least squares"
    assert engine_taps.whole_depth([(8, 0.3), (16, 0.34)], 64) == (pytest.approx(0.26 + 64 * 0.005), fitted)
    assert engine_taps.whole_depth([(8, 1.0), (12, 2.0), (16, 3.0)], 64) == (pytest.approx(15.0), fitted)
    # Depths bound by a cost that does not grow with them (the taps output): a line that falls
    # with depth would put the whole target faster than any depth measured; the deepest point
    # alone, in proportion, is used (vLLM 0.34.0's 27B-shaped runs: 8 and 16 layers, then 32).
    falling = engine_taps.whole_depth([(8, 1 / 28056.2), (16, 1 / 29190.7)], 64)
    assert falling == (pytest.approx(4 / 29190.7), "in proportion to the deepest (16 layers): no fit rising with depth")

    def depth(layers, tokens_per_s, latency):
        return {"case": "qwen3.6-27b", "seq_len": 4096, "target_layers": layers, "tap_ids": [0, layers - 1],
                "startup_s": 100.0, "capture_tokens_per_s": tokens_per_s, "latency_s": latency,
                "latency_s_all": [latency]}  # fmt: skip

    # 1/16000 s a token at 8 layers, 1/8000 at 16: 1/16000 more per 8 layers, no fixed part.
    whole = engine_taps.at_whole_depth([depth(8, 16000.0, 0.3), depth(16, 8000.0, 0.34)], 64)
    assert whole["capture_tokens_per_s"] == 2000.0 and whole["latency_s"] == pytest.approx(0.58)
    assert whole["extrapolation"] == "fixed + per-layer cost, least squares"
    assert whole["target_layers"] == [8, 16] and whole["whole_target_layers"] == 64
    assert [d["capture_tokens_per_s"] for d in whole["depths"]] == [16000.0, 8000.0]
    failed = {key: value for key, value in depth(16, 0, 0).items() if key not in ("capture_tokens_per_s", "latency_s")}
    broken = engine_taps.at_whole_depth([depth(8, 16000.0, 0.3), {**failed, "error": "EngineError: died"}], 64)
    assert broken["error"] == "EngineError: died" and "capture_tokens_per_s" not in broken


def test_the_taps_part_of_the_gpu_check_fails_when_a_training_step_run_fails(monkeypatch, tmp_path):
    """gpu_check --taps: train_step (8B, 27B) then engine_taps with their record; a failed
    train_step run fails the part even when engine_taps itself exits 0."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_check

    def fake_run(argv, **kwargs):
        out = Path(argv[argv.index("--out") + 1])
        if "train_step.py" in argv[1]:
            if "qwen3.6-27b" in argv:
                return SimpleNamespace(returncode=1, stderr="CUDA out of memory")
            out.write_text(json.dumps({"device": "card", "results": [{"case": "qwen3-8b", "mode": "drafter"}]}))
        else:
            assert json.loads(Path(argv[argv.index("--trainer-record") + 1]).read_text())["results"]
            out.write_text(json.dumps({"cases": [{"case": "qwen3-8b", "capture_tokens_per_s": 1.0}]}))
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    result = gpu_check.check_taps("/envs/vllm/bin/python", tmp_path)
    assert result["train_step_errors"] == ["CUDA out of memory"] and result["engine_taps"][0]["case"] == "qwen3-8b"
    assert result["exit_code"] == 1
    assert not gpu_check.passed(
        {"cuda_tests": {"passed_all": True}, "engines": {}, "taps": result}, SimpleNamespace(no_cuda_tests=False)
    )
