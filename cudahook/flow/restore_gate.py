"""May this image be restored on this node, and with which device map?

Asked at post-restore, the last moment a restore can still be refused
cleanly (the tasks exist but have not run). Every reason is one clear line.
A reason that no retry on this node can change (driver branch, GPU count,
model or memory, a driver that cannot remap) is `NotRestorableHere`, exit 6:
the orchestrator should start the workload cold or restore it elsewhere.
"""

from __future__ import annotations

from cudahook.core.backends import driver_major
from cudahook.platform.errors import DeviceMapError, EnvironmentProblem, NotRestorableHere

from . import annotations as ann
from .containers import gpu_uuids, gpus_and_models, visible_gpus
from .context import Context

# typing costs milliseconds at every hook start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cudahook.core.manifest import Manifest


def _same_driver_branch(feats: Any, m: Manifest) -> None:
    """Refuses unless this node runs the checkpoint's driver branch with a
    cuda-checkpoint that can restore at all."""
    have, had = feats.major, driver_major(m.driver_version or "")
    if had is None:
        # Without it the branch check would pass by default: refuse instead.
        raise EnvironmentProblem(
            "the checkpoint does not record the driver version it was taken with: "
            "cannot check that this node runs the same driver branch", reason="MANIFEST_NO_DRIVER")
    if had != have:
        raise NotRestorableHere(
            f"checkpoint was taken with driver {m.driver_version}, this node runs "
            f"{feats.version}: restore needs the same driver branch", reason="DRIVER_BRANCH")
    if not feats.actions and not feats.toggle:
        raise EnvironmentProblem("cuda-checkpoint on this node supports neither actions nor toggle",
                                 reason="DRIVER_TOO_OLD")


def plan_restore(ctx: Context, record: dict[str, Any] | None, opts: ann.Options,
                 m: Manifest) -> dict[str, str] | None:
    """The device map this restore needs (None: the same GPUs), or a refusal."""
    from cudahook.core.devicemap import check_targets, compute_device_map, parse_device_map

    feats = ctx.backend.features  # refuses when this node's driver version is unknown
    _same_driver_branch(feats, m)
    source = list(m.gpus)
    node, now = gpus_and_models(ctx, ["all"])
    if any(u.startswith("MIG-") for u in source):
        from cudahook.core.gpus import mig_uuids

        node = [*node, *mig_uuids(ctx.host, ctx.settings)]
    if opts.device_map:
        mapping: dict[str, str] | None = parse_device_map(opts.device_map)
        # The driver needs every GPU the process saw in the map (a partial
        # map fails "invalid argument" at post-resume, where the only way out
        # is to kill the container): refuse it here, while that is clean.
        uncovered = [u for u in source if u not in (mapping or {})]
        if uncovered:
            raise EnvironmentProblem(
                "the cudahook.io/device-map annotation does not name GPU(s) "
                + ", ".join(uncovered) + " of the checkpoint: a device map must cover "
                "every GPU the processes used", reason="DEVICE_MAP_INVALID")
        missing = [u for u in (mapping or {}).values() if u not in node]
    else:
        visible = visible_gpus(record)
        target = gpu_uuids(ctx, visible) if visible else source
        missing = [u for u in target if u not in node]
        try:
            mapping = compute_device_map(source, target) if not missing else None
        except DeviceMapError as exc:
            raise NotRestorableHere(str(exc), reason="GPU_MISMATCH") from exc
    if missing:
        raise NotRestorableHere(
            "GPU(s) not present on this node: " + ", ".join(missing)
            + ("" if record else " (the OCI hook did not see this container; "
               "register it or set cudahook.io/device-map)"), reason="GPU_MISSING")
    if mapping and not feats.device_map:
        raise NotRestorableHere(
            f"the restore moves GPUs ({', '.join(f'{a}={b}' for a, b in mapping.items())}) "
            f"but cuda-checkpoint {feats.version} has no --device-map (driver R580 or newer)",
            reason="DEVICE_MAP_UNSUPPORTED")
    if mapping:
        # The same chip with enough memory: the driver refuses anything else.
        models = {u: (g.name, g.memory_mib) for u, g in m.gpu_models.items()}
        try:
            check_targets(mapping, models, now)
        except DeviceMapError as exc:
            raise NotRestorableHere(str(exc), reason="GPU_MISMATCH") from exc
    return mapping
