"""The speculators-format export (``dflash_pipeline.model.speculators_format``): beside the z-lab
export, the drafter as vllm-project/speculators 0.9 stores it, with the verifier's embedding and
LM head in the file. Checked here: the config fields and the tensors (against the z-lab export and
the target), the one-line refusal of a drafter the format cannot express, the export rule's
outputs, and, in the vLLM CPU environment (which also holds the speculators package), that the
speculators package's own model classes load every export without missing or unexpected weights
and that vLLM reads from it exactly the drafter it reads from the z-lab export (DFlash2 and
sliding-window drafters included). Serving parity with the z-lab export is measured in
tests/test_vllm_cpu.py, on the drafter the workflow trains.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.model import speculators_format
from dflash_pipeline.model.config import FULL, SLIDING, DrafterConfig, drafter_config_for_target
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.model.target_identity import TargetMismatch, check_at_evaluate, weights_digest
from dflash_pipeline.stages.export import export_drafter, main as export_main
from dflash_pipeline.training.checkpoint import capture_rng, save_checkpoint
from tests.support.engine_envs import REPO, vllm_python

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
# Drafter shapes the pipeline trains: (algorithm, layer_types, sliding_window).
SHAPES = {
    "full": ("dflash", [FULL, FULL], None),
    "sliding": ("dflash", [SLIDING, SLIDING], 16),
    "dflash2": ("dflash2", [FULL, FULL], None),
    "mixed": ("dflash", [SLIDING, FULL], 16),
}
EXPRESSIBLE = ("full", "sliding", "dflash2")
CHECK = REPO / "tests" / "support" / "speculators_check.py"


def drafter_config(demo_model: Path, shape: str, dtype: str = "float32") -> DrafterConfig:
    from transformers import AutoConfig

    algorithm, layer_types, window = SHAPES[shape]
    return drafter_config_for_target(
        AutoConfig.from_pretrained(demo_model), num_layers=len(layer_types), block_size=8,
        mask_token_id=3, layer_types=layer_types, sliding_window=window, intermediate_size=128,
        dtype=dtype, algorithm=algorithm, dflash2=DFLASH2,
    )  # fmt: skip


def write_run(root: Path, config: DrafterConfig, seed: int = 0) -> Path:
    """A run folder with one finished segment: a checkpoint of a drafter with random weights (every
    tensor, so equal tensors mean copied ones) and the segment's manifest. Returns the manifest."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for tensor in drafter.state_dict().values():
            tensor.normal_()
    save_checkpoint(open_storage(root), layout.checkpoint_prefix(0),
                    {"model": drafter.state_dict(), "step": 1}, capture_rng())  # fmt: skip
    manifest = root / layout.segment_manifest_key(0)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"checkpoint_prefix": layout.checkpoint_prefix(0),
                                    "drafter_config": config.to_zlab()}))  # fmt: skip
    return manifest


def export_both(demo_model: Path, root: Path, shape: str, dtype: str = "bfloat16") -> tuple[Path, Path]:
    """The z-lab export in root/drafter and the speculators one in root/drafter/speculators."""
    manifest = write_run(root, drafter_config(demo_model, shape))
    zlab = root / "drafter"
    speculators = zlab / speculators_format.FOLDER
    export_drafter(
        str(root), str(manifest), str(zlab / "config.json"), str(zlab / "model.safetensors"), dtype,
        target=str(demo_model),
        speculators_out=(str(speculators / "config.json"), str(speculators / "model.safetensors")),
    )  # fmt: skip
    return zlab, speculators


