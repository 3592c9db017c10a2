"""The administrator's commands, one module each: its arguments and its
`run`. `cudahook.admin.cli` holds the table, the options every command
takes, and the one place errors become a line and an exit code."""
