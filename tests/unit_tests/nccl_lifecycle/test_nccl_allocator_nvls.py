"""nccl_allocator.init() must keep an explicitly set NCCL_NVLS_ENABLE (safety-critical).

The code under test is the real ``init()``; only ``_build_nccl_allocator`` (a CUDA/NCCL C++
extension build) is replaced, because it cannot run on a CPU box and does not touch the
environment.
"""

import pytest

from megatron.core import nccl_allocator

# The value upstream's init() exports when the variable is unset (NVLS on).
UPSTREAM_DEFAULT = str(1)


@pytest.fixture
def no_extension_build(monkeypatch):
    built = []
    monkeypatch.setattr(nccl_allocator, "_build_nccl_allocator", lambda: built.append(True))
    return built


@pytest.mark.parametrize("explicit", ["0", "2"])
def test_explicit_nvls_value_survives_init(monkeypatch, no_extension_build, explicit):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", explicit)
    nccl_allocator.init()
    assert nccl_allocator.os.environ["NCCL_NVLS_ENABLE"] == explicit
    assert no_extension_build == [True], "init() must still build the allocator"


def test_unset_nvls_is_set_by_init_as_upstream(monkeypatch, no_extension_build):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    nccl_allocator.init()
    assert nccl_allocator.os.environ["NCCL_NVLS_ENABLE"] == UPSTREAM_DEFAULT


def test_init_still_disables_tensor_register_allocator_hook(monkeypatch, no_extension_build):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "1")
    nccl_allocator.init()
    assert nccl_allocator.os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] == "0"
    assert nccl_allocator.os.environ["NCCL_NVLS_ENABLE"] == "0"