# --- the config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", EXPRESSIBLE)
def test_the_config_holds_what_speculators_and_vllm_read(shape, demo_model):
    config = drafter_config(demo_model, shape)
    document = speculators_format.speculators_config(config, "/models/target", ["Qwen3ForCausalLM"])
    algorithm = "dflash2" if shape == "dflash2" else "dflash"
    assert document["speculators_model_type"] == algorithm
    assert document["architectures"] == ["DFlash2DraftModel" if shape == "dflash2" else "DFlashDraftModel"]
    assert document["speculators_version"] == "0.9.0"
    # Capture indices, as vLLM's eagle_aux_hidden_state_layer_ids (tap id + 1).
    assert document["aux_hidden_state_layer_ids"] == [i + 1 for i in config.target_layer_ids]
    assert document["block_size"] == 8 and document["mask_token_id"] == 3
    assert document["draft_vocab_size"] == config.vocab_size  # the full vocabulary: no t2d / d2t
    assert document["sample_from_anchor"] is False
    # vLLM makes dflash_config.causal = not sliding_window_non_causal, for every layer.
    assert document["sliding_window_non_causal"] is (shape != "sliding")
    spec = document["speculators_config"]
    assert spec["algorithm"] == algorithm and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7,
                                         "accept_tolerance": 0.0, "verifier_accept_k": 1}]  # fmt: skip
    assert spec["verifier"] == {"name_or_path": "/models/target", "architectures": ["Qwen3ForCausalLM"]}
    layers = document["transformer_layer_config"]
    zlab = config.to_zlab()
    # The draft layers' Qwen3 config is the z-lab config without the DFlash wrapper's keys.
    assert layers == {k: v for k, v in zlab.items() if k not in speculators_format.WRAPPER_KEYS}
    assert layers["model_type"] == "qwen3" and "dflash_config" not in layers
    assert layers["is_causal"] is (shape == "sliding")
    assert layers["rope_parameters"] == {"rope_type": "default", "rope_theta": config.rope_theta}
    if shape == "sliding":
        assert layers["layer_types"] == [SLIDING, SLIDING] and layers["sliding_window"] == 16
    if shape == "dflash2":
        assert {k: document[k] for k in DFLASH2} == DFLASH2
    else:
        assert not set(DFLASH2) & set(document)


def test_a_mixed_drafter_is_refused_in_one_line(demo_model):
    config = drafter_config(demo_model, "mixed")
    reason = speculators_format.refusal(config.layer_types)
    assert reason and "\n" not in reason
    assert reason.startswith("speculators format not written (z-lab format only)")
    with pytest.raises(ValueError, match="mixes sliding-window layers"):
        speculators_format.speculators_config(config, "t", [])
    for shape in EXPRESSIBLE:
        assert speculators_format.refusal(SHAPES[shape][1]) is None
    assert speculators_format.refusal(None) is None  # the config's default: all full attention


def test_a_mixed_drafter_is_exported_in_the_zlab_format_only_saying_why(demo_model, tmp_path, capsys):
    manifest = write_run(tmp_path, drafter_config(demo_model, "mixed"))
    out = tmp_path / "drafter"
    zlab = (str(out / "config.json"), str(out / "model.safetensors"))
    export_drafter(str(tmp_path), str(manifest), *zlab, "bfloat16", target=str(demo_model))
    printed = capsys.readouterr().out.splitlines()
    refusal = speculators_format.refusal([SLIDING, FULL])
    assert [line for line in printed if "speculators" in line] == [refusal]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # Asked for anyway (the rule declares it only for drafters the format expresses): an error,
    # before anything is written.
    (out / "config.json").unlink()
    with pytest.raises(ValueError, match="speculators format not written"):
        export_drafter(
            str(tmp_path),
            str(manifest),
            *zlab,
            "bfloat16",
            target=str(demo_model),
            speculators_out=(str(out / "s" / "config.json"), str(out / "s" / "model.safetensors")),
        )
    assert not (out / "s").exists() and not (out / "config.json").exists()


# --- the tensors ---------------------------------------------------------------------------------


