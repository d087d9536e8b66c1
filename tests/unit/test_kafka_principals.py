"""Whom a region's brokers see each component as (crossdc/security.py `kafka_principals`,
`kafka_principal_template`), and the ACLs and the fence naming it (dr/controller/acl.py).
Against a real broker (a certificate's subject, a token's `sub`):
tests/integration/test_kafka_security.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from crossdc.errors import ConfigError
from crossdc.security import CONTROLLER, MIRROR, PROXY, RECONCILE, KafkaSecurity
from crossdc.topology import Topology, load_topology
from dr.controller.acl import KafkaFence, component_acls, proxy_deny
from dr.stack.paths import REPO_ROOT

TOPOLOGY = REPO_ROOT / "policies" / "topology.local.yaml"
POLICY = REPO_ROOT / "policies" / "default.yaml"
DN = "CN=proxy.east.example,OU=crossdc,O=Example"


def _mtls(tmp_path: Path, **kw: Any) -> KafkaSecurity:
    return KafkaSecurity(protocol="SSL", cert_file=tmp_path / "{principal}.pem",
                         key_file=tmp_path / "{principal}.key", **kw)


def _topology(security: dict[str, Any]) -> Topology:
    data = load_topology(TOPOLOGY).model_dump(mode="json")
    for r in data["regions"]:
        r["security"] = security
    return Topology.model_validate(data)


def test_by_default_each_component_is_its_own_name(tmp_path: Path) -> None:
    """Today's behaviour: right for SCRAM/PLAIN with a password each, and for mTLS with a
    mapping rule that keeps the CN."""
    for sec in (KafkaSecurity(credentials_dir=tmp_path), _mtls(tmp_path)):
        assert [sec.kafka_principal(p) for p in (PROXY, MIRROR, CONTROLLER, RECONCILE)] == [
            PROXY, MIRROR, CONTROLLER, RECONCILE]
        assert sec.fence_conflict() is None
    # a pinned username: every client authenticates as it, so the brokers see it
    pinned = KafkaSecurity(username="svc", password_file=tmp_path / "pw")
    assert pinned.kafka_principal(PROXY) == pinned.kafka_principal(MIRROR) == "svc"
    assert "'svc'" in (pinned.fence_conflict() or "")


def test_the_map_wins_then_the_template_and_user_prefix_is_dropped(tmp_path: Path) -> None:
    sec = _mtls(tmp_path, kafka_principals={"proxy": f"User:{DN}"},
                kafka_principal_template="CN={principal},OU=crossdc,O=Example")
    assert sec.kafka_principals == {"proxy": DN}
    assert sec.kafka_principal(PROXY) == DN
    assert sec.kafka_principal(MIRROR) == "CN=crossdc-mirror,OU=crossdc,O=Example"
    oauth = KafkaSecurity(mechanism="OAUTHBEARER", oauth={"token_file": tmp_path / "t"},
                          kafka_principals={"proxy": "0oa1b2c3-proxy",
                                            "mirror": "0oa1b2c3-mirror"})
    assert oauth.kafka_principal(PROXY) == "0oa1b2c3-proxy"
    assert oauth.kafka_principal(CONTROLLER) == CONTROLLER  # not named: its own name


def test_the_acls_and_the_fence_name_whom_the_brokers_see(tmp_path: Path) -> None:
    sec = _mtls(tmp_path, kafka_principals={"proxy": DN})
    acls = component_acls(sec)
    principals = {a.principal for a in acls}
    assert f"User:{DN}" in principals
    assert f"User:{PROXY}" not in principals
    assert f"User:{MIRROR}" in principals
    assert proxy_deny("payments", sec).principal == f"User:{DN}"
    assert proxy_deny("payments").principal == f"User:{PROXY}"  # no security: the name
    assert len(acls) == len(component_acls())


@pytest.mark.parametrize(("field", "value", "words"), [
    ("kafka_principals", {"proxi": "x"}, "'proxi': not a component"),
    ("kafka_principals", {"admin": "x"}, "not a component"),  # the super user: not ACL'd
    ("kafka_principals", {"proxy": "*"}, "every principal"),
    ("kafka_principals", {"proxy": "User:"}, "empty"),
    ("kafka_principals", {"proxy": " svc"}, "space at an end"),
    ("kafka_principals", {"proxy": "CN=p, OU=crossdc"}, "RFC 2253"),
    ("kafka_principals", {"proxy": "CN={principle}"}, "only placeholder"),
    ("kafka_principal_template", "CN=crossdc,OU=x", "names no {principal}"),
    ("kafka_principals", {"proxy": "svc", "mirror": "User:svc"}, "the mirror too"),
])
def test_a_name_that_cannot_be_right_is_refused(tmp_path: Path, field: str, value: Any,
                                               words: str) -> None:
    with pytest.raises(ValidationError, match=words.replace("{", r"\{").replace("}", r"\}")):
        _mtls(tmp_path, **{field: value})
    # an escaped comma inside a value is a comma of the value, not a separator
    assert _mtls(tmp_path, kafka_principals={"proxy": r"CN=a\, b,O=x"}).kafka_principal(
        PROXY) == r"CN=a\, b,O=x"


def test_an_unknown_component_names_file_line_and_field(tmp_path: Path) -> None:
    data = load_topology(TOPOLOGY).model_dump(mode="json")
    data["regions"][0]["security"] = {
        "protocol": "SSL", "cert_file": "/c/{principal}.pem", "key_file": "/c/{principal}.key",
        "kafka_principals": {"prxy": DN}}
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as err:
        load_topology(path)
    text = str(err.value)
    assert "regions[0].security.kafka_principals" in text
    assert "'prxy': not a component (one of proxy, mirror, controller, reconcile)" in text
    assert f"{path}:" in text


def test_the_fence_refuses_a_region_where_the_proxies_are_the_mirror_too(
        tmp_path: Path) -> None:
    """A pinned username shared by every component: a deny of the proxies would deny the
    mirror as well (before this, it denied User:crossdc-proxy, whom nobody was)."""
    topo = _topology({"username": "svc", "password_file": str(tmp_path / "pw")})
    with pytest.raises(ConfigError, match=r"regions\[0\]\.security: region east: .*'svc'"):
        KafkaFence(topo, POLICY, principal=CONTROLLER)
    ok = _topology({"protocol": "SSL", "cert_file": "/c/{principal}.pem",
                    "key_file": "/c/{principal}.key", "kafka_principals": {"proxy": DN}})
    fence = KafkaFence(ok, POLICY, principal=CONTROLLER)
    assert {r: proxy_deny("t", s).principal for r, s in fence.security.items()} == {
        r.name: f"User:{DN}" for r in ok.regions}


def test_the_shipped_schema_has_the_fields() -> None:
    import json
    schema = json.loads((REPO_ROOT / "policies" / "topology.schema.json").read_text())
    props = schema["$defs"]["KafkaSecurity"]["properties"]
    assert {"kafka_principals", "kafka_principal_template"} <= set(props)
