"""Max-pool double-buffer flags: CLI parse/validate, DDP configs, fully_shard plumbing (CPU)."""

import importlib
import inspect

import pytest

from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig as MCoreDDPConfig,
)
from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
    DistributedDataParallelConfig as FsdpDDPConfig,
)

# The package re-exports the function `fully_shard`; we need the module.
fs = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard")

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 1 --bf16 --lr 1e-4 --train-iters 2 "
    "--ckpt-format fsdp_dtensor"
).split()
FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params".split()


@pytest.fixture
def validated(megatron_validator):
    """``run(extra_flags)`` -> args after Megatron's parse_args + validate_args (CPU, 2 ranks)."""
    return megatron_validator(BASE, world_size=2)


def test_flags_parse_with_defaults_off(validated):
    args = validated(FSDP)
    assert args.megatron_fsdp_max_pool_double_buffer is False
    assert args.fsdp_db_use_persist_buf_on_alloc_fail is False
    assert args.fsdp_double_buffer is False


def test_max_pool_implies_double_buffer(validated):
    args = validated(FSDP + ["--megatron-fsdp-max-pool-double-buffer"])
    assert args.megatron_fsdp_max_pool_double_buffer is True
    assert args.fsdp_double_buffer is True


def test_persist_fallback_flag_with_double_buffer(validated):
    args = validated(FSDP + ["--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail"])
    assert args.fsdp_db_use_persist_buf_on_alloc_fail is True


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--megatron-fsdp-max-pool-double-buffer"], "requires --use-megatron-fsdp"),
        (
            [
                "--use-megatron-fsdp",
                "--data-parallel-sharding-strategy",
                "optim_grads",
                "--megatron-fsdp-max-pool-double-buffer",
            ],
            "optim_grads_params",
        ),
        (
            FSDP + ["--megatron-fsdp-max-pool-double-buffer", "--overlap-moe-expert-parallel-comm"],
            "incompatible with --overlap-moe-expert-parallel-comm",
        ),
        (FSDP + ["--fsdp-db-use-persist-buf-on-alloc-fail"], "requires --fsdp-double-buffer"),
    ],
)
def test_invalid_combinations_rejected(validated, extra, match):
    with pytest.raises(ValueError, match=match):
        validated(extra)


# What each DDP config needs to use Megatron-FSDP's units (Megatron-FSDP's own always does).
UNITS = {MCoreDDPConfig: {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"},
         FsdpDDPConfig: {"data_parallel_sharding_strategy": "optim_grads_params"}}


@pytest.mark.parametrize("cfg_cls", [MCoreDDPConfig, FsdpDDPConfig])
def test_ddp_configs_post_init_imply_double_buffer(cfg_cls):
    assert cfg_cls().megatron_fsdp_max_pool_double_buffer is False
    assert cfg_cls().fsdp_double_buffer is False
    cfg = cfg_cls(megatron_fsdp_max_pool_double_buffer=True, **UNITS[cfg_cls])
    assert cfg.fsdp_double_buffer is True


@pytest.mark.parametrize("cfg_cls", [MCoreDDPConfig, FsdpDDPConfig])
@pytest.mark.parametrize(("fields", "match"), [
    ({"megatron_fsdp_max_pool_double_buffer": True, "data_parallel_sharding_strategy": "optim_grads"},
     "megatron_fsdp_max_pool_double_buffer.* requires data_parallel_sharding_strategy.* optim_grads_params"),
    ({"fsdp_db_use_persist_buf_on_alloc_fail": True},
     "fsdp_db_use_persist_buf_on_alloc_fail.* requires fsdp_double_buffer"),
])
def test_ddp_configs_check_the_same_rules_as_the_command_line(cfg_cls, fields, match):
    """Public API users are held to the rules validate_args holds flags to, in field names."""
    with pytest.raises(ValueError, match=match):
        cfg_cls(**{**UNITS[cfg_cls], **fields})


def test_fully_shard_builds_megatron_cores_config_and_max_pool_passes_it():
    """With Megatron Core importable, fully_shard builds Megatron Core's config, without
    use_megatron_fsdp: the config must take max-pool from it (only the command line, where that
    flag picks the wrapper, asks for --use-megatron-fsdp). fully_shard_model checks its keywords
    first, in their names (test_double_buffer_policy.py); the config names its fields."""
    assert fs.DistributedDataParallelConfig is MCoreDDPConfig
    cfg = fs.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                           megatron_fsdp_max_pool_double_buffer=True, megatron_fsdp_max_pool_lanes=3)
    assert cfg.fsdp_double_buffer and not cfg.use_megatron_fsdp
    with pytest.raises(ValueError, match=r"^megatron_fsdp_max_pool_double_buffer requires data_parallel_sharding_"):
        fs.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads",
                                         megatron_fsdp_max_pool_double_buffer=True)


