"""The simulator behaves like the real driver and tools, failures included."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cudahook.core.backends.cli import parse_help
from cudahook.sim import tool as simtool
from cudahook.sim.tool import help_text


def cc(node, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run([str(node.lab.cuda_checkpoint), *args], capture_output=True,
                          text=True, timeout=timeout)


def device_fds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "/nvidia" in target:
            out.append(target)
    return out


# Recorded from driver 555.58.02 (the tool is a stub; the text is libcuda's).
# Only the version line may differ between R555, R570 and R580.
R555_HELP = """CUDA checkpoint and restore utility.
Version 555.58.02. Copyright (C) 2024 NVIDIA Corporation. All rights reserved.

Operations:
--get-state --pid <pid>
\tPrints the current checkpoint state of the process specified by <pid>

--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]
\tPerforms the specified action on <pid>.
\tFor the lock action a timeout can be provided, the lock operation will wait up to <ms> \
milliseconds for the operation to succeed.

--toggle --pid <pid>
\tToggles the CUDA state in the specified process between the running and checkpointed states

--get-restore-tid --pid <pid>
\tRetrieves the CUDA restore thread ID of the process specified by <pid>

Options:
--pid|-p <pid>
\tThe pid upon which to perform the operation

--timeout|-t <timeout>
\tOptional timeout that can be specified for the lock action in milliseconds

