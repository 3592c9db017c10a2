"""`cudahook check` and the metrics against GPU containers run by runc and
checkpointed by CRIU: the VMM interposer's sockets, a paused container, and
a whole checkpoint and restore counted in the metrics file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from cudahook.core import manifest
from cudahook.platform import metrics

from .conftest import CRIU, needs_runc, tree_digest
from .test_vmm import start

pytestmark = needs_runc


def check(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    data = yaml.safe_load(config.read_text())
    if data.get("criu") != str(CRIU):  # the suite's CRIU, as runc uses it
        data["criu"] = str(CRIU)
        config.write_text(yaml.safe_dump(data))
    r = subprocess.run([sys.executable, "-m", "cudahook", "--config", str(config), "--json",
                        "check", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1, 6), r.stderr
    return r.returncode, json.loads(r.stdout)


def codes(verdict: dict[str, Any]) -> list[str]:
    return [p["code"] for p in verdict["problems"]]


def test_vmm_sockets_and_coordinator(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    # One CUDA process with the interposer, one without: its state could not all be saved.
    cid, *_ = start(env, tmp_path, name="half",
                    workloads=[("v", {"mib": 1, "vmm": True}), ("p", {"mib": 1})])
    rc, v = check(env.config, "--container", cid)
    assert rc == 1 and codes(v) == ["VMM_SOCKETS_INCOMPLETE"], v
    assert "1 of 2 CUDA processes" in v["problems"][0]["detail"]
    # Every process with its socket, but no coordinator to save them.
    cid2, *_ = start(env, tmp_path, name="full")
    rc, v = check(env.config, "--container", cid2)
    assert rc == 0 and v["facts"]["vmm"] is True, v
    broken = env.tmp / "no-coordinator.yaml"
    data = yaml.safe_load(env.config.read_text())
    data["vmm_coordinator"] = "/nonexistent/snapshot-cuda-vmm"
    broken.write_text(yaml.safe_dump(data))
    rc, v = check(broken, "--container", cid2)
    assert rc == 1 and codes(v) == ["VMM_COORDINATOR_MISSING"], v


def test_a_paused_container_is_not_probed(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, _bundle, _ctl, tags = start(env, tmp_path, vmm=False)
    assert env.box.pause(cid).returncode == 0
    try:
        rc, v = check(env.config, "--container", cid)
        assert rc == 1 and codes(v) == ["CONTAINER_PAUSED"], v
        assert "processes" not in v["checked"]  # cuda-checkpoint would hang on it
    finally:
        assert env.box.resume(cid).returncode == 0
    env.wait_running(tags, env.counters(tags))


def samples(path: Path) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(path.read_text()) for s in fam.samples}


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float | None:
    hits = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]
    return hits[0] if len(hits) == 1 else None


def test_checkpoint_and_restore_are_checked_and_counted(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = make_env()
    cid, bundle, _ctl, tags = start(env, tmp_path)  # three CUDA processes, VMM interposer
    rc, v = check(env.config, "--container", cid, "--image-dir", str(tmp_path))
    assert rc == 0, v
    image = tmp_path / "img"
    r = env.box.checkpoint(cid, image)
    assert r.returncode == 0, r.stderr
    m = manifest.read(image)
    assert m is not None and set(m.files) == {"cuda-vmm.state"}
    assert m.gpu_memory_bytes == 3 << 20  # 1 MiB each, as nvidia-smi reports it
    frozen = env.frozen(cid, tags)
    rc, v = check(env.config, "--image", str(image), "--bundle", str(bundle))
    assert rc == 0 and v["facts"]["device_map"] is None, v
    digest = tree_digest(image)
    r = env.box.restore(cid, bundle, image)
    assert r.returncode == 0, r.stderr
    env.wait_running(tags, frozen)
    assert tree_digest(image) == digest  # the restore wrote nothing into the image
    # The guardian counts CRIU's dump once CRIU has exited: it may still be at it.
    deadline = time.monotonic() + 30
    while value(found := samples(env.state_dir / metrics.DEFAULT_NAME),
                "cudahook_phase_duration_seconds_count", container=cid, phase="criu_dump") is None:
        assert time.monotonic() < deadline, found
        time.sleep(0.05)
    for kind in ("checkpoints", "restores"):
        assert value(found, f"cudahook_{kind}_total", container=cid, outcome="ok") == 1
    for phase in ("lock", "checkpoint", "restore", "unlock", "vmm_prepare", "vmm_restore",
                  "criu_dump", "criu_restore"):
        assert value(found, "cudahook_phase_duration_seconds_count", container=cid,
                     phase=phase) == 1, phase
    assert value(found, "cudahook_gpu_memory_moved_bytes_total", container=cid,
                 direction="to_gpu") == 3 << 20
    st = json.loads(subprocess.run(
        [sys.executable, "-m", "cudahook", "--config", str(env.config), "--json", "status",
         "--no-live"], capture_output=True, text=True, timeout=60).stdout)
    entry = next(c for c in st["containers"] if c["id"] == cid)
    assert entry["last"]["check"]["side"] == "checkpoint" and entry["last"]["check"]["ok"]
    assert entry["last"]["restore"]["ok"] and entry["last"]["restore"]["gpu_bytes"] == 3 << 20
    assert entry["metrics"]["series"]["cudahook_restores_total{outcome=ok}"] == 1
    assert os.path.exists(st["metrics_file"])


def test_the_room_checked_follows_the_containers_gpu_memory_path(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`check --container` on a container whose annotation asks for `auto`:
    with custom storage its GPU memory would go to the image, so a memory
    limit too tight for a host copy does not refuse it and the image
    directory's disk does; without custom storage the same container takes
    the host path and its memory cgroup's headroom refuses it."""
    env = make_env(driver=590)
    env.lab.set(cuda_version=13040)
    settings = env.lab.settings(backend="driver-api")
    env.config.write_text(yaml.safe_dump(dict(settings.__dict__)))
    bundle = env.box.bundle("b", [("st", {"mib": 40})],
                            annotations={"cudahook.io/gpu-memory": "auto"})
    cid = env.cid()
    assert env.box.run(cid, bundle).returncode == 0
    env.wait_running(["st"], steps=2)
    init = int(env.box.state(cid)["pid"])
    memory = next(Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
                  for line in Path(f"/proc/{init}/cgroup").read_text().splitlines()
                  if line.split(":")[1] == "memory")
    usage = int((memory / "memory.usage_in_bytes").read_text())
    (memory / "memory.limit_in_bytes").write_text(str(usage + (8 << 20)))

    rc, v = check(env.config, "--container", cid)
    assert rc == 0 and v["facts"]["gpu_memory_path"] == "storage", v
    assert "host memory" not in v["checked"] and "HOST_MEMORY" not in codes(v), v
    assert any("--image-dir" in w for w in v["warnings"]), v
    small = tmp_path / "small"
    small.mkdir()
    assert subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs",
                           str(small)]).returncode == 0
    try:
        rc, v = check(env.config, "--container", cid, "--image-dir", str(small))
        assert rc == 1 and codes(v) == ["IMAGE_SPACE"], v
        assert "storage path" in v["problems"][0]["detail"], v
    finally:
        subprocess.run(["umount", str(small)])

    env.lab.set(cuda_version=13010)  # the same node without custom storage
    rc, v = check(env.config, "--container", cid)
    assert rc == 1 and codes(v) == ["HOST_MEMORY"], v
    assert v["facts"]["gpu_memory_path"] == "host", v
    assert "custom storage unavailable" in v["facts"]["gpu_memory_path_why"], v
    assert "memory limit" in v["problems"][0]["detail"], v
    env.wait_running(["st"], env.counters(["st"]), steps=2)  # checks touched nothing
