"""Tensor-parallel ranks 1..N-1 of an engine replica as Ray actors, in the replica's own
placement group: rank r in bundle r, with that bundle's CPUs (the replica, rank 0, holds bundle
0). cluster/app.py asks Serve for the group (`placement_group_bundles`, one bundle per rank).

Each actor runs one call, `RankActor.run(fn, rank, *args)`, for as long as the rank serves; the
call's object ref is how the replica sees the rank: ready means the rank ended, and Ray's error
says how. The actors are owned by the replica's process, so they go down with it (Ray ends an
actor whose owner dies); `ray.kill` of an actor shows here as its rank having died.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from radixserve.workers.distributed.launch import RankHandle


class RankActor:
    """The process of one following rank (made a Ray actor by `RayLauncher.start`)."""

    def run(self, fn: Callable[..., None], rank: int, *args: Any) -> None:
        fn(rank, *args)


class ActorRank:
    """A RankHandle over a RankActor and its running call."""

    def __init__(self, rank: int, actor: Any, running: Any):
        self.rank, self.actor, self.running = rank, actor, running

    def exit_reason(self) -> str | None:
        ready, _ = ray.wait([self.running], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self.running)
        except ray.exceptions.RayActorError as exc:
            return f"died (its actor is gone: {_first_line(exc)})"
        except Exception as exc:
            return f"failed ({_first_line(exc)})"
        return "exited"

    def join(self, timeout_s: float) -> bool:
        ready, _ = ray.wait([self.running], timeout=timeout_s)
        return bool(ready)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


class RayLauncher:
    """Starts following ranks as RankActors named `{name}-rank{r}` (in the replica's namespace)."""

    def __init__(self, name: str):
        self.name = name
        self.host = ray.util.get_node_ip_address()  # rank 0's store listens on this node

    def _placement_group(self, world_size: int) -> Any:
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError(
                "a tensor-parallel replica runs in a placement group of one bundle per rank; "
                "this one has none (cluster/app.py sets placement_group_bundles for tp_size > 1)"
            )
        if len(pg.bundle_specs) < world_size:
            raise RuntimeError(
                f"tp_size {world_size} needs {world_size} placement group bundles, "
                f"the replica's group has {len(pg.bundle_specs)}"
            )
        return pg

    def threads_per_rank(self, world_size: int) -> int:
        cpus = self._placement_group(world_size).bundle_specs[0].get("CPU", 1)
        return max(1, int(cpus))

    def start(self, fn: Callable[..., None], ranks: Sequence[int], *args: Any) -> list[RankHandle]:
        ranks = list(ranks)
        pg = self._placement_group(max(ranks) + 1)
        actor_class = ray.remote(RankActor)
        handles: list[RankHandle] = []
        for rank in ranks:
            bundle = pg.bundle_specs[rank]
            actor: Any = actor_class.options(
                name=f"{self.name}-rank{rank}",
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=False,
                ),
            ).remote()
            handles.append(ActorRank(rank, actor, actor.run.remote(fn, rank, *args)))
        return handles
