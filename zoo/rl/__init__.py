"""Post-training with reinforcement learning on verifiable rewards (ERNIE 5.0 RL stage)."""
