"""``python -m dflash_pipeline``: the ``dflash-pipeline`` command (dflash_pipeline.stages.command)."""

import sys

from dflash_pipeline.stages.command import main

if __name__ == "__main__":
    sys.exit(main())
