"""The reward stage: scores each sample of a group (`scorer.py`); the reward function runs in a child
process (`nano_miles/rewards/worker.py`). Advantages are the trainer's (`nano_miles/algo/advantages.py`)."""
