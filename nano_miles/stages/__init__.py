"""The pipeline's processes, one sub-package each, in the order a sample passes them:

    rollout/   prompts -> engine /generate -> RolloutGroups (the producer, its ledger of issued groups)
    reward/    RolloutGroups -> rewards -> ScoredGroups (the reward function in a child)
    trainer/   ScoredGroups -> advantages, GRPO steps -> weights pushed to the engine (checkpoints, evaluation)

Each is a library; its process is a thin entry point in the repository's `procs/` (`procs/rollout.py`,
`procs/reward.py`, `procs/trainer.py`), which supervisord starts.
"""
