# hfsdp: NumPy fallback for the sample index (added by the datasets-helpers-lazy-build patch).
"""A NumPy implementation of ``build_sample_idx`` for machines without a C++ compiler.

Same contract as the C++ template in ``helpers.cpp``: row ``i`` of the ``[num_samples + 1, 2]``
result holds (index into ``document_indices``, offset in that document) where sample ``i``
starts. Samples start every ``sequence_length`` tokens of the flattened document stream, so
each boundary is found with one ``searchsorted`` instead of a token-by-token walk: a boundary
lands in the first document whose end is at or past ``start + add_extra_token``.
"""

import math

import numpy


def build_sample_idx_numpy(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
    dtype=numpy.int32,
) -> numpy.ndarray:
    """Build the 2-D sample index; see the module docstring."""
    if sequence_length <= 1:
        raise ValueError(f"sequence_length must be > 1, got {sequence_length}")
    if num_epochs <= 0:
        raise ValueError(f"num_epochs must be > 0, got {num_epochs}")
    if tokens_per_epoch <= 1:
        raise ValueError(f"tokens_per_epoch must be > 1, got {tokens_per_epoch}")
    extra = int(add_extra_token_to_sequence)
    total = int(num_epochs) * int(tokens_per_epoch) - extra
    if drop_last_partial_sequence:
        num_samples = total // sequence_length
    else:
        # helpers.cpp rounds through a C float; keep its float32 rounding bit for bit.
        num_samples = int(math.ceil(numpy.float32(total) / numpy.float32(sequence_length)))
    lengths = sizes[document_indices].astype(numpy.int64)
    ends = numpy.cumsum(lengths)
    starts = ends - lengths
    boundary = numpy.arange(1, num_samples + 1, dtype=numpy.int64) * sequence_length
    doc = numpy.searchsorted(ends, boundary + extra, side="left")
    past_end = doc >= len(document_indices)
    doc = numpy.minimum(doc, len(document_indices) - 1)
    offset = boundary - starts[doc]
    offset[past_end] = int(sizes[document_indices[-1]]) - extra
    out = numpy.zeros((num_samples + 1, 2), dtype=dtype)
    out[1:, 0] = doc
    out[1:, 1] = offset
    return out
