"""A stand-in entry for test_replication: maps the buffers handed over, exits non-zero unless
their sums are the ones its config expects, then writes into them (the parent sees those
bytes: the same memory, not a copy)."""

import sys

from asyncckpt.memory.replication import read_stand_in

config, jobs, arenas = read_stand_in(sys.stdin.buffer)
sums = {i: int(a.sum()) for i, a in arenas.items()}
if sums != config["expect"] or jobs != ["job"]:
    sys.exit(f"stand-in probe: got {sums} and {jobs}, expected {config['expect']}")
for a in arenas.values():
    a.fill_(5)
