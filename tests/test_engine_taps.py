"""Taps from vLLM (engines.engine_taps and the project's connector): the checks a client makes on
every file before use, the server's command line, the node-local cache's byte bound and folder,
the quiet request log, and against real vLLM (its CPU build, fp32) the taps equal to the
in-process target's (model.taps) to 1e-4, with chunked prefill, prefix-cache hits, several
concurrent sequences, the last layer and an unsorted tap order; the shards `extract` stores from
the engine equal the target's to 1e-4."""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_pipeline.engines.engine_taps import (
    CONNECTOR_MODULE,
    CONNECTOR_SOURCE,
    FAILED_SUFFIX,
    CacheBound,
    EngineTaps,
    TapsMismatch,
    arrange_taps,
    check_engine_taps,
    node_local_root,
    reference_device,
    taps_difference,
    taps_server_spec,
    taps_storage,
    target_taps,
)

# fp32 on both sides; measured worst 1.6e-5 (the last layer of a 301-token sequence).
FP32_ATOL = 1e-4


def connector_file(tokens: list[int], layers: list[int], hidden: int = 3) -> dict[str, torch.Tensor]:
    """What the connector writes: slot s of token t holds 100 * layer + t in every element."""
    rows = torch.tensor([[[100.0 * layer + t] * hidden for layer in layers] for t in range(len(tokens))])
    return {"hidden_states": rows, "token_ids": torch.tensor(tokens), "layer_ids": torch.tensor(layers)}


def test_taps_come_out_in_the_asked_order_from_vllms_ascending_slots():
    found = connector_file([7, 8, 9], [2, 6, 8])
    # taps [5, 1] = vLLM layers 6 and 2; layer 8 was captured too and is not asked for.
    taps = arrange_taps(found, [7, 8, 9], [5, 1])
    assert taps.shape == (3, 6)
    assert taps[:, 0].tolist() == [600.0, 601.0, 602.0]
    assert taps[:, 3].tolist() == [200.0, 201.0, 202.0]
    # Ascending taps and nothing else captured: the file's rows as they are, not a copy.
    found = connector_file([7, 8, 9], [2, 6])
    taps = arrange_taps(found, [7, 8, 9], [1, 5])
    assert taps[:, 0].tolist() == [200.0, 201.0, 202.0] and taps[:, 3].tolist() == [600.0, 601.0, 602.0]
    assert taps.data_ptr() == found["hidden_states"].data_ptr()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"token_ids": torch.tensor([7, 8, 10])}, "other token ids"),
        ({"token_ids": torch.tensor([7, 8])}, "other token ids"),
        ({"hidden_states": torch.zeros(2, 2, 3)}, "shape"),
        ({"layer_ids": torch.tensor([6, 2])}, "ascending"),
        ({"layer_ids": torch.tensor([2, 7])}, r"need layers \[2, 6\]"),
    ],
)
def test_a_file_that_is_not_the_samples_taps_is_refused(change, message):
    found = {**connector_file([7, 8, 9], [2, 6]), **change}
    with pytest.raises(TapsMismatch, match=message):
        arrange_taps(found, [7, 8, 9], [5, 1])


def test_the_server_asks_vllm_for_layer_ids_one_above_the_taps_and_sees_only_the_connector(tmp_path):
    spec = taps_server_spec(
        "/models/target", [5, 1, 7], 8123, tmp_path, python="/engine/bin/python", env={"PYTHONPATH": "/pipeline"}
    )
    args = spec.extra_args
    speculative = json.loads(args[args.index("--speculative-config") + 1])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 6, 8]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == CONNECTOR_MODULE
    assert taps_storage(spec) == tmp_path / "taps"
    # The engine imports the connector from the run's copy, and nothing of the pipeline's.
    assert spec.env["PYTHONPATH"] == str(tmp_path / "connector")
    assert (tmp_path / "connector" / f"{CONNECTOR_MODULE}.py").read_text().count("import dflash_pipeline") == 0


def test_the_server_is_sized_for_the_sequences_its_clients_keep_in_flight(tmp_path):
    # vLLM's default (1024 sequences on a large GPU) sized a 27B hybrid target's start-up past an
    # H100's memory; the server's own bound comes first, so a user's --max-num-seqs still wins.
    spec = taps_server_spec(
        "/models/target", [1], 8123, tmp_path, python=None, env={}, max_num_seqs=16, extra_args=["--max-num-seqs", "4"]
    )
    args = spec.extra_args
    assert [args[i + 1] for i, arg in enumerate(args) if arg == "--max-num-seqs"] == ["16", "4"]
    assert (
        "--max-num-seqs" not in taps_server_spec("/models/target", [1], 8123, tmp_path, python=None, env={}).extra_args
    )


def test_the_per_run_checks_reference_runs_on_the_cpu_when_the_target_does_not_fit_the_gpu():
    """A 54 GB target beside 80 GB free computes its reference on the GPU; one larger than the
    free memory (a target the engine shards over several GPUs) on the CPU; CPU jobs and unknown
    sizes stay where they are."""
    gpu, cpu, gb = torch.device("cuda:0"), torch.device("cpu"), 10**9
    assert reference_device(gpu, 54 * gb, 80 * gb) == gpu
    assert reference_device(gpu, 54 * gb, 55 * gb) == cpu  # no room for the forward beside it
    assert reference_device(gpu, 140 * gb, 80 * gb) == cpu
    assert reference_device(gpu, None, 80 * gb) == gpu
    assert reference_device(cpu, 140 * gb, None) == cpu


