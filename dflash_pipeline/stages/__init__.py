"""One module per rule family, named like the rule and its script: the stage's I/O and its CLI (``python -m dflash_pipeline.stages.<name> --help``)."""
