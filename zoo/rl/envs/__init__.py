"""RL environments beyond single-answer tasks (issue 18, item 3): instruction following with format
constraints (`zoo.rl.envs.instructions`), tool use with a calculator inside the rollout
(`zoo.rl.envs.tools`), and their query datamodules (`zoo.rl.envs.data`).

The verifiers are plain module-level functions of `(Query, completion)` registered in
`zoo.rl.verifiers.VERIFIERS`, so the verifier pool runs them like any other; nothing here is imported by
this package's `__init__` (verifier workers import only what they call).
"""
