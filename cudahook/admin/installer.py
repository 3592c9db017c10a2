"""What install.sh does once the virtual environment exists: place the hook
executables, the configuration and the commands, register runtimes, and
undo all of it on --uninstall. Every file it touches goes through the
journal, so uninstall puts the system back byte for byte.
Standard library only (install.sh may run it with the system Python).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cudahook.platform import paths

from . import configure, hookfiles
from .journal import Change, Journal


def install_changes(prefix: Path, python: str, root: str, source: Path) -> list[Change]:
    j = Journal(root)
    libexec = prefix / "libexec"
    config = j.at("/etc/cudahook/config.yaml")
    values = {"RUNC": hookfiles.real_runc(exclude=libexec / "runc-path"),
              "HOOK": str(libexec / "cudahook-oci-hook")}
    changes = [
        Change(libexec / name, hookfiles.render(name, python, str(config), values, root=root).encode(),
               mode=0o755)
        for name in hookfiles.NAMES
    ]
    if not config.exists():
        changes.append(Change(config, (source / "config" / "config.yaml").read_bytes(),
                              mode=0o644))
    venv_bin = Path(python).parent
    for name, target in (("cudahook", venv_bin / "cudahook"),
                         ("cudahook-sim", venv_bin / "cudahook-sim"),
                         ("cudahook-runtime", libexec / "cudahook-runtime")):
        changes.append(Change(j.at(f"/usr/local/bin/{name}"), None, symlink=str(target)))
    return changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="install.sh (cudahook installer)")
    p.add_argument("action", choices=("install", "uninstall"))
    p.add_argument("--prefix", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--root", default=os.environ.get(paths.ROOT_ENV) or "/")
    p.add_argument("--source", default=str(Path(__file__).resolve().parents[2]))
    p.add_argument("--runtime", action="append", default=[])
    p.add_argument("--default-runtime", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    j = Journal(args.root)
    prefix = Path(args.prefix)
    try:
        if args.action == "uninstall":
            restored, kept = j.revert(None, dry_run=args.dry_run)
            verb = "would restore" if args.dry_run else "restored"
            for path in restored:
                print(f"{verb} {path}")
            for line in kept:
                print(f"kept {line}")
            return 0
        changes = install_changes(prefix, args.python, args.root, Path(args.source))
        for d in j.apply("install", changes, dry_run=args.dry_run):
            print(d if args.dry_run else d.splitlines()[1].replace("+++ ", "installed "))
        for rt in ["runc", *[r for r in args.runtime if r != "runc"]]:
            for line in configure.configure(rt, prefix / "libexec", root=args.root,
                                            default=args.default_runtime and rt == "docker",
                                            dry_run=args.dry_run):
                print(line)
    except (configure.ConfigureError, OSError) as exc:
        print(f"install.sh: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