def test_the_file_holds_the_drafter_as_exported_and_the_verifiers_embedding_and_head(demo_model, tmp_path):
    zlab, speculators = export_both(demo_model, tmp_path, "full", dtype="bfloat16")
    drafter = load_file(zlab / "model.safetensors")
    stored = load_file(speculators / "model.safetensors")
    assert set(stored) == set(drafter) | {"embed_tokens.weight", "lm_head.weight"}
    for name, tensor in drafter.items():  # bit for bit, in the export dtype
        assert stored[name].dtype == torch.bfloat16 and torch.equal(stored[name], tensor), name
    with safe_open(str(demo_model / "model.safetensors"), "pt") as target:
        # As the target stores them (fp32 here, not cast to the drafter's bf16): vLLM shares
        # them with the target only when they are equal.
        assert torch.equal(stored["embed_tokens.weight"], target.get_tensor("model.embed_tokens.weight"))
        assert torch.equal(stored["lm_head.weight"], target.get_tensor("lm_head.weight"))
    with safe_open(str(speculators / "model.safetensors"), "pt") as fh:
        # The segment recorded no digest: the target folder's at export.
        assert fh.metadata() == {"format": "pt", "target_weights": weights_digest(demo_model)}
    config = json.loads((speculators / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(demo_model.resolve()),
        "architectures": json.loads((demo_model / "config.json").read_text())["architectures"],
    }
    assert config["dtype"] == config["transformer_layer_config"]["dtype"] == "bfloat16"


def test_the_export_names_the_trained_against_weights_and_evaluate_refuses_others(demo_model, tmp_path):
    """The segment's digest goes into both formats' metadata; a copy of the target with other
    weights under the same config.json is refused at evaluate."""
    manifest = write_run(tmp_path, drafter_config(demo_model, "full"))
    trained_against = weights_digest(demo_model)
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "target_weights": trained_against}))
    zlab = tmp_path / "drafter"
    speculators = zlab / speculators_format.FOLDER
    summary = export_drafter(
        str(tmp_path), str(manifest), str(zlab / "config.json"), str(zlab / "model.safetensors"), "float32",
        target=str(demo_model),
        speculators_out=(str(speculators / "config.json"), str(speculators / "model.safetensors")),
    )  # fmt: skip
    assert summary["target_weights"] == trained_against
    for folder in (zlab, speculators):
        with safe_open(str(folder / "model.safetensors"), "pt") as fh:
            assert fh.metadata()["target_weights"] == trained_against
    assert check_at_evaluate(zlab / "model.safetensors", demo_model)["match"] is True
    changed = tmp_path / "re-released"
    shutil.copytree(demo_model, changed)
    weights = load_file(changed / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, changed / "model.safetensors")
    assert (changed / "config.json").read_bytes() == (demo_model / "config.json").read_bytes()
    with pytest.raises(TargetMismatch, match=f"trained against \\({trained_against}\\)"):
        check_at_evaluate(zlab / "model.safetensors", changed)


def test_a_tied_lm_head_is_written_as_a_copy_of_the_embedding(demo_model, tmp_path):
    target = tmp_path / "tied"
    target.mkdir()
    embed = torch.randn(399, 128)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(128)},
              target / "model.safetensors")  # fmt: skip
    tensors = speculators_format.verifier_tensors(target, drafter_config(demo_model, "full"))
    assert torch.equal(tensors["lm_head.weight"], embed)
    assert torch.equal(tensors["embed_tokens.weight"], embed)
    assert tensors["lm_head.weight"].data_ptr() != tensors["embed_tokens.weight"].data_ptr()
    save_file(tensors, tmp_path / "both.safetensors")  # two names, two storages: safetensors takes it


def test_a_verifier_of_another_shape_is_an_error(demo_model, tmp_path):
    target = tmp_path / "other"
    target.mkdir()
    wide = torch.zeros(400, 128)
    save_file({"model.embed_tokens.weight": wide, "lm_head.weight": wide.clone()},
              target / "model.safetensors")  # fmt: skip
    needs = r"embed_tokens.weight is \(400, 128\), the drafter needs \(399, 128\)"
    with pytest.raises(ValueError, match=needs):
        speculators_format.verifier_tensors(target, drafter_config(demo_model, "full"))


