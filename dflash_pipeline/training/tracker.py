"""Optional experiment tracker (``train.tracker``): TensorBoard, Weights & Biases or MLflow.

Training's main rank logs each step's metrics record (the same numbers as ``metrics.jsonl``) at
the global step; the evaluate job logs its headline figures (tau, speed-up, lossless, the
serving engine's tau) once, at the run's last training step. Every backend has the same two
calls, ``log(metrics, step)`` and ``close()``, plus ``flush()`` at the points where training
writes its metrics (checkpoints, the segment's end). Libraries are imported only when a tracker
is opened: none of them is a dependency of the pipeline (the ``tracker-*`` extras install them)
and the preflight refuses a configured tracker whose library is missing (``tracker_problems``).

A segment is a job of its own, so every backend continues one run per pipeline run:
TensorBoard writes a new event file into the same folder, W&B resumes a run id derived from the
run root, MLflow reopens the run id kept in the run's storage (``layout.TRACKER_STATE``). Steps
that a resumed segment repeats after a crash are logged again (TensorBoard shows both points;
W&B drops steps below its current one).

TensorBoard writes event files into a local folder. With a local run root that is
``<run root>/logs/tensorboard``; with an S3 run root the job writes into a local folder
(``train.tracker_dir``, else a temporary one) and uploads the files to ``logs/tensorboard/`` of
the run at every flush, so the run's storage holds them: download that folder to browse it.

A tracker that fails (a server down, a bad login) costs a warning, not the training: the job
goes on without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path, PurePosixPath

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import Storage, is_s3_url, open_storage

log = logging.getLogger(__name__)

# tracker name -> (module the backend imports, the package's pip extra)
TRACKERS = {
    "tensorboard": ("tensorboard", "tracker-tensorboard"),
    "wandb": ("wandb", "tracker-wandb"),
    "mlflow": ("mlflow", "tracker-mlflow"),
}
DEFAULT_PROJECT = "dflash-pipeline"
# Fields of a training metrics record that are no metric: where and when it was measured.
NOT_METRICS = {"segment", "step", "time", "algorithm"}


def tracker_problems(train: dict) -> list[str]:
    """The ``train`` section's tracker: [] when none is set or its library is importable here."""
    name = train.get("tracker")
    if not name:
        return []
    module, extra = TRACKERS[name]
    if importlib.util.find_spec(module) is None:
        return [
            f"train.tracker: {name} is not installed in this environment; "
            f"install it with `pip install 'dflash-pipeline[{extra}]'` (or set train.tracker: null)"
        ]
    return []


def run_name(run_url: str) -> str:
    """The run's name: the last folder of its root (``<results_dir>/<run>``)."""
    return PurePosixPath(str(run_url).rstrip("/")).name


