"""Post-training with reinforcement learning on verifiable rewards (ERNIE 5.0 RL stage).

`zoo.rl.losses` (GRPO / GSPO / IcePop / MISC / WPSM), `zoo.rl.hints` (AHRL), `zoo.rl.records` (queries and
rollouts), `zoo.rl.verifiers` (verifiers, the worker pool), `zoo.rl.tasks_text`, `zoo.rl.prompts` (prompts
with media), `zoo.rl.responses` (text / image / speech responses), `zoo.rl.policy` (the engine's weights),
`zoo.rl.rollout` (the inference engine), `zoo.rl.replay` (router replay, the trainer's log-probs),
`zoo.rl.schedulers` (sync / APRIL / U-RB), `zoo.rl.scoring` (rewards, validation), `zoo.rl.update` (the
policy update), `zoo.rl.data` (text tasks), `zoo.rl.data_shapes` (image / speech / clip to caption),
`zoo.rl.engines` (the engine protocol, backends), `zoo.rl.ray_backend` / `ray_engines` / `ray_verifiers`
(engines and verifiers as Ray actors), `zoo.rl.envs` (instruction following, tool use) and
`zoo.rl.task.RLTask`.

Names are imported on first use: verifier worker processes import `zoo.rl.verifiers` and must not pay
for Lightning.
"""

from importlib import import_module

_EXPORTS = {
    "RLTask": "zoo.rl.task",
    "RolloutConfig": "zoo.rl.task",
    "UpdateConfig": "zoo.rl.update",
    "OptimConfig": "zoo.rl.update",
    "ScoringConfig": "zoo.rl.scoring",
    "RLDataModule": "zoo.rl.data",
    "QueryDataModule": "zoo.rl.data",
    "ShapesRLDataModule": "zoo.rl.data_shapes",
    "PolicyLossConfig": "zoo.rl.losses",
    "MismatchBounds": "zoo.rl.losses",
    "policy_loss": "zoo.rl.losses",
    "group_advantages": "zoo.rl.losses",
    "HintSchedule": "zoo.rl.hints",
    "HintController": "zoo.rl.hints",
    "Query": "zoo.rl.records",
    "Rollout": "zoo.rl.records",
    "VerifierPool": "zoo.rl.verifiers",
    "TextTasks": "zoo.rl.tasks_text",
    "EngineSettings": "zoo.rl.engines",
    "InProcessBackend": "zoo.rl.engines",
    "RayBackend": "zoo.rl.ray_backend",
    "InstructionRLDataModule": "zoo.rl.envs.data",
    "ToolRLDataModule": "zoo.rl.envs.data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'zoo.rl' has no attribute {name!r}")
