"""The algorithm as pure math, tensors in and tensors out: advantage estimators (`advantages.py`), TITO
batches and token log-probs (`grpo.py`), the policy losses (`loss.py`) and the admission rules
(`admission.py`). No sockets, no HTTP, no processes."""
