"""`cudahook migrate`: move a GPU container to another node (podman
archives): `checkpoint`, `restore` and `keygen`, each a command of its own."""

from __future__ import annotations

import argparse
from pathlib import Path

from cudahook.platform.errors import Exit

from .common import Command, emit, no_arguments, seconds_arg, settings


def _podman_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--podman", default="podman",
                   help="the podman command line, global options included (default: podman)")
    p.add_argument("--timeout", type=seconds_arg, default=3600.0,
                   help="deadline for podman's checkpoint or restore, in seconds")


def _checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("container")
    p.add_argument("archive")
    p.add_argument("--leave-running", action="store_true",
                   help="the container goes on here after the checkpoint")
    p.add_argument("--compress", choices=("gzip", "none"), default="gzip")
    p.add_argument("--sign-key", metavar="KEY", help="sign the archive (ARCHIVE.sig) with "
                   "this Ed25519 private key (migrate keygen)")
    _podman_options(p)


def _checkpoint(args: argparse.Namespace) -> int:
    from cudahook.admin import migrate
    from cudahook.flow.context import Context
    from cudahook.platform.host import Host

    ctx = Context(settings(args), Host())
    out = migrate.checkpoint(ctx, migrate.podman_argv(args.podman), args.container,
                             Path(args.archive), leave_running=args.leave_running,
                             compress=args.compress, timeout=args.timeout,
                             sign_key=Path(args.sign_key) if args.sign_key else None)
    emit(args, out, f"{out['container']}: checkpointed into {out['archive']} "
         f"({out['bytes']} bytes, sha256 {out['sha256']}); copy it with "
         f"{Path(out['archive']).name}{migrate.SIDECAR}")
    return Exit.OK


def _restore_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("archive")
    p.add_argument("--name", help="the restored container's name (default: the original's)")
    p.add_argument("--gpus", help="this node's GPU UUIDs to restore onto, comma separated "
                   "(default: the same GPUs if all are here, else the first ones)")
    p.add_argument("--no-verify", action="store_true",
                   help="restore without ARCHIVE.sha256 (the tar is still read to the end)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the archive and this node (exit 0, 2, 5 or 6), restore nothing")
    p.add_argument("--work-dir", help="where the copy naming this node's GPUs is written "
                   "(default: $TMPDIR; as large as the archive, uncompressed)")
    p.add_argument("--verify-key", metavar="PUB", action="append", default=[],
                   help="a trusted Ed25519 public key: ARCHIVE.sig must be signed by one "
                   "(repeatable; also migrate_trusted_keys_dir)")
    _podman_options(p)


def _restore(args: argparse.Namespace) -> int:
    from cudahook.admin import migrate
    from cudahook.flow.context import Context
    from cudahook.platform.host import Host

    ctx = Context(settings(args), Host())
    podman = migrate.podman_argv(args.podman)
    gpus = [u.strip() for u in args.gpus.split(",") if u.strip()] if args.gpus else None
    out = migrate.restore(ctx, podman, Path(args.archive), name=args.name, gpus=gpus,
                          verify=not args.no_verify, timeout=args.timeout,
                          work_dir=args.work_dir, dry_run=args.dry_run,
                          verify_keys=[Path(k) for k in args.verify_key])
    moved = ", ".join(f"{a}={b}" for a, b in (out["device_map"] or {}).items())
    emit(args, out, f"{out['container']}: {'would be restored' if args.dry_run else 'restored'}"
         + (f" onto {', '.join(out['gpus'])}" if out["gpus"] else "")
         + (f" (device map {moved})" if moved else "")
         + f"\n  verified: {', '.join(out['verified'])}"
         + (f"\n  not verified: {', '.join(out['not_verified'])}" if out["not_verified"] else "")
         + (f"\n  dropped from the spec: {', '.join(out['dropped_annotations'])} (this node's "
            "CRIU configuration applies)" if out["dropped_annotations"] else ""))
    return Exit.OK


def _keygen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="KEY",
                   help="the private key (0600); the public key is KEY.pub")


def _keygen(args: argparse.Namespace) -> int:
    from cudahook.admin import signing

    # Loaded though unused: a bad --config is refused here as everywhere.
    settings(args)
    keys = signing.keygen(Path(args.out))
    emit(args, keys, f"{keys['private_key']} (keep it on the checkpointing nodes), "
         f"{keys['public_key']} (for restoring nodes), {keys['key_id']}")
    return Exit.OK


COMMAND = Command(
    "migrate", "move a GPU container to another node (podman)", no_arguments,
    subcommands=(
        Command("checkpoint", "checkpoint a container into an archive (and ARCHIVE.sha256)",
                _checkpoint_arguments, _checkpoint),
        Command("restore", "restore a container from an archive onto this node's GPUs",
                _restore_arguments, _restore),
        Command("keygen", "make an Ed25519 key pair for signing archives",
                _keygen_arguments, _keygen),
    ))
