"""What the trainer imports to save: neither DCP nor DTensor, which only the worker (DCP) or a
state holding DTensors needs. Each costs a trainer about a second and tens of MiB; a first
save that imported DTensor blocked the loop 1.3 s instead of 0.3 s (benchmarks/memory_stall.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

SAVER = """
import json, sys
import torch
from asyncckpt import KeepLast, Schedule, SyncCheckpointEngine
state = {"w": torch.ones(1 << 16), "step": 3, "nested": {"b": torch.arange(4)}}
schedule = Schedule(every_steps=2, memory_every_steps=1)
with SyncCheckpointEngine(sys.argv[1], keep=KeepLast(2), schedule=schedule) as engine:
    for step in range(1, 5):
        tier = engine.due(step)
        if tier:
            engine.save(step, state, tier=tier)
    engine.wait()
    steps = [c.step for c in engine.list_checkpoints()]
names = ("torch.distributed.checkpoint", "torch.distributed.tensor")
print(json.dumps({"steps": steps, "imported": [n for n in names if n in sys.modules]}))
"""


def test_saves_to_memory_and_disk_import_neither_dcp_nor_dtensor(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SAVER, str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"steps": [2, 4], "imported": []}, (got, out.stderr[-3000:])
