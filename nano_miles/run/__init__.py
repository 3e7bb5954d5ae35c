"""Running the pipeline: the config (`config.py`) and what each field accepts (`rules.py`), the one path
from a user's mistake to one line and exit 2 (`cli.py`), what every process sets up (`process.py`),
what the run's supervisord listener decides (`watch.py`) and the CURVE keys for the sockets (`keys.py`)."""
