"""Process-group rendezvous for the CPU tests, without TCP ports.

[Note: no picked ports]
A port found free by binding port 0 and closing the socket can be taken by any other process
before the test's TCPStore binds it (``EADDRINUSE``), and the CI machine runs other jobs. So:

* a 1-rank group rendezvous through an in-memory ``HashStore`` (:func:`init_one_rank_gloo`);
* a multi-rank job's ranks rendezvous through a file (:func:`file_init_methods`): a fresh path
  per ``init_process_group`` call, in a folder the test owns. Gloo's own connections then bind
  port 0 themselves, which cannot race.
"""

from pathlib import Path

import torch.distributed as dist


def init_one_rank_gloo() -> None:
    """Create a 1-rank gloo default group (rank 0) on an in-memory store."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def file_init_methods(folder: Path, n: int) -> list[str]:
    """``n`` ``file://`` init methods on fresh paths in ``folder`` (one per init_process_group).

    Torch's FileStore needs a new file for each rendezvous; a path that already exists is refused.
    """
    paths = [folder.resolve() / f"rendezvous{i}" for i in range(n)]
    taken = [str(p) for p in paths if p.exists()]
    if taken:
        raise FileExistsError(f"rendezvous file(s) already exist: {taken}; use a fresh folder")
    return [f"file://{p}" for p in paths]
