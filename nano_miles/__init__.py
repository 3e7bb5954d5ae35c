"""nano-miles: GRPO post-training as separate processes joined by ZeroMQ."""

__version__ = "0.1.0"
