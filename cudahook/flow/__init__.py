"""The checkpoint and restore policy, in order: what each hook phase does,
what it checks first, and what it undoes when a step fails.

`hooks/` parses what the runtime and CRIU hand over and calls in here with
plain values; `admin/` calls in here too. Nothing here imports `hooks/`.
"""
