# Copyright (c) 2026, hfsdp authors. All rights reserved.

"""Flag check for --nccl-comm-warmup, called from validate_args (training/arguments.py).

The warmup creates NCCL communicators; with another --distributed-backend there are none to
create, so the flag would silently do nothing. Refuse it at argument validation instead.
"""


def validate_nccl_comm_warmup_args(args) -> None:
    """Raise ValueError when --nccl-comm-warmup is combined with a non-NCCL backend."""
    if args.nccl_comm_warmup and args.distributed_backend != "nccl":
        raise ValueError(
            f"--nccl-comm-warmup warms NCCL communicators, but --distributed-backend is "
            f"{args.distributed_backend!r}, so it would warm nothing; drop --nccl-comm-warmup or use "
            "--distributed-backend nccl."
        )