--help|-h
\tPrint this help message
"""
INVALID = "Invalid option(s) or option(s) not supported by this CUDA Driver\n"


def without_version(text: str) -> list[str]:
    return [line for line in text.split("\n") if not line.startswith("Version ")]


@pytest.mark.parametrize("driver", [555, 570, 580])
def test_help_is_the_recorded_text(make_node, driver: int) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=driver)
    out = cc(node, "--help")
    assert out.returncode == 0 and out.stderr == ""
    expected = R555_HELP
    if driver >= 580:
        expected = expected.replace("--help|-h\n", "--device-map|-d <old_uuid>=<new_uuid>,...\n"
                                    "\tOptional GPU remapping for the restore action, with UUIDs "
                                    "in GPU-xxxxxxxx-... form. Every GPU used by the checkpointed "
                                    "process must be listed.\n\n--help|-h\n")
    assert without_version(out.stdout) == without_version(expected)
    assert f"Version {node.lab.config['driver_version']}. Copyright" in out.stdout
    assert out.stdout == help_text(driver)
    f = parse_help(out.stdout)
    assert f.major == driver and f.toggle and f.actions and f.get_state and f.restore_tid
    assert f.device_map == (driver >= 580)


def test_r555_usage_errors_print_the_whole_help(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=555)
    tool = str(node.lab.cuda_checkpoint)
    for args, head in (([], "No operation selected\n"),
                       (["--get-state"], "Missing pid to perform operation on\n"),
                       (["--frobnicate"], f"{tool}: unrecognized option '--frobnicate'\n{INVALID}"),
                       (["--get", "--pid", "1"], f"{tool}: option '--get' is ambiguous; "
                        "possibilities: '--get-state' '--get-restore-tid'\n" + INVALID),
                       (["--get-state", "--pid"], f"{tool}: option '--pid' requires an argument\n"
                        + INVALID),
                       (["-x"], f"{tool}: invalid option -- 'x'\n{INVALID}")):
        out = cc(node, *args)
        assert (out.returncode, out.stdout) == (1, ""), args
        assert out.stderr == f"{head}\n{R555_HELP}", args


def test_r550_takes_exactly_toggle_pid(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=550)
    p = node.spawn("w", mib=1)
    node.lab.wait_counter("w")
    for args in (["--help"], [], ["--get-state", "--pid", str(p.pid)],
                 ["--pid", str(p.pid), "--toggle"], ["--toggle", f"--pid={p.pid}"],
                 ["--toggle", "-p", str(p.pid)]):
        out = cc(node, *args)
        assert (out.returncode, out.stdout, out.stderr) == (255, "", INVALID), args
    assert cc(node, "--toggle", "--pid", str(p.pid)).returncode == 0
    assert device_fds(p.pid) == []
    out = cc(node, "--toggle", "--pid", "4000000")
    assert out.returncode == 255
    assert out.stderr == 'Could not toggle on process ID 4000000: "invalid argument"\n'


@pytest.mark.parametrize("driver,code", [(550, 255), (555, 1), (580, 1)])
def test_without_a_gpu_every_call_fails_in_cuinit(make_node, driver: int, code: int) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=driver)
    node.lab.stop()
    time.sleep(0.3)
    args = [["--toggle", "--pid", "1"], ["--get-state", "--pid", "1"], ["--pid=1", "--get-state"]]
    for a in args if driver >= 555 else [*args[:1], ["--help"], ["--frobnicate"]]:
        out = cc(node, *a)
        assert (out.returncode, out.stdout) == (code, ""), a
        assert out.stderr == 'Error initializing CUDA: "no CUDA-capable device is detected"\n'
    if driver >= 555:
        assert cc(node, "--help").returncode == 0  # R555+ parse before cuInit


def test_r570_rejects_device_map(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=570)
    out = cc(node, "--action", "restore", "--pid", "1", "--device-map", "GPU-a=GPU-b")
    assert out.returncode == 1
    assert out.stderr == (f"{node.lab.cuda_checkpoint}: unrecognized option '--device-map'\n"
                          f"{INVALID}\n{help_text(570)}")


def test_getopt_forms_thread_ids_and_timeout_zero(node) -> None:  # type: ignore[no-untyped-def]
    p = node.spawn("w", mib=1)
    st = node.lab.wait_counter("w")
    pid = str(p.pid)
    for args in (["--get-state", f"--pid={pid}"], [f"-p{pid}", "--get-state"],
                 ["--get-s", "-p", pid], ["--get-state", "--p", pid], ["-hp", pid],
                 ["--get-state", "--pid", pid, "stray"]):
        out = cc(node, *args)
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout in ("running\n", help_text(580)), args
    # The restore thread's ID stands for its process.
    tid = str(st["restore_tid"])
    assert tid != pid
    assert cc(node, "--get-state", "--pid", tid).stdout == "running\n"
    assert cc(node, "--action", "lock", "--pid", tid, "--timeout", "0").returncode == 0
    assert cc(node, "--action", "checkpoint", "--pid", pid, "--timeout", "0").returncode == 0
    assert cc(node, "--get-state", "--pid", pid).stdout == "checkpointed\n"
    assert cc(node, "--get-restore-tid", "--pid", tid).stdout == f"{tid}\n"
    assert cc(node, "--action=restore", "-p", pid).returncode == 0
    assert cc(node, "--act", "unlock", "--pid", pid, "-t0").returncode == 0
    node.lab.wait_counter("w", node.lab.status("w")["counter"] + 5)


def test_state_machine_and_memory_round_trip(node) -> None:  # type: ignore[no-untyped-def]
    p = node.spawn("w", mib=8)
    st = node.lab.wait_counter("w", 2)
    pid = str(p.pid)
    assert cc(node, "--get-state", "--pid", pid).stdout == "running\n"
    assert cc(node, "--get-restore-tid", "--pid", pid).stdout.strip() == str(st["restore_tid"])
    tname = Path(f"/proc/{p.pid}/task/{st['restore_tid']}/comm").read_text().strip()
    assert tname.startswith("cuda") and len(tname) == 15

    # Illegal transitions fail with exit 1; the CUDA error is in stderr only.
    for action in ("checkpoint", "restore", "unlock"):
        out = cc(node, "--action", action, "--pid", pid)
        assert out.returncode == 1
        assert out.stderr == (f'Could not {action} on process ID {pid}: '
                              '"the operation cannot be performed in the present state"\n')

    assert cc(node, "--action", "lock", "--pid", pid).returncode == 0
    assert cc(node, "--get-state", "--pid", pid).stdout == "locked\n"
    frozen = node.lab.status("w")["counter"]
    time.sleep(0.2)
    assert node.lab.status("w")["counter"] == frozen  # locked: no GPU work
    assert cc(node, "--action", "lock", "--pid", pid).returncode == 1

    assert cc(node, "--action", "checkpoint", "--pid", pid).returncode == 0
    assert cc(node, "--get-state", "--pid", pid).stdout == "checkpointed\n"
    assert device_fds(p.pid) == []  # nothing left for CRIU to choke on
    gpu = node.lab.info()["gpus"][0]
    assert gpu["memory_used_mib"] == 0 and gpu["processes"] == []

    assert cc(node, "--action", "restore", "--pid", pid).returncode == 0
    assert cc(node, "--get-state", "--pid", pid).stdout == "locked\n"
    assert len(device_fds(p.pid)) >= 2
    assert node.lab.status("w")["counter"] == frozen
    assert cc(node, "--action", "unlock", "--pid", pid).returncode == 0
    st = node.lab.wait_counter("w", frozen + 12)
    assert st["intact"] and st["errors"] == [] and st["checks"] >= 1


def test_non_cuda_and_nvml_only_processes_fail_every_call(node) -> None:  # type: ignore[no-untyped-def]
    nvml = node.spawn("nvml", nvml_only=True)
    node.lab.wait_counter("nvml")
    plain = subprocess.Popen(["sleep", "30"])
    try:
        for pid in (nvml.pid, plain.pid):
            expect = {"--get-state": f"Error getting process state for process ID {pid}: "
                      '"initialization error"\n',
                      "--get-restore-tid": f"Could not find restore thread for process ID {pid}\n",
                      "--action": f'Could not lock on process ID {pid}: "initialization error"\n'}
            for args in (["--get-state"], ["--get-restore-tid"], ["--action", "lock"]):
                out = cc(node, *args, "--pid", str(pid))
                assert (out.returncode, out.stderr) == (1, expect[args[0]])
        assert device_fds(nvml.pid)  # NVML users do hold device nodes
    finally:
        plain.kill()
        plain.wait()


def test_lock_timeout_on_busy_process_leaves_it_running(node) -> None:  # type: ignore[no-untyped-def]
    p = node.spawn("busy", mib=1, kernel_ms=1500, interval_ms=0)
    node.lab.wait_counter("busy", 0)
    time.sleep(0.1)  # the next kernel is in flight
    t = time.monotonic()
    out = cc(node, "--action", "lock", "--pid", str(p.pid), "--timeout", "200")
    assert time.monotonic() - t < 1.4
    assert out.returncode == 1
    assert out.stderr == f'Could not lock on process ID {p.pid}: "the operation timed out"\n'
    assert cc(node, "--get-state", "--pid", str(p.pid)).stdout == "running\n"
    c = node.lab.status("busy")["counter"]
    node.lab.wait_counter("busy", c, timeout=10)


def test_stopped_target_makes_the_tool_hang(node) -> None:  # type: ignore[no-untyped-def]
    p = node.spawn("w", mib=1)
    node.lab.wait_counter("w")
    os.kill(p.pid, signal.SIGSTOP)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            cc(node, "--get-state", "--pid", str(p.pid), timeout=1.0)
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert cc(node, "--get-state", "--pid", str(p.pid)).stdout == "running\n"


def test_lost_gpu_connection_loses_the_memory(node) -> None:  # type: ignore[no-untyped-def]
    """What a dump without a checkpoint amounts to: the device memory is gone."""
    node.spawn("w", mib=4)
    node.lab.wait_counter("w", 2)
    node.lab.stop()  # the GPU goes away under a running process
    deadline = time.monotonic() + 10
    while node.lab.status("w").get("state") != "lost":
        assert time.monotonic() < deadline, node.lab.status("w")
        time.sleep(0.05)
    assert node.lab.status("w")["intact"] is False


def test_failed_restore_out_of_memory_stays_checkpointed(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(gpus=1, memory_mib=48)
    p = node.spawn("a", mib=32)
    node.lab.wait_counter("a")
    pid = str(p.pid)
    assert cc(node, "--action", "lock", "--pid", pid).returncode == 0
    assert cc(node, "--action", "checkpoint", "--pid", pid).returncode == 0
    hog = node.spawn("hog", mib=32)  # takes the memory meanwhile
    node.lab.wait_counter("hog")
    out = cc(node, "--action", "restore", "--pid", pid)
    assert out.returncode == 1
    assert out.stderr == f'Could not restore on process ID {pid}: "out of memory"\n'
    assert cc(node, "--get-state", "--pid", pid).stdout == "checkpointed\n"
    os.killpg(hog.pid, signal.SIGKILL)
    hog.wait()
    time.sleep(0.2)
    assert cc(node, "--action", "restore", "--pid", pid).returncode == 0
    assert cc(node, "--action", "unlock", "--pid", pid).returncode == 0
    st = node.lab.wait_counter("a", node.lab.status("a")["counter"] + 12)
    assert st["intact"] and not st["errors"]


def test_device_map_must_name_every_gpu_the_process_sees(node) -> None:  # type: ignore[no-untyped-def]
    p = node.spawn("w", mib=2)
    node.lab.wait_counter("w")
    pid = str(p.pid)
    cc(node, "--action", "lock", "--pid", pid)
    cc(node, "--action", "checkpoint", "--pid", pid)
    a, b = node.lab.uuids
    # The process uses GPU a but CUDA in it sees a and b: naming a alone is partial.
    for bad in (f"{b}={a}", f"{a}={b}", "bogus"):
        out = cc(node, "--action", "restore", "--pid", pid, "--device-map", bad)
        assert out.returncode == 1
        assert out.stderr == f'Could not restore on process ID {pid}: "invalid argument"\n'
        assert cc(node, "--get-state", "--pid", pid).stdout == "checkpointed\n"
    assert cc(node, "--action", "restore", "--pid", pid, "-d", f"{a}={b},{b}={a}").returncode == 0
    cc(node, "--action", "unlock", "--pid", pid)
    st = node.lab.wait_counter("w", node.lab.status("w")["counter"] + 12)
    assert st["gpu"] == b and st["intact"]
    assert [g["memory_used_mib"] > 0 for g in node.lab.info()["gpus"]] == [False, True]


def test_toggle_round_trip_on_r550(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(driver=550)
    p = node.spawn("w", mib=2)
    node.lab.wait_counter("w")
    assert cc(node, "--toggle", "--pid", str(p.pid)).returncode == 0
    assert device_fds(p.pid) == []
    c = node.lab.status("w")["counter"]
    assert cc(node, "--toggle", "--pid", str(p.pid)).returncode == 0
    assert node.lab.wait_counter("w", c + 12)["intact"]


def test_attach_latency_is_paid_per_call(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(attach_latency_s=0.4)
    p = node.spawn("w", mib=1)
    node.lab.wait_counter("w")
    t = time.monotonic()
    assert cc(node, "--get-state", "--pid", str(p.pid)).returncode == 0
    assert time.monotonic() - t >= 0.4
    t = time.monotonic()
    cc(node, "--help")
    assert time.monotonic() - t < 0.4  # R555+: --help does not attach
    node.lab.set(driver=550)
    t = time.monotonic()
    assert cc(node, "--help").returncode == 255
    assert time.monotonic() - t >= 0.4  # R550 calls cuInit before anything


def test_copy_bandwidth_is_paid_per_mib(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(bandwidth_mib_s=40)
    p = node.spawn("w", mib=16)
    node.lab.wait_counter("w")
    cc(node, "--action", "lock", "--pid", str(p.pid))
    t = time.monotonic()
    assert cc(node, "--action", "checkpoint", "--pid", str(p.pid)).returncode == 0
    assert time.monotonic() - t >= 16 / 40


def test_fault_injection_by_pid_tag_and_count(node) -> None:  # type: ignore[no-untyped-def]
    a = node.spawn("a", mib=1)
    b = node.spawn("b", mib=1)
    node.lab.wait_counter("a")
    node.lab.wait_counter("b")
    node.lab.fault("lock", code=2, pid=a.pid, times=1)
    node.lab.fault("get-state", mode="crash", tag="b")
    out = cc(node, "--action", "lock", "--pid", str(a.pid))
    assert out.returncode == 1 and '"out of memory"' in out.stderr
    assert cc(node, "--action", "lock", "--pid", str(a.pid)).returncode == 0  # used up
    out = cc(node, "--get-state", "--pid", str(b.pid))
    assert out.returncode == 1
    assert b.wait(timeout=5) == -signal.SIGKILL
    node.lab.clear_faults()
    node.lab.fault("unlock", mode="hang")
    with pytest.raises(subprocess.TimeoutExpired):
        cc(node, "--action", "unlock", "--pid", str(a.pid), timeout=1.0)


def test_crash_faults_kill_the_tool_itself_and_skip_lets_calls_through(node) -> None:  # type: ignore[no-untyped-def]
    a = node.spawn("a", mib=1)
    node.lab.wait_counter("a")
    pid = str(a.pid)
    node.lab.fault("get-state", mode="segv", skip=1, times=1)
    assert cc(node, "--get-state", "--pid", pid).stdout == "running\n"  # let through
    out = cc(node, "--get-state", "--pid", pid)
    assert (out.returncode, out.stdout, out.stderr) == (-signal.SIGSEGV, "", "")
    assert cc(node, "--get-state", "--pid", pid).stdout == "running\n"  # used up
    # `after`: the driver carried the lock out before the tool died.
    node.lab.fault("lock", mode="segv", after=True, times=1)
    assert cc(node, "--action", "lock", "--pid", pid).returncode == -signal.SIGSEGV
    assert cc(node, "--get-state", "--pid", pid).stdout == "locked\n"
    assert cc(node, "--action", "unlock", "--pid", pid).returncode == 0
    assert a.poll() is None  # the target lives on
    node.lab.fault("nvidia-smi")
    out = subprocess.run([str(node.lab.nvidia_smi), "-L"], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 9 and "couldn't communicate with the NVIDIA driver" in out.stdout


def test_a_crash_in_the_driver_library_kills_its_caller_after_the_call(node) -> None:  # type: ignore[no-untyped-def]
    from cudahook.core.backends import make_backend
    from cudahook.platform.errors import ToolError
    from cudahook.platform.host import Host

    a = node.spawn("a", mib=1)
    node.lab.wait_counter("a")
    backend = make_backend(node.lab.settings(backend="driver-api"), Host())
    try:
        node.lab.fault("lock", mode="segv", after=True, times=1)
        with pytest.raises(ToolError, match="driver helper exited"):
            backend.lock(a.pid, 0)
        assert backend.get_state(a.pid) == "locked"  # a fresh helper; the lock held
        backend.unlock(a.pid)
        assert backend.get_state(a.pid) == "running"
    finally:
        backend.close()  # type: ignore[attr-defined]


def test_multi_process_workload_has_one_cuda_context_per_worker(node) -> None:  # type: ignore[no-untyped-def]
    node.spawn("mp", mib=2, procs=3)
    reports = [node.lab.wait_counter(f"mp.{i}") for i in range(3)]
    pids = {r["pid"] for r in reports}
    tids = {r["restore_tid"] for r in reports}
    assert len(pids) == 3 and len(tids) == 3
    procs = node.lab.info()["gpus"][0]["processes"]
    assert {p["pid"] for p in procs} == pids


def test_device_map_targets_same_chip_enough_memory_and_toggle_ignores_it(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(gpus=3, gpu_specs=[{}, {"name": "NVIDIA A100-SXM4-80GB (simulated)"},
                                        {"memory_mib": 40000}])
    p = node.spawn("w", mib=2)
    node.lab.wait_counter("w")
    pid = str(p.pid)
    a, b, c = node.lab.uuids
    # --toggle takes a map and ignores it, as the real tool does.
    assert cc(node, "--toggle", "--pid", pid, "--device-map", f"{a}={c},{b}={b},{c}={a}").returncode == 0
    assert cc(node, "--get-state", "--pid", pid).stdout == "checkpointed\n"
    for bad in (f"{a}={b},{b}={a},{c}={c}", f"{a}={c},{b}={b},{c}={a}"):
        out = cc(node, "--action", "restore", "--pid", pid, "--device-map", bad)
        assert out.stderr == f'Could not restore on process ID {pid}: "invalid argument"\n'
    assert cc(node, "--toggle", "--pid", pid, "-d", f"{a}={c},{b}={b},{c}={a}").returncode == 0
    st = node.lab.wait_counter("w", node.lab.status("w")["counter"] + 5)
    assert st["gpu"] == a and st["intact"]


def test_r590_help_adds_jobs_to_r580(make_node) -> None:  # type: ignore[no-untyped-def]
    from cudahook.core.backends.cli import features_for

    node = make_node(driver=590)
    out = cc(node, "--help")
    assert out.returncode == 0 and out.stdout == help_text(590)
    assert "--launch-job <job_file>" in out.stdout
    assert without_version(out.stdout.replace(simtool.JOB_OPERATION, "")) == without_version(
        help_text(580))
    assert parse_help(out.stdout).launch_job and features_for("590.44.01").launch_job
    assert not features_for("580.65.06").launch_job


def test_cuda_13_4_reports_checkpointing_and_restoring_meanwhile(make_node) -> None:  # type: ignore[no-untyped-def]
    node = make_node(bandwidth_mib_s=20)
    node.lab.set(transient_states=True)
    p = node.spawn("w", mib=16)
    node.lab.wait_counter("w")
    pid = str(p.pid)
    assert cc(node, "--action", "lock", "--pid", pid).returncode == 0
    for action, during, after in (("checkpoint", "checkpointing", "checkpointed"),
                                  ("restore", "restoring", "locked")):
        call = subprocess.Popen([str(node.lab.cuda_checkpoint), "--action", action, "--pid", pid])
        seen = set()
        while call.poll() is None:
            seen.add(cc(node, "--get-state", "--pid", pid).stdout.strip())
        assert call.returncode == 0 and during in seen, seen
        illegal = "unlock" if after == "checkpointed" else "lock"
        assert cc(node, "--action", illegal, "--pid", pid).returncode == 1
        assert cc(node, "--get-state", "--pid", pid).stdout == f"{after}\n"
    assert cc(node, "--action", "unlock", "--pid", pid).returncode == 0
    st = node.lab.wait_counter("w", node.lab.status("w")["counter"] + 11)
    assert st["intact"] and not st["errors"]


def test_copies_share_a_gpus_link_and_run_in_parallel_across_gpus(make_node) -> None:  # type: ignore[no-untyped-def]
    import concurrent.futures

    node = make_node(gpus=2, bandwidth_mib_s=16)

    def checkpoint_all(pids: list[int]) -> float:
        for pid in pids:
            assert cc(node, "--action", "lock", "--pid", str(pid)).returncode == 0
        t = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(pids)) as pool:
            codes = list(pool.map(lambda p: cc(node, "--action", "checkpoint", "--pid",
                                                str(p)).returncode, pids))
        assert codes == [0] * len(pids)
        took = time.monotonic() - t
        for pid in pids:
            assert cc(node, "--action", "restore", "--pid", str(pid)).returncode == 0
            assert cc(node, "--action", "unlock", "--pid", str(pid)).returncode == 0
        return took

    apart = [node.spawn(f"a{i}", mib=8, gpu=i).pid for i in range(2)]
    together = [node.spawn(f"t{i}", mib=8, gpu=0).pid for i in range(2)]
    for tag in ("a0", "a1", "t0", "t1"):
        node.lab.wait_counter(tag)
    one_copy = 8 / 16
    assert checkpoint_all(apart) < 2 * one_copy  # two links side by side
    assert checkpoint_all(together) >= 2 * one_copy  # one link, taken in turns


def test_the_host_copy_is_the_processs_memory_and_a_lost_page_is_caught(node) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint leaves the device memory in a memfd the process holds
    (what CRIU dumps with it), the GPU's own reference gone; what the restore
    puts back is that memory, byte for byte: a page changed in it fails the
    workload's memory check."""
    p = node.spawn("w", mib=4, check_every=1)
    node.lab.wait_counter("w", 2)
    pid = str(p.pid)
    for action in ("lock", "checkpoint"):
        assert cc(node, "--action", action, "--pid", pid).returncode == 0
    copies = [f"/proc/{pid}/fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")
              if "cudahook-sim-device-memory" in os.readlink(f"/proc/{pid}/fd/{n}")]
    assert copies and sum(os.stat(c).st_size for c in copies) >= 4 << 20
    gpu = node.lab.info()["gpus"][0]
    assert gpu["memory_used_mib"] == 0  # on the host now, not on the GPU
    big = max(copies, key=lambda c: os.stat(c).st_size)
    fd = os.open(big, os.O_RDWR)
    try:
        page = os.pread(fd, 4096, 1 << 20)
        os.pwrite(fd, bytes(b ^ 0xFF for b in page), 1 << 20)
    finally:
        os.close(fd)
    for action in ("restore", "unlock"):
        assert cc(node, "--action", action, "--pid", pid).returncode == 0
    deadline = time.monotonic() + 10
    while node.lab.status("w").get("intact") is not False:
        assert time.monotonic() < deadline, node.lab.status("w")
        time.sleep(0.05)
    assert not [n for n in os.listdir(f"/proc/{pid}/fd")
                if "cudahook-sim-device-memory" in os.readlink(f"/proc/{pid}/fd/{n}")]
