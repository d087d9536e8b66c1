"""Logging set-up and the Docker-engine decision."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import structlog

from crossdc.logs import configure_logging
from dr.stack.docker import docker_available, kafka_env
from dr.stack.kafka import KafkaNode
from dr.stack.ports import free_topology


def test_json_logs_carry_bound_context(capsys: pytest.CaptureFixture[str]) -> None:
    # configure_logging binds the current (captured) stderr; restore what was there so
    # later tests do not log into a closed capture file.
    before = structlog.get_config()
    handlers, level = logging.getLogger().handlers[:], logging.getLogger().level
    configure_logging("json", "info")
    try:
        log = structlog.get_logger("t").bind(region="east", topic="orders", partition=3)
        log.info("batch_mirrored", records=12)
        log.debug("not_shown")
        logging.getLogger("aiokafka.conn").warning("a library's line")
    finally:
        structlog.configure(**before)
        logging.getLogger().handlers[:] = handlers
        logging.getLogger().setLevel(level)
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 2
    assert lines[0]["event"] == "batch_mirrored"
    assert lines[0]["region"] == "east"
    assert lines[0]["partition"] == 3
    assert lines[0]["level"] == "info"
    # every line names its logger: crossdc's own and a library's through stdlib logging
    assert lines[0]["logger"] == "t"
    assert (lines[1]["event"], lines[1]["logger"]) == ("a library's line", "aiokafka.conn")


def test_docker_decided_by_engine_ping_not_by_client(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    assert docker_available() is False


def test_kafka_env_maps_properties_to_image_variables(tmp_path) -> None:  # type: ignore[no-untyped-def]
    topo = free_topology(["east"])
    node = KafkaNode(topo.regions[0], 0, 1, 1, tmp_path, tmp_path, tmp_path)
    env = kafka_env(node, "abc")
    assert env["CLUSTER_ID"] == "abc"
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == \
        f"1@127.0.0.1:{topo.regions[0].local.kafka.controller_port}"  # type: ignore[union-attr]
    assert "KAFKA_LOG_DIRS" not in env
