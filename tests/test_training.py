"""Training segments: exact resume (SIGTERM, SIGKILL after a periodic checkpoint, segment chain),
metrics, and the export that SGLang and vLLM load."""

from __future__ import annotations

import json
import math
import re
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.jobstate import RunHalted, clear_halt, raise_if_halted, read_halt
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.stages.export import expected_tensor_shapes, export_drafter
from dflash_pipeline.training.checkpoint import load_checkpoint
from dflash_pipeline.training.distributed import Distributed, ReplicasDiffer, check_replicas
from dflash_pipeline.training.divergence import DivergenceGuard
from dflash_pipeline.training.segment_log import Boundary, step_boundary
from dflash_pipeline.training.step import lr_factor
from dflash_pipeline.training.trainer import PREEMPTED_EXIT_CODE, SegmentJob, TrainingDiverged
from tests.support.paused_run import Pause
from tests.support.train_data import write_tokenized_shard

STEPS = 8


def settings(**overrides) -> dict:
    base = validate_config({"train": {}})["train"]
    base.update(
        mode="online",
        segments=1,
        steps_per_segment=STEPS,
        checkpoint_every_steps=STEPS // 2,
        batch_size=2,
        gpus_per_job=0,
        num_layers=2,
        intermediate_size=128,
        block_size=4,
        num_anchors=16,
        learning_rate=3e-3,
        warmup_ratio=0.25,
        metrics_every_seconds=0,
        attention="sdpa",
        export_dtype="float32",
    )
    base.update(overrides)
    return base


@pytest.fixture(scope="module", autouse=True)
def one_compute_thread():
    """Bit-for-bit comparisons need one compute thread. With two, PyTorch's CPU kernels are not
    run-to-run deterministic: of three uninterrupted 8-step runs of these settings, in process or
    not, one ended in another state than the other two (fc.weight[0, 0] 1.7569e-03 against
    1.7563e-03); with one thread, every run ends in the same. torchrun gives each rank one thread
    already (the two-rank tests); the training subprocesses here get it from OMP_NUM_THREADS."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenized(demo_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        "00000": str(write_tokenized_shard(demo_model, root / "t0.parquet", 24, seed=0, heldout_every=6)),
        "00001": str(write_tokenized_shard(demo_model, root / "t1.parquet", 24, seed=1)),
    }


def run_segment(run_dir: Path, segment: int, s: dict, demo_model, tokenized) -> dict:
    return SegmentJob(
        run_url=str(run_dir),
        segment=segment,
        settings=s,
        target_dir=str(demo_model),
        tokenized=tokenized,
        manifest_path=str(run_dir / layout.segment_manifest_key(segment)),
        device="cpu",
    ).run()


def final_state(run_dir: Path, segment: int = 0):
    loaded = load_checkpoint(open_storage(str(run_dir)), layout.checkpoint_prefix(segment))
    assert loaded is not None, f"no checkpoint of segment {segment} in {run_dir}"
    return loaded.state["model"], loaded.state


def assert_same_state(a, b):
    (wa, ta), (wb, tb) = a, b
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert ta["step"] == tb["step"]
    for (ka, sa), (_, sb) in zip(ta["optimizer"]["state"].items(), tb["optimizer"]["state"].items()):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (ka, key)
    assert ta["scheduler"] == tb["scheduler"]


@pytest.fixture(scope="module")
def reference(demo_model, tokenized, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    manifest = run_segment(run_dir, 0, settings(), demo_model, tokenized)
    return run_dir, manifest


def test_segment_writes_checkpoint_manifest_and_metrics(reference, demo_model):
    from dflash_pipeline.model.target_identity import weights_digest

    run_dir, manifest = reference
    assert manifest["steps"] == [0, STEPS]
    # The weights the taps came from, which the export names.
    assert manifest["target_weights"] == weights_digest(demo_model) is not None
    written = json.loads((run_dir / layout.segment_manifest_key(0)).read_text())
    assert written == manifest
    lines = (run_dir / layout.train_progress_prefix(0) / layout.TRAIN_METRICS).read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert r["loss"] > 0 and 1 <= r["accept_len"] <= 4 and len(r["accuracy_per_position"]) == 3
        assert r["tokens_per_s"] > 0 and r["lr"] > 0
    telemetry = json.loads((run_dir / layout.train_progress_prefix(0) / "telemetry.json").read_text())
    assert telemetry["state"] == "done" and telemetry["steps_done"] == STEPS
    # The in-segment checkpoints are gone once the segment's own checkpoint exists.
    leftovers = (run_dir / layout.train_progress_prefix(0) / "checkpoint").rglob("*")
    assert not [p for p in leftovers if p.is_file()]


def test_two_segments_equal_one_segment_bit_for_bit(reference, demo_model, tokenized, tmp_path):
    s = settings(segments=2, steps_per_segment=STEPS // 2)
    run_segment(tmp_path, 0, s, demo_model, tokenized)
    run_segment(tmp_path, 1, s, demo_model, tokenized)
    assert_same_state(final_state(tmp_path, 1), final_state(reference[0]))


def start_training(run_dir: Path, s: dict, demo_model, tokenized, pause: Pause | None = None) -> subprocess.Popen:
    """Segment 0 of a run in ``run_dir`` by the stage's command line; its output goes to
    ``training.log`` beside it (a pipe nobody reads while the test waits could fill and stall it).
    With ``pause``, held after a write until the test lets it go on."""
    settings_file, shards_file = run_dir / "settings.json", run_dir / "shards.json"
    settings_file.write_text(json.dumps(s))
    shards_file.write_text(json.dumps({"tokenized": tokenized}))
    command = [
        sys.executable, "-m", "dflash_pipeline.stages.train", "--run-url", str(run_dir), "--segment", "0",
        "--settings", str(settings_file), "--target", str(demo_model), "--device", "cpu",
        "--manifest", str(run_dir / layout.segment_manifest_key(0)),
        "--shards", str(shards_file),
    ]  # fmt: skip
    with open(run_dir / "training.log", "w") as out:
        if pause is None:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        return subprocess.Popen(pause.command(command), stdout=out, stderr=subprocess.STDOUT, env=pause.env())


def finished(proc: subprocess.Popen, run_dir: Path) -> str:
    """The training's output once it has ended."""
    proc.wait(timeout=PATIENCE_S)
    return (run_dir / "training.log").read_text()


