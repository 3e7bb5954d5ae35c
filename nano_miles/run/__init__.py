"""Running the pipeline: the config (`config.py`), what every process sets up (`process.py`), the
supervisord listener that ends a run (`run_end.py`) and the CURVE keys for the sockets (`keys.py`)."""
