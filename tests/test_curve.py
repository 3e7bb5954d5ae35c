"""CURVE on the pipeline's sockets: a keyed PUSH/PULL pair works, a client without the right key gets
nothing through. Run: `pytest tests/test_curve.py`."""

import zmq

from harness.servers import free_port
from nano_miles.run.keys import create_keys
from nano_miles.wire import sockets as channels
from nano_miles.wire.sockets import make_socket


def test_curve_push_pull_and_a_stranger(tmp_path):
    create_keys(tmp_path / "keys")
    stranger_dir = tmp_path / "stranger"
    create_keys(stranger_dir)  # valid keys, but not the ones this pipeline admits
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    try:
        channels.use_curve(str(tmp_path / "keys"))
        pull = make_socket(ctx, zmq.PULL, endpoint, bind=True)
        push = make_socket(ctx, zmq.PUSH, endpoint, bind=False)
        push.send(b"hello")
        assert pull.poll(5000, zmq.POLLIN) and pull.recv() == b"hello"
        assert pull.curve_server
        channels.use_curve(str(stranger_dir))  # wrong client key and wrong server key
        stranger = make_socket(ctx, zmq.PUSH, endpoint, bind=False)
        stranger.send(b"let me in")
        channels.use_curve("")
        plaintext = make_socket(ctx, zmq.PUSH, endpoint, bind=False)  # no CURVE at all
        plaintext.send(b"plain")
        assert not pull.poll(1500, zmq.POLLIN), "a client without the right key got a message through"
        for sock in (pull, push, stranger, plaintext):
            sock.close(linger=0)
    finally:
        channels.use_curve("")
        for auth in channels._authenticators.values():
            auth.stop()
        channels._authenticators.clear()
        ctx.term()