# Bounds for a hang only (each test also has pytest-timeout's): a loaded machine only makes the
# training slower, never a different result.
PATIENCE_S = 600


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_killed_and_resumed_equals_uninterrupted_bit_for_bit(how, reference, demo_model, tokenized, tmp_path):
    s = settings()
    metrics = tmp_path / layout.train_progress_prefix(0) / layout.TRAIN_METRICS
    # Held where the signal comes: after the first step's metrics (SIGTERM: the job checkpoints
    # where it is and exits), or after the first periodic checkpoint (SIGKILL: the rerun resumes
    # from it), so the signal never comes after the segment has ended.
    suffix = layout.TRAIN_METRICS if how == "sigterm" else "checkpoint/latest.json"
    pause = Pause(tmp_path / "pause", suffix)
    proc = start_training(tmp_path, s, demo_model, tokenized, pause)
    pause.wait_held(proc, PATIENCE_S)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
        pause.resume_once_signalled(proc, PATIENCE_S)
        out = finished(proc, tmp_path)
        assert proc.returncode == PREEMPTED_EXIT_CODE, out
        assert "SIGTERM: checkpointed at step 1;" in out
    else:
        proc.kill()
        finished(proc, tmp_path)
        assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / layout.segment_manifest_key(0)).exists()
    resumed = start_training(tmp_path, s, demo_model, tokenized)
    out = finished(resumed, tmp_path)
    assert resumed.returncode == 0, out
    assert f"steps {1 if how == 'sigterm' else STEPS // 2}..{STEPS - 1} from in-segment checkpoint" in out
    assert_same_state(final_state(tmp_path), final_state(reference[0]))
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(STEPS)), "metrics must hold each step once after a resume"


