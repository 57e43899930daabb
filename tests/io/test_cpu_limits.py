"""cpu_limits: the CPU set and quota of this process's cgroup, v2 and v1, from fake trees."""

from __future__ import annotations

import pytest

from asyncckpt.io import cpu_limits as cl


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert cl.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cl.parse_cpu_list("5") == {5}
    assert cl.parse_cpu_list("\n") == frozenset()
    for bad in ("3-1", "a", "1-x"):
        with pytest.raises(ValueError):
            cl.parse_cpu_list(bad)


def _v2(tmp_path, path="/", cpuset=None, cpu_max=None, usage_usec=None):
    root = tmp_path / "cgroup"
    d = root / path.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    if cpuset is not None:
        (d / "cpuset.cpus.effective").write_text(cpuset)
    if cpu_max is not None:
        (d / "cpu.max").write_text(cpu_max)
    if usage_usec is not None:
        (d / "cpu.stat").write_text(f"usage_usec {usage_usec}\nuser_usec 1\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_cgroup_v2_in_its_own_namespace_is_read_at_the_top(tmp_path):
    root, proc = _v2(tmp_path, "/", cpuset="0-7", cpu_max="250000 100000", usage_usec=2500000)
    assert cl.cpuset(root, proc) == set(range(8))
    assert cl.quota(root, proc) == (2.5, 2.5)


def test_cgroup_v2_without_a_namespace_is_read_in_the_process_own_group(tmp_path):
    """A nested group's quota (a pod under kubepods) is its own, not the top's: the top had
    none, so the quota was silently ignored."""
    root, proc = _v2(tmp_path, "/kubepods/pod1", "4-5", "100000 100000", 7000000)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "cpuset.cpus.effective").write_text("0-63\n")
    assert cl.cpuset(root, proc) == {4, 5}
    assert cl.quota(root, proc) == (1.0, 7.0)


def test_cgroup_v2_without_a_quota_or_files_is_none(tmp_path):
    root, proc = _v2(tmp_path, "/", cpu_max="max 100000", usage_usec=1)
    assert cl.quota(root, proc) is None
    assert cl.cpuset(root, proc) is None
    (root / "cpu.max").write_text("250000 100000\n")
    (root / "cpu.stat").write_text("garbage\n")
    assert cl.quota(root, proc) is None
    assert cl.cpuset(root, tmp_path / "no_such_file") is None


def test_cgroup_v1_reads_the_cpuset_and_the_cfs_quota_per_controller(tmp_path):
    """A Slurm job on a cgroup v1 host: cpuset and cpu,cpuacct hierarchies of their own (the
    quota was read from cgroup v2 files only)."""
    root = tmp_path / "cgroup"
    job = "/slurm/uid_1/job_7/step_0"
    cpuset = root / "cpuset" / job.lstrip("/")
    cpu = root / "cpu,cpuacct" / job.lstrip("/")
    for d in (cpuset, cpu):
        d.mkdir(parents=True)
    (cpuset / "cpuset.effective_cpus").write_text("96-127\n")
    (cpu / "cpu.cfs_quota_us").write_text("400000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (cpu / "cpuacct.usage").write_text("3000000000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"7:cpuset:{job}\n4:cpu,cpuacct:{job}\n1:name=systemd:/\n0::/\n")
    assert cl.cpuset(root, proc) == set(range(96, 128))
    assert cl.quota(root, proc) == (4.0, 3.0)
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cl.quota(root, proc) is None


def test_this_machines_cgroups_read_without_error():
    found = cl.cpuset()
    assert found is None or len(found) >= 1
    q = cl.quota()
    assert q is None or (q[0] > 0 and q[1] >= 0)


def test_a_cgroup_path_above_the_namespace_root_reads_the_top(tmp_path):
    """``0::/../..``: a process outside its cgroup namespace's root. The path led above the
    mount (to a real directory there), so the top's quota and CPU set were not read."""
    root, proc = _v2(tmp_path, "/", cpuset="0-3", cpu_max="200000 100000", usage_usec=1000000)
    for path in ("/..", "/../..", "/a/../../b"):
        proc.write_text(f"0::{path}\n")
        assert cl.cpuset(root, proc) == {0, 1, 2, 3}, path
        assert cl.quota(root, proc) == (2.0, 1.0), path


def test_a_cgroup_directory_it_may_not_look_into_says_nothing_instead_of_raising(
    tmp_path, monkeypatch
):
    """Path.is_dir lets EACCES through: the whole CPU reading was lost, every auto save then
    wrote one file at a time."""
    root, proc = _v2(tmp_path, "/", cpuset="0-3")
    real_is_dir = cl.Path.is_dir

    def refused(self):
        if self == root:
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_dir(self)

    monkeypatch.setattr(cl.Path, "is_dir", refused)
    assert cl.own_dirs(root, proc) == {}
    assert cl.cpuset(root, proc) is None
    (tmp_path / "binary").write_bytes(b"\xff\xfe0::/\n")
    assert cl.own_dirs(root, tmp_path / "binary") == {}
