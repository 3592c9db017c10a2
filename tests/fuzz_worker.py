"""Runs hook entry points in-process for the fuzz test, one case per line.

Started once by tests/test_fuzz_hooks.py under an address-space limit. Each
request (a JSON line on stdin) names the hook, its argv, its environment,
its stdin and its working directory; the reply (a JSON line on stdout) gives
the exit code, what went to stderr, the time taken, any exception that
escaped the entry point, and any signal it tried to send to a process the
case did not offer as the container's.
"""

from __future__ import annotations

import base64
import io
import json
import os
import resource
import sys
import time
import traceback


def main() -> int:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout
    real_kill = os.kill
    allowed: set[int] = set()
    refused: list[str] = []

    def kill(pid: int, sig: int) -> None:
        if pid not in allowed:
            refused.append(f"kill({pid}, {sig})")
            raise PermissionError(1, "refused by the fuzz harness")
        real_kill(pid, sig)

    def killpg(pgid: int, sig: int) -> None:
        refused.append(f"killpg({pgid}, {sig})")
        raise PermissionError(1, "refused by the fuzz harness")

    os.kill, os.killpg = kill, killpg  # type: ignore[assignment]
    from cudahook.hooks import criu_action as criuhook
    from cudahook.hooks import oci_hook as ocihook

    home = os.getcwd()
    for line in sys.stdin:
        case = json.loads(line)
        allowed.clear()
        allowed.update(case.get("killable", []))
        refused.clear()
        os.environ.clear()
        os.environ.update(case["env"])
        os.chdir(case["cwd"])
        sys.stdin = io.TextIOWrapper(io.BytesIO(base64.b64decode(case["stdin"])))
        err = io.StringIO()
        sys.stderr = err
        raised = None
        t0 = time.monotonic()
        try:
            rc = ocihook.main(case["argv"]) if case["hook"] == "oci" else criuhook.main()
        except BaseException:  # the property under test: nothing escapes
            rc = None
            raised = traceback.format_exc()
        took = time.monotonic() - t0
        sys.stderr = sys.__stderr__
        os.chdir(home)
        out.write(json.dumps({"rc": rc, "stderr": err.getvalue(), "seconds": took,
                              "raised": raised, "refused": list(refused)}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