def test_export_loads_with_every_tensor_and_config_field(reference, tmp_path):
    run_dir, manifest = reference
    manifest_path = run_dir / layout.segment_manifest_key(0)
    config_out, weights_out = tmp_path / "drafter" / "config.json", tmp_path / "drafter" / "model.safetensors"
    config_out.parent.mkdir()
    export_drafter(str(run_dir), str(manifest_path), str(config_out), str(weights_out), "bfloat16")
    config = json.loads(config_out.read_text())
    tensors = load_file(weights_out)
    from dflash_pipeline.model.config import DrafterConfig

    drafter_config = DrafterConfig.from_zlab(config)
    shapes = expected_tensor_shapes(drafter_config)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k for k in tensors)
    H = config["hidden_size"]
    assert tensors["fc.weight"].shape == (H, len(config["dflash_config"]["target_layer_ids"]) * H)
    # The fields SGLang and vLLM read (docs/evaluation.md, "What the export writes for the engines").
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["mask_token_id"] == 3  # the demo tokenizer's <|mask|>
    assert config["dflash_config"]["target_layer_ids"] == [1, 5]  # default rule: 1 .. N-3 for 8 target layers
    assert config["num_target_layers"] == 8
    assert config["layer_types"] == ["full_attention"] * 2
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["dflash_config"]["mask_token_id"] < config["vocab_size"]


