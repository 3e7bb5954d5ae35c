"""Test and benchmark harness, outside the library: engine servers as child processes (`servers.py`),
the real supervisord pipeline in a private run directory (`supervised_run.py`), a sharded
training-step check (`fsdp_step.py`), the benchmarks' verdicts on their targets (`verdict.py`) and their
result files, rewritten after every finished run (`result_file.py`)."""
