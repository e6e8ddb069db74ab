"""The planner's gradient dtypes follow the tree's Megatron-FSDP adapter, on every base.

0.18's adapter turns ``grad_reduce_in_fp32`` into fp32 main grads and fp32 communication; 0.19's
passes ``--megatron-fsdp-main-grads-dtype``/``--megatron-fsdp-grad-comm-dtype`` through, so a
bf16 model's gradient buffers (and the max-pool's grad pool) are bf16 there. A planner that kept
0.18's rule on 0.19.2 planned a grad pool twice the one the run builds.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import megatron.core
from hfsdp.planner.memory import grad_dtypes
from megatron.core import package_info

ADAPTER = Path(megatron.core.__file__).parent / "distributed" / "fsdp" / "mcore_fsdp_adapter.py"


def _args(fp32: bool, main=None, comm=None) -> SimpleNamespace:
    return SimpleNamespace(accumulate_allreduce_grads_in_fp32=fp32, megatron_fsdp_main_grads_dtype=main,
                           megatron_fsdp_grad_comm_dtype=comm)


@pytest.mark.parametrize("release, expected", [
    ((0, 18), (torch.float32, torch.float32)),
    ((0, 19), (None, None)),
])
def test_fp32_reduction_flag_per_release(release, expected):
    assert grad_dtypes(_args(True), release) == expected


@pytest.mark.parametrize("release", [(0, 18), (0, 19)])
def test_explicit_dtypes_pass_through_without_the_fp32_flag(release):
    assert grad_dtypes(_args(False, torch.bfloat16, torch.float32), release) == (torch.bfloat16, torch.float32)


def _main_grads_expr() -> ast.expr:
    """The expression the tree's adapter passes as ``main_grads_dtype=``."""
    for node in ast.walk(ast.parse(ADAPTER.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "main_grads_dtype":
            return node.value
    raise AssertionError(f"{ADAPTER} passes no main_grads_dtype= keyword; the planner's rule needs a new look")


def test_the_rule_matches_this_trees_adapter():
    """The tree's adapter reads grad_reduce_in_fp32 for main_grads_dtype exactly when the planner
    applies the fp32 rule to this tree's release."""
    expr = _main_grads_expr()
    reads_fp32_flag = any(isinstance(n, ast.Attribute) and n.attr == "grad_reduce_in_fp32" for n in ast.walk(expr))
    tree_release = (int(package_info.MAJOR), int(package_info.MINOR))
    planner_fp32 = grad_dtypes(_args(True)) == (torch.float32, torch.float32)
    assert reads_fp32_flag == planner_fp32, (
        f"megatron-core {package_info.__version__} ({tree_release}): the adapter "
        f"{'reads' if reads_fp32_flag else 'ignores'} grad_reduce_in_fp32 for main_grads_dtype, but the planner "
        f"{'applies' if planner_fp32 else 'does not apply'} the fp32 rule")
