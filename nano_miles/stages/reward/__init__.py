"""The reward stage: scores each sample and computes group advantages (`scorer.py`); the reward
function runs in a child process (`nano_miles/rewards/worker.py`)."""
