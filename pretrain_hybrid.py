#!/usr/bin/env python3
"""Pretrain a hybrid (Mamba / attention / MLP / MoE) model: ``pretrain_gpt.py`` with the family
forced to ``hybrid`` (``--hybrid-layer-pattern`` is required)."""

from hfsdp.environment import require_environment

if __name__ == "__main__":
    require_environment("pretrain_hybrid.py")

from hfsdp.training.entry import main  # noqa: E402

if __name__ == "__main__":
    main(forced_family="hybrid")
