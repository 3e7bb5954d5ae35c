"""The algorithm as pure math, tensors in and tensors out: GRPO advantages, TITO batches, token
log-probs (`grpo.py`) and the dual-clip PPO loss (`loss.py`). No sockets, no HTTP, no processes."""
