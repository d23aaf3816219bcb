"""The experiment tracker (train.tracker): TensorBoard for real (a tiny training segment read back
from its event files), W&B and MLflow through stand-ins of their modules (neither is installed
for the tests), and the preflight's one line for a tracker whose library is missing."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.storage import LocalStorage
from dflash_pipeline.training import tracker as tracker_module
from dflash_pipeline.training.tracker import (
    TensorBoardTracker,
    eval_scalars,
    log_evaluation,
    open_tracker,
    tracker_problems,
    train_scalars,
)
from tests.test_training import STEPS, run_segment, settings, tokenized  # noqa: F401 (a fixture)

EVAL_DOCUMENT = {
    "overall": {"tau": 2.5, "speedup_estimate": 1.8},
    "lossless": {"checked": True, "passed": True},
    "simulated": {"tau": 2.6},
    "engine": {"overall": {"tau": 2.4}, "lossless": {"checked": True, "passed": False}},
}


def train_section(**overrides) -> dict:
    return {**validate_config({"train": {}})["train"], **overrides}


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_missing_tracker_library_is_one_line_naming_its_extra(monkeypatch):
    assert tracker_problems(train_section()) == []
    assert tracker_problems(train_section(tracker="tensorboard")) == []  # installed for the tests
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    (line,) = tracker_problems(train_section(tracker="wandb"))
    assert line.startswith("train.tracker: wandb is not installed") and "dflash-pipeline[tracker-wandb]" in line


def test_the_preflight_refuses_a_tracker_without_its_library(monkeypatch, tmp_path):
    from dflash_pipeline.stages import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    monkeypatch.setattr(preflight, "check_engines", lambda config: ([], []))
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    config = validate_config(
        {"target": {"build_demo": True}, "dataset": {"paths": [str(data)]}, "train": {"tracker": "mlflow"}}
    )
    problems, _ = preflight.run_problems(config, str(tmp_path / "run"))
    assert [p for p in problems if p.startswith("train.tracker")] == [
        "train.tracker: mlflow is not installed in this environment; install it with "
        "`pip install 'dflash-pipeline[tracker-mlflow]'` (or set train.tracker: null)"
    ]


def test_a_metrics_record_becomes_flat_scalars():
    record = {
        "segment": 0,
        "step": 7,
        "algorithm": "dflash",
        "loss": 1.5,
        "accuracy_per_position": [0.5, 0.25],
        "accept_len": float("nan"),
        "gpu_mem_gib": None,
        "tokens_per_s": 10,
        "time": 1.0,
    }
    assert train_scalars(record) == {
        "train/loss": 1.5,
        "train/accuracy_per_position/1": 0.5,
        "train/accuracy_per_position/2": 0.25,
        "train/tokens_per_s": 10.0,
    }
    assert eval_scalars(EVAL_DOCUMENT) == {
        "eval/tau": 2.5,
        "eval/speedup": 1.8,
        "eval/lossless_passed": 1.0,
        "eval/simulated_tau": 2.6,
        "eval/engine_tau": 2.4,
        "eval/engine_lossless_passed": 0.0,
    }
    assert eval_scalars({"overall": {"tau": None}, "lossless": {"checked": False}}) == {}


def test_a_training_segment_logs_its_metrics_to_tensorboard_and_evaluate_its_summary(
    demo_model,
    tokenized,  # noqa: F811 (the fixture imported above)
    tmp_path,
):
    run_dir = tmp_path / "run"
    s = settings(tracker="tensorboard")
    run_segment(run_dir, 0, s, demo_model, tokenized)
    folder = run_dir / layout.TENSORBOARD_DIR
    scalars = read_scalars(folder)
    lines = (run_dir / layout.train_progress_prefix(0) / layout.TRAIN_METRICS).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [step for step, _ in scalars["train/loss"]] == list(range(STEPS))
    assert [value for _, value in scalars["train/loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [step for step, _ in scalars["train/lr"]] == list(range(STEPS))
    for tag in ("train/accuracy_per_position/1", "train/accuracy_per_position/3", "train/grad_norm"):
        assert len(scalars[tag]) == STEPS, tag
    assert "train/tokens_per_s" in scalars and "train/time" not in scalars

    metrics = tmp_path / "evaluate-metrics.json"
    metrics.write_text(json.dumps(EVAL_DOCUMENT))
    log_evaluation(s, str(run_dir), metrics)
    scalars = read_scalars(folder)
    assert scalars["eval/tau"] == [(STEPS, 2.5)]  # at the step training ended at
    assert scalars["eval/lossless_passed"] == [(STEPS, 1.0)]
    assert scalars["eval/engine_tau"] == [(STEPS, pytest.approx(2.4))]
    assert len(scalars["train/loss"]) == STEPS


def test_tensorboard_files_are_uploaded_to_the_runs_storage_at_each_flush(tmp_path):
    """An S3 run root: the job writes locally and uploads to logs/tensorboard/ of the run (a
    local storage stands in for the bucket)."""
    run = LocalStorage(tmp_path / "bucket")
    tracker = TensorBoardTracker(tmp_path / "local", storage=run)
    tracker.log({"train/loss": 2.0}, 0)
    tracker.flush()
    (uploaded,) = (tmp_path / "bucket" / layout.TENSORBOARD_DIR).iterdir()
    assert read_scalars(uploaded.parent) == {"train/loss": [(0, 2.0)]}
    tracker.log({"train/loss": 1.0}, 1)
    tracker.close()
    assert read_scalars(uploaded.parent) == {"train/loss": [(0, 2.0), (1, 1.0)]}
    assert tracker_module.tensorboard_dir(train_section(tracker_dir=str(tmp_path / "tb")), "s3://b/results/x") == (
        tmp_path / "tb",
        True,
    )
    assert tracker_module.tensorboard_dir(train_section(), "results/x") == (
        Path("results/x") / layout.TENSORBOARD_DIR,
        False,
    )


class _Calls(list):
    def __call__(self, name):
        return lambda *args, **kwargs: self.append((name, args, kwargs))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = _Calls()
    run = types.SimpleNamespace(log=calls("log"), finish=calls("finish"))

    def init(**kwargs):
        calls.append(("init", (), kwargs))
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return calls


def test_wandb_resumes_one_run_per_pipeline_run(fake_wandb, tmp_path):
    train = train_section(tracker="wandb", tracker_project="drafters")
    first = open_tracker(train, "s3://bucket/results/demo")
    first.log({"train/loss": 1.0}, 3)
    first.close()
    open_tracker(train, "s3://bucket/results/demo").close()
    (_, _, init), log, finish, (_, _, again), _ = fake_wandb
    assert init["project"] == "drafters" and init["name"] == "demo" and init["resume"] == "allow"
    assert init["id"] == again["id"] and init["id"].startswith("demo-")
    assert init["config"]["learning_rate"] == train["learning_rate"] and "tracker" not in init["config"]
    assert log == ("log", ({"train/loss": 1.0},), {"step": 3}) and finish[0] == "finish"
    other = open_tracker(train, "s3://bucket/elsewhere/demo")
    assert fake_wandb[-1][2]["id"] != init["id"]  # the same name under another root
    other.close()


def test_mlflow_creates_the_run_once_and_later_jobs_reopen_it(monkeypatch, tmp_path):
    calls = _Calls()
    started = []

    def start_run(**kwargs):
        started.append(kwargs)
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="abc123"))

    fake = types.SimpleNamespace(
        start_run=start_run,
        set_experiment=calls("set_experiment"),
        log_params=calls("log_params"),
        log_metrics=calls("log_metrics"),
        end_run=calls("end_run"),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    run_dir = tmp_path / "results" / "demo"
    train = train_section(tracker="mlflow")
    first = open_tracker(train, str(run_dir))
    first.log({"train/loss": 1.0}, 0)
    first.close()
    second = open_tracker(train, str(run_dir))
    second.log({"train/loss": 0.5}, 1)
    second.close()
    assert started == [{"run_name": "demo"}, {"run_id": "abc123"}]
    assert json.loads((run_dir / layout.TRACKER_STATE).read_text()) == {"mlflow_run_id": "abc123"}
    names = [name for name, _, _ in calls]
    assert names == ["set_experiment", "log_params", "log_metrics", "end_run", "log_metrics", "end_run"]
    assert calls[0][1] == ("dflash-pipeline",)
    assert calls[4] == ("log_metrics", ({"train/loss": 0.5},), {"step": 1})


def test_a_failing_tracker_is_a_warning_and_training_goes_on(monkeypatch, caplog):
    def init(**kwargs):
        return types.SimpleNamespace(log=lambda *a, **k: 1 / 0, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    tracker = open_tracker(train_section(tracker="wandb"), "results/demo")
    tracker.log({"train/loss": 1.0}, 0)
    tracker.log({"train/loss": 1.0}, 1)  # disabled after the first failure: no second warning
    tracker.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0] and "going on without it" in warnings[0]

    def broken_init(**kwargs):
        raise ConnectionError("no server")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=broken_init))
    open_tracker(train_section(tracker="wandb"), "results/demo").log({"train/loss": 1.0}, 0)
    assert "cannot be opened (ConnectionError: no server)" in caplog.records[-1].getMessage()