def test_lr_schedule_warms_up_then_decays_to_floor():
    values = [lr_factor(s, 100, 0.1, 0.1) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


# The reference taps and tolerance per storage dtype: float32 holds the computed taps exactly (up
# to the rounding of a different batch shape); bfloat16 rounds fp32-computed taps to 8 mantissa
# bits, or holds bf16-computed ones as computed (then only the batch shape's rounding differs).
TAPS_TOLERANCE = {"float32": 1e-5, "bfloat16": 0.02, "float8_e4m3fn": 0.07}


@pytest.mark.parametrize("hidden_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_offline_training_reads_extracted_taps(hidden_dtype, reference, demo_model, tokenized, tmp_path):
    from dflash_pipeline.model.target import target_compute_dtype
    from dflash_pipeline.model.target_identity import weights_digest
    from dflash_pipeline.stages.extract import extract_shard

    # Extraction on the device a job would take; the reference below is computed alike.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if hidden_dtype == "float32" and target_compute_dtype(device) != "float32":
        # On a GPU the target computes in bf16: float32 storage is refused, before any work.
        shard, path = next(iter(tokenized.items()))
        manifest = tmp_path / layout.shard_key("extract", shard)
        with pytest.raises(ValueError, match=r"train\.hidden_dtype: float32 .* bfloat16 on cuda"):
            extract_shard(
                path, str(demo_model), [1, 5], str(tmp_path), shard, str(manifest), hidden_dtype, device=device
            )
        assert not manifest.exists() and not (tmp_path / layout.hidden_states_key(shard)).exists()
        return
    hidden = {}
    for shard, path in tokenized.items():
        manifest = tmp_path / layout.shard_key("extract", shard)
        extract_shard(path, str(demo_model), [1, 5], str(tmp_path), shard, str(manifest), hidden_dtype, device=device)
        hidden[shard] = str(manifest)
        written = json.loads(manifest.read_text())
        assert (tmp_path / written["key"]).stat().st_size == written["size"]
        assert written["hidden_dtype"] == hidden_dtype
        assert (written["device"], written["compute_dtype"]) == (
            torch.device(device).type,
            target_compute_dtype(device),
        )
        assert written["target_weights"] == weights_digest(demo_model)
    job = SegmentJob(
        run_url=str(tmp_path),
        segment=0,
        settings=settings(mode="offline", hidden_dtype=hidden_dtype),
        target_dir=str(demo_model),
        tokenized=tokenized,
        hidden=hidden,
        manifest_path=str(tmp_path / layout.segment_manifest_key(0)),
        device="cpu",
    )
    job.run()
    # The stored taps are the target's taps as online training computes them on the device and
    # in the dtype the manifest names (up to the rounding of a different batch shape, or of the
    # storage dtype), and training from them lands next to online training.
    from dflash_pipeline.data.hidden import HiddenShards
    from dflash_pipeline.model.taps import TargetTaps
    from dflash_pipeline.model.target import load_target
    from dflash_pipeline.training.data import collate, read_training_sequences
    from dflash_pipeline.model.config import build_drafter_config

    config = build_drafter_config(settings(), str(demo_model))
    sequences = read_training_sequences(tokenized)[:3]
    ids, _ = collate(sequences, "cpu")
    stored = HiddenShards(open_storage(str(tmp_path)), hidden, config).taps(sequences, ids, "cpu", torch.float32)
    written = json.loads(Path(next(iter(hidden.values()))).read_text())
    target = load_target(str(demo_model), written["device"], getattr(torch, written["compute_dtype"]))
    online = TargetTaps(target, [1, 5])(ids.to(written["device"])).float().cpu()
    tolerance = TAPS_TOLERANCE[hidden_dtype]
    for i, seq in enumerate(sequences):
        n = len(seq.input_ids)
        torch.testing.assert_close(stored[i, :n], online[i, :n], rtol=tolerance, atol=tolerance * 10)
    ref_weights, _ = final_state(reference[0])
    weights, _ = final_state(tmp_path)
    drift = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
    assert drift < (1e-3 if hidden_dtype == "float32" else 0.05), drift


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", "float32"), ("cuda", "bfloat16"), ("cuda:1", "bfloat16"), (torch.device("cuda", 0), "bfloat16")],
)
def test_the_target_computes_in_bf16_on_a_gpu_and_in_fp32_on_cpu_for_training_and_extraction_alike(
    device, dtype, tmp_path, monkeypatch
):
    from dflash_pipeline.model.target import target_compute_dtype
    from dflash_pipeline.training import trainer

    assert target_compute_dtype(device) == dtype
    # Online training takes the same dtype on that device (set up only; nothing runs on it).
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = SegmentJob(
        run_url=str(tmp_path), segment=0, settings=settings(), target_dir="unused", tokenized={},
        manifest_path=str(tmp_path / "m.json"), device=str(device),
    )  # fmt: skip
    assert trainer._SegmentRun(job).compute_dtype == getattr(torch, dtype)


def test_extract_refuses_float32_storage_of_bf16_taps_before_any_work(tmp_path):
    from dflash_pipeline.stages.extract import extract_shard
    from dflash_pipeline.training.offline import stored_dtype_problem

    # Neither the shard nor the target exists: the refusal comes before either is read.
    manifest = tmp_path / "manifest.json"
    args = (str(tmp_path / "missing.parquet"), str(tmp_path / "no-target"), [1], str(tmp_path), "00000", str(manifest))
    with pytest.raises(ValueError) as refused:
        extract_shard(*args, "float32", device="cuda")
    message = str(refused.value)
    assert message.startswith("train.hidden_dtype: float32 would store taps that extract computes in bfloat16 on cuda")
    assert "Set train.hidden_dtype: bfloat16" in message and "train.gpus_per_job: 0" in message
    assert not manifest.exists()
    assert stored_dtype_problem("float32", "cpu") is None  # fp32 compute: float32 keeps it exactly
    assert all(stored_dtype_problem(d, "cuda:0") is None for d in ("bfloat16", "float8_e4m3fn"))


def two_rank_segment(tmp_path, s, demo_model, tokenized):
    """Segment 0 of a run in ``tmp_path`` as a torchrun command of two CPU ranks (gloo)."""
    from dflash_pipeline.stages.train import segment_args, torchrun_command

    settings_file = tmp_path / "settings.json"
    settings_file.write_text(json.dumps(s))
    job = SegmentJob(
        run_url=str(tmp_path),
        segment=0,
        settings=s,
        target_dir=str(demo_model),
        tokenized=tokenized,
        manifest_path=str(tmp_path / layout.segment_manifest_key(0)),
        device="cpu",
    )
    return job, settings_file, torchrun_command(2, [*segment_args(job, str(settings_file)), "--device", "cpu"])


def test_ddp_over_two_processes_trains_and_resumes_after_sigterm(demo_model, tokenized, tmp_path):
    """torchrun with two CPU ranks (gloo): both ranks stop at the same step on SIGTERM, each
    writes its shard of the checkpoint, and a rerun resumes from there to the end of the segment,
    bit for bit where an uninterrupted run ends."""
    from dflash_pipeline.stages.train import segment_args, torchrun_command

    s = settings(steps_per_segment=12, checkpoint_every_steps=100, batch_size=1)
    job, settings_file, command = two_rank_segment(tmp_path, s, demo_model, tokenized)
    metrics = tmp_path / layout.train_progress_prefix(0) / layout.TRAIN_METRICS
    # Rank 0 held after the first step's metrics (rank 1 waits for it at the step's all-reduce):
    # the signal reaches both ranks in the segment's first steps, whatever the machine's speed.
    pause = Pause(tmp_path / "pause", layout.TRAIN_METRICS)
    with open(tmp_path / "training.log", "w") as log_file:
        proc = subprocess.Popen(
            pause.command(command), stdout=log_file, stderr=subprocess.STDOUT, env=pause.env(), start_new_session=True
        )
    pause.wait_held(proc, PATIENCE_S)
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun's group: it forwards the signal to the ranks
    pause.resume_once_signalled(proc, PATIENCE_S)
    out = finished(proc, tmp_path)
    assert proc.returncode != 0
    assert out.count("SIGTERM: checkpointed at step 1;") == 2, out  # both ranks, same step
    latest = json.loads((tmp_path / layout.train_progress_prefix(0) / "checkpoint" / "latest.json").read_text())
    shares = json.loads((tmp_path / latest["prefix"] / "checkpoint.json").read_text())["files"]
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=PATIENCE_S)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "from in-segment checkpoint" in resumed.stdout + resumed.stderr
    # Each rank read only its own share from storage and got the other's over the group.
    read = re.findall(r"in-segment checkpoint: ([\d.]+) MB read from storage by this rank", resumed.stderr)
    assert sorted(float(x) for x in read) == sorted(round(f["size"] / 1e6, 1) for f in shares.values()), read
    manifest = json.loads((tmp_path / layout.segment_manifest_key(0)).read_text())
    assert manifest["processes"] == 2 and manifest["steps"] == [0, 12]
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(12))
    # Each rank wrote its own shard of the checkpoint; rank 0 the index naming both.
    index = json.loads((tmp_path / layout.checkpoint_prefix(0) / "checkpoint.json").read_text())
    assert sorted(index["files"]) == ["shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    assert index["world"] == 2 and index["step"] == 12
    # ... and the interrupted, resumed pair of ranks ends where an uninterrupted pair does.
    straight = tmp_path / "straight"
    straight.mkdir()
    job.run_url, job.manifest_path = str(straight), str(straight / layout.segment_manifest_key(0))
    command = torchrun_command(2, [*segment_args(job, str(settings_file)), "--device", "cpu"])
    uninterrupted = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr
    assert_same_state(final_state(tmp_path), final_state(straight))


def test_a_dflash2_segment_logs_selector_metrics_and_exports_the_authors_format(demo_model, tokenized, tmp_path):
    s = settings(
        algorithm="dflash2",
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=4,
        selector_warmup_ratio=0.25,
        selector_ramp_ratio=0.25,
        steps_per_segment=STEPS,
        checkpoint_every_steps=STEPS,
    )
    manifest = run_segment(tmp_path, 0, s, demo_model, tokenized)
    assert manifest["algorithm"] == "dflash2"
    assert manifest["drafter_config"]["architectures"] == ["DFlash2DraftModel"]
    assert {"selector_recall", "selector_accuracy", "selector_accept_len"} <= set(manifest["last_metrics"])
    lines = (tmp_path / layout.train_progress_prefix(0) / layout.TRAIN_METRICS).read_text().splitlines()
    records = [json.loads(x) for x in lines]
    # alpha: 0 for the first quarter of the steps, a ramp over the next quarter, then 1.
    assert [r["selector_weight"] for r in records] == [0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    for r in records:
        assert r["algorithm"] == "dflash2"
        assert 0 <= r["selector_accuracy"] <= r["selector_recall"] <= 1
        assert 1 <= r["selector_accept_len"] <= 4 and r["selector_loss"] >= 0
        assert r["total_loss"] == pytest.approx(r["loss"] + r["selector_weight"] * r["selector_loss"], rel=1e-4)
    out = tmp_path / "drafter"
    out.mkdir()
    export_drafter(
        str(tmp_path),
        str(tmp_path / layout.segment_manifest_key(0)),
        str(out / "config.json"),
        str(out / "model.safetensors"),
        "bfloat16",
    )
    tensors = load_file(out / "model.safetensors")
    assert len(tensors) == 15 * 2 + 6 and "candidate_selector.successor_codebook" in tensors


class _Ranks:
    """Two ranks as a collective: this one, and a copy of it whose weights the test may change."""

    rank, world = 0, 2

    def __init__(self, other: dict):
        self.other = other

    def gather_objects(self, obj):
        return [obj, {**obj, **self.other}]


def test_diverged_replicas_are_refused_naming_the_parameters():
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    check_replicas(module, _Ranks({}))  # the same weights: nothing to say
    with pytest.raises(ReplicasDiffer, match=r"different weights in 1 parameters \(first: 1.bias\)"):
        check_replicas(module, _Ranks({"1.bias": 123.0}))


def test_ddp_trains_dflash2_with_the_selector_reduced_across_ranks(demo_model, tokenized, tmp_path):
    """The selector's loss is computed outside the DDP-wrapped block forward; its gradients must
    still be all-reduced, or the ranks' weights drift apart (check_replicas fails the segment)."""
    s = settings(
        algorithm="dflash2",
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=4,
        steps_per_segment=4,
        checkpoint_every_steps=100,
        batch_size=1,
    )
    _, _, command = two_rank_segment(tmp_path, s, demo_model, tokenized)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((tmp_path / layout.segment_manifest_key(0)).read_text())
    assert manifest["processes"] == 2 and manifest["algorithm"] == "dflash2"
    assert manifest["steps"] == [0, 4]


@pytest.mark.parametrize(("device_type", "backend"), [("cpu", "gloo"), ("cuda", "nccl"), (None, "nccl")])
def test_the_rank_group_backend_follows_the_job_device_on_a_gpu_host(monkeypatch, device_type, backend):
    # CPU ranks on a GPU machine (a CPU benchmark or gpus_per_job 0 there) must not get NCCL,
    # which has no CPU tensors: their first collective would fail.
    chosen = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda b: chosen.append(b))
    assert Distributed.from_env(device_type).world == 2
    assert chosen == [backend]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_segment_with_background_checkpoints_ends_with_its_checkpoint_on_the_device(
    demo_model, tokenized, tmp_path
):
    # The trainer's GPU path: buffers reserved after the first step, background saves staged
    # into them every 2 steps and committed, the final checkpoint loading onto the device.
    s = settings(checkpoint_every_steps=2, checkpoint_async=True, attention="sdpa")
    manifest = SegmentJob(
        run_url=str(tmp_path), segment=0, settings=s, target_dir=str(demo_model), tokenized=tokenized,
        manifest_path=str(tmp_path / layout.segment_manifest_key(0)), device="cuda",
    ).run()  # fmt: skip
    assert manifest["steps"] == [0, STEPS]
    device = torch.device("cuda", torch.cuda.current_device())
    loaded = load_checkpoint(open_storage(str(tmp_path)), layout.checkpoint_prefix(0), map_location=device)
    assert loaded.state["step"] == STEPS
    assert all(t.device == device for t in loaded.state["model"].values())


def boundary(step: int, **flags):
    """The decisions after ``step`` steps of segment 1 (steps 8..15), checkpointing every 4."""
    given = dict(first=False, checkpoint_async=False, pending=False, writing=False, stop=False, orphaned=False)
    return step_boundary(step, (8, 16), 4, **{**given, **flags})


def test_a_step_boundary_goes_on_or_saves_every_few_steps_but_never_at_the_last():
    assert boundary(9) == Boundary(commit=False, reserve=False, stop=None, last=False, save=False)
    assert boundary(12).save and boundary(12).stop is None
    assert not boundary(16).save and boundary(16).last  # the final checkpoint follows instead
    assert [step for step in range(9, 17) if boundary(step).save] == [12]


def test_a_step_boundary_commits_a_background_save_once_every_rank_has_written_it():
    assert boundary(13, pending=True).commit
    assert not boundary(13, pending=True, writing=True).commit  # a rank still writes: next step
    assert not boundary(13).commit  # nothing in flight
    # The buffers of background saves: reserved once, after the job's first step.
    assert boundary(9, first=True, checkpoint_async=True).reserve
    assert not boundary(9, first=True).reserve and not boundary(10, checkpoint_async=True).reserve


def test_a_step_boundary_stops_on_sigterm_or_a_gone_driver_except_at_the_last_step():
    sigterm = boundary(12, stop=True)
    assert sigterm.stop == "SIGTERM" and not sigterm.save and not sigterm.last  # checkpoint, exit
    assert boundary(10, orphaned=True).stop == "driver gone"
    assert boundary(10, stop=True, orphaned=True).stop == "SIGTERM"  # preempted: the retry resumes
    at_last = boundary(16, stop=True)
    assert at_last.stop == "SIGTERM" and at_last.last  # the segment finishes: its checkpoint is the save
    # A finished background save is committed before stopping, as at any boundary.
    assert boundary(11, stop=True, pending=True).commit


def test_sigterm_at_the_last_step_finishes_the_segment(reference, demo_model, tokenized, tmp_path, monkeypatch, caplog):
    """A SIGTERM during the segment's last step: the segment's final checkpoint and manifest are
    the save (nothing dropped, nothing claimed that did not happen)."""
    from dflash_pipeline.training import trainer

    original = trainer._SegmentRun._train_step

    def step_then_sigterm(self, step):
        record = original(self, step)
        if step == self.end_step - 1:
            self.stop_requested = True  # what the SIGTERM handler does
        return record

    monkeypatch.setattr(trainer._SegmentRun, "_train_step", step_then_sigterm)
    with caplog.at_level("INFO", logger="dflash_pipeline.training"):
        manifest = run_segment(tmp_path, 0, settings(), demo_model, tokenized)
    out = caplog.text
    assert f"SIGTERM at the segment's last step ({STEPS}): finishing the segment" in out
    assert "checkpointed" not in out
    assert manifest["steps"] == [0, STEPS]
    assert (tmp_path / layout.segment_manifest_key(0)).is_file()
    assert_same_state(final_state(tmp_path), final_state(reference[0]))


def test_a_segment_whose_driver_is_gone_checkpoints_and_stops_then_resumes_exactly(
    reference, demo_model, tokenized, tmp_path, monkeypatch, caplog
):
    """The job's driver (its lease token) no longer drives the run: the segment saves its
    in-segment checkpoint and stops with DriverGone; the next run resumes bit for bit."""
    from dflash_pipeline.core.lease import DRIVER_TOKEN_ENV, DriverGone
    from dflash_pipeline.training import trainer

    monkeypatch.setattr(trainer, "DRIVER_CHECK_EVERY_S", 0.0)  # read the lease at every step
    monkeypatch.setenv(DRIVER_TOKEN_ENV, "token-of-a-driver-that-is-gone")  # and no lease at all
    with pytest.raises(DriverGone, match=r"the run lease is gone.*checkpointed at step 1\)"):
        run_segment(tmp_path, 0, settings(), demo_model, tokenized)
    assert not (tmp_path / layout.segment_manifest_key(0)).exists()
    monkeypatch.delenv(DRIVER_TOKEN_ENV)
    with caplog.at_level("INFO", logger="dflash_pipeline.training"):
        run_segment(tmp_path, 0, settings(), demo_model, tokenized)
    assert "steps 1..7 from in-segment checkpoint" in caplog.text
    assert_same_state(final_state(tmp_path), final_state(reference[0]))


def test_torchrun_gets_the_shard_lists_in_a_file_not_in_argv(tmp_path):
    """10,000 offline shards would be megabytes of argv (Linux caps one argument list)."""
    from dflash_pipeline.stages.train import segment_args

    shards = {f"{i:05d}": f"s3://bucket/run/outputs/tokenize-{i:05d}.parquet" for i in range(10_000)}
    job = SegmentJob(
        run_url="s3://bucket/run",
        segment=3,
        settings={},
        target_dir="/models/target",
        tokenized=shards,
        hidden=dict(shards),
        manifest_path="m.json",
    )
    args = segment_args(job, str(tmp_path / "settings.json"), logs=["logs/train/segment-0003.log"])
    assert len(" ".join(args)) < 1000
    listed = json.loads(Path(args[args.index("--shards") + 1]).read_text())
    assert listed == {"tokenized": shards, "hidden": shards}


def test_the_divergence_guard_halts_at_the_first_non_finite_step_without_a_budget():
    guard = DivergenceGuard({"max_loss_ratio": None, "loss_window": 3, "max_skipped_steps": 0})
    assert guard.judge(2.0, 1.0).apply
    for loss, grad_norm, why in [(math.nan, 1.0, "loss"), (2.0, math.inf, "gradient norm")]:
        verdict = DivergenceGuard({"max_skipped_steps": 0}).judge(loss, grad_norm)
        assert not verdict.apply and verdict.halt and verdict.reason == f"{why} is not finite"


def test_the_divergence_guard_judges_a_loss_spike_against_the_running_mean_once_the_window_is_full():
    guard = DivergenceGuard({"max_loss_ratio": 10.0, "loss_window": 3, "max_skipped_steps": 0})
    assert guard.judge(1.0, 1.0).apply and guard.judge(100.0, 1.0).apply  # no mean yet: a window of 3
    assert guard.judge(1.0, 1.0).apply  # mean 34
    assert guard.judge(339.0, 1.0).apply  # under 10x the mean of [1, 100, 1]
    spike = guard.judge(4000.0, 1.0)  # mean of [100, 1, 339] = 146.7
    assert spike.halt and "27.3x the mean 146.7 of the last 3 steps" in spike.reason


def test_the_divergence_guard_skips_up_to_its_budget_per_segment_counting_a_resumed_segments_skips():
    settings_ = {"max_loss_ratio": 10.0, "loss_window": 2, "max_skipped_steps": 2}
    guard = DivergenceGuard(settings_)
    # The previous segment's losses fill the window, its skips do not count; this segment's do.
    guard.seed([{"loss": 1.0}, {"loss": 9.0, "skipped": True}, {"loss": 1.0}], count_skips=False)
    guard.seed([{"loss": 1.0, "total_loss": 1.5}, {"loss": math.nan, "skipped": True}])
    assert guard.running_mean() == 1.25 and guard.skipped == 1
    skipped = guard.judge(math.nan, 1.0)
    assert not skipped.apply and not skipped.halt and guard.skipped == 2
    assert guard.judge(1.0, 1.0).apply
    assert guard.judge(math.nan, 1.0).halt


def test_a_diverging_segment_stops_unsaved_halts_the_run_and_restarts_from_the_last_good_checkpoint(
    demo_model, tokenized, tmp_path
):
    """Segment 1 with a learning rate of 1e12: its first non-finite step stops it, the message names
    that step, its figures and segment 0's checkpoint; nothing of segment 1 is a checkpoint (the
    background save of the diverged weights is dropped), the run is halted; with a sound rate again
    and the halt cleared, segment 1 restarts from segment 0's checkpoint at that rate."""
    s = settings(segments=2, steps_per_segment=STEPS // 2, checkpoint_every_steps=1)
    run_segment(tmp_path, 0, s, demo_model, tokenized)
    store = open_storage(str(tmp_path))
    with pytest.raises(TrainingDiverged) as raised:
        run_segment(tmp_path, 1, {**s, "learning_rate": 1e12}, demo_model, tokenized)
    message = str(raised.value)
    assert "\n" not in message
    metrics_key = layout.train_progress_prefix(1) + layout.TRAIN_METRICS
    records = [json.loads(line) for line in store.read_text(metrics_key).splitlines()]
    last = records[-1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records[:-1])
    assert not (math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"])) and last["skipped"]
    assert message.startswith(f"train segment 0001 diverged at step {last['step']}: ")
    assert f"last good checkpoint: {store.join(layout.checkpoint_prefix(0))} (step {STEPS // 2}" in message
    assert "make clear-halt" in message
    assert not (tmp_path / layout.segment_manifest_key(1)).exists()
    assert not store.exists(layout.checkpoint_prefix(1) + "index.json")
    assert not store.exists(layout.train_progress_prefix(1) + "checkpoint/latest.json")
    telemetry = json.loads(store.read_text(layout.train_progress_prefix(1) + "telemetry.json"))
    assert telemetry["state"] == "diverged"
    halt = read_halt(store)
    assert (halt["stage"], halt["unit"], halt["shard"]) == ("train", "segment", "0001")
    assert halt["message"] == message and halt["details"]["step"] == last["step"]
    json.loads(store.read_text(layout.HALT), parse_constant=lambda c: pytest.fail(f"{c} in the halt object"))
    with pytest.raises(RunHalted, match="train segment 0001 diverged at step"):
        raise_if_halted(store, "train segment 0001")

    clear_halt(store)
    run_segment(tmp_path, 1, {**s, "learning_rate": 1e-3}, demo_model, tokenized)
    records = [json.loads(line) for line in store.read_text(metrics_key).splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS // 2, STEPS))
    assert not any(r.get("skipped") for r in records)
    # The rate in force is the config's, not the one segment 0's checkpoint was saved with.
    assert records[0]["lr"] == pytest.approx(1e-3 * lr_factor(STEPS // 2, STEPS, 0.25, s["min_lr_ratio"]))
