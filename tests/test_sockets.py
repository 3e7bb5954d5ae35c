"""Control channel over real ZeroMQ sockets: idempotent retries, lost replies, restarts, bad input."""

import threading
import time

import pytest
import zmq

from nano_miles.wire.control import decode_reply, encode_request
from nano_miles.wire.sockets import ControlClient, ControlError, ControlServer, ControlTimeout, make_socket


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class Counting:
    """Handlers that count how often each command really ran."""

    def __init__(self):
        self.calls = {"pause": 0, "resume": 0, "commit": 0}
        self.version = -1

    def handlers(self):
        def pause(mode):
            self.calls["pause"] += 1
            return {"mode": mode}

        def resume(version):
            self.calls["resume"] += 1
            self.version = version
            return {"version": version}

        def commit(step, group_ids, dropped_attempts, no_signal_group_ids):
            self.calls["commit"] += 1
            return {"num_ids": len(group_ids)}
        return {"pause": pause, "resume": resume, "commit": commit}


def serve_in_thread(server, stop, delay_s=0.0):
    def loop():
        time.sleep(delay_s)
        while not stop.is_set():
            server.poll_once(0.02)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_repeated_req_id_runs_once_and_gets_the_same_reply(ctx, tmp_path):
    state = Counting()
    server = ControlServer(ctx, f"ipc://{tmp_path}/c", state.handlers())
    req = make_socket(ctx, zmq.REQ, f"ipc://{tmp_path}/c", bind=False)
    payloads = [encode_request("commit", "same-id", "run-a", step=3, group_ids=["e0-i1", "e0-i2"],
                               dropped_attempts={}, no_signal_group_ids=[]),
                encode_request("pause", "p1", "run-a", mode="abort")]
    replies = []
    for payload in payloads + payloads:
        req.send(payload)
        server.poll_once(1.0)
        replies.append(req.recv())
    assert replies[0] == replies[2] and replies[1] == replies[3]
    assert state.calls == {"pause": 1, "resume": 0, "commit": 1}
    assert decode_reply(replies[0]).result == {"num_ids": 2}
    req.close()
    server.close()


def test_lost_reply_is_retried_without_running_twice(ctx, tmp_path):
    state = Counting()
    server = ControlServer(ctx, f"ipc://{tmp_path}/c", state.handlers())
    stop = threading.Event()
    # The server starts late: the client's first try times out and its socket is dropped, so the
    # reply to that try is lost; the retry carries the same req_id and is answered from the cache.
    thread = serve_in_thread(server, stop, delay_s=0.5)
    client = ControlClient(ctx, f"ipc://{tmp_path}/c", run_id="run-a", timeout_s=0.3, retries=10)
    assert client.request("resume", version=4) == {"version": 4}
    stop.set()
    thread.join()
    assert state.calls["resume"] == 1 and state.version == 4
    client.close()
    server.close()


def test_client_notices_a_restarted_server(ctx, tmp_path):
    endpoint = f"ipc://{tmp_path}/c"
    client = ControlClient(ctx, endpoint, run_id="run-a", timeout_s=1.0, retries=3)
    for incarnation in range(2):
        server = ControlServer(ctx, endpoint, Counting().handlers())
        stop = threading.Event()
        thread = serve_in_thread(server, stop)
        client.request("pause", mode="in_place")
        stop.set()
        thread.join()
        server.close()
        assert client.is_server_restarted == (incarnation == 1)
    client.close()


def test_no_server_gives_a_timeout_naming_the_endpoint(ctx, tmp_path):
    client = ControlClient(ctx, f"ipc://{tmp_path}/nobody", run_id="run-a", timeout_s=0.1, retries=2)
    with pytest.raises(ControlTimeout, match="nobody"):
        client.request("status")
    client.close()


def test_a_client_that_gives_up_stops_retrying_after_the_try_under_way(ctx, tmp_path):
    # a stopping trainer whose producer is stopping too: one try, not control_retries of them
    client = ControlClient(ctx, f"ipc://{tmp_path}/nobody", run_id="run-a", timeout_s=0.2, retries=10,
                           give_up=lambda: True)
    started = time.monotonic()
    with pytest.raises(ControlTimeout, match="in 1 tries"):
        client.request("status")
    assert time.monotonic() - started < 1.0
    client.close()


def test_bad_requests_are_answered_and_the_server_goes_on(ctx, tmp_path):
    state = Counting()
    server = ControlServer(ctx, f"ipc://{tmp_path}/c", state.handlers())
    req = make_socket(ctx, zmq.REQ, f"ipc://{tmp_path}/c", bind=False)
    for junk in (b"", b"\xc1\xc1", b"\x93\x01\x02\x03", encode_request("status", "s1", "run-a")):
        req.send(junk)
        server.poll_once(1.0)
        reply = decode_reply(req.recv())
        assert not reply.ok and reply.error
    assert server.num_rejected == 3  # the status request was valid, just not served here
    client = ControlClient(ctx, f"ipc://{tmp_path}/c", run_id="run-a", timeout_s=1.0, retries=2)
    stop = threading.Event()
    thread = serve_in_thread(server, stop)
    with pytest.raises(ControlError, match="not served"):
        client.request("status")
    assert client.request("pause", mode="retract") == {"mode": "retract"}
    stop.set()
    thread.join()
    for s in (req, client, server):
        s.close()


def test_a_server_claimed_by_one_run_refuses_and_counts_another(ctx, tmp_path):
    state = Counting()
    server = ControlServer(ctx, f"ipc://{tmp_path}/c", state.handlers(), claim_cmd="commit")
    stop = threading.Event()
    thread = serve_in_thread(server, stop)
    ours = ControlClient(ctx, f"ipc://{tmp_path}/c", run_id="run-a", timeout_s=1.0, retries=2)
    leftover = ControlClient(ctx, f"ipc://{tmp_path}/c", run_id="run-b", timeout_s=1.0, retries=2)
    try:
        leftover.request("pause", mode="abort")  # before any claim a server serves whoever asks
        ours.request("commit", step=1, group_ids=["e0-i0"], dropped_attempts={}, no_signal_group_ids=[])  # the claim
        with pytest.raises(ControlError, match="foreign run: run-b"):
            leftover.request("commit", step=9, group_ids=["e0-i9"], dropped_attempts={}, no_signal_group_ids=[])
        with pytest.raises(ControlError, match="foreign run: run-b"):
            leftover.request("resume", version=9)
        assert ours.request("resume", version=2) == {"version": 2}
        assert state.calls == {"pause": 1, "resume": 1, "commit": 1} and state.version == 2
        assert server.num_foreign == 2
    finally:
        stop.set()
        thread.join()  # before the socket it polls is closed
        ours.close()
        leftover.close()
        server.close()
