"""``python -m dflash_pipeline``: the ``dflash-pipeline`` command (dflash_pipeline.cli)."""

import sys

from dflash_pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