def train_scalars(record: dict) -> dict[str, float]:
    """A training metrics record as flat scalars under ``train/``: numbers as they are, lists
    (``accuracy_per_position``) one scalar per block position (1 = the first drafted slot);
    None and NaN (a step without real blocks) are left out."""
    scalars = {}
    for key, value in record.items():
        if key in NOT_METRICS:
            continue
        if isinstance(value, (list, tuple)):
            scalars.update({f"train/{key}/{i + 1}": v for i, v in enumerate(value)})
        else:
            scalars[f"train/{key}"] = value
    return {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def eval_scalars(document: dict) -> dict[str, float]:
    """The evaluate metrics JSON's headline figures under ``eval/``: the loop's tau and speed-up
    estimate, lossless passed (1/0, when checked), the simulated tau, the serving engine's tau
    and lossless (vllm, sglang)."""
    overall = document.get("overall") or {}
    engine = document.get("engine") or {}
    figures = {
        "eval/tau": overall.get("tau"),
        "eval/speedup": overall.get("speedup_estimate"),
        "eval/lossless_passed": _passed(document.get("lossless")),
        "eval/simulated_tau": (document.get("simulated") or {}).get("tau"),
        "eval/engine_tau": (engine.get("overall") or {}).get("tau"),
        "eval/engine_lossless_passed": _passed(engine.get("lossless")),
    }
    return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def _passed(lossless: dict | None) -> int | None:
    if not lossless or not lossless.get("checked"):
        return None
    return int(bool(lossless.get("passed")))


class Tracker:
    """No tracker (``train.tracker: null``, and every rank but the main one)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: Path, storage: Storage | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        # An S3 run root: the event files are uploaded to it at each flush.
        self.storage = storage

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()
        if self.storage is not None:
            for path in sorted(self.log_dir.glob("events.out.tfevents.*")):
                self.storage.upload_file(f"{layout.TENSORBOARD_DIR}/{path.name}", path)

    def close(self) -> None:
        self.flush()
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, name: str, run_url: str, project: str | None, config: dict):
        import wandb

        # One W&B run per pipeline run: every segment and the evaluate job resume the same id.
        # WANDB_MODE (online, offline, disabled), WANDB_ENTITY and the login come from the
        # environment, as wandb reads them.
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=name,
            id=_stable_id(name, run_url),
            resume="allow",
            config=config,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    def __init__(self, name: str, storage: Storage, project: str | None, config: dict):
        import mlflow

        # MLFLOW_TRACKING_URI (and credentials) come from the environment, as mlflow reads them.
        self.mlflow = mlflow
        state = _read_state(storage)
        run_id = state.get("mlflow_run_id")
        if run_id:
            mlflow.start_run(run_id=run_id)
        else:
            experiment = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
            mlflow.set_experiment(experiment)
            run = mlflow.start_run(run_name=name)
            # Params once, when the run is created: MLflow refuses a param whose value changes,
            # and a later segment may run with other operational keys.
            mlflow.log_params({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in config.items()})
            storage.write_text(layout.TRACKER_STATE, json.dumps({**state, "mlflow_run_id": run.info.run_id}))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _stable_id(name: str, run_url: str) -> str:
    """The same id for every job of a run; two runs of one name under different roots differ."""
    digest = hashlib.sha256(str(run_url).rstrip("/").encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', name)}-{digest}"


def _read_state(storage: Storage) -> dict:
    return json.loads(storage.read_text(layout.TRACKER_STATE)) if storage.exists(layout.TRACKER_STATE) else {}


def tensorboard_dir(train: dict, run_url: str) -> tuple[Path, bool]:
    """(the local folder TensorBoard writes into, whether its files are uploaded to the run)."""
    if is_s3_url(run_url):
        folder = train.get("tracker_dir") or tempfile.mkdtemp(prefix="dflash-tensorboard-")
        return Path(folder), True
    return Path(train.get("tracker_dir") or Path(run_url) / layout.TENSORBOARD_DIR), False


class _Guarded(Tracker):
    """A tracker whose failures are warnings: the first one disables it for the rest of the job."""

    def __init__(self, inner: Tracker, name: str):
        self.inner, self.name = inner, name

    def _call(self, method: str, *args) -> None:
        if self.inner is None:
            return
        try:
            getattr(self.inner, method)(*args)
        except Exception as err:  # noqa: BLE001 (any tracker failure is the same warning)
            log.warning("train.tracker %s failed (%s: %s); going on without it", self.name, type(err).__name__, err)
            self.inner = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self._call("log", metrics, step)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")
        self.inner = None


def open_tracker(train: dict, run_url: str) -> Tracker:
    """The tracker ``train`` (the config's train section) asks for, for the run at ``run_url``;
    a Tracker that does nothing when none is set or it cannot be opened."""
    name = train.get("tracker")
    if not name:
        return Tracker()
    if name not in TRACKERS:
        raise ValueError(f"train.tracker: unknown tracker {name!r} (one of {', '.join(TRACKERS)})")
    config = {k: v for k, v in train.items() if not k.startswith("tracker")}
    try:
        if name == "tensorboard":
            folder, upload = tensorboard_dir(train, run_url)
            inner = TensorBoardTracker(folder, open_storage(run_url) if upload else None)
        elif name == "wandb":
            inner = WandbTracker(run_name(run_url), run_url, train.get("tracker_project"), config)
        else:
            inner = MlflowTracker(run_name(run_url), open_storage(run_url), train.get("tracker_project"), config)
    except Exception as err:  # noqa: BLE001 (as a failure while logging: a warning)
        log.warning("train.tracker %s cannot be opened (%s: %s); going on without it", name, type(err).__name__, err)
        return Tracker()
    return _Guarded(inner, name)


def log_evaluation(train: dict, run_url: str, metrics_path: str | os.PathLike) -> None:
    """The evaluate job's headline figures (its metrics JSON, also a failed gate's) as summary
    scalars at the run's last training step. Nothing when no tracker is set or no metrics were
    written."""
    if not train.get("tracker") or not Path(metrics_path).exists():
        return
    document = json.loads(Path(metrics_path).read_text())
    tracker = open_tracker(train, run_url)
    tracker.log(eval_scalars(document), train["segments"] * train["steps_per_segment"])
    tracker.close()
