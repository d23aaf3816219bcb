"""One training segment: steps [K*N, (K+1)*N) of the drafter, resumable bit for bit.

The segment starts from, in order: its own latest in-segment checkpoint (a crash or preemption
inside the segment), the previous segment's final checkpoint, or a fresh seeded drafter. Every
source of randomness is a function of (seed, step, rank) -- anchors come from a generator seeded
per step, batches from ``BatchOrder`` -- so weights, optimizer and scheduler state plus the step
number reproduce the run exactly; RNG states are saved as well for anything else that draws.
SIGTERM checkpoints at the end of the current step and exits (at the segment's last step it
finishes the segment instead: its final checkpoint is the save); so does a job whose driver is
gone (``dflash_pipeline.core.lease``, checked about once a minute); a periodic checkpoint every M steps
(written in the background while training goes on) bounds what a SIGKILL loses. Checkpoints are
written by every rank, each its share (``dflash_pipeline.training.checkpoint``).

The run loop reads a batch, steps, logs and checkpoints; what each step boundary decides (commit
a background save, stop, finish, a periodic save) is one function of flags OR-ed over the ranks,
``step_boundary`` (``training.segment_log``, with the metrics log). Its length (over 400 lines):
set-up, loop and saves of one segment; the process group (``training.distributed``), the
optimizer (``training.step``), the checkpoint format, the data and the drafter config live in
their own modules.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from dflash_pipeline.core import layout
from dflash_pipeline.model.config import build_drafter_config
from dflash_pipeline.model import target_identity
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.model.target import target_compute_dtype
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.jobstate import write_halt
from dflash_pipeline.core.lease import DriverGone, raise_if_driverless
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.training.blocks import block_metrics, blocks_forward
from dflash_pipeline.training.distributed import Distributed, check_replicas
from dflash_pipeline.training.checkpoint import (
    INDEX,
    PendingSave,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from dflash_pipeline.training.rolling_checkpoints import RollingCheckpoints
from dflash_pipeline.training.data import BatchOrder, collate, read_training_sequences
from dflash_pipeline.training.divergence import APPLY, DivergenceGuard, Verdict
from dflash_pipeline.training.selector import selector_metrics, selector_weight
from dflash_pipeline.training.segment_log import Boundary, MetricsLog, step_boundary
from dflash_pipeline.training.tap_sources import TapSource, TapSourceError, open_training_target
from dflash_pipeline.training.step import lr_factor, make_optimizer, optimizer_step
from dflash_pipeline.training.tracker import Tracker, open_tracker, train_scalars

log = logging.getLogger(__name__)
PREEMPTED_EXIT_CODE = 143
# How often the main rank reads the run lease to see whether its driver still drives the run.
DRIVER_CHECK_EVERY_S = 60.0
SELECTOR_SUMMARY = ("selector_recall", "selector_accuracy", "selector_accept_len")


class TrainingError(RuntimeError):
    pass


class TrainingDiverged(TrainingError):
    """A diverged step beyond the skip budget: the segment stopped unsaved and the run is halted;
    the message is the one line that names the step, its figures and the last good checkpoint."""


@dataclass
class SegmentJob:
    run_url: str
    segment: int
    settings: dict
    target_dir: str
    tokenized: dict[str, str]
    manifest_path: str
    hidden: dict[str, str] = field(default_factory=dict)  # offline mode: shard -> manifest
    device: str | None = None
    # train.taps_from engine: the job's taps server (engines.engine_taps.EngineTapSource), the
    # segment's tap source instead of the target (training.tap_sources)
    tap_source: TapSource | None = None

    def run(self) -> dict:
        return _SegmentRun(self).run()


class _SegmentRun:
    def __init__(self, job: SegmentJob):
        self.job = job
        s = self.settings = job.settings
        self.dist = Distributed.from_env(torch.device(job.device).type if job.device else None)
        if job.device:
            self.device = torch.device(job.device)
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", self.dist.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.on_gpu = self.device.type == "cuda"
        # The target's dtype here is also what `extract` computes stored taps in on this device.
        self.compute_dtype = getattr(torch, target_compute_dtype(self.device))
        self.backend = s["attention"] if s["attention"] != "auto" else ("flex" if self.on_gpu else "sdpa")
        self.storage = open_storage(job.run_url)
        self.start_step = job.segment * s["steps_per_segment"]
        self.end_step = self.start_step + s["steps_per_segment"]
        self._prefetched_to = -1  # the furthest step whose taps an engine source was asked for
        self.total_steps = s["segments"] * s["steps_per_segment"]
        self.stop_requested = False
        self.driver_checked_at = time.monotonic()
        self.driver_gone: str | None = None
        self.pending: PendingSave | None = None  # the background checkpoint save in flight
        self.saved_step: int | None = None  # the step of this segment's latest rolling checkpoint
        self.verdict: Verdict = APPLY  # the divergence guard's verdict on the last step

    # --- set-up --------------------------------------------------------------------------------
    def _load_target(self):
        self.drafter_config = build_drafter_config(self.settings, self.job.target_dir)
        try:
            target = open_training_target(
                self.settings, self.job.target_dir, self.drafter_config, self.device, self.compute_dtype,
                engine_source=self.job.tap_source, hidden=self.job.hidden, storage=self.storage,
                world=self.dist.world,
            )  # fmt: skip
        except TapSourceError as err:
            raise TrainingError(str(err)) from None
        self.tap_source = target.source
        self.embed_weight, self.lm_head_weight = target.embed_weight, target.lm_head_weight
        # The weights the taps come from (the target here, the taps server's, or the stored
        # taps' record), which the segment manifest and the export name.
        self.target_weights = target.weights

    def _build_model(self):
        torch.manual_seed(self.settings["seed"])
        self.drafter = DFlashDrafter(self.drafter_config).to(self.device)
        self.model = self.drafter
        if self.dist.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(
                _BlockForward(self.drafter),
                device_ids=[self.device.index] if self.on_gpu else None,
            )
        s = self.settings
        self.optimizer = make_optimizer(self.drafter, s)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, self.total_steps, s["warmup_ratio"], s["min_lr_ratio"]),
        )

    def _restore(self) -> str:
        """Load the state to start from; returns where it came from."""
        self.rolling = RollingCheckpoints(self.storage, layout.train_progress_prefix(self.job.segment) + "checkpoint/")
        # Every tensor onto this rank's own device (never the device it was saved from).
        where = dict(map_location=self.device, rank=self.dist.rank, group=self.dist)
        loaded = self.rolling.load_latest(**where)
        source = "in-segment checkpoint"
        if loaded is None and self.job.segment > 0:
            loaded = load_checkpoint(self.storage, layout.checkpoint_prefix(self.job.segment - 1), **where)
            source = f"segment {self.job.segment - 1}"
            if loaded is None:
                raise TrainingError(
                    f"segment {self.job.segment - 1}'s checkpoint is missing from "
                    f"{self.storage.join(layout.checkpoint_prefix(self.job.segment - 1))} "
                    f"(no {INDEX}: never written, or its save did not finish)"
                )
        if loaded is None:
            self.step = self.start_step
            return "fresh drafter"
        if source == "in-segment checkpoint":
            self.saved_step = int(loaded.state["step"])
        log.info("%s: %.1f MB read from storage by this rank", source, loaded.bytes_read / 1e6)
        state = loaded.state
        self.drafter.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._configured_learning_rate()
        restore_rng(loaded.rng, self.device)
        self.step = int(state["step"])
        if not self.start_step <= self.step <= self.end_step:
            raise TrainingError(
                f"checkpoint from {source} is at step {self.step}, outside segment "
                f"{self.job.segment} [{self.start_step}, {self.end_step})"
            )
        return source

    def _configured_learning_rate(self) -> None:
        """The config's train.learning_rate over the one a checkpoint holds (its optimizer and
        schedule carry the rate they were saved with): a segment restarted after a divergence
        halt with a lower rate trains at that rate. Unchanged, the values are the same bits."""
        rate = self.settings["learning_rate"]
        if self.scheduler.base_lrs != [rate] * len(self.scheduler.base_lrs):
            log.info(
                f"learning rate {self.scheduler.base_lrs[0]:g} of the checkpoint -> {rate:g} (train.learning_rate)"
            )
        self.scheduler.base_lrs = [rate] * len(self.scheduler.base_lrs)
        for group, lmbda in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["initial_lr"] = rate
            group["lr"] = rate * lmbda(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _state(self) -> dict:
        """What every rank holds alike (DDP); each rank's RNG goes beside it (capture_rng)."""
        return {
            "step": self.step,
            "samples_seen": self.step * self.plan.global_batch,
            "model": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    # --- the loop ------------------------------------------------------------------------------
    def _rank_batch(self, step: int) -> list:
        return [self.sequences[i] for i in self.plan.rank_batch_at(step, self.dist.rank, self.dist.world)]

    def _batch(self, step: int):
        sequences = self._rank_batch(step)
        input_ids, loss_mask = collate(sequences, self.device)
        source = self.tap_source
        taps = source.taps(sequences, input_ids, self.device, self.compute_dtype)
        # Each later batch asked for once, as soon as it is prefetch_depth steps ahead (a source
        # that fetches ahead: the engine computes them while this step trains).
        furthest = min(step + source.prefetch_depth, self.end_step - 1)
        for ahead in range(max(step, self._prefetched_to) + 1, furthest + 1):
            source.prefetch(self._rank_batch(ahead))
        self._prefetched_to = max(self._prefetched_to, furthest)
        return input_ids, loss_mask, taps, sum(x.length for x in sequences)

    def _train_step(self, step: int) -> dict:
        s = self.settings
        started = time.perf_counter()
        input_ids, loss_mask, taps, real_tokens = self._batch(step)
        generator = torch.Generator().manual_seed(s["seed"] * 1_000_003 + step * 1009 + self.dist.rank)
        out = optimizer_step(
            self.drafter,
            self.optimizer,
            self.scheduler,
            taps,
            input_ids,
            loss_mask,
            self.embed_weight,
            self.lm_head_weight,
            s,
            generator,
            self.backend,
            forward_module=self.model if self.dist.world > 1 else None,
            selector_weight=selector_weight(
                step, self.total_steps, s["selector_loss_weight"],
                s["selector_warmup_ratio"], s["selector_ramp_ratio"],
            ),
            judge=self._judge,
        )  # fmt: skip
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        tokens = self.dist.sum(float(real_tokens), self.device)
        metrics = block_metrics(out.loss.hits, out.blocks)
        if out.selector is not None:
            # loss stays the DFlash (base) term, comparable across algorithms; total_loss is
            # what was optimised.
            metrics.update(selector_metrics(out.selector, out.blocks))
            metrics.update(selector_weight=out.selector_weight, total_loss=round(out.total_loss, 6))
        diverged = {} if out.applied else {"skipped": True, "diverged": self.verdict.reason}
        return {
            "segment": self.job.segment,
            "step": step,
            "algorithm": self.drafter_config.algorithm,
            "loss": round(out.loss.loss.item(), 6),
            **metrics,
            **diverged,
            "grad_norm": round(out.grad_norm, 6),
            "lr": out.lr,
            "step_time_s": round(elapsed, 4),
            "steps_per_s": round(1.0 / elapsed, 4),
            "tokens_per_s": round(tokens / elapsed, 1),
            "gpu_mem_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3) if self.on_gpu else None,
            "time": time.time(),
        }

    def _judge(self, loss: float, grad_norm: float) -> bool:
        """Whether the step's update is applied (``training.divergence``). Every rank judges the
        mean loss over the ranks and the (all-reduced, so equal) gradient norm: all decide alike."""
        loss = self.dist.sum(loss, self.device) / self.dist.world
        self.judged = (loss, grad_norm)
        self.verdict = self.guard.judge(loss, grad_norm)
        if not self.verdict.apply and not self.verdict.halt:
            log.warning(
                f"step {self.step} skipped ({self.guard.skipped} of train.divergence.max_skipped_steps "
                f"{self.guard.max_skipped_steps}): {self.verdict.reason} (loss {loss:.6g}, grad_norm {grad_norm:.6g})"
            )
        return self.verdict.apply

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    def _check_driver(self) -> bool:
        """Whether this job's driver is gone (main rank, at most once a minute: one read of
        the lease); the reason is kept for the message."""
        if not self.dist.is_main or time.monotonic() - self.driver_checked_at < DRIVER_CHECK_EVERY_S:
            return False
        self.driver_checked_at = time.monotonic()
        try:
            raise_if_driverless(self.storage, f"train segment {self.job.segment}")
        except DriverGone as err:
            self.driver_gone = str(err)
            return True
        except Exception as err:  # noqa: BLE001 (storage trouble is not a verdict on the driver)
            log.warning("cannot read the run lease (%s); training goes on", err)
        return False

    def run(self) -> dict:
        metrics = self._prepare()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        resumed_at = self.step
        try:
            while self.step < self.end_step:
                record = self._train_step(self.step)  # reads its batch, one optimizer step
                self.step += 1
                self._log(record, metrics)
                if self.verdict.halt:
                    self._diverged(record, metrics)
                self._checkpoint(self._boundary(resumed_at), metrics)
            self._commit_pending(metrics)
            return self._finish(metrics)
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.tracker.close()

    def _prepare(self) -> MetricsLog:
        """The target (or its embeddings), the training sequences, the drafter and the state it
        resumes from; the segment's metrics log."""
        s = self.settings
        self._load_target()
        # Memory-mapped: every rank maps the same local copies (shared page cache), none holds
        # the set in its own memory.
        self.sequences = read_training_sequences(
            self.job.tokenized,
            cache_dir=s.get("data_cache_dir"),
            rank=self.dist.local_rank,
            world=int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world)),
        )
        self.plan = BatchOrder(self.sequences.lengths, s["batch_size"] * self.dist.world, s["seed"])
        self._build_model()
        source = self._restore()
        metrics = MetricsLog(
            self.storage, self.job.segment, (self.start_step, self.end_step), s["metrics_every_seconds"]
        )
        metrics.resume_from(self.step)
        self.guard = self._divergence_guard(metrics)
        # The experiment tracker (train.tracker), main rank only: it logs what metrics.jsonl holds.
        self.tracker = open_tracker(s, self.job.run_url) if self.dist.is_main else Tracker()
        log.info(
            f"segment {self.job.segment}: steps {self.step}..{self.end_step - 1} from {source}; "
            f"{len(self.sequences)} training sequences, {self.dist.world} process(es), "
            f"{self.device}, attention {self.backend}",
        )
        return metrics

    def _divergence_guard(self, metrics: MetricsLog) -> DivergenceGuard:
        """The guard of this segment (train.divergence), seeded with the losses of the steps
        before it: the previous segment's for the running mean, this one's before a resume."""
        guard = DivergenceGuard(self.settings.get("divergence") or schema_defaults("train")["divergence"])
        if self.job.segment > 0:
            key = layout.train_progress_prefix(self.job.segment - 1) + layout.TRAIN_METRICS
            if self.storage.exists(key):
                lines = self.storage.read_text(key).splitlines()[-guard.loss_window :]
                guard.seed([json.loads(line) for line in lines if line], count_skips=False)
        guard.seed(metrics.records)
        return guard

    def _last_good_checkpoint(self) -> str:
        """Where the segment would restart from: its latest in-segment checkpoint, the previous
        segment's, or none."""
        if self.saved_step is not None:
            return f"{self.storage.join(self.rolling.step_prefix(self.saved_step))} (step {self.saved_step})"
        if self.job.segment > 0:
            previous = layout.checkpoint_prefix(self.job.segment - 1)
            return f"{self.storage.join(previous)} (step {self.start_step}, segment {self.job.segment - 1}'s end)"
        return "none (segment 0 starts from a fresh drafter)"

    def _diverged(self, record: dict, metrics: MetricsLog) -> NoReturn:
        """Stop the segment at a diverged step beyond the skip budget, saving nothing: the
        weights that gave this step's loss are no checkpoint (a background save of them is
        dropped, an in-segment checkpoint of them removed); halt the run (core.jobstate) and say
        it in one line. Every rank gets here at the same step (the verdict is alike on all)."""
        step, (loss, grad_norm) = record["step"], self.judged
        if self.pending is not None:
            if self.pending.step < step:  # the state of an earlier, sound step: kept
                self._commit_pending(metrics)
            else:
                self.pending.result()  # its files are written, but no index points to them
                self.pending = None
        if self.saved_step is not None and self.saved_step >= step:
            if self.dist.is_main:
                self.rolling.clear()
            self.saved_step = None
        message = (
            f"train segment {self.job.segment:04d} diverged at step {step}: {self.verdict.reason} "
            f"(loss {loss:.6g}, grad_norm {grad_norm:.6g}); stopped without saving this state; "
            f"last good checkpoint: {self._last_good_checkpoint()}; the run is halted: fix the cause "
            "(e.g. a lower train.learning_rate), then clear the halt: make clear-halt"
        )
        if self.dist.is_main:
            metrics.flush("diverged")
            # As text where not finite: the halt object is JSON that browsers parse (no NaN there).
            figures = {k: v if math.isfinite(v) else str(v) for k, v in (("loss", loss), ("grad_norm", grad_norm))}
            details = {"step": step, **figures, "reason": self.verdict.reason}
            try:
                write_halt(
                    self.storage, "train", layout.segment_name(self.job.segment),
                    f"diverged at step {step}: {self.verdict.reason}", message, details, unit="segment",
                )  # fmt: skip
            except Exception as err:  # noqa: BLE001 (the divergence is what the job must report)
                log.error(f"could not halt the run ({err}): other jobs may go on")
        self.dist.barrier()
        raise TrainingDiverged(message)

    def _log(self, record: dict, metrics: MetricsLog) -> None:
        if self.dist.is_main:
            metrics.add(record)
            self.tracker.log(train_scalars(record), record["step"])

    def _boundary(self, resumed_at: int) -> Boundary:
        """The decisions at the end of step ``self.step - 1``, alike on every rank: one
        all-reduce of a SIGTERM on any rank, whether a background checkpoint write is still
        running on any rank, and whether the driver is gone."""
        stop, writing, orphaned = self.dist.flags_any(
            [self.stop_requested, self.pending is not None and not self.pending.done(), self._check_driver()],
            self.device,
        )
        return step_boundary(
            self.step,
            (self.start_step, self.end_step),
            self.settings["checkpoint_every_steps"],
            first=self.step == resumed_at + 1,
            checkpoint_async=self.settings["checkpoint_async"],
            pending=self.pending is not None,
            writing=writing,
            stop=stop,
            orphaned=orphaned,
        )

    def _checkpoint(self, at: Boundary, metrics: MetricsLog) -> None:
        """What a step boundary decided, done: the finished background save committed, the
        buffers reserved, then a stop (after an in-segment checkpoint) or a periodic save."""
        if at.commit:
            self._commit_pending(metrics)
        if at.reserve:
            self.rolling.reserve(self._state(), self.dist)
        if at.stop and at.last:
            # The final checkpoint after the loop is the save: nothing is dropped, no new
            # rolling checkpoint is needed, and the segment is done.
            log.warning(f"{at.stop} at the segment's last step ({self.step}): finishing the segment, then exiting")
        elif at.stop:
            self._stop(at.stop, metrics)
        elif at.save:
            self._save_rolling(metrics)

    def _stop(self, why: str, metrics: MetricsLog) -> NoReturn:
        """An in-segment checkpoint, then out: SIGTERM exits as preempted (the retry resumes
        here), a job whose driver is gone fails with DriverGone."""
        self._commit_pending(metrics)
        self.rolling.save(self._shared_state(), capture_rng(self.device), self.dist)
        self._flush(metrics)
        if why == "SIGTERM":
            log.warning(f"SIGTERM: checkpointed at step {self.step}; exiting")
            raise SystemExit(PREEMPTED_EXIT_CODE)
        raise DriverGone(
            (self.driver_gone or "train stopped: its driver is gone") + f" (checkpointed at step {self.step})"
        )

    def _shared_state(self) -> dict:
        """The state every rank saves a share of: refused if the replicas differ (every
        checkpoint, periodic, on SIGTERM and at the end, goes through here)."""
        check_replicas(self.drafter, self.dist)
        return self._state()

    def _save_rolling(self, metrics: MetricsLog) -> None:
        """A periodic checkpoint. Async (train.checkpoint_async): this rank's share of the state
        is copied to the CPU here and written by a background thread while training goes on; it
        becomes the latest checkpoint at the first step boundary where every rank finished."""
        self._commit_pending(metrics)  # at most one save in flight
        if self.settings["checkpoint_async"]:
            self.pending = self.rolling.begin(self._shared_state(), capture_rng(self.device), self.dist)
        else:
            self.rolling.save(self._shared_state(), capture_rng(self.device), self.dist)
            self.saved_step = self.step
            self._flush(metrics)

    def _commit_pending(self, metrics: MetricsLog) -> None:
        """Wait for the save in flight (if any) and make it the latest checkpoint; every rank
        calls this at the same step."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.rolling.commit(pending, self.dist)
        self.saved_step = pending.step
        self._flush(metrics)

    def _flush(self, metrics: MetricsLog) -> None:
        if self.dist.is_main:
            metrics.flush("running")
            self.tracker.flush()

    def _finish(self, metrics: MetricsLog) -> dict:
        manifest = None
        prefix = layout.checkpoint_prefix(self.job.segment)
        # Every rank writes its shard; rank 0 the index, then the manifest Snakemake waits for.
        index = save_checkpoint(self.storage, prefix, self._shared_state(), capture_rng(self.device), self.dist)
        if self.dist.is_main:
            metrics.flush("done")
            last = metrics.records[-1] if metrics.records else {}
            manifest = {
                "segment": self.job.segment,
                "steps": [self.start_step, self.end_step],
                "checkpoint": self.storage.join(prefix),
                "checkpoint_prefix": prefix,
                "files": index["files"],
                "drafter_config": self.drafter_config.to_zlab(),
                "algorithm": self.drafter_config.algorithm,
                target_identity.KEY: self.target_weights,
                "last_metrics": {
                    **{k: last.get(k) for k in ("loss", "accuracy", "accept_len", "lr")},
                    **{k: last[k] for k in SELECTOR_SUMMARY if k in last},
                },
                "processes": self.dist.world,
            }
            from dflash_pipeline.core.storage import write_atomically

            with write_atomically(self.job.manifest_path) as tmp:
                tmp.write_text(json.dumps(manifest, indent=1))
            self.rolling.clear()
        self.dist.barrier()
        return manifest


class _BlockForward(torch.nn.Module):
    """The drafter's training forward as one module call, so DDP can overlap gradient
    all-reduce with the backward pass."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, taps, embed_weight, blocks, backend):
        return blocks_forward(self.drafter, taps, embed_weight, blocks, backend)
