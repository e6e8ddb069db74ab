"""Environment every GPU launch of this project pins: NVLink multicast stays off.

The lent GPU machines must never enable NVLS / multicast (device README); our launchers
(functional driver, sbatch jobs, benchmark) all export these, so the values live here once.
Standard library only: imported by launchers before torch or megatron.
"""

NVLS_SAFE_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
