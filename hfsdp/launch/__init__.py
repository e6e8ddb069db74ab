"""How our launchers start ranks: one torchrun command line, one environment rule.

* :mod:`hfsdp.launch.env`: ``--env KEY=VALUE`` and the caller's environment, passed through;
* :mod:`hfsdp.launch.torchrun`: the torchrun command for N ranks on this host, over its GPUs,
  one rank per GPU or several (``--ranks-per-gpu``);
* :mod:`hfsdp.launch.shared_gpu`: what each rank of the several-ranks-per-GPU mode runs first;
* :mod:`hfsdp.launch.fit`: whether that many ranks' planned memory fits one GPU.

Standard library only, except :mod:`hfsdp.launch.fit` (the planner imports torch and Megatron).
"""
