"""Record the devices this job was given and the jobs seen holding theirs at the same moment.

A job marks itself in ``running/`` while it holds its devices and, before it ends, waits until
it sees another job there (or every other job has finished): jobs run side by side whatever the
machine's speed, and each record names those it ran beside.
"""

import json
import os
import sys
import time
from pathlib import Path

out, asked, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
me = out.stem
running = Path("running")
running.mkdir(exist_ok=True)
(running / me).touch()
others = [f"job{i}" for i in range(count) if f"job{i}" != me]
deadline = time.monotonic() + 240  # against a hang only
alongside = []
while time.monotonic() < deadline:
    # A marker is there only while its job holds its devices, as this one does now.
    alongside = sorted(p.name for p in running.iterdir() if p.name != me)
    if alongside or all((out.parent / f"{o}.json").exists() for o in others):
        break
    time.sleep(0.05)
record = {"devices": os.environ["CUDA_VISIBLE_DEVICES"].split(","), "asked": asked, "alongside": alongside}
(running / me).unlink()
out.write_text(json.dumps(record))
