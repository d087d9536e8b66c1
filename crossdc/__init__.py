"""crossdc's kernel: what every component shares and that imports none of them.

Errors (`crossdc.errors`), the dr-* header names (`crossdc.headers`), the topology model
(`crossdc.topology`), YAML loading with file:line:field errors (`crossdc.yamlfile`), logging
set-up (`crossdc.logs`), shared settings (`crossdc.settings`), the primary record
(`crossdc.primary`); one layer up, the Consul and Kafka client wrappers (`crossdc.clients`).
"""

from typing import TYPE_CHECKING, Any

from crossdc.errors import ConfigError, ConfigIssue, CrossdcError

if TYPE_CHECKING:
    from crossdc.topology import Region, Topology, load_topology

__all__ = ["ConfigError", "ConfigIssue", "CrossdcError", "Region", "Topology", "load_topology"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The topology's names load on first use: building its pydantic models costs about
    0.2 s, which every `import crossdc.<anything>` paid (`dr consume --target` needs none)."""
    if name in ("Region", "Topology", "load_topology"):
        import importlib
        return getattr(importlib.import_module("crossdc.topology"), name)
    raise AttributeError(f"module 'crossdc' has no attribute {name!r}")
