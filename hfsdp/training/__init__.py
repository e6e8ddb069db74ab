"""Our training entry points over ``megatron.training.pretrain`` (0.18.2 API).

Import-free on purpose: ``pretrain_gpt.py`` must run :func:`hfsdp.patchset.guard.ensure_fork`
before anything imports ``megatron``. Import submodules explicitly.
"""
