"""The trainer: the step loop (`step_loop.py`), the optimizer step (`learner.py`), its peers engine and
producer (`peers.py`), checkpoints (`checkpoint.py`) and held-out evaluation (`evaluate.py`)."""
