"""The DR controller: leader lock, health with canaries, lease fencing, failover and failback,
Consul DNS, standby metadata sync. `dr controller run` runs one; `dr failover`, `dr failback`
and `dr gate` drive them through Consul KV."""

from dr.controller.config import ControllerSettings
from dr.controller.controller import Controller
from dr.controller.errors import (
    ControllerError,
    FailoverInProgress,
    FailoverRefused,
    NotLeader,
    StepFailed,
)
from dr.controller.state import FailoverRecord, GateRecord, RegionHealth

__all__ = [
    "Controller",
    "ControllerError",
    "ControllerSettings",
    "FailoverInProgress",
    "FailoverRecord",
    "FailoverRefused",
    "GateRecord",
    "NotLeader",
    "RegionHealth",
    "StepFailed",
]
