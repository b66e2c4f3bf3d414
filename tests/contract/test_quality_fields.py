"""--eval-every / --target-loss judged before launching, and the bytes a process sends as the records
count them (contract.traffic)."""
from __future__ import annotations

import socket
import time

import pytest

from contract import ConfigError, RunConfig
from contract.spec import check_common
from contract.traffic import SentBytes
from workload.configs import get_model_config

CFG = RunConfig(system="reference", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1)


@pytest.mark.parametrize("fields,message", [
    ({"eval_every": -1}, "--eval-every must be >= 0"),
    ({"target_loss": 3.0}, "--target-loss needs --eval-every"),
    ({"eval_every": 2, "target_loss": float("nan")}, "--target-loss must be a finite loss > 0"),
])
def test_bad_quality_requests(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_common(CFG.replace(**fields))
    check_common(CFG.replace(eval_every=2, target_loss=3.0))


def test_sent_bytes_counts_this_process_tcp_payload():
    counter = SentBytes()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as a:
            b, _ = server.accept()
            with b:
                a.sendall(b"x" * 300_000)
                b.sendall(b"y" * 1_000)
                got = 0
                while got < 300_000:
                    got += len(b.recv(1 << 20))
                time.sleep(0.05)
                assert counter.read() == 301_000  # both ends are this process
    assert counter.read() == 301_000  # closed sockets keep their last reading
