"""What travels between processes: the data-plane messages (`data.py`), the control-plane commands and
replies (`control.py`), and the one ZeroMQ socket helper with the control client and server
(`sockets.py`). Messages are msgpack; nothing is pickled, and decoding never needs torch."""
