"""The executables a runtime or CRIU starts, and the parsers of what they
hand over; every decision is made in `cudahook.flow`.

- `oci_hook`: createRuntime/prestart/poststop; its input is the state on
  stdin (`oci_state`).
- `criu_action`: the CRIU action script; `criu_env` parses CRIU's
  environment, and the action is handed to `flow.checkpoint` or
  `flow.restore`.
- `runtime_wrapper`: the runc wrapper that adds the OCI hooks.

May import: `cudahook.flow`, `cudahook.vmm`, `cudahook.core`, `cudahook.platform`.
"""
