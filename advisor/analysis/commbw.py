"""Measured communication: the bus bandwidth a distributed profiled run's collectives reached, and the
hardware with its intra-node link set to it, so that the estimator and the planner use what was measured.

Bus bandwidth is nccl-tests' ``busbw``: a call's algorithm bytes times a factor of the collective and
the group size n, over the call's time. The factor turns the bytes of the call into the bytes each
rank's link carries in the ring algorithm, so it is comparable across collectives and group sizes and
with the link's own rate (NVIDIA/nccl-tests, doc/PERFORMANCE.md: all-reduce 2(n-1)/n, reduce-scatter and
all-gather (n-1)/n, broadcast 1; src/alltoall.cu (n-1)/n, src/sendrecv.cu 1). The estimator's ring
formulas (``advisor.estimate.steptime._ring_all_reduce_s``, ``_ring_gather_s``) are the same factors over
``link x COMM_EFFICIENCY_FRAC``, so that product is a bus bandwidth and a measured one can replace it.

Three choices, and why:

- The call's time is the shortest of its ranks' durations. A rank's collective event (a ``gloo:*``
  range, an NCCL kernel) starts when that rank reaches the call and so includes its wait for the
  slowest peer; the last rank to arrive waits least, and its duration is closest to the transfer
  alone. Ranks are paired by the k-th call of one kind and size on each rank (c10d issues a group's
  collectives in the same order on every member); send and recv pair with each other. Durations are
  per rank, so no clock needs to agree across hosts.
- The kind whose factor applies is the one the backend ran: gloo runs a reduce-scatter as an
  all-reduce of the whole input (``advisor.analysis.collectives``), whose range is ``gloo:all_reduce``, so it
  moves 2(n-1)/n of the input, not (n-1)/n.
- Aggregate: total bus bytes over total time of the calls of at least ``MIN_CALL_BYTES``, which is the
  bytes-weighted harmonic mean of the calls' bandwidths. Per-call latency dominates small calls (a 4-byte
  loss all-reduce takes as long as a megabyte's) and the estimator charges it separately
  (``COLLECTIVE_LATENCY_S`` per bucket or unit), so they are left out; a plain mean of per-call rates
  would let a few lucky or unlucky calls dominate, where the ratio of sums weighs each call by its bytes.

Limits: the group size n of a call is not in gloo traces, so it comes from the run's layout, and only
runs whose collectives all span the world (one of dp, tp, pp, cp above 1) are measured. The measurement
is what the link delivered during training, contention with the step's own compute included (on a CPU
host the gloo threads share the cores with the model), which is what the planner needs to predict.
"""

from __future__ import annotations

import math

import pandas as pd

from advisor.analysis.collectives import collective_calls, collective_kind, collective_sizes
from advisor.errors import AdvisorError
from advisor.estimate.links import (
    MeasuredLink,
)
from advisor.spec.presets import device_key_for

MIN_CALL_BYTES = 2**20
"""Calls smaller than this (algorithm bytes) are not counted: per-call latency dominates them. 1 MiB is
DDP's first bucket cap (torch dist._DEFAULT_FIRST_BUCKET_BYTES); gradient buckets and layer gathers are
this size or larger, and they are the traffic whose rate the estimator needs."""

# Bus bytes per algorithm byte for a group of n ranks (module docstring for the sources).
_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


def bus_factor(kind: str, n: int) -> float:
    """Bus bytes per algorithm byte of a collective ``kind`` over ``n`` ranks; NaN for kinds without one
    (barrier, other)."""
    f = _BUS_FACTORS.get(kind)
    return f(n) if f is not None and n >= 2 else math.nan