def test_the_relative_difference_is_per_tap():
    reference = torch.cat([torch.full((2, 3), 100.0), torch.full((2, 3), 1.0)], dim=-1)
    engine = reference.clone()
    engine[:, 3:] += 0.1  # 10% of the second tap, 0.1% of the first tap's scale
    assert taps_difference(engine, reference, 2) == pytest.approx(0.1)


# --- the node-local cache: its byte bound, its folder, the request log ---------------------------


def test_the_cache_bound_counts_every_file_waiting_in_the_folder(tmp_path):
    bound = CacheBound(tmp_path / "taps", max_bytes=100)
    assert bound.held_bytes() == 0 and bound.has_room()  # no folder yet: nothing held
    (tmp_path / "taps").mkdir()
    (tmp_path / "taps" / "a.safetensors").write_bytes(b"x" * 60)
    (tmp_path / "taps" / "b.safetensors.partial").write_bytes(b"x" * 40)  # being written
    assert bound.held_bytes() == 100 and bound.has_room()  # at the bound: still room
    (tmp_path / "taps" / "c.safetensors").write_bytes(b"x")
    assert bound.held_bytes() == 101 and not bound.has_room()
    assert CacheBound(tmp_path / "taps", max_bytes=None).has_room()  # no bound


def test_no_request_goes_out_while_the_cache_holds_more_than_the_bound(tmp_path):
    """Another reader's 100 bytes fill a 50-byte cache: the client waits, sending nothing, until
    they are consumed; then it asks, and reads and deletes its own file."""
    storage = tmp_path / "taps"
    storage.mkdir()
    unread = storage / "other-rank.safetensors"
    unread.write_bytes(b"x" * 100)
    events = []
    client = EngineTaps("http://engine", "target", storage, [1], alive=lambda: True, max_cache_bytes=50)

    def request(token_ids):
        events.append("request")
        path = storage / "mine.safetensors"
        save_file(connector_file(token_ids, [2]), str(path))
        return path

    def sleep(_seconds):  # the other reader consumes its file while this client waits
        events.append("wait")
        unread.unlink()

    client._request, client.sleep = request, sleep
    with client:
        taps = client.taps([7, 8, 9])
    assert events == ["wait", "request"]
    assert taps[:, 0].tolist() == [200.0, 201.0, 202.0]
    assert not list(storage.iterdir())  # its own file deleted once read


def test_a_taps_file_the_engine_could_not_write_fails_its_request_at_once_with_the_engines_error(tmp_path):
    """The connector leaves a marker beside a file it could not write (the engine itself stops
    only at its next step, which may never come): the client waiting for that file raises with
    the engine's error and the file's name instead of waiting out its request timeout."""
    from dflash_pipeline.engines.client import EngineError

    storage = tmp_path / "taps"
    storage.mkdir()
    client = EngineTaps("http://engine", "target", storage, [1], alive=lambda: True, timeout=60)

    def request(token_ids):
        path = storage / "req-7.safetensors"
        (storage / "req-7.safetensors.failed").write_text("OSError: [Errno 28] No space left on device\n")
        return path

    client._request = request
    written = r"could not write the taps file .*req-7.safetensors: OSError: \[Errno 28\]"
    with client, pytest.raises(EngineError, match=written):
        client.taps([7, 8, 9])
    assert not list(storage.iterdir())  # the marker consumed with its request
    # The connector (the engine's environment: it imports nothing of the pipeline's) names the
    # marker the same way.
    assert f'FAILED_SUFFIX = "{FAILED_SUFFIX}"' in CONNECTOR_SOURCE.read_text()


def test_tap_files_go_to_shared_memory_when_it_has_room_else_to_the_temp_folder(tmp_path):
    import tempfile

    shm = tmp_path / "shm"
    shm.mkdir()
    assert node_local_root(1024, candidates=[tmp_path / "absent", shm]) == str(shm)
    (tmp_path / "a-file").write_text("")
    assert node_local_root(1024, candidates=[tmp_path / "a-file"]) == tempfile.gettempdir()
    # Twice the bound must be free (requests in flight may pass it): no file system has 2**62.
    assert node_local_root(2**61, candidates=[shm]) == tempfile.gettempdir()


def test_the_taps_requests_are_not_logged_one_by_one(tmp_path, caplog):
    """httpx logs each request at INFO: quiet (WARNING) while a taps client is open, as before
    once it is closed."""
    before = logging.getLogger("httpx").level
    caplog.set_level(logging.INFO)
    client = EngineTaps("http://engine", "target", tmp_path, [1])
    client.http = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    with client:
        assert client._healthy()
        assert not logging.getLogger("httpcore").isEnabledFor(logging.INFO)
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
    assert logging.getLogger("httpx").level == before
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200))) as plain:
        plain.get("http://elsewhere/")
    assert [r for r in caplog.records if r.name == "httpx"]  # other clients log as before


# --- real vLLM ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(demo_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()


def client_for(server, tap_ids) -> EngineTaps:
    return EngineTaps.of_server(server.spec, tap_ids, alive=server.alive, timeout=600)


