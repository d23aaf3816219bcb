"""The live status page of a run: ``python -m dflash_pipeline.status`` (see ``--help``)."""
