"""The client distribution (client/, `crossdc-client`): the SDK loads grpc and protobuf and
nothing else of crossdc or its daemons (the import-linter contract says the same of the
source; this is the run time, imports inside functions included once a client is built), and
the two distributions install no file twice. `.ci/clean-venv.sh` installs it alone into a
fresh venv and produces and consumes through a real proxy with it."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from dr.stack.paths import REPO_ROOT

CLIENT = REPO_ROOT / "client"
DAEMON_LIBS = {"aiokafka", "confluent_kafka", "consul", "aiohttp", "typer", "rich",
               "cryptography", "pydantic", "yaml", "structlog", "tenacity",
               "prometheus_client", "orjson", "click"}
OURS_ELSEWHERE = {"crossdc", "proxy", "dr", "mirror"}

_PROBE = """
import json, sys
before = set(sys.modules)
import crossdc_client
from crossdc_client import (AsyncConsumer, AsyncProducer, Connection, ConsumeFailed,
                            ProduceFailed, Producer)
import crossdc_client.api, crossdc_client.build_protos, crossdc_client.files
# what runs inside: a channel, a producer and a consumer built (never started: no server)
conn = Connection(token="cdc_probe_token", options=[("grpc.enable_retries", 0)])
conn.open("127.0.0.1:1")
AsyncConsumer("127.0.0.1:1", "g", ["t"])
files = {m.split(".")[0]: getattr(mod, "__file__", None) or ""
         for m, mod in list(sys.modules.items()) if m not in before}
print(json.dumps(files))
"""


def test_the_sdk_loads_grpc_and_protobuf_and_nothing_of_crossdc_or_its_daemons(
        tmp_path: Path) -> None:
    # a folder outside the checkout: the checkout's packages are not on the path by accident
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=True)
    loaded: dict[str, str] = json.loads(out.stdout)
    tops = set(loaded) - set(sys.stdlib_module_names)
    assert {"crossdc_client", "grpc", "google"} <= tops
    assert not tops & DAEMON_LIBS, tops & DAEMON_LIBS
    assert not tops & OURS_ELSEWHERE, tops & OURS_ELSEWHERE
    # every module of the SDK is the client distribution's own source
    assert Path(loaded["crossdc_client"]).resolve().is_relative_to(CLIENT / "src")


def find_packages(root: str, include: list[str]) -> list[str]:
    """setuptools' `find_packages(root, include=...)`: the packages (folders with an
    __init__.py, inside packages) whose dotted name matches a pattern."""

    def walk(folder: Path, prefix: str) -> list[str]:
        out = []
        for sub in sorted(folder.iterdir()):
            if sub.is_dir() and sub.name.isidentifier() and (sub / "__init__.py").is_file():
                out += [prefix + sub.name, *walk(sub, f"{prefix}{sub.name}.")]
        return out

    return [n for n in walk(Path(root), "")
            if any(fnmatch.fnmatchcase(n, pat) for pat in include)]


def test_the_two_distributions_hold_disjoint_packages() -> None:
    """pip never sees two distributions owning one file: crossdc finds its packages at the
    top of the checkout, crossdc-client under client/src, and no name is in both."""
    main = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text(encoding="utf-8"))
    main_find = main["tool"]["setuptools"]["packages"]["find"]
    client_find = client["tool"]["setuptools"]["packages"]["find"]
    ours = set(find_packages(str(REPO_ROOT), include=main_find["include"]))
    theirs = set(find_packages(str(CLIENT / client_find["where"][0]),
                               include=client_find["include"]))
    assert {"proxy", "crossdc"} <= ours
    assert theirs
    assert all(p.split(".")[0] == "crossdc_client" for p in theirs)
    assert not ours & theirs
    assert not {p for p in ours if p.startswith("crossdc_client")}
    # the .proto ships once: with the client (its stubs are built there)
    assert not list((REPO_ROOT / "proxy").rglob("*.proto"))
    assert list((CLIENT / "src" / "crossdc_client" / "protos").rglob("*.proto"))


def test_the_full_install_re_exports_the_sdk_objects_themselves() -> None:
    """`from proxy.client import AsyncProducer` and the errors' classes are the SDK's own
    objects, so an `except ProxyError` or `except CrossdcError` catches what it always did."""
    import crossdc_client.consumer
    import crossdc_client.errors
    import crossdc_client.producer
    from crossdc import errors, files, lifecycle
    from proxy import api, client, consumer_client
    from proxy import errors as proxy_errors

    assert client.AsyncProducer is crossdc_client.producer.AsyncProducer
    assert consumer_client.AsyncConsumer is crossdc_client.consumer.AsyncConsumer
    assert errors.CrossdcError is crossdc_client.errors.CrossdcError
    assert errors.ConfigError is crossdc_client.errors.ConfigError
    assert issubclass(proxy_errors.ProduceFailed, errors.CrossdcError)
    assert proxy_errors.ProxyError is crossdc_client.errors.ProxyError
    assert issubclass(lifecycle.Closed, errors.CrossdcError)
    assert files.read_user_file is crossdc_client.files.read_user_file
    assert api.pb is crossdc_client.api.pb
