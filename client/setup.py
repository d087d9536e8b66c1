"""The build hook: the gRPC stubs of the proxy's API are generated when crossdc-client is
built, not at run time.

Everything else about the distribution is in pyproject.toml. `build_py` (run by `pip install
./client`, `pip wheel ./client` and editable installs) runs protoc from the build environment's
grpcio-tools (`[build-system] requires`) on `src/crossdc_client/protos/` and writes
`crossdc_client/_proto/` into the build: a wheel carries the stubs, and an installed SDK needs
no grpcio-tools and never writes into its own package. An editable install writes them into
the checkout instead (where `make setup` also builds them with the dev venv's grpcio-tools).

`build_protos.py` is loaded by its path: importing the package here would need its run-time
dependencies, which a build environment does not have.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "src" / "crossdc_client"


def _build_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_crossdc_build_protos",
                                                  PACKAGE / "build_protos.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """build_py, then the gRPC stubs into the build (or the checkout, when editable)."""

    def run(self) -> None:
        super().run()
        editable = bool(getattr(self, "editable_mode", False))
        out = (PACKAGE if editable else Path(self.build_lib) / "crossdc_client") / "_proto"
        written = _build_protos().generate(out)
        self.announce(f"generated {len(written)} gRPC stub file(s) into {out}", level=2)


setup(cmdclass={"build_py": BuildPyWithStubs})