def matched_calls(calls: pd.DataFrame, group_size: int) -> pd.DataFrame:
    """One row per collective call matched across ranks, from :func:`advisor.analysis.collectives.collective_calls`
    (with sizes) of a run whose collectives all span ``group_size`` ranks.

    Columns: ``kind`` (what the backend ran: the event's own name where it names a kind, else the
    issuing op's), ``bytes`` (algorithm bytes), ``ranks`` (ranks that recorded it), ``dur_ns`` (the
    shortest of their durations), ``bus_bytes`` (bytes x :func:`bus_factor`, NaN where the kind has
    none), ``bus_bytes_per_s``. Calls without a size are dropped. In call order of the lowest rank.
    """
    cols = ["kind", "bytes", "ranks", "dur_ns", "bus_bytes", "bus_bytes_per_s"]
    sized = calls[calls["bytes"].notna() & (calls["bytes"] > 0) & (calls["dur_ns"] > 0)]
    if sized.empty:
        dtypes = {"kind": "str", "bytes": "float64", "ranks": "int64", "dur_ns": "int64"}
        return pd.DataFrame({c: pd.Series(dtype=dtypes.get(c, "float64")) for c in cols})
    own = sized["name"].map(collective_kind)
    kind = own.where(~own.isin(("other", "send_recv")), sized["kind"])  # NCCL's SendRecv kernel runs many kinds
    frame = pd.DataFrame(
        {
            "rank": sized["rank"].to_numpy(),
            "kind": kind.to_numpy(),
            "pair": kind.replace({"send": "p2p", "recv": "p2p"}).to_numpy(),
            "bytes": sized["bytes"].to_numpy(),
            "start_ns": sized["start_ns"].to_numpy(),
            "dur_ns": sized["dur_ns"].to_numpy(),
        }
    ).sort_values(["rank", "start_ns"], kind="stable")
    frame["k"] = frame.groupby(["rank", "pair", "bytes"]).cumcount()
    out = (
        frame.groupby(["pair", "bytes", "k"], sort=False)
        .agg(kind=("kind", "first"), ranks=("rank", "size"), dur_ns=("dur_ns", "min"), order=("start_ns", "first"))
        .reset_index()
        .sort_values("order", kind="stable")
    )
    out["bus_bytes"] = [b * bus_factor(k, group_size) for k, b in zip(out["kind"], out["bytes"], strict=True)]
    out["bus_bytes_per_s"] = out["bus_bytes"] / (out["dur_ns"] / 1e9)
    return out[cols].reset_index(drop=True).astype({"ranks": "int64", "dur_ns": "int64"})


def run_link(events: pd.DataFrame, record: dict, metrics: dict, run_id: str) -> MeasuredLink | None:
    """The bus bandwidth (bytes/s) of a distributed run's collectives, from its per-rank event table
    (``advisor.analysis.summary.load_trace``, which keeps the collectives' sizes) and its run.json
    ``record`` and metrics.json ``metrics``.

    None when the run is not a finished distributed run (status ok, ``world_size`` > 1), when its
    layout has more than one kind of process group (a call's group size is then unknown), or when it
    has no sized collective of at least MIN_CALL_BYTES with a bus factor.
    """
    if record.get("status") != "ok":
        return None
    world = int(metrics.get("world_size") or 1)
    if world < 2 or not _one_group(record, world):
        return None
    table = matched_calls(collective_calls(events, collective_sizes(events)), world)
    used = table[(table["bytes"] >= MIN_CALL_BYTES) & table["bus_bytes"].notna()]
    if used.empty:
        return None
    seconds = used["dur_ns"].sum() / 1e9
    kinds = ", ".join(f"{n} {k}" for k, n in used["kind"].value_counts().sort_index().items())
    basis = (
        f"{len(used)} collectives of {world} ranks ({kinds}; "
        f"{used['bytes'].min() / 2**20:.1f}-{used['bytes'].max() / 2**20:.1f} MiB each): "
        f"{used['bus_bytes'].sum() / 1e6:,.1f} MB of bus traffic in {seconds * 1e3:,.1f} ms, each call timed "
        f"by its fastest rank (the others include waiting for it); {len(table) - len(used)} calls under 1 MiB "
        "or without a bus factor left out"
    )
    return MeasuredLink(
        run_id=run_id,
        device_key=run_device_key(record, metrics),
        world_size=world,
        bus_bytes_per_s=float(used["bus_bytes"].sum() / seconds),
        n_calls=len(used),
        basis=basis,
    )


# --- internals ---------------------------------------------------------------------------------------


def _one_group(record: dict, world: int) -> bool:
    """Whether every collective of the run spans all ``world`` ranks: one parallel degree is the world."""
    par = (record.get("setup") or {}).get("parallel") or {}
    degrees = [int(par.get(k, 1)) for k in ("dp", "tp", "pp", "cp")]
    ep = int(par.get("ep", 1))
    return sorted(degrees) == [1, 1, 1, world] and ep in (1, world)


def run_device_key(record: dict, metrics: dict) -> str:
    """The run's device key as the calibration names it: from its recorded setup, else its metrics."""
    try:
        return device_key_for(record)
    except AdvisorError:
        return device_key_for(metrics)
