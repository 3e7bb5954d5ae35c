"""Test and benchmark harness, outside the library: engine servers as child processes (`servers.py`),
the real supervisord pipeline in a private run directory (`supervised_run.py`), a sharded
training-step check (`fsdp_step.py`), and the benchmarks' verdicts on their targets (`verdict.py`)."""
