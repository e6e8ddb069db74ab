#!/usr/bin/env python3
"""Train a model with a KL term against a frozen reference copy of it, both under Megatron-FSDP.

The trained model's loss is its token cross entropy plus ``--reference-kl-weight`` times
KL(reference || trained). The reference is a frozen copy of the initial model in its own
Megatron-FSDP config (its own pool scope, no double buffer); docs/reference-model.md. Every flag of
``pretrain_gpt.py`` applies, plus:

    --reference-kl-weight W     weight of the KL term (default 0.1; 0 trains on the cross entropy alone)
    --reference-free-after N    free the reference after training step N
    --no-reference              no reference model: the same loss path without the KL term

Launch with torchrun, e.g.::

    torchrun --nproc-per-node 2 examples/reference_kl/train.py --use-megatron-fsdp ... --reference-kl-weight 0.1
"""

from hfsdp.environment import require_environment

if __name__ == "__main__":
    require_environment("examples/reference_kl/train.py")

from hfsdp.training.reference import main  # noqa: E402

if __name__ == "__main__":
    main()
