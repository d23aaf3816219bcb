"""train.target_quantization: the FP8 target's linear weights take about half of bf16's bytes,
its taps stay close to the full-precision target's, the option reaches the taps server's command
line and the target identity, and the schema refuses another value in one line."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.core.config import ConfigError, rule_params, validate_config
from dflash_pipeline.model.quantized import Fp8Linear, linear_weight_bytes, quantized_identity
from dflash_pipeline.model.target import load_target
from dflash_pipeline.model.taps import TargetTaps
from dflash_pipeline.model.target_identity import comparison

# Measured on the demo target (fp32 on CPU, 64 tokens): per-tap relative errors (Frobenius norm)
# from 0.034 at the first layer to 0.061 at the deepest, growing with depth (e4m3 keeps 3
# mantissa bits: ~3% per weight).
TAPS_RELATIVE_ERROR = 0.08


def test_an_fp8_target_stores_its_decoder_linears_in_half_of_bf16s_bytes(demo_model):
    bf16 = load_target(str(demo_model), "cpu", torch.bfloat16)
    fp8 = load_target(str(demo_model), "cpu", torch.bfloat16, "fp8")
    ratio = linear_weight_bytes(fp8) / linear_weight_bytes(bf16)
    # One byte a weight plus a 4-byte scale per output channel: just over half.
    assert 0.5 <= ratio < 0.55, ratio
    assert any(isinstance(m, Fp8Linear) for m in fp8.modules())
    # The drafter shares the embeddings and the LM head: they keep the compute dtype.
    assert fp8.get_input_embeddings().weight.dtype == torch.bfloat16
    assert fp8.get_output_embeddings().weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in fp8.parameters())


def test_an_fp8_targets_taps_are_close_to_the_full_precision_targets(demo_model):
    layers = [0, 3, 7]
    full = TargetTaps(load_target(str(demo_model), "cpu", torch.float32), layers)
    quantized = TargetTaps(load_target(str(demo_model), "cpu", torch.float32, "fp8"), layers)
    ids = torch.arange(3, 67)[None, :]
    want, got = full(ids)[0], quantized(ids)[0]
    width = want.shape[-1] // len(layers)
    for k in range(len(layers)):
        tap = slice(k * width, (k + 1) * width)
        error = ((got[:, tap] - want[:, tap]).norm() / want[:, tap].norm()).item()
        assert 0 < error < TAPS_RELATIVE_ERROR, (layers[k], error)


def test_the_quantization_defines_the_taps_and_reaches_the_taps_servers_command_line(tmp_path):
    from dflash_pipeline.engines.engine_taps import taps_server_spec

    plain, fp8 = validate_config({}), validate_config({"train": {"target_quantization": "fp8"}})
    for rule in ("train", "extract"):
        assert rule_params(fp8, rule)["target_quantization"] == "fp8"
        assert rule_params(fp8, rule) != rule_params(plain, rule)
    # Each segment's τ is measured against the target the segment trained against.
    from dflash_pipeline.stages.segment_tau import segment_tau_settings

    assert segment_tau_settings(fp8)["target_quantization"] == "fp8"
    assert segment_tau_settings(plain)["target_quantization"] is None
    engine = {"python": "/engine/bin/python", "env": {}}
    args = taps_server_spec("/models/t", [1], 8000, tmp_path, quantization="fp8", **engine).extra_args
    assert args[args.index("--quantization") + 1] == "fp8"
    assert "--quantization" not in taps_server_spec("/models/t", [1], 8000, tmp_path / "b", **engine).extra_args


def test_another_quantization_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        validate_config({"train": {"target_quantization": "int3"}})
    # The configuration's problems, one a line: this one names the key, the value and the choices.
    assert "config key 'train.target_quantization': 'int3' is not one of [None, 'fp8']" in [
        line.strip() for line in str(err.value).splitlines()
    ]


def test_a_drafter_of_fp8_taps_served_against_the_full_precision_target_is_a_named_mismatch():
    digest = "sampled-v1:0123456789abcdef"
    trained = quantized_identity(digest, "fp8")
    assert trained == "sampled-v1:0123456789abcdef+fp8"
    assert quantized_identity(digest, None) == digest and quantized_identity(None, "fp8") is None
    assert comparison(trained, digest)["match"] is False
    assert comparison(trained, quantized_identity(digest, "fp8"))["match"] is True


def test_evaluate_compares_the_drafter_with_the_target_quantized_as_evaluate_says(tmp_path):
    from dflash_pipeline.model.target_identity import TargetMismatch, check_at_evaluate, weights_digest
    from dflash_pipeline.core.config import schema_defaults
    from dflash_pipeline.stages.evaluate import evaluate_job
    from tests.test_target_identity import drafter_recording, tiny_target

    target = tiny_target(tmp_path / "target")
    digest = weights_digest(target)
    fp8_drafter = drafter_recording(tmp_path / "fp8", quantized_identity(digest, "fp8"))
    assert check_at_evaluate(fp8_drafter, target, "refuse", "fp8")["match"] is True
    with pytest.raises(TargetMismatch):
        check_at_evaluate(fp8_drafter, target, "refuse")
    # A drafter of full-precision taps against the FP8 target: the other cross, named the same way.
    plain_drafter = drafter_recording(tmp_path / "plain", digest)
    with pytest.raises(TargetMismatch, match=r"\+fp8\) are not those"):
        check_at_evaluate(plain_drafter, target, "refuse", "fp8")
    # The job passes its setting to the check, before anything loads (no prompts exist here).
    with pytest.raises(TargetMismatch, match=r"\+fp8\) are not those"):
        evaluate_job(
            str(target), str(plain_drafter.parent / "config.json"), str(tmp_path / "none.parquet"), [],
            tmp_path / "metrics.json", {**schema_defaults("evaluate"), "target_quantization": "fp8"}, False,
            tmp_path / "failed.json",
        )  # fmt: skip


def test_evaluates_quantization_defines_its_metrics_and_is_refused_with_a_serving_engine(tmp_path, capsys):
    plain, fp8 = validate_config({}), validate_config({"evaluate": {"target_quantization": "fp8"}})
    assert rule_params(fp8, "evaluate")["target_quantization"] == "fp8"
    assert rule_params(plain, "evaluate")["target_quantization"] is None
    with pytest.raises(ConfigError) as err:
        validate_config({"evaluate": {"target_quantization": "fp8", "engine": "vllm"}})
    assert [line.strip() for line in str(err.value).splitlines()][1:] == [
        "evaluate.target_quantization: fp8 applies to the project's loop only; evaluate.engine vllm would "
        "serve the checkpoint's own weights (set engine: transformers)"
    ]
    # The command line alike, in one line naming the flag.
    from dflash_pipeline.stages.evaluate import main

    for folder in ("target", "drafter"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text("")
    argv = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    argv += ["--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "m.json")]
    with pytest.raises(SystemExit):
        main([*argv, "--engine", "vllm", "--target-quantization", "fp8"])
    err = capsys.readouterr().err
    assert (
        "argument --target-quantization: fp8 applies to the project's loop only; --engine vllm would serve the "
        "checkpoint's own weights" in err
    )