def prefix_cache_hits(server) -> float:
    metrics = httpx.get(f"{server.spec.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits"))


@pytest.mark.workflow
def test_vllm_taps_equal_the_targets_with_chunked_prefill_prefix_hits_and_concurrency(vllm_taps_server, target):
    last = target.config.num_hidden_layers - 1
    tap_ids = [5, 1, last]  # unsorted, and the last layer (its output before the final norm)
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    # Longer than the 64-token prefill chunk, several at once.
    sequences = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (37, 129, 250, 301)]
    with client_for(vllm_taps_server, tap_ids) as client:
        first = client.taps_of(sequences)
        hits_before = prefix_cache_hits(vllm_taps_server)
        # Again, and a new sequence sharing 200 tokens with one of them: served from cached blocks.
        again = client.taps_of([*sequences, sequences[3][:200] + sequences[0]])
        assert prefix_cache_hits(vllm_taps_server) > hits_before
    worst = 0.0
    for tokens, got in zip([*sequences, *sequences, sequences[3][:200] + sequences[0]], [*first, *again]):
        expected = target_taps(target, tap_ids, tokens)
        assert got.dtype == torch.float32 and got.shape == expected.shape == (
            len(tokens),
            3 * target.config.hidden_size,
        )
        worst = max(worst, (got - expected).abs().max().item())
    assert worst <= FP32_ATOL
    # Nothing left behind: each file is deleted once read.
    assert not list(taps_storage(vllm_taps_server.spec).iterdir())


@pytest.mark.workflow
def test_the_per_run_check_passes_the_engine_and_catches_other_layers(vllm_taps_server, target):
    tokens = list(range(3, 90))
    reference = target_taps(target, [1, 5], tokens)
    with client_for(vllm_taps_server, [1, 5]) as client, client_for(vllm_taps_server, [0, 4]) as shifted:
        assert check_engine_taps(client, reference, tokens, tolerance=1e-4) <= 1e-4
        # An engine that hands over the layers below the asked ones (the off-by-one).
        client.taps = shifted.taps
        with pytest.raises(TapsMismatch, match="differ from the target's"):
            check_engine_taps(client, reference, tokens, tolerance=1e-4)


# --- training fed by the engine -----------------------------------------------------------------

STEPS = 6
# fp32 taps that differ by ~1e-5 move the losses of a few steps by far less than this.
LOSS_ATOL = 1e-3


def train_settings(**overrides) -> dict:
    from dflash_pipeline.core.config import validate_config

    base = validate_config({"train": {}})["train"]
    base.update(
        mode="online", segments=1, steps_per_segment=STEPS, checkpoint_every_steps=2, batch_size=2,
        gpus_per_job=0, num_layers=2, intermediate_size=128, block_size=4, num_anchors=16,
        learning_rate=3e-3, warmup_ratio=0.25, metrics_every_seconds=0, attention="sdpa",
    )  # fmt: skip
    base.update(overrides)
    return base


@pytest.fixture(scope="module")
def tokenized(demo_model, tmp_path_factory):
    from tests.support.train_data import write_tokenized_shard

    root = tmp_path_factory.mktemp("tok")
    return {"00000": str(write_tokenized_shard(demo_model, root / "t0.parquet", 16, seed=0))}


def run_segment(run_dir, demo_model, tokenized, taps_server=None, source=None):
    from dflash_pipeline.core import layout
    from dflash_pipeline.stages.train import engine_tap_source
    from dflash_pipeline.training.trainer import SegmentJob

    if taps_server:
        source = engine_tap_source(taps_server, train_settings(), drafter_taps(demo_model))
    with source or nullcontext():
        return SegmentJob(
            run_url=str(run_dir), segment=0, settings=train_settings(), target_dir=str(demo_model),
            tokenized=tokenized, manifest_path=str(run_dir / layout.segment_manifest_key(0)), device="cpu",
            tap_source=source,
        ).run()  # fmt: skip


def drafter_taps(demo_model) -> list[int]:
    from dflash_pipeline.model.config import build_drafter_config

    return list(build_drafter_config(train_settings(), str(demo_model)).target_layer_ids)


