"""Frequent kernel sequences: the chains of memory-bound kernels that repeat (fusion candidates).

A chain is a maximal run of consecutive kernels on one GPU stream that are all elementwise, reduction
or normalisation kernels (``breakdown.kernel_category``): a copy, a set or any other kernel (a GEMM, an
attention or communication kernel) ends it. Chains with the same kernels in the same order are one
sequence; a sequence that repeats (every layer, every step) is what a compiler fuses into one kernel.

HTA's ``get_frequent_cuda_kernel_sequences`` counts the kernel lists that the calls of one named CPU
operator launch; this needs no operator name and reads nsys exports too (which have no CPU ops). Its
estimate of what fusion saves: each chain run as one kernel costs as much as its longest member (the
members read and write tensors of about the same size, and a fused kernel moves them once), so a
chain saves its time minus its longest kernel's, and each run its launches but one.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from advisor.analysis.breakdown import _per_name, kernel_category, kernel_spans
from advisor.trace.table import grouped_lexsort, kind_mask

FUSABLE = frozenset({"elementwise", "reduction", "normalization"})
NAME_CHARS = 60  # per kernel in the sequence column: template names run to hundreds of characters
COLUMNS = [
    "rank",
    "length",
    "count",
    "time_ns",
    "saving_ns",
    "saving_pct",
    "launches_saved",
    "categories",
    "sequence",
]


_QUALIFIER = re.compile(r"(?:\w+|\(anonymous namespace\)|<unnamed>)::|\(int\)|^void ")


def short_kernel_name(name: str) -> str:
    """A kernel's name without return type, namespaces and casts, cut to NAME_CHARS: the template
    arguments that tell PyTorch's elementwise kernels apart (their functor) come into view.
    ``void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>``
    reads ``vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, ...>``."""
    name = _QUALIFIER.sub("", name)
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"


def kernel_chains(df: pd.DataFrame, min_len: int = 2, top: int = 20) -> pd.DataFrame:
    """Per rank, the repeated chains of memory-bound kernels, most saving first (``top`` per rank):
    ``length`` kernels, seen ``count`` times (twice at least), ``time_ns`` in all, ``saving_ns`` fused
    (the chain's time minus its longest kernel's, summed over its runs), ``saving_pct`` of the rank's
    kernel span, ``launches_saved`` ((length - 1) x count), the members' ``categories`` and the
    ``sequence`` of kernel names (short_kernel_name, joined by ' → ')."""
    kernels = kind_mask(df, "kernel")
    if not kernels.any():
        return pd.DataFrame(columns=COLUMNS)
    rows = np.flatnonzero(kind_mask(df, "kernel", "memcpy", "memset"))
    rank = df["rank"].to_numpy()[rows]
    device, stream = df["device"].to_numpy()[rows], df["stream"].to_numpy()[rows]
    start, dur = df["start_ns"].to_numpy()[rows], df["dur_ns"].to_numpy()[rows]
    category = _per_name(df["name"], rows, kernel_category)
    fusable = kernels[rows] & np.isin(category, list(FUSABLE))
    codes = df["name"].array.codes[rows]
    order = grouped_lexsort((start, stream, device, rank))
    rank, device, stream, dur, fusable, codes, category = (
        a[order] for a in (rank, device, stream, dur, fusable, codes, category)
    )
    # Runs of fusable kernels: a new run starts where the stream changes or the previous event is not
    # fusable; an event that is not fusable belongs to no run.
    same_stream = np.r_[False, (rank[1:] == rank[:-1]) & (device[1:] == device[:-1]) & (stream[1:] == stream[:-1])]
    starts_run = fusable & ~(same_stream & np.r_[False, fusable[:-1]])
    run_id = np.cumsum(starts_run) - 1
    run_id[~fusable] = -1
    members = np.flatnonzero(fusable)
    if members.size == 0:
        return pd.DataFrame(columns=COLUMNS)
    # Each run's bounds in ``members``, its total and its longest kernel, for all runs at once; the loop
    # only keys the runs long enough by their kernel names.
    first = np.r_[0, np.flatnonzero(np.diff(run_id[members])) + 1]
    last = np.r_[first[1:], members.size]
    d = dur[members]
    total, longest = np.add.reduceat(d, first), np.maximum.reduceat(d, first)
    long_enough = last - first >= min_len
    member_codes = codes[members].tolist()
    spans = kernel_spans(df)
    sequences: dict[tuple, list] = {}
    for a, b, r, t, m in zip(
        *(x[long_enough].tolist() for x in (first, last, rank[members[first]], total, longest)), strict=True
    ):
        entry = sequences.setdefault((r, tuple(member_codes[a:b])), [0, 0, 0, members[a:b]])
        entry[0] += 1
        entry[1] += t
        entry[2] += t - m
    labels = df["name"].cat.categories
    out = []
    for (r, key), (count, time_ns, saving_ns, part) in sequences.items():
        if count < 2:
            continue
        names = [str(labels[c]) if c >= 0 else "nan" for c in key]
        span = spans.get(r, 0)
        out.append(
            (
                r,
                len(key),
                count,
                time_ns,
                saving_ns,
                100 * saving_ns / span if span else np.nan,
                (len(key) - 1) * count,
                ", ".join(dict.fromkeys(category[part].tolist())),
                " → ".join(short_kernel_name(n) for n in names),
            )
        )
    table = pd.DataFrame(out, columns=COLUMNS)
    table = table.sort_values(["rank", "saving_ns", "sequence"], ascending=[True, False, True], kind="stable")
    return table.groupby("rank", sort=False).head(top).reset_index(drop=True)


def chain_saving_pct(chains: pd.DataFrame, ranks: int) -> float | None:
    """What fusing every repeated chain saves, in % of the kernel span, mean over the ``ranks`` ranks
    that ran kernels (the chains table keeps the top ones per rank: their sum is a lower bound)."""
    if ranks == 0:
        return None
    if chains.empty:
        return 0.0
    return float(chains.groupby("rank")["saving_pct"].sum().sum() / ranks)
