"""CPU tests of the NCCL kernel counter (hfsdp/trace/kernels.py)."""

from types import SimpleNamespace as E

from hfsdp.trace.kernels import count_nccl_kernels


def test_counts_symmetric_and_other_nccl_kernels_on_the_device_only():
    events = [
        E(name="ncclSymkDevKernel_AllGather_LL", device_type="DeviceType.CUDA"),
        E(name="ncclSymkDevKernel_ReduceScatter_LD", device_type="DeviceType.CUDA"),
        E(name="ncclSymkDevKernel_ReduceScatter_LD", device_type="DeviceType.CUDA"),
        E(name="ncclDevKernel_AllGather_RING_LL", device_type="DeviceType.CUDA"),
        E(name="ncclDevKernel_AllReduce_Sum_f32_RING_LL", device_type="DeviceType.CUDA"),
        E(name="ncclDevKernel_AllGather_RING_LL", device_type="DeviceType.CPU"),  # host record
        E(name="ampere_bf16_gemm", device_type="DeviceType.CUDA"),
        # c10d's GPU annotation of the op (seen on 2xH200 next to every kernel): not a kernel.
        E(name="nccl:all_gather_into_tensor_coalesced", device_type="DeviceType.CUDA"),
    ]
    counts = count_nccl_kernels(events)
    assert counts["symk"] == {"all_gather": 1, "reduce_scatter": 2, "other": 0}
    assert counts["other_nccl"] == {"all_gather": 1, "reduce_scatter": 0, "other": 1}
    assert "ampere_bf16_gemm" not in counts["kernel_names"]