def losses(run_dir) -> dict[int, float]:
    from dflash_pipeline.core import layout

    lines = (run_dir / layout.train_progress_prefix(0) / layout.TRAIN_METRICS).read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def target_fed(demo_model, tokenized, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("target-fed")
    run_segment(run_dir, demo_model, tokenized)
    return losses(run_dir)


def address(server) -> dict:
    return {"url": server.spec.url, "model": server.spec.model, "storage": str(taps_storage(server.spec))}


class TargetAsTapSource:
    """A tap source (training.tap_sources.TapSource) whose taps the in-process target computes
    though it prefetches as the engine source does; it keeps what the loop asked for and what it
    prefetched."""

    def __init__(self, demo_model, prefetch_depth=1):
        from dflash_pipeline.model.taps import TargetTaps
        from dflash_pipeline.model.target import load_target

        self.taps_of = TargetTaps(
            load_target(str(demo_model), torch.device("cpu"), torch.float32), drafter_taps(demo_model)
        )
        self.prefetch_depth = prefetch_depth
        self.asked, self.prefetched = [], []
        self.ahead_when_asked = []  # how many batches had been prefetched when each was asked for

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def prefetch(self, sequences):
        self.prefetched.append([seq.input_ids[:4].tolist() for seq in sequences])

    def taps(self, sequences, input_ids, device, dtype):
        from dflash_pipeline.training.data import collate

        self.asked.append([seq.input_ids[:4].tolist() for seq in sequences])
        self.ahead_when_asked.append(len(self.prefetched))
        assert torch.equal(collate(sequences, device)[0], input_ids)  # the batch the loop collated
        return self.taps_of(input_ids).to(dtype)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_loop_prefetches_the_next_batches_and_trains_as_on_the_targets_own_taps(
    depth, demo_model, tokenized, target_fed, tmp_path
):
    source = TargetAsTapSource(demo_model, prefetch_depth=depth)
    run_segment(tmp_path, demo_model, tokenized, source=source)
    assert losses(tmp_path) == target_fed
    assert len(source.asked) == STEPS
    # Each step's batch was asked for ahead, once, in order; none after the last.
    assert source.prefetched == source.asked[1:]
    # When step s's batch is needed, the batches up to s - 1 + depth have been asked for.
    assert source.ahead_when_asked == [0] + [min(s - 1 + depth, STEPS - 1) for s in range(1, STEPS)]


@pytest.mark.workflow
def test_a_segment_fed_by_the_engine_matches_one_fed_by_the_target(
    vllm_taps_server, target_fed, demo_model, tokenized, tmp_path
):
    run_segment(tmp_path, demo_model, tokenized, address(vllm_taps_server))
    engine_fed = losses(tmp_path)
    assert sorted(engine_fed) == sorted(target_fed) == list(range(STEPS))
    for step, loss in target_fed.items():
        assert engine_fed[step] == pytest.approx(loss, abs=LOSS_ATOL), step


@pytest.mark.workflow
def test_an_engine_killed_mid_segment_fails_it_cleanly_and_it_resumes(
    vllm_taps_server, target_fed, demo_model, tokenized, tmp_path, monkeypatch
):
    import os
    import signal

    from dflash_pipeline.engines.client import EngineError
    from dflash_pipeline.engines.engine_taps import EngineTapSource
    from dflash_pipeline.engines.environments import engine_env
    from dflash_pipeline.engines.launch import ManagedServer, free_port
    from tests.support.engine_envs import VLLM_CPU_ENV, VLLM_CPU_MEM_FRACTION, vllm_python

    runtime = tmp_path / "doomed"
    spec = taps_server_spec(
        demo_model, [1, 5], free_port(), runtime, python=str(vllm_python()),
        env=engine_env("vllm", {"vllm": {"env": dict(VLLM_CPU_ENV)}}), mem_fraction=VLLM_CPU_MEM_FRACTION,
        dtype="float32", max_model_len=512,
    )  # fmt: skip
    batches = []
    original = EngineTapSource.taps

    def kill_after_the_fourth_batch(self, *args, **kwargs):
        taps = original(self, *args, **kwargs)
        batches.append(self.client.url)
        if len(batches) == 4 and self.client.url == spec.url:
            os.killpg(doomed.process.pid, signal.SIGKILL)  # the engine dies mid-segment
            doomed.process.wait()  # dead before the loop asks for the next batch's taps
        return taps

    monkeypatch.setattr(EngineTapSource, "taps", kill_after_the_fourth_batch)
    run_dir = tmp_path / "run"
    with ManagedServer(spec, runtime / "vllm-taps.log", runtime, startup_timeout=1800) as doomed:
        with pytest.raises(EngineError, match="taps"):
            run_segment(run_dir, demo_model, tokenized, address(doomed))
    # Steps 0-3 ran on their batches; step 4's, asked for while step 3 trained, found no engine.
    assert sorted(losses(run_dir)) == [0, 1, 2, 3]
    # The job's retry, with its node's new server: from the last checkpoint to the end.
    run_segment(run_dir, demo_model, tokenized, address(vllm_taps_server))
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(STEPS))
    for step, loss in target_fed.items():
        assert resumed[step] == pytest.approx(loss, abs=LOSS_ATOL), step


@pytest.fixture(scope="module")
def demo_data(demo_model, tmp_path_factory):
    """The demo workflow up to tokenize on 8 prompts, run once: the two workflow tests below
    each copy it and run their own stages from it (the taps come from the engine there)."""
    from tests.conftest import copy_workflow
    from tests.support.engine_envs import VLLM_CPU_ENV, vllm_python

    workflow = copy_workflow(tmp_path_factory.mktemp("taps-demo-data") / "wf")
    workflow.write_config(
        num_shards=1,
        until="tokenize",
        target={"model": str(demo_model), "build_demo": False},
        dataset={"paths": [workflow.few_prompts(8)]},
        generation={"max_new_tokens": 48},
        tokenize={"max_degenerate_fraction": 1.0},
        engines={"vllm": {"python": str(vllm_python()), "env": dict(VLLM_CPU_ENV)}},
    )
    workflow.snakemake()
    return workflow


# The segment's τ in the loop (rule segment_tau) has nothing to do with where the taps come from
# (tests/test_workflow.py checks it): not measured in these runs.
NO_SEGMENT_TAU = {"enabled": False}