def kwargs_fully_shard_passes_on(monkeypatch, **kwargs):
    """The keyword arguments ``fully_shard(**kwargs)`` gives fully_shard_model (not called)."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_model(*args, **model_kwargs):
        seen.update(model_kwargs)
        raise Stop

    monkeypatch.setattr(fs, "fully_shard_model", fake_model)
    with pytest.raises(Stop):
        fs.fully_shard(module=None, optimizer=None, **kwargs)
    return seen


def test_fully_shard_plumbs_maxpool_kwarg(monkeypatch):
    for fn in (fs.fully_shard, fs.fully_shard_model):
        param = inspect.signature(fn).parameters["maxpool_double_buffer"]
        assert param.default is False
    # fully_shard forwards the kwarg to fully_shard_model ...
    src = inspect.getsource(fs.fully_shard_model)
    assert kwargs_fully_shard_passes_on(monkeypatch, maxpool_double_buffer=True)["maxpool_double_buffer"]
    # ... which builds the DDP config with the max-pool field set (needs GPUs to call).
    assert "megatron_fsdp_max_pool_double_buffer=maxpool_double_buffer" in src


def test_nccl_ub_implies_double_buffer_as_in_0_19(validated):
    args = validated(FSDP + ["--use-nccl-ub"])
    assert args.fsdp_double_buffer is True
    assert args.fsdp_manual_registration is True


def test_nccl_ub_with_ep_overlap_names_both_flags(validated):
    with pytest.raises(ValueError, match="--use-nccl-ub.*--overlap-moe-expert-parallel-comm"):
        validated(FSDP + ["--use-nccl-ub", "--overlap-moe-expert-parallel-comm"])


def test_max_pool_allocator_lives_where_0_19_has_it():
    """ParamAndGradBuffer's MaxPoolAllocator is the overlay's MaxPool with its bucket types, and
    takes 0.19's keyword arguments, the same as FixedPoolAllocator's (one call site for both)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp.double_buffer import allocator, lanes

    assert issubclass(pgb.MaxPoolAllocator, allocator.MaxPool)
    assert issubclass(pgb.LaneMaxPoolAllocator, lanes.LaneMaxPool)
    for cls in (pgb.MaxPoolAllocator, pgb.LaneMaxPoolAllocator):
        assert issubclass(cls, pgb.TemporaryBucketAllocator)
        assert (cls.bucket_type, cls.backup_type) == (pgb.Bucket, pgb.StorageResizeBasedBucketAllocator)
    fixed = set(inspect.signature(pgb.FixedPoolAllocator).parameters)
    assert {"name", "fsdp_param_groups", "size", "dtype_fn", "fallback_to_persistent_buffer"} <= fixed
    assert fixed <= set(inspect.signature(pgb.MaxPoolAllocator).parameters)
    with pytest.raises(TypeError, match="has no bucket types"):
        allocator.MaxPool("fsdp_params", [])
