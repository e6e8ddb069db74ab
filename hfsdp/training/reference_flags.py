"""The flags of ``examples/reference_kl/train.py`` (training/reference.py), standard library only:
the launchers and the planner split them off before Megatron reads the rest (entries.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from hfsdp.usererror import UserError


@dataclass(frozen=True)
class ReferenceSettings:
    """The example's own flags."""

    enabled: bool = True
    kl_weight: float = 0.1
    free_after: int | None = None  # free the reference after this training step

    def __post_init__(self) -> None:
        if not self.kl_weight >= 0.0 or self.kl_weight == float("inf"):
            raise UserError(f"--reference-kl-weight {self.kl_weight} is not a finite number >= 0",
                            "give a weight such as 0.1, or 0 to train on the cross entropy alone")
        if self.free_after is not None and self.free_after < 1:
            raise UserError(f"--reference-free-after {self.free_after} is not a step (1 or more)",
                            "give the step after which to free the reference, or leave the flag out")
        if not self.enabled and self.free_after is not None:
            raise UserError("--reference-free-after with --no-reference: there is no reference to free",
                            "drop one of the two flags")


def flag_parser() -> argparse.ArgumentParser:
    """The example's own flags (``python -m hfsdp.flags`` lists them from here)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--reference-kl-weight", type=float, default=ReferenceSettings.kl_weight, metavar="W",
                        help="Weight of the KL(reference || trained) term in the loss; 0 trains on the cross "
                             "entropy alone.")
    parser.add_argument("--reference-free-after", type=int, default=None, metavar="N",
                        help="Free the reference model after training step N.")
    parser.add_argument("--no-reference", action="store_true",
                        help="No reference model: the same loss path without the KL term.")
    return parser


def split_flags(argv: Sequence[str]) -> tuple[ReferenceSettings, list[str]]:
    """The example's flags and the rest (Megatron's), which the usual entry parses."""
    parser = flag_parser()
    try:
        ns, rest = parser.parse_known_args(list(argv))
    except SystemExit:  # argparse already printed which value it could not read
        raise UserError("--reference-kl-weight takes a number and --reference-free-after a step",
                        "fix the value") from None
    return ReferenceSettings(not ns.no_reference, ns.reference_kl_weight, ns.reference_free_after), rest