def run_from_demo_data(demo_data, folder, **config):
    """A copy of the shared data's workflow with ``config`` on top, run: its data stages were
    done (not one of them in the run's own job table: no dry run first, a Snakemake start more)."""
    import shutil

    from tests.conftest import Workflow, parse_job_table

    workflow = Workflow(folder)
    shutil.copytree(demo_data.root, workflow.root, symlinks=True)
    workflow.write_config(**config)
    proc = workflow.snakemake()
    ran = parse_job_table(proc.stdout + proc.stderr)
    assert ran and not {"ingest", "prepare", "generate", "tokenize"} & set(ran), ran
    return workflow


@pytest.mark.workflow
def test_the_demo_trains_a_drafter_with_taps_from_the_engine(demo_model, demo_data, tmp_path):
    """The workflow to a drafter with train.taps_from: engine: each train job starts its vLLM
    taps server, checks a sample against the target and trains from the engine's taps."""
    from dflash_pipeline.core import layout
    from tests.support.engine_envs import VLLM_CPU_MEM_FRACTION

    workflow = run_from_demo_data(
        demo_data,
        tmp_path / "wf",
        until="train",
        train={
            "segments": 1, "steps_per_segment": 3, "checkpoint_every_steps": 2, "batch_size": 2,
            "taps_from": "engine",
            "taps_server": {"mem_fraction": VLLM_CPU_MEM_FRACTION, "max_model_len": 512},
            "segment_eval": NO_SEGMENT_TAU,
        },
    )  # fmt: skip
    run = workflow.root / "results/demo"
    manifest = json.loads((run / layout.segment_manifest_key(0)).read_text())
    assert manifest["steps"] == [0, 3]
    logs = (run / "logs" / "train" / "segment-0000.log").read_text(errors="replace")
    assert "one sample's taps" in logs  # the per-run check ran, and passed


# --- extract fed by the engine -------------------------------------------------------------------


def reuse_server(monkeypatch, server) -> None:
    """The taps server an extract job starts is the session's (its start is the same code as
    training's, run by the workflow test above); the job's refusal check, client, per-run check
    and extraction run as written."""
    from dflash_pipeline.engines import engine_taps, launch

    monkeypatch.setattr(engine_taps, "taps_server_spec", lambda *args, **kwargs: server.spec)
    monkeypatch.setattr(launch, "ManagedServer", lambda *args, **kwargs: nullcontext(server))


@pytest.mark.workflow
def test_extract_through_the_engine_stores_the_targets_taps(
    vllm_taps_server, demo_model, tokenized, tmp_path, monkeypatch, caplog
):
    from dflash_pipeline.core import layout
    from dflash_pipeline.stages.extract import extract_job
    from tests.support.engine_envs import VLLM_CPU_ENV, vllm_python

    reuse_server(monkeypatch, vllm_taps_server)
    caplog.set_level(logging.INFO)
    settings = train_settings(mode="offline", hidden_dtype="float32")
    engines = {"vllm": {"python": str(vllm_python()), "env": dict(VLLM_CPU_ENV)}}
    shard, path = next(iter(tokenized.items()))
    stored = {}
    for source in ("target", "engine"):
        run = tmp_path / source
        manifest = extract_job(
            path, str(demo_model), settings, str(run), shard, str(run / layout.shard_key("extract", shard)),
            device="cpu", taps_from=source, engines=engines,
        )  # fmt: skip
        assert manifest["taps_from"] == source and manifest["compute_dtype"] == "float32"
        stored[source] = (manifest, load_file(str(run / manifest["key"])))
    assert "one sample's taps" in caplog.text  # the per-run check ran, and passed
    (target_manifest, by_target), (engine_manifest, by_engine) = stored["target"], stored["engine"]
    for key in ("rows", "tokens", "width", "layer_ids", "hidden_dtype"):
        assert engine_manifest[key] == target_manifest[key], key
    assert by_engine["offsets"].tolist() == by_target["offsets"].tolist()
    assert by_engine["rows"].tolist() == by_target["rows"].tolist()
    assert by_engine["taps"].shape == by_target["taps"].shape == (target_manifest["tokens"], target_manifest["width"])
    assert (by_engine["taps"] - by_target["taps"]).abs().max().item() <= FP32_ATOL
    assert not list(taps_storage(vllm_taps_server.spec).iterdir())  # every file consumed


@pytest.mark.workflow
def test_the_demo_extracts_offline_taps_from_the_engine(demo_model, demo_data, tmp_path):
    """The workflow with extract.taps_from: engine: the extract job starts its vLLM taps server,
    checks the shard's first row against the target and stores the engine's taps; training
    reads them."""
    from dflash_pipeline.core import layout
    from tests.support.engine_envs import VLLM_CPU_MEM_FRACTION

    workflow = run_from_demo_data(
        demo_data,
        tmp_path / "wf",
        until="train",
        extract={"taps_from": "engine"},
        train={
            "mode": "offline", "hidden_dtype": "float32", "segments": 1, "steps_per_segment": 2,
            "batch_size": 2, "taps_server": {"mem_fraction": VLLM_CPU_MEM_FRACTION, "max_model_len": 512},
            "segment_eval": NO_SEGMENT_TAU,
        },
    )  # fmt: skip
    run = workflow.root / "results/demo"
    manifest = json.loads((run / layout.shard_key("extract", "00000")).read_text())
    assert (manifest["taps_from"], manifest["compute_dtype"]) == ("engine", "float32")
    assert json.loads((run / layout.segment_manifest_key(0)).read_text())["steps"] == [0, 2]
    logs = (run / "logs" / "extract" / "00000.log").read_text(errors="replace")
    assert "one sample's taps" in logs  # the per-run check ran, and passed


