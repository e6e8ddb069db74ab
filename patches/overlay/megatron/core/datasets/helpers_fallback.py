# hfsdp: what ``helpers.py`` imports when ``helpers_cpp`` is not built yet.
"""Try to build ``helpers_cpp`` now; if that is impossible, serve the NumPy sample index.

Only ``build_sample_idx`` has a NumPy twin (it is all ``--mock-data`` and single-dataset
training need). The blending and BERT/T5 mapping helpers raise a clear error that names the
missing compiler instead of an ImportError from deep inside a dataset build.
"""

import logging
from functools import partial

import numpy

from megatron.core.datasets.helpers_build import build_helpers
from megatron.core.datasets.helpers_numpy import build_sample_idx_numpy

logger = logging.getLogger(__name__)

try:
    build_helpers()
    from megatron.core.datasets.helpers_cpp import *  # noqa: F401,F403
    from megatron.core.datasets.helpers_cpp import build_sample_idx_int32, build_sample_idx_int64
except (RuntimeError, OSError, ImportError) as _build_error:
    _reason = str(_build_error)  # the except-name is unbound after this block
    logger.warning("dataset helpers_cpp unavailable (%s); using the NumPy sample index", _reason)
    build_sample_idx_int32 = partial(build_sample_idx_numpy, dtype=numpy.int32)
    build_sample_idx_int64 = partial(build_sample_idx_numpy, dtype=numpy.int64)

    def _needs_compiler(name):
        def missing(*args, **kwargs):
            raise RuntimeError(
                f"megatron.core.datasets.helpers.{name} needs the compiled helpers_cpp extension: "
                f"{_reason}. Install a C++ compiler and pybind11, or use --mock-data."
            )

        return missing

    build_blending_indices = _needs_compiler("build_blending_indices")
    build_exhaustive_blending_indices = _needs_compiler("build_exhaustive_blending_indices")
    build_mapping = _needs_compiler("build_mapping")
    build_blocks_mapping = _needs_compiler("build_blocks_mapping")
