"""Adapters: one module per executable a runtime or CRIU starts, turning what
it hands over (OCI state on stdin, CRIU's environment, runc's argv) into
calls on the core.

- `oci_hook`: createRuntime/prestart/poststop. Its input: the state on
  stdin (`oci_state`), the bundle's config.json (`oci_bundle`), the GPUs it
  asks for (`gpu_request`) and cudahook's annotations (`annotations`).
- `criu_action`: the CRIU action script: the whole timeline of a checkpoint
  and a restore, in order. `criu_env` parses CRIU's environment, `criu_run`
  keeps one CRIU run's progress (its actions run twice), `containers` finds
  the container behind it, `restore_gate` decides whether an image may be
  restored here, `checks` whether a checkpoint or a restore can succeed
  now (with reason codes; `cudahook check` calls the same functions),
  `results` keeps each outcome for `cudahook status` and the metrics, and
  `guardian` is the detached process that brings CUDA processes back when
  CRIU did not.
- `runtime_wrapper`: the runc wrapper that adds the OCI hooks.
- `context`: what every hook needs, assembled once per run.

May import: `cudahook.vmm`, `cudahook.core`, `cudahook.platform`.
"""