def test_the_cli_writes_the_speculators_folder_when_given_the_target(demo_model, tmp_path, capsys):
    manifest = write_run(tmp_path, drafter_config(demo_model, "dflash2"))
    out = tmp_path / "by-hand"
    args = ["--run-url", str(tmp_path), "--manifest", str(manifest), "--out", str(out)]
    args += ["--dtype", "float32"]
    assert export_main(args) == 0
    assert not (out / "speculators").exists()  # without --target: the z-lab format only
    assert export_main([*args, "--target", str(demo_model)]) == 0
    config = json.loads((out / "speculators" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2"
    assert "exported the speculators format (dflash2, speculators 0.9.0)" in capsys.readouterr().out


# --- the export rule -----------------------------------------------------------------------------


@pytest.mark.workflow
@pytest.mark.parametrize("shape", ["full", "mixed"])
def test_the_export_rule_declares_the_speculators_folder_only_for_drafters_it_expresses(shape, workflow):
    _, layer_types, window = SHAPES[shape]
    workflow.write_config(train={"num_layers": 2, "layer_types": layer_types, "sliding_window": window})
    target = f"results/demo/{speculators_format.RUN_CONFIG}"
    proc = workflow.snakemake("-n", target, check=False)
    if shape == "mixed":
        assert proc.returncode != 0 and "MissingRuleException" in proc.stdout + proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "rule export:" in proc.stdout + proc.stderr


# --- in the speculators package and in vLLM (the vLLM CPU environment) --------------------------


@pytest.fixture(scope="module")
def checked(demo_model, tmp_path_factory):
    """Every expressible shape exported both ways, and a mixed drafter's speculators config as
    it would have to be written (either value of the one flag), all read once in the vLLM CPU
    environment by tests/support/speculators_check.py."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("speculators")
    folders = {shape: export_both(demo_model, root / shape, shape) for shape in EXPRESSIBLE}
    mixed_config = drafter_config(demo_model, "mixed")
    mixed_zlab = root / "mixed-zlab"  # vLLM's view reads the config only
    mixed_zlab.mkdir()
    mixed_config.save(mixed_zlab / "config.json")
    forced = {}
    for flag in (False, True):
        folder = root / f"mixed-{flag}"
        folder.mkdir()
        uniform = speculators_format.speculators_config(drafter_config(demo_model, "full"), str(demo_model), [])
        uniform.update(
            sliding_window_non_causal=flag,
            transformer_layer_config=speculators_format.transformer_layer_config(mixed_config),
        )
        (folder / "config.json").write_text(json.dumps(uniform))
        forced[flag] = folder
    out = root / "check.json"
    proc = subprocess.run(
        [str(python), str(CHECK), "--speculators", *(str(s) for _, s in folders.values()),
         "--zlab", *(str(z) for z, _ in folders.values()), str(mixed_zlab), "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    proc = subprocess.run(
        [str(python), str(CHECK), "--no-load", "--speculators", *(str(f) for f in forced.values()),
         "--out", str(root / "forced.json")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    forced_result = json.loads((root / "forced.json").read_text())
    return {
        "shapes": {shape: (result[str(z)], result[str(s)]) for shape, (z, s) in folders.items()},
        "mixed_zlab": result[str(mixed_zlab)],
        "mixed_forced": [forced_result[str(f)] for f in forced.values()],
    }


@pytest.mark.parametrize("shape", EXPRESSIBLE)
def test_the_speculators_package_loads_it_without_missing_or_unexpected_weights(shape, checked):
    _, speculators = checked["shapes"][shape]
    loading = speculators["loading"]
    expected = "DFlash2DraftModel" if shape == "dflash2" else "DFlashDraftModel"
    assert loading["class"] == expected  # speculators' own class, picked by its registry
    assert loading["config_class"] == expected.replace("DraftModel", "SpeculatorConfig")
    assert loading["missing"] == [] and loading["unexpected"] == [] and loading["mismatched"] == []
    assert loading["errors"] == [] and loading["differing"] == []
    # Only the training-time verifier copies are not in the file (speculators never saves them).
    assert set(loading["model_tensors"]) - set(loading["file_tensors"]) == {
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    # As a user loads it (the verifier's embedding and head read again from name_or_path): the
    # same values, all finite.
    assert speculators["official"] == {"class": expected, "differing": [], "nonfinite": []}


@pytest.mark.parametrize("shape", EXPRESSIBLE)
def test_vllm_reads_from_it_the_drafter_it_reads_from_the_zlab_export(shape, checked):
    zlab, speculators = (entry["vllm"] for entry in checked["shapes"][shape])
    assert speculators["config_class"] == "SpeculatorsConfig" and zlab["config_class"] == "Qwen3Config"
    # vLLM's DFlash model takes use_aux_hidden_state as true when the config does not say.
    assert speculators["dflash_config"].pop("use_aux_hidden_state") is None
    assert zlab["dflash_config"].pop("use_aux_hidden_state") is True
    assert speculators.pop("speculative_config") == {"method": "dflash", "num_speculative_tokens": 7}
    for view in (zlab, speculators):
        view.pop("config_class")
    assert speculators == zlab
    layers = speculators["layers"]
    assert layers == ([[16, True]] * 2 if shape == "sliding" else [[None, False]] * 2)


def test_the_format_cannot_give_vllm_a_mixed_drafters_attention(checked):
    """Why a mixed drafter is refused: served from its z-lab export, vLLM runs its sliding layer
    causally and its full layer bidirectionally, as trained; from a speculators config, with
    either value of the one flag, every layer the same way."""
    assert checked["mixed_zlab"]["vllm"]["layers"] == [[16, True], [None, False]]
    forced = [view["vllm"]["layers"] for view in checked["mixed_forced"]]
    assert forced == [[[16, True], [None, True]], [[16, False], [None, False]]]
