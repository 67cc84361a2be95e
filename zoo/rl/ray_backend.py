"""`RayBackend`: RL rollouts and rewards on a Ray cluster, chosen in YAML instead of the in-process default.

    model:
      class_path: zoo.rl.task.RLTask
      init_args:
        rollout_backend:
          class_path: zoo.rl.ray_backend.RayBackend
          init_args: {engines: 2, num_cpus_per_engine: 0.5, verifier_actors: 2}

The trainer stays in the Lightning process; the rollout engines are actors (`zoo.rl.ray_engines`), pushed
new weights through the object store on the schedule the rollout scheduler sets, and the verifier calls
run in actors with timeouts (`zoo.rl.ray_verifiers`). Ray is joined at `address` when given (a running
cluster: `ray start --head` on one node, `ray start --address=...` on the others), else the cluster the
process already joined, else a local one is started with `num_cpus`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zoo.rl.engines import EngineSettings, RolloutBackend, ScoringPool

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel
    from zoo.rl.ray_engines import RayEngineGroup


class RayBackend(RolloutBackend):
    """Rollout engines and verifiers as Ray actors.

    Args:
        engines: rollout engine actors (each its own copy of the policy; rollouts of one query group stay
            on one engine).
        num_cpus_per_engine, num_gpus_per_engine: Ray resources of each engine actor (fractions allowed).
        verifier_actors: verifier actors (0: the in-process `VerifierPool` of `ScoringConfig`).
        num_cpus_per_verifier: Ray CPUs of each verifier actor.
        threads_per_actor: OMP_NUM_THREADS in every actor's runtime env.
        max_engine_restarts: engine actors recreated over the run (after a death) before the run fails.
        engine_timeout_s: longest an engine call may take before its actor is killed and recreated (None:
            no limit; a dead actor is noticed either way).
        verifier_retries: times a verifier call is sent again after its actor died under it.
        address: the Ray cluster to join ("auto", "ray://host:10001", ...); None: the one this process
            joined already, else a new local cluster.
        num_cpus: CPUs of a new local cluster (None: Ray's count of the machine's).
    """

    def __init__(
        self,
        engines: int = 1,
        num_cpus_per_engine: float = 1.0,
        num_gpus_per_engine: float = 0.0,
        verifier_actors: int = 2,
        num_cpus_per_verifier: float = 0.25,
        threads_per_actor: int = 1,
        max_engine_restarts: int = 3,
        engine_timeout_s: float | None = None,
        verifier_retries: int = 1,
        address: str | None = None,
        num_cpus: int | None = None,
    ) -> None:
        super().__init__()
        if engines < 1 or verifier_actors < 0:
            raise ValueError(
                f"RayBackend needs engines >= 1 and verifier_actors >= 0, got {engines}, {verifier_actors}"
            )
        self.engines, self.num_cpus_per_engine, self.num_gpus_per_engine = (
            engines,
            num_cpus_per_engine,
            num_gpus_per_engine,
        )
        self.verifier_actors, self.num_cpus_per_verifier = verifier_actors, num_cpus_per_verifier
        self.threads_per_actor, self.max_engine_restarts = threads_per_actor, max_engine_restarts
        self.engine_timeout_s, self.verifier_retries = engine_timeout_s, verifier_retries
        self.address, self.num_cpus = address, num_cpus
        self._started_ray = False

    def connect(self) -> None:
        """Join (or start) the Ray cluster, once."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, num_cpus=self.num_cpus, include_dashboard=False)
            self._started_ray = True

    def build_engine(self, model: UnifiedModel, settings: EngineSettings, version: int) -> RayEngineGroup:
        from zoo.rl.ray_engines import RayEngineGroup

        self.connect()
        return RayEngineGroup(
            model,
            settings,
            version,
            engines=self.engines,
            num_cpus_per_engine=self.num_cpus_per_engine,
            num_gpus_per_engine=self.num_gpus_per_engine,
            threads_per_engine=self.threads_per_actor,
            max_restarts=self.max_engine_restarts,
            call_timeout_s=self.engine_timeout_s,
        )

    def verifier_pool(self, workers: int, timeout_s: float) -> ScoringPool:
        if self.verifier_actors == 0:
            return super().verifier_pool(workers, timeout_s)
        from zoo.rl.ray_verifiers import RayVerifierPool

        self.connect()
        return RayVerifierPool(
            self.verifier_actors,
            timeout_s,
            num_cpus_per_actor=self.num_cpus_per_verifier,
            threads_per_actor=self.threads_per_actor,
            retries=self.verifier_retries,
        )

    def close(self) -> None:
        """Shut down the local cluster this backend started (a joined one is left running)."""
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
