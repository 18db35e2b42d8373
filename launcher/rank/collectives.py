"""Who this rank is among the ranks, and the few collectives the launcher runs between them.

Horovod is joined only when the launcher started more than one rank (horovodrun and mpirun say how
many in the environment; a rank started directly is alone). A one-rank run, `lms-launch plan` and
`lms-launch bench` therefore work where Horovod is not built, as on an air-gapped GPU machine that
was given TensorFlow alone (docs/gpu-bundle.md). Every collective here short-circuits for one rank.

Collectives must be called by every rank, the same number of times, in the same order.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from launcher import env as ev


@dataclass(frozen=True)
class RankContext:
    """Who this process is among the ranks and what it computes on."""

    rank: int
    size: int
    local_rank: int
    local_size: int  # ranks on this host
    host: str
    device: str  # "GPU:0" (the one GPU this rank sees), "CPU:0", or "CPU:1" (a CPU rank with LMS on)

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def size_from_env(environ: Mapping[str, str]) -> int:
    """How many ranks the launcher started, before Horovod starts; 1 for a rank started directly."""
    for key in (ev.HOROVOD_SIZE, ev.OMPI_COMM_WORLD_SIZE):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return 1


def join_ranks(pick_device: Callable[[int], str], environ: Mapping[str, str] = os.environ) -> RankContext:
    """Joins the other ranks (Horovod, only when there are others) and returns this rank's context;
    `pick_device(local_rank)` chooses the device it computes on."""
    if size_from_env(environ) == 1:
        return RankContext(rank=0, size=1, local_rank=0, local_size=1, host=socket.gethostname(),
                           device=pick_device(0))
    import horovod.tensorflow as hvd

    hvd.init()
    return RankContext(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(),
                       host=socket.gethostname(), device=pick_device(hvd.local_rank()))


def allgather_object(ctx: RankContext, value: Any) -> list:
    """Every rank's `value` (any picklable object), rank 0's first."""
    if ctx.size == 1:
        return [value]
    import horovod.tensorflow as hvd

    return hvd.allgather_object(value)


def broadcast_object(ctx: RankContext, value: Any, name: str) -> Any:
    """Rank 0's `value` on every rank."""
    if ctx.size == 1:
        return value
    import horovod.tensorflow as hvd

    return hvd.broadcast_object(value, root_rank=0, name=name)


def all_ranks(ctx: RankContext, flag: bool) -> bool:
    """True when every rank says True."""
    return all(allgather_object(ctx, flag))


def broadcast_variables(ctx: RankContext, variables: list) -> None:
    """Gives every rank rank 0's values (weights and optimizer state) before the first step.
    Keras 3 variables break `hvd.broadcast_variables`, as they break `hvd.DistributedGradientTape`
    (docs/install.md, "Why TensorFlow 2.18.1 and Horovod 0.28.1"), so each is assigned the tensor that `hvd.broadcast` returns."""
    if ctx.size == 1:
        return
    import horovod.tensorflow as hvd
    import tensorflow as tf

    @tf.function
    def broadcast():
        for i, variable in enumerate(variables):
            variable.assign(hvd.broadcast(variable.value, root_rank=0, name=f"broadcast_{i}"))

    broadcast()


def make_mean_across_ranks(ctx: RankContext, variables: list) -> Callable[[], list]:
    """A collective that returns the ranks' mean of each variable's value, leaving the variables as
    they are (traced once; call it as often as needed)."""
    if ctx.size == 1:
        return lambda: [v.value for v in variables]
    import horovod.tensorflow as hvd
    import tensorflow as tf

    @tf.function
    def mean():
        return hvd.grouped_allreduce([v.value for v in variables], op=hvd.Average)

    return mean


def average_across_ranks(ctx: RankContext, variables: list) -> None:
    """Averages state that is not trained (batch-norm moving statistics), which each rank updates
    from its own batches, so the final model is the same everywhere."""
    if ctx.size == 1 or not variables:
        return
    for variable, mean in zip(variables, make_mean_across_ranks(ctx, variables)()):
        variable.assign(mean)


def barrier(ctx: RankContext) -> None:
    """Returns once every rank has called it (a one-number allreduce)."""
    if ctx.size == 1:
        return
    import horovod.tensorflow as hvd
    import tensorflow as tf

    with tf.device("/device:CPU:0"):
        hvd.allreduce(tf.constant([1], tf.int32), op=hvd.Sum, name="lms_launch_barrier").numpy()


def make_max_across_ranks() -> Callable[[int], int]:
    """A collective over one integer: the largest any rank gives (the stop request's agreement)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    def largest(value: int) -> int:
        with tf.device("/device:CPU:0"):
            flags = hvd.allreduce(tf.constant([value], tf.int32), op=hvd.Max, name="lms_launch_stop_request")
        return int(flags.numpy()[0])

    return largest
