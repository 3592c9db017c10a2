"""P1: what a CRIU action costs when there is no GPU work to do.

Variants (all launched with posix_spawn + waitpid, stdio /dev/null):
  sh-noop          /bin/sh -c :                    the reference: launching a process
  network-lock     installed action script, CRTOOLS_SCRIPT_ACTION=network-lock
                   (irrelevant action: the script's shell `case` exits)
  pre-dump-nocuda  installed action script, pre-dump, CRTOOLS_INIT_PID = a plain
                   `sleep` tree; the per-CRIU-run record is removed first, so
                   every sample is CRIU's FIRST call (the real work)
  pre-dump-2nd     the same, record left in place: CRIU 4.1.1's duplicate call
  post-restore-nocuda / post-resume-nocuda
                   restore-side actions for an image without a cudahook manifest

Second part, interpreter start-up of an action that does GPU work (same
interpreter for all; `-I` as the hooks run it):
  py-pass          <venv python> -I -c pass
  py-import-hook   <venv python> -I -c 'import cudahook.hooks.criu_action'
  py-hook-prelude  + config.load(<yaml>) (what main() does before any tool call)
  py-pass-S        <venv python> -I -S -c pass  (no site: no .pth processing)

Targets: each no-op action <= 2x sh-noop; py-import-hook <= 1.5x py-pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: bench/_checkout.py
    import _checkout  # noqa: F401

from bench.common import (
    PYTHON,
    REPO,
    Result,
    arg_parser,
    benchmark,
    interleave,
    kill_group,
    log,
    make_cgroup,
    remove_cgroup,
    reps_of,
    run_main,
    spawn_wait,
    tmpdir,
    wait_members,
    write_config,
)

REPO_S = str(REPO)
PROTO = Path(__file__).resolve().parent / "prototypes" / "criu-action-fastpath.sh"
TITLE = "No-op CRIU action vs /bin/sh -c :; hook interpreter start-up vs python -I -c pass"


def importtime_top(code: str, top: int = 12, runs: int = 5) -> list[dict[str, object]]:
    """`-X importtime` cumulative microseconds per top-level module, median of runs."""
    import statistics

    per: dict[str, list[int]] = {}
    own: dict[str, list[int]] = {}
    for _ in range(runs):
        r = subprocess.run([PYTHON, "-I", "-X", "importtime", "-c", code],
                           capture_output=True, text=True, timeout=60)
        for line in r.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
            if m:
                depth = len(m.group(3)) // 2
                per.setdefault(f"{depth}:{m.group(4)}", []).append(int(m.group(2)))
                own.setdefault(f"{depth}:{m.group(4)}", []).append(int(m.group(1)))
    rows = [{"module": k.split(":", 1)[1], "depth": int(k.split(":", 1)[0]),
             "cumulative_us": int(statistics.median(v)),
             "self_us": int(statistics.median(own[k]))} for k, v in per.items()]
    rows.sort(key=lambda x: -x["cumulative_us"])  # type: ignore[operator]
    return rows[:top]


def new_modules(code: str) -> list[str]:
    """Modules a -I interpreter has loaded after `code` beyond plain start-up."""
    probe = ("import sys; base=set(sys.modules); " + code
             + "; print('\\n'.join(sorted(set(sys.modules)-base)))")
    r = subprocess.run([PYTHON, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    return r.stdout.split()


@benchmark("P1", TITLE)
def run(args) -> Result:  # type: ignore[no-untyped-def]
    reps = reps_of(args)
    res = Result("P1", TITLE)
    with tmpdir("p1") as tmp:
        from cudahook.admin import hookfiles

        state = tmp / "state"
        cfg = write_config(tmp / "cudahook.yaml", state_dir=str(state),
                           log_file=str(tmp / "cudahook.log"))
        hooks = hookfiles.install(tmp / "hooks", python=PYTHON, config=str(cfg))
        action = str(hooks["cudahook-criu-action"])
        image = tmp / "image"
        image.mkdir()
        proto = tmp / "proto-action"
        proto.write_text(PROTO.read_text().replace("@PYTHON@", PYTHON)
                         .replace("@CONFIG@", str(cfg)).replace("@STATE@", str(state)))
        proto.chmod(0o755)
        # A plain "container": a shell and two sleeps, in their own pids cgroup
        # when one can be made (as runc would), else just a process tree.
        cg = make_cgroup("p1")
        join = f"echo $$ > {cg}/cgroup.procs; " if cg else ""
        tree = subprocess.Popen(["/bin/sh", "-c", join + "sleep 100000 & sleep 100000 & wait"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            if cg:
                wait_members(cg, 3)
            # The run's node root (bench/common.py): a Python variant that
            # loads the configuration writes its cache under it, never the node's.
            base_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                        "CUDAHOOK_ROOT": os.environ["CUDAHOOK_ROOT"]}

            def env(act: str, init: bool = True) -> dict[str, str]:
                e = {**base_env, "CRTOOLS_SCRIPT_ACTION": act, "CRTOOLS_IMAGE_DIR": str(image)}
                if init:
                    e["CRTOOLS_INIT_PID"] = str(tree.pid)
                return e

            runs_dir = state / "runs"

            def forget_runs() -> None:
                if runs_dir.is_dir():
                    for p in runs_dir.iterdir():
                        p.unlink(missing_ok=True)

            def sp(argv: list[str], e: dict[str, str] | None = None, *, first: bool = False):  # type: ignore[no-untyped-def]
                def go() -> float:
                    if first:
                        forget_runs()
                    dt, rc = spawn_wait(argv, e if e is not None else base_env)
                    if rc != 0:
                        raise RuntimeError(f"{argv} exited {rc}")
                    return dt
                return go

            actions = {
                "sh-noop": sp(["/bin/sh", "-c", ":"]),
                "network-lock": sp([action], env("network-lock")),
                "pre-dump-nocuda": sp([action], env("pre-dump"), first=True),
                "pre-dump-2nd": sp([action], env("pre-dump")),
                "post-restore-nocuda": sp([action], env("post-restore"), first=True),
                "post-resume-nocuda": sp([action], env("post-resume"), first=True),
                "proto-pre-dump": sp([str(proto)], env("pre-dump"), first=True),
                "proto-post-restore": sp([str(proto)], env("post-restore"), first=True),
                "proto-post-resume": sp([str(proto)], env("post-resume"), first=True),
            }
            descr = {
                "sh-noop": "/bin/sh -c :",
                "network-lock": "action script, irrelevant action (shell exits)",
                "pre-dump-nocuda": "action script, pre-dump, plain sleep tree, CRIU's 1st call",
                "pre-dump-2nd": "the same, CRIU's duplicate 2nd call (cached outcome)",
                "post-restore-nocuda": "action script, post-restore, image without manifest",
                "post-resume-nocuda": "action script, post-resume, image without manifest",
                "proto-pre-dump": "PROTOTYPE shell fast path (bench/prototypes), pre-dump",
                "proto-post-restore": "PROTOTYPE shell fast path, post-restore",
                "proto-post-resume": "PROTOTYPE shell fast path, post-resume",
            }
            log(f"P1 actions: {reps} reps")
            res.add_samples(interleave(actions, reps, warmup=2, progress="P1 actions"), descr)

            py_reps = reps
            pyv = {
                "py-pass": sp([PYTHON, "-I", "-c", "pass"]),
                "py-import-hook": sp([PYTHON, "-I", "-c", "import cudahook.hooks.criu_action"]),
                "py-hook-prelude": sp([PYTHON, "-I", "-c",
                                       "import cudahook.hooks.criu_action; "
                                       "from cudahook.platform import config; "
                                       f"config.load({str(cfg)!r})"]),
                "py-pass-S": sp([PYTHON, "-I", "-S", "-c", "pass"]),
                # What two fixes would give (evidence for docs/performance.md):
                "py-import-hook-S": sp([PYTHON, "-I", "-S", "-c",
                                        f"import sys; sys.path.insert(0, {REPO_S!r}); "
                                        "import cudahook.hooks.criu_action"]),
                "py-prelude-novalidate": sp([PYTHON, "-I", "-c",
                                             "import cudahook.hooks.criu_action, yaml; "
                                             "from cudahook.platform.config import Settings; "
                                             f"Settings(**yaml.load(open({str(cfg)!r}), "
                                             "Loader=yaml.CSafeLoader))"]),
            }
            pdescr = {
                "py-pass": f"{PYTHON} -I -c pass",
                "py-import-hook": "-I -c 'import cudahook.hooks.criu_action'",
                "py-hook-prelude": "import the CRIU action + config.load(yaml): before any tool call",
                "py-pass-S": "-I -S -c pass (no site, no .pth files)",
                "py-import-hook-S": "-I -S, sys.path set by the script, import cudahook.hooks.criu_action",
                "py-prelude-novalidate": "import criuhook + YAML (C loader) without jsonschema "
                                         "validation",
            }
            log(f"P1 interpreter: {py_reps} reps")
            res.add_samples(interleave(pyv, py_reps, warmup=2, progress="P1 python"), pdescr)
        finally:
            kill_group(tree)
            remove_cgroup(cg)
        res.notes.append("sleep tree " + (f"in its own pids cgroup {cg}" if cg else
                                          "in the root cgroup (no writable pids hierarchy)"))

        for v in ("network-lock", "pre-dump-nocuda", "pre-dump-2nd", "post-restore-nocuda",
                  "post-resume-nocuda"):
            res.ratio(f"{v} / sh", v, "sh-noop", 2.0)
        for v in ("proto-pre-dump", "proto-post-restore", "proto-post-resume"):
            res.ratio(f"{v} / sh", v, "sh-noop", 2.0, headline=False)
        res.ratio("hook import / python pass", "py-import-hook", "py-pass", 1.5)
        res.ratio("hook prelude / python pass", "py-hook-prelude", "py-pass", 1.5, headline=False)
        res.ratio("hook import -S / python pass", "py-import-hook-S", "py-pass", 1.5,
                  headline=False)
        res.ratio("prelude w/o validation / python pass", "py-prelude-novalidate", "py-pass",
                  1.5, headline=False)
        res.ratio("python pass / sh", "py-pass", "sh-noop", None, headline=False)
        res.ratio("python -S pass / python pass", "py-pass-S", "py-pass", None, headline=False)

        # Where the time goes.
        res.extra["importtime_hook"] = importtime_top("import cudahook.hooks.criu_action", 15)
        res.extra["importtime_prelude"] = importtime_top(
            "import cudahook.hooks.criu_action; from cudahook.platform import config; "
            f"config.load({str(cfg)!r})", 15)
        res.extra["importtime_pass"] = importtime_top("pass", 8)
        mods = new_modules(f"import cudahook.hooks.criu_action; from cudahook.platform import config; "
                           f"config.load({str(cfg)!r})")
        res.extra["modules_prelude"] = mods
        res.extra["modules_prelude_count"] = len(mods)
        res.extra["modules_prelude_heavy"] = sorted(
            {m.split(".")[0] for m in mods if m.split(".")[0] in (
                "yaml", "jsonschema", "referencing", "rpds", "attrs", "attr", "concurrent",
                "subprocess", "dataclasses", "pathlib", "typing", "json", "logging", "ipaddress",
                "uuid", "urllib", "email", "decimal", "fractions", "importlib_metadata")})
        res.notes.append(
            f"{len(mods)} modules loaded by the GPU-path prelude beyond `-c pass`; heavy roots: "
            + ", ".join(res.extra["modules_prelude_heavy"]))
        res.notes.append("py-pass already pays site + the editable-install .pth finder "
                         "(compare py-pass-S)")
    return res


def parser():  # type: ignore[no-untyped-def]
    return arg_parser(__doc__.split("\n")[0], reps=150, quick_reps=25)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "")
    sys.exit(run_main(run, parser()))
