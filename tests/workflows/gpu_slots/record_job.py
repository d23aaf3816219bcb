"""Record the devices this job was given and the interval it held them."""

import json
import os
import sys
import time

out, asked = sys.argv[1], int(sys.argv[2])
start = time.time()
time.sleep(1.5)
with open(out, "w") as fh:
    json.dump(
        {
            "devices": os.environ["CUDA_VISIBLE_DEVICES"].split(","),
            "asked": asked,
            "start": start,
            "end": time.time(),
        },
        fh,
    )