def test_the_limits_table_says_which_engines_serve_taps():
    from dflash_pipeline.engines.limits import taps_refusal

    assert taps_refusal("vllm", "0.26.0", "gpu") is None
    assert taps_refusal("vllm", "0.32.0", "cpu") is None
    assert "0.25.1" in taps_refusal("vllm", "0.25.1", "gpu")
    assert "the last layer's final-normed hidden state" in taps_refusal("sglang", "0.5.17", "gpu")
    assert "not to stream a training run's taps" in taps_refusal("sglang", "0.5.23", "gpu")


# Programs run by the vLLM environment's Python with the connector's modules on its path (the
# connector imports vLLM); ``connector_programs`` runs them all in one process.
CACHE_LAYOUT_PROGRAM = """
from dflash_taps_connector import DFlashTapsConnector, token_axis
print(token_axis((9, 16, 5, 64), 16, 5), token_axis((9, 5, 16, 64), 16, 5), token_axis((9, 4, 4, 8), 4, 4))
print(DFlashTapsConnector.get_required_kvcache_layout(None))
try:
    token_axis((9, 3, 7, 64), 16, 5)
except ValueError as exc:
    print('refused:', exc)
from types import SimpleNamespace as N
from dflash_taps_connector import _group_block_size
hybrid = N(kv_cache_groups=[N(kv_cache_spec=N(block_size=528)), N(kv_cache_spec=N(block_size=44))])
print(_group_block_size(hybrid, 1, 16), _group_block_size(None, 0, 16))
"""

BACKGROUND_WRITES_PROGRAM = """
import os, sys, threading
import torch
from safetensors.torch import load_file
from dflash_taps_connector import write_taps_file
from taps_host_copies import BackgroundWrites
done, gate = [], threading.Event()
def slow(i):
    gate.wait()
    done.append(i)
writes = BackgroundWrites(limit=2)
writes.submit(slow, 0)
writes.submit(slow, 1)
third = threading.Thread(target=writes.submit, args=(slow, 2))
third.start()
third.join(0.5)
print("third waits for a slot:", third.is_alive())
gate.set()
third.join()
writes.settle(below=1)
print("written in order:", done)
def full(path):
    raise OSError(28, "No space left on device", path)
writes.submit(full, "x.safetensors")
try:
    writes.settle(below=1)
except OSError as exc:
    print("raised:", exc)
path = os.path.join(sys.argv[1], "taps", "req-1.safetensors")
rows = torch.arange(24, dtype=torch.float32).reshape(4, 2, 3)
write_taps_file(path, rows, [5, 6, 7, 8], [2, 9])
found = load_file(path)
print("file:", found["hidden_states"].equal(rows), found["token_ids"].tolist(), found["layer_ids"].tolist(), sorted(os.listdir(os.path.dirname(path))))
os.remove(path)
try:
    write_taps_file(path, None, [5, 6, 7, 8], [2, 9])  # rows that cannot be written
except AttributeError:
    print("failed:", sorted(os.listdir(os.path.dirname(path))), open(path + ".failed").read().split(":")[0])
"""

CONNECTOR_PROGRAMS = {"cache_layout": CACHE_LAYOUT_PROGRAM, "background_writes": BACKGROUND_WRITES_PROGRAM}

# Each program in a namespace of its own, its output kept apart (a traceback in it if it raises,
# and the next runs all the same); the last line printed is every program's output as JSON.
RUN_PROGRAMS = """
import contextlib, io, json, sys, traceback
outputs = {}
for name, source in json.loads(sys.argv[2]).items():
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            exec(compile(source, name, "exec"), {"__name__": name})
        except BaseException:
            traceback.print_exc(file=sys.stdout)
    outputs[name] = buffer.getvalue().splitlines()
print(json.dumps(outputs))
"""


