"""The one seam between cudahook and the world outside its process.

Owns: running tools with deadlines and reading /proc and cgroups (`host`),
where node files live (`paths`), settings (`config`), durable state under
/run (`store`), the structured log (`eventlog`), the error types with
their exit codes (`errors`), the reason codes of refusals (`reasons`) and
the Prometheus metrics file (`metrics`).

May import: the standard library, PyYAML and jsonschema (lazily), and its own
modules. Nothing else of cudahook.
"""
