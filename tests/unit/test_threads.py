"""The default thread count: the physical cores this process may use, as llama.cpp's own default.

The cgroup case runs a real process under a real CPU quota: a child cgroup bind-mounted over the cpu
controller in a private mount namespace, which is what a container sees.  That needs root and unshare.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hetero_spec.config import MAX_THREADS, usable_cpus
from hetero_spec.target.llama_target import default_threads, physical_cores

COUNT = "from hetero_spec.target.llama_target import default_threads; print(default_threads())"


def cores_from_lscpu(cpus: set[int]) -> int:
    """Distinct (socket, core) pairs among ``cpus`` as util-linux reports them: an oracle independent of the
    code under test, which reads /sys."""
    out = subprocess.run(["lscpu", "--parse=cpu,core,socket"], capture_output=True, text=True, check=True).stdout
    rows = [line.split(",") for line in out.splitlines() if line and not line.startswith("#")]
    return len({(socket, core) for cpu, core, socket in rows if int(cpu) in cpus})


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="lscpu (util-linux) is the oracle")
def test_default_is_the_physical_cores_of_the_affinity_mask():
    mask = os.sched_getaffinity(0)
    assert MAX_THREADS == usable_cpus() == len(mask)
    assert default_threads() == physical_cores() == cores_from_lscpu(mask)
    assert physical_cores({min(mask)}) == 1


def test_a_narrower_affinity_mask_narrows_the_default():
    cpu = min(os.sched_getaffinity(0))
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}}); {COUNT}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1"


def _cpu_controller() -> tuple[Path, str, str] | None:
    """(mount point, quota file, the quota of one CPU) of a writable cgroup cpu controller, v1 or v2."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "cpu.cfs_quota_us", "100000"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
        return v2, "cpu.max", "100000 100000"
    return None


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_container_cpu_quota_caps_the_default():
    """docker --cpus 1 on a bigger host: llama.cpp's workers spin on every core they see, so the default must
    follow the quota (64 threads throttled to 2 CPUs' time decode far slower than 2)."""
    if usable_cpus() < 2:
        pytest.skip("one CPU: a quota of one cannot narrow it")
    controller = _cpu_controller()
    if controller is None:
        pytest.skip("no writable cgroup cpu controller")
    mount, quota_file, one_cpu = controller
    group = mount / f"hetero-spec-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / quota_file).write_text(one_cpu)
        script = (f"echo $$ > {group}/cgroup.procs && mount --bind {group} {mount} && "
                  f"exec {sys.executable} -c '{COUNT}'")
        out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "1"
    finally:
        group.rmdir()