@pytest.fixture(scope="module")
def connector_programs(tmp_path_factory) -> dict[str, list[str]]:
    """Each of ``CONNECTOR_PROGRAMS``' output lines, run in one process of the vLLM environment
    (one import of vLLM and torch for all) from a copy of the connector's modules; a scratch
    folder is the programs' ``sys.argv[1]``."""
    import subprocess

    from dflash_pipeline.engines.engine_taps import install_connector
    from tests.support.engine_envs import vllm_python

    root = tmp_path_factory.mktemp("connector")
    folder = install_connector(root / "connector")
    env = {"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [str(vllm_python()), "-c", RUN_PROGRAMS, str(root), json.dumps(CONNECTOR_PROGRAMS)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_connector_finds_a_blocks_tokens_in_either_releases_cache_layout(connector_programs):
    """vLLM 0.26 (the GPU pin) keeps the hidden-state cache as [blocks, tokens, layers, hidden],
    0.32 as [blocks, layers, tokens, hidden]; the connector read 0.32's only and asked for a layout
    0.26's attention backends refuse (the first GPU start died at "Unknown cache layout format")."""
    output = connector_programs["cache_layout"]
    assert "Traceback (most recent call last):" not in output, "\n".join(output)
    lines = output[-4:]
    # A tie (as many taps as tokens a block) goes by the installed release's own shape rule: 0.32 here.
    assert lines[0] == "1 2 2"
    assert lines[1] == "NHD"  # the name 0.26 and 0.32 both know (0.32 reads it as LBNHC)
    assert lines[2].startswith("refused: hidden-state cache of shape (9, 3, 7, 64)")
    # vLLM 0.34 sizes each cache group's blocks on a hybrid target: the hidden states' group's
    # size, not cache_config.block_size, counts the scheduler's block ids there.
    assert lines[3] == "44 16"


def test_the_connector_writes_files_in_the_background_a_few_at_a_time_and_a_failed_write_stops_it(
    connector_programs,
):
    """The engine's step loop no longer waits for each taps file (a 126 MB one took ~56 ms to
    /dev/shm): the writes go to a thread, at most a few in flight (each holds its rows in host
    memory), in order; a failed write raises at the connector's next call, so the engine stops
    and its clients see a dead server instead of waiting for a file that never comes."""
    output = connector_programs["background_writes"]
    assert "Traceback (most recent call last):" not in output, "\n".join(output)
    lines = output[-5:]
    assert lines[0] == "third waits for a slot: True"
    assert lines[1] == "written in order: [0, 1, 2]"
    assert lines[2] == "raised: [Errno 28] No space left on device: 'x.safetensors'"
    assert lines[3] == "file: True [5, 6, 7, 8] [2, 9] ['req-1.safetensors']"
    # A failed write leaves its marker (the error, for the client) and no partial file.
    assert lines[4] == "failed: ['req-1.safetensors.failed'] AttributeError"


class RecordingTapsClient:
    """``EngineTaps``' interface: each sequence's taps are its ids as one column; the asks are kept."""

    def __init__(self, fail_on: int | None = None):
        self.asked: list[list[int]] = []
        self.fail_on = fail_on
        self.closed = False

    def taps_of(self, sequences):
        from dflash_pipeline.engines.client import EngineError

        self.asked.append([seq[0] for seq in sequences])
        if self.fail_on is not None and any(seq[0] == self.fail_on for seq in sequences):
            raise EngineError("the taps server at http://x died while this client waited for a file")
        return [torch.tensor(seq, dtype=torch.float32)[:, None] for seq in sequences]

    def close(self):
        self.closed = True


def batch_of(*firsts: int):
    from types import SimpleNamespace

    return [SimpleNamespace(input_ids=torch.tensor([first, first + 1])) for first in firsts]


def test_the_next_batchs_taps_are_asked_for_while_this_one_trains_and_taken_once():
    from dflash_pipeline.engines.engine_taps import EngineTapSource

    client = RecordingTapsClient()
    now, later = batch_of(1, 5), batch_of(9)
    with EngineTapSource(client) as source:
        first = source.taps(now, torch.zeros(1, 3), "cpu", torch.float32)
        source.prefetch(later)
        second = source.taps(later, torch.zeros(1, 2), "cpu", torch.float32)
        again = source.taps(later, torch.zeros(1, 2), "cpu", torch.float32)  # nothing ahead any more: asked anew
    assert client.asked == [[1, 5], [9], [9]] and client.closed
    assert first.tolist() == [[[1.0], [2.0], [0.0]], [[5.0], [6.0], [0.0]]]  # right-padded to 3
    assert second.tolist() == again.tolist() == [[[9.0], [10.0]]]


def test_two_batches_wait_ahead_at_most_and_each_is_taken_once():
    from dflash_pipeline.engines.engine_taps import EngineTapSource

    client = RecordingTapsClient()
    first, second, third = batch_of(1), batch_of(3), batch_of(5)
    with EngineTapSource(client, prefetch_depth=2) as source:
        for batch in (first, second, third, first):  # a third ahead and a repeat are ignored
            source.prefetch(batch)
        assert source.taps(first, torch.zeros(1, 2), "cpu", torch.float32).tolist() == [[[1.0], [2.0]]]
        source.prefetch(third)  # a slot is free again
        assert source.taps(second, torch.zeros(1, 2), "cpu", torch.float32).tolist() == [[[3.0], [4.0]]]
        assert source.taps(third, torch.zeros(1, 2), "cpu", torch.float32).tolist() == [[[5.0], [6.0]]]
    assert sorted(client.asked) == [[1], [3], [5]]  # each batch asked of the engine once


def test_a_prefetch_for_other_sequences_is_not_taken_and_its_engine_error_surfaces_where_used():
    from dflash_pipeline.engines.client import EngineError
    from dflash_pipeline.engines.engine_taps import EngineTapSource

    client = RecordingTapsClient(fail_on=7)
    with EngineTapSource(client) as source:
        source.prefetch(batch_of(3))
        other = source.taps(batch_of(4), torch.zeros(1, 2), "cpu", torch.float32)  # not the prefetched batch
        assert other.tolist() == [[[4.0], [5.0]]]
        doomed = batch_of(7)
        source.prefetch(doomed)
        with pytest.raises(EngineError, match="died"):
            source.taps(doomed, torch.zeros(1, 2), "cpu", torch.float32)


def host_copies_module():
    """The connector's copies-and-writes module, loaded by its path: it imports only torch (the
    connector beside it imports vLLM), so its logic runs here without an engine."""
    import importlib.util

    from dflash_pipeline.engines.engine_taps import CONNECTOR_SOURCE

    spec = importlib.util.spec_from_file_location("taps_host_copies", CONNECTOR_SOURCE.parent / "taps_host_copies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GatedCopies:
    """A device copy whose event is done only when the test opens its gate (a GPU copy still in
    flight); ``waiting`` is set once something waits on the copy of that index."""

    pin_memory = False

    def __init__(self):
        import threading

        self.gates: list = []
        self.waiting: list = []
        self.buffers: list[int] = []  # data_ptr of each copy's host buffer, in order
        self._threading = threading

    def copy(self, host, rows):
        host.copy_(rows)
        gate, waiting = self._threading.Event(), self._threading.Event()
        self.gates.append(gate)
        self.waiting.append(waiting)
        self.buffers.append(host.data_ptr())

        class Event:
            def synchronize(self):
                waiting.set()
                gate.wait()

        return Event()


def test_the_connectors_host_buffers_are_reused_and_grow_only_for_larger_rows():
    module = host_copies_module()
    copies = module.RowsToHost(module.HostCopy(), limit=2)
    written: list[tuple[str, list]] = []

    def record(rows, name):
        written.append((name, rows.clone().tolist()))

    copies.submit(torch.ones(4, 2, 3), record, "first")
    copies.writes.settle(below=1)
    assert copies.allocations == 1
    for i, rows in enumerate([torch.zeros(4, 2, 3), torch.zeros(2, 2, 3, dtype=torch.bfloat16), torch.zeros(3, 2)]):
        copies.submit(rows, record, f"same-or-smaller-{i}")
        copies.writes.settle(below=1)
    assert copies.allocations == 1  # same size, fewer bytes, another dtype: no new buffer
    copies.submit(torch.full((5, 2, 3), 7.0), record, "larger")
    copies.writes.settle(below=1)
    assert copies.allocations == 2  # grown once for the larger rows...
    copies.submit(torch.full((5, 2, 3), 8.0), record, "larger-again")
    copies.writes.settle(below=1)
    assert copies.allocations == 2  # ...and that buffer serves the next rows of that size
    assert written[-1] == ("larger-again", torch.full((5, 2, 3), 8.0).tolist())


def test_no_taps_file_is_written_before_its_copy_is_done_and_rows_keep_their_order_and_values(tmp_path):
    import os

    from safetensors.torch import load_file

    module = host_copies_module()
    copier = GatedCopies()
    copies = module.RowsToHost(copier, limit=3)
    paths = [str(tmp_path / f"req-{i}.safetensors") for i in range(3)]
    rows = [torch.arange(6 * (i + 1), dtype=torch.float32).reshape(i + 1, 2, 3) + 100 * i for i in range(3)]

    def write(host, path):
        from safetensors.torch import save_file

        save_file({"hidden_states": host.contiguous()}, path)

    for path, r in zip(paths, rows):
        copies.submit(r, write, path)
    copier.waiting[0].wait()  # the writer waits on the first copy's event...
    assert not any(os.path.exists(p) for p in paths)  # ...and writes nothing meanwhile
    for gate in copier.gates:
        gate.set()
    copies.writes.settle(below=1)
    for path, r in zip(paths, rows):
        assert load_file(path)["hidden_states"].equal(r)


def test_when_every_host_buffer_is_in_flight_the_next_rows_wait_for_the_oldest():
    import threading

    module = host_copies_module()
    copier = GatedCopies()
    copies = module.RowsToHost(copier, limit=2)
    written: list[str] = []
    copies.submit(torch.zeros(2, 3), lambda host, name: written.append(name), "first")
    copies.submit(torch.zeros(2, 3), lambda host, name: written.append(name), "second")
    third = threading.Thread(target=copies.submit, args=(torch.zeros(2, 3), lambda h, n: written.append(n), "third"))
    third.start()
    copier.waiting[0].wait()
    third.join(0.5)
    # Both buffers hold copies in flight: the third rows are not copied anywhere yet.
    assert third.is_alive() and len(copier.buffers) == 2
    copier.gates[0].set()
    third.join()
    # The oldest was written and its buffer, none other, took the third rows.
    assert written == ["first"] and copier.buffers[2] == copier.buffers[0]
    copier.gates[1].set()
    copier.gates[2].set()
    copies.writes.settle(below=1)
    assert written == ["first", "second", "third"] and copies.allocations == 2


def test_a_failed_taps_write_gives_its_buffer_back_and_raises_at_the_next_call():
    module = host_copies_module()
    copies = module.RowsToHost(module.HostCopy(), limit=1)

    def full(host):
        raise OSError(28, "No space left on device")

    copies.submit(torch.zeros(2), full)
    with pytest.raises(OSError, match="No space left"):
        copies.submit(torch.zeros(2), full)
    copies.submit(torch.zeros(2), lambda host: None)  # the buffer is free again
    copies.writes.settle(below=1)
    assert copies.allocations == 1
