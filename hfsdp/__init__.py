"""hfsdp: our own code for the hybrid Megatron-FSDP patch set (tooling, entry-point helpers).

Keep this file import-free: ``hfsdp.patchset`` runs with the standard library alone inside
pip's isolated build environment.
"""
