"""Metrics from Megatron's stdout (no TensorBoard needed).

Megatron prints, per logged iteration (``print_rank_last``)::

    [<date> <time>] iteration        3/      20 | consumed samples: ... |
    elapsed time per iteration (ms): 71.2 | ... | lm loss: 1.045678E+01 | ... | num zeros: 0 | ...

and, with ``--log-memory-interval 1`` (``report_memory`` on data-parallel rank 0)::

    [Rank 0] (after 3 iterations) memory (MB) | allocated: 812.5 | max allocated: 1650.1 | ...

and, after each evaluation (``evaluate_and_print_results``, with ``--eval-iters`` > 0), every
``--eval-interval`` steps and once more after the last step::

    validation loss at iteration 9 | lm loss value: 9.876543E+00 | lm loss PPL: ...
    validation loss at iteration 20 on validation set | lm loss value: 7.587728E+00 | ...

Metric names follow Megatron's TensorBoard keys so the golden JSON looks like upstream's:
``lm loss``, ``num-zeros``, ``iteration-time`` (seconds), ``mem-allocated-bytes``,
``mem-max-allocated-bytes``, ``mem-reserved-bytes``, ``mem-max-reserved-bytes``, and
``lm loss validation`` for the validation loss (the test set's line is not read), plus
``grad-norm`` and ``load_balancing_loss`` where the step line has them: :data:`METRIC_NAMES`.
When ``--eval-interval`` divides ``--train-iters``, the last step has two validation lines (the
loop's and the final one, on new batches); as for every metric, the later one wins. Recipes pick
such an interval all the same: a golden's steps must be evenly spaced.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from itertools import pairwise

_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
_FIELD = re.compile(r"\s*([^:|]+?):\s*([-+0-9.eEnaif]+)\s*(?=\|)")
# "at iteration N" during training, "at iteration N on validation set" after it; not the test set.
_VALID = re.compile(r"\bvalidation loss at iteration (\d+)(?: on validation set)?\s*\|(.*)$")
_VALID_FIELD = re.compile(r"\s*([^:|]+?) value:\s*([-+0-9.eEnaif]+)\s*(?=\|)")
_MEM = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\)(.*)$")
_MEM_FIELD = re.compile(r"(?:^|\|)\s*(max allocated|allocated|max reserved|reserved):\s*([-+0-9.eE]+)")
# [Note: one line, several records]
# Ranks that share one stdout (torchrun without --tee) interleave: Python's print writes a record
# and its newline in two writes, so another rank's whole record can land between them. A line can
# then hold two records ("... max reserved: 326.00 [<date>] iteration 7/ 20 | ..."), and each is
# read from where its head starts to where the next one's starts.
_HEAD = re.compile(r"\biteration\s+\d+/\s*\d+\s*\||\bvalidation loss at iteration \d+"
                   r"|\[Rank \d+\] \(after \d+ iterations\) memory \(MB\)")
_MEM_FIELDS = {
    "allocated": "mem-allocated-bytes",
    "max allocated": "mem-max-allocated-bytes",
    "reserved": "mem-reserved-bytes",
    "max reserved": "mem-max-reserved-bytes",
}
_MB = 1024.0 * 1024.0
# The step line's fields that are read, and the metric each becomes (iteration-time in seconds).
STEP_FIELDS = {
    "lm loss": "lm loss",
    "num zeros": "num-zeros",
    "elapsed time per iteration (ms)": "iteration-time",
    "grad norm": "grad-norm",
    "load_balancing_loss": "load_balancing_loss",
    "reference kl": "reference kl",  # examples/reference_kl/train.py
}
VALIDATED = ("lm loss",)  # the validation line's losses that are read, each as "<key> validation"
# [Note: metric names] Every name :func:`parse_log` gives a metric, and so every name a golden or
# a metrics.json may hold (golden.py refuses any other): the one list of them.
_STEP_NAMES = tuple(STEP_FIELDS.values())
METRIC_NAMES = (_STEP_NAMES[0], *(f"{key} validation" for key in VALIDATED), *_STEP_NAMES[1:], *_MEM_FIELDS.values())

Metrics = dict[str, dict[int, float]]


def is_step_line(line: str) -> bool:
    """Whether ``line`` is Megatron's log line of a training step."""
    return _ITER.search(line) is not None


def records(lines: Iterable[str]) -> Iterable[str]:
    """Each record of ``lines`` on its own, however the ranks' writes were interleaved."""
    for line in lines:
        starts = [m.start() for m in _HEAD.finditer(line)]
        if starts:
            for start, end in pairwise([*starts, len(line)]):
                yield line[start:end]


def parse_log(lines: Iterable[str]) -> Metrics:
    """Per-iteration metrics found in ``lines`` (later duplicates of a step win)."""
    metrics: Metrics = {}

    def put(name: str, step: int, value: float) -> None:
        metrics.setdefault(name, {})[step] = value

    for line in records(lines):
        m = _ITER.search(line)
        if m:
            step = int(m.group(1))
            for key, raw in _FIELD.findall(m.group(3) + "|"):
                key = key.strip()
                try:
                    value = float(raw)
                except ValueError:
                    continue
                name = STEP_FIELDS.get(key)
                if name is not None:
                    put(name, step, value / 1000.0 if name == "iteration-time" else value)
            continue
        m = _VALID.search(line)
        if m:
            step = int(m.group(1))
            for key, raw in _VALID_FIELD.findall(m.group(2) + "|"):
                if key.strip() not in VALIDATED:
                    continue
                try:
                    put(f"{key.strip()} validation", step, float(raw))
                except ValueError:
                    continue
            continue
        m = _MEM.search(line)
        if m and m.group(1) == "0":
            step = int(m.group(2))
            for key, raw in _MEM_FIELD.findall(m.group(3)):
                put(_MEM_FIELDS[key], step, float(raw) * _MB)
    return metrics


# Megatron stamps each step's line with the local wall clock: " [<date> <time>.<microseconds>] iteration 2/ ..."
_STAMPED_STEP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]\s*iteration\s+(\d+)/")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


def clock(stamp: str) -> float:
    """Seconds since the epoch of a local wall-clock stamp as Megatron writes it (fraction optional)."""
    return datetime.strptime(stamp if "." in stamp else stamp + ".0", TIME_FORMAT).timestamp()


def step_clock(lines: Iterable[str]) -> dict[int, float]:
    """When each step's line was written (seconds since the epoch, local clock; first line wins)."""
    out: dict[int, float] = {}
    for line in lines:
        for m in _STAMPED_STEP.finditer(line):
            out.setdefault(int(m.group(2)), clock(m.group(1)))
    return out


def parse_file(path: str) -> Metrics:
    with open(path, errors="replace") as f:
        return parse_log(f)
