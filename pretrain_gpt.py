#!/usr/bin/env python3
"""Pretrain GPT, MoE or hybrid models with the hfsdp fork of megatron-core 0.18.2.

Every upstream Megatron flag applies (``python pretrain_gpt.py --help``). The model family follows
the args: ``--hybrid-layer-pattern`` -> hybrid, ``--num-experts`` -> MoE, otherwise dense GPT.
Launch with torchrun, e.g.::

    torchrun --nproc-per-node 2 pretrain_gpt.py --transformer-impl local --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 8192 ...
"""

from hfsdp.environment import require_environment

if __name__ == "__main__":
    require_environment("pretrain_gpt.py")

from hfsdp.training.entry import main  # noqa: E402

if __name__ == "__main__":
    main()
