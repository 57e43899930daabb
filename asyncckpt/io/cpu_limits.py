"""What CPU this process's cgroup allows it: its CPU set and its quota.

``io_threads="auto"`` (io_threads.py) counts idle cores; the machine's count is the wrong
yardstick inside a container or a Slurm job, whose cgroup allows a subset of the cores
(``cpuset``) or a share of their time (a CPU quota: a Kubernetes limit). Both are read from
this process's own cgroup, found through ``/proc/self/cgroup``: cgroup v2 (one hierarchy,
``0::/path``) or v1 (a hierarchy per controller, ``N:cpuset:/path``). In a container with its
own cgroup namespace the path is ``/`` and the files are at the mount's top; without one the
path is the host's, found under the mount when it is there, else the top is read.

Anything unreadable is None: the caller decides without it (and says so where it matters).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

#: Where the cgroup filesystems are mounted, and where this process's cgroups are named.
CGROUP = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` (the kernel's CPU list format) as a set of CPU ids; ValueError if not."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def own_dirs(root: Path = CGROUP, proc_cgroup: Path = PROC_CGROUP) -> dict[str, Path]:
    """This process's cgroup directory per controller: ``""`` for cgroup v2, the controller's
    name (``cpuset``, ``cpu``, ``cpuacct``) for v1. Empty where ``proc_cgroup`` is unreadable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    dirs: dict[str, Path] = {}
    for line in lines:
        try:
            _own_dir(root, line, dirs)
        except OSError:  # a directory we may not look into (EACCES): this line says nothing
            continue
    return dirs


def _own_dir(root: Path, line: str, dirs: dict[str, Path]) -> None:
    """Add one ``/proc/self/cgroup`` line's directory to ``dirs``, per controller it names."""
    parts = line.split(":", 2)
    if len(parts) != 3:
        return
    _, controllers, path = parts
    rel = path.strip().lstrip("/")
    if ".." in PurePosixPath(rel).parts:  # outside its namespace's root: read the top
        rel = ""
    if controllers == "":  # v2: one hierarchy at the mount's top
        bases, names = [root], [""]
    else:  # v1: a mount per controller ("cpu,cpuacct" may be mounted as either name)
        names = controllers.split(",")
        bases = [root / controllers, *(root / n for n in names)]
    for base in bases:
        if not base.is_dir():
            continue
        found = base / rel if rel and (base / rel).is_dir() else base
        for name in names:
            dirs.setdefault(name, found)
        return


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def cpuset(root: Path = CGROUP, proc_cgroup: Path = PROC_CGROUP) -> frozenset[int] | None:
    """The CPU ids this process's cgroup may run on, or None where no cgroup says."""
    dirs = own_dirs(root, proc_cgroup)
    candidates = []
    if "" in dirs:
        candidates.append(dirs[""] / "cpuset.cpus.effective")
    if "cpuset" in dirs:
        candidates += [dirs["cpuset"] / "cpuset.effective_cpus", dirs["cpuset"] / "cpuset.cpus"]
    for path in candidates:
        text = _read(path)
        if text is None:
            continue
        try:
            cpus = parse_cpu_list(text)
        except ValueError:
            continue
        if cpus:
            return cpus
    return None


def quota(root: Path = CGROUP, proc_cgroup: Path = PROC_CGROUP) -> tuple[float, float] | None:
    """(quota in cores, CPU seconds the cgroup has used), or None without a quota or where it
    cannot be read. cgroup v2: ``cpu.max`` and ``cpu.stat``; v1: ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` and ``cpuacct.usage`` (nanoseconds)."""
    dirs = own_dirs(root, proc_cgroup) or {"": root}
    if "" in dirs:
        found = _quota_v2(dirs[""])
        if found is not None:
            return found
    if "cpu" in dirs:
        return _quota_v1(dirs["cpu"], dirs.get("cpuacct", dirs["cpu"]))
    return None


def _quota_v2(d: Path) -> tuple[float, float] | None:
    cpu_max, stat = _read(d / "cpu.max"), _read(d / "cpu.stat")
    if cpu_max is None or stat is None:
        return None
    try:
        limit, period = cpu_max.split()[:2]
        if limit == "max":
            return None
        usage = re.search(r"^usage_usec (\d+)$", stat, re.M)
        if usage is None:
            return None
        return int(limit) / int(period), int(usage.group(1)) / 1e6
    except ValueError:
        return None


def _quota_v1(cpu: Path, cpuacct: Path) -> tuple[float, float] | None:
    limit, period = _read(cpu / "cpu.cfs_quota_us"), _read(cpu / "cpu.cfs_period_us")
    usage = _read(cpuacct / "cpuacct.usage")
    if limit is None or period is None or usage is None:
        return None
    try:
        if int(limit) <= 0:  # -1: no quota
            return None
        return int(limit) / int(period), int(usage) / 1e9
    except ValueError:
        return None
