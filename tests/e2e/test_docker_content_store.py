"""dockerd 20.10's checkpoint commands and containerd's content store: a blob
dockerd deleted stays until containerd's next garbage collection, and a
second checkpoint of the same container (or a second start from the same
checkpoint) meanwhile fails "content sha256:...: already exists" - after
CRIU has dumped, for a checkpoint. A loaded machine delays the collection;
here containerd is told to (its collector pauses about 5000 times as long
as a collection took), so the window is open every time, and the helpers
of tests/e2e/daemons.py must wait it out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.daemons import Dockerd, image_tar

from .test_daemons_smoke import COUNTER, counter, moves, pytestmark, wait_for  # noqa: F401


def test_docker_checkpoints_wait_for_the_content_store(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with Dockerd(tmp_path / "dockerd", gc={"pause_threshold": 0.0002}) as d:
        name = d.load_image(image_tar(tmp_path / "busybox.tar"))
        cid = d.docker("run", "-d", "--name", "counter", "-v", f"{data}:/data", name,
                       "sh", "-c", COUNTER).stdout.strip()
        wait_for(lambda: counter(data) >= 5, what="counter >= 5")
        # A first checkpoint, waited out: a collection has just run, and the
        # collector now pauses, so what the next ones delete stays a while.
        d.docker("checkpoint", "create", "--leave-running", cid, "cp0", timeout=120)
        assert d.settle_content()
        d.docker("checkpoint", "create", "--leave-running", cid, "cp1", timeout=120)
        # The first checkpoint's blobs (its runtime spec among them) are
        # still in the store: the second one meets them unless it waits.
        assert d.content(), "the content store emptied at once: the race is not staged"
        d.docker("checkpoint", "create", cid, "cp2", timeout=120)
        assert not d.inspect(cid)["State"]["Running"]
        frozen = counter(data)
        # Its checkpoint tar is still there too: a start from it at once
        # commits the same bytes again.
        assert d.content(), "the content store emptied at once: the race is not staged"
        d.start_checkpoint(cid, "cp2")
        first = moves(data, frozen, "restored counter to move")
        assert first <= frozen + 5, f"frozen={frozen}, first value after restore {first}"
        d.docker("rm", "-f", cid)


@pytest.mark.parametrize("args, target", [
    (("checkpoint", "create", "c", "cp"), "c"),
    (("checkpoint", "create", "--leave-running", "c", "cp"), "c"),
    (("checkpoint", "create", "--checkpoint-dir", "/x", "c", "cp"), "c"),
    (("checkpoint", "create", "c"), None),
])
def test_checkpoint_target(args: tuple[str, ...], target: str | None) -> None:
    from tests.e2e.daemons import _checkpoint_target, _stores_checkpoint

    assert _stores_checkpoint(args)
    assert _checkpoint_target(args) == target
    assert _stores_checkpoint(("start", "--checkpoint", "cp", "c"))
    assert _stores_checkpoint(("start", "--checkpoint=cp", "c"))
    assert not _stores_checkpoint(("start", "c"))
    assert not _stores_checkpoint(("checkpoint", "ls", "c"))
