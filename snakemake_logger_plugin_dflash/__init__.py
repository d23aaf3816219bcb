"""Snakemake logger plugin ``dflash``: job events for the status page (``--logger dflash``).

Snakemake's main process hands every log record to this handler (behind a queue listener). The
handler keeps only the records that say what a job is doing (planned, started, finished,
failed) and the run's overall progress, and appends them as JSON lines to a local events file,
which ``python -m dflash_pipeline.status`` reads. Nothing here talks to storage or the network.
"""

# No `from __future__ import annotations` here: the plugin registry turns the field types into
# argparse types, and needs real types, not strings.
from dataclasses import dataclass, field
from logging import LogRecord
from typing import Optional

from snakemake_interface_logger_plugins.base import LogHandlerBase
from snakemake_interface_logger_plugins.settings import LogHandlerSettingsBase

from dflash_pipeline.status.events import DEFAULT_EVENTS_FILE, EventWriter, event_from_record


@dataclass
class LogHandlerSettings(LogHandlerSettingsBase):
    events_file: Optional[str] = field(  # noqa: UP045 (see above: a real type, not a union)
        default=None,
        metadata={
            "help": f"JSON-lines file the job events are appended to (default: {DEFAULT_EVENTS_FILE} "
            "in the working directory); the status page reads it.",
            "env_var": True,
            "required": False,
        },
    )


class LogHandler(LogHandlerBase):
    def __post_init__(self) -> None:
        path = getattr(self.settings, "events_file", None) or DEFAULT_EVENTS_FILE
        # A dry-run plans jobs but runs none: recording it would show phantom running jobs.
        self.writer = None if self.common_settings.dryrun else EventWriter(path)

    def emit(self, record: LogRecord) -> None:
        if self.writer is None:
            return
        event = event_from_record(record)
        if event is not None:
            self.writer.write(event)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        super().close()

    @property
    def writes_to_stream(self) -> bool:
        return False

    @property
    def writes_to_file(self) -> bool:
        # False on purpose: Snakemake treats file handlers as its log file and asks for their
        # baseFilename; the events file is a data file for the status page, not the run log.
        return False

    @property
    def has_filter(self) -> bool:
        # Our own selection by event type; the default filter would drop records under --quiet.
        return True

    @property
    def has_formatter(self) -> bool:
        return True

    @property
    def needs_rulegraph(self) -> bool:
        return False
