"""The services the run command starts beside a run's ranks (torchft's lighthouse): started and
listening before the ranks, gone when the launch ends, also when it fails."""
from __future__ import annotations

import socket

import pytest

from contract import RunConfig
from runners import services
from runners.launcher import free_port
from workload.configs import get_model_config

CFG = RunConfig(system="diloco", model=get_model_config("tiny"), batch_size=2, micro_batch_size=1, dp=2)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_lighthouse_listens_while_the_launch_runs_and_is_gone_after(tmp_path):
    port = free_port()
    where = services.Placing(bind="127.0.0.1", advertise="127.0.0.1", port=port)
    with services.started(services.SERVICES, CFG, tmp_path, where) as env:
        assert env["TORCHFT_LIGHTHOUSE"] == f"http://127.0.0.1:{port}" and listening(port)
        log = (tmp_path / "torchft-lighthouse.log").read_text()
        assert "Lighthouse listening on" in log
    assert not listening(port)
    with pytest.raises(KeyboardInterrupt):
        with services.started(services.SERVICES, CFG, tmp_path, where):
            assert listening(port)
            raise KeyboardInterrupt
    assert not listening(port)


def test_other_nodes_of_a_cluster_only_learn_where_it_is(tmp_path):
    where = services.Placing(bind="0.0.0.0", advertise="node01", port=services.LIGHTHOUSE_PORT, start=False)
    with services.started(services.SERVICES, CFG, tmp_path, where) as env:
        assert env["TORCHFT_LIGHTHOUSE"] == f"http://node01:{services.LIGHTHOUSE_PORT}"
    assert not (tmp_path / "torchft-lighthouse.log").exists()


def test_a_lighthouse_that_cannot_listen_fails_the_launch(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        where = services.Placing(bind="127.0.0.1", advertise="127.0.0.1", port=taken.getsockname()[1])
        with pytest.raises(services.ServiceError, match="torchft-lighthouse did not start"):
            with services.started(services.SERVICES, CFG, tmp_path, where):
                pass
