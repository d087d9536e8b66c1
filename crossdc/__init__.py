"""crossdc's kernel: what every component shares and that imports none of them.

Errors (`crossdc.errors`), the dr-* header names (`crossdc.headers`), the topology model
(`crossdc.topology`), YAML loading with file:line:field errors (`crossdc.yamlfile`), logging
set-up (`crossdc.logs`), shared settings (`crossdc.settings`), the primary record
(`crossdc.primary`); one layer up, the Consul and Kafka client wrappers (`crossdc.clients`).
"""

from crossdc.errors import ConfigError, ConfigIssue, CrossdcError
from crossdc.topology import Region, Topology, load_topology

__all__ = ["ConfigError", "ConfigIssue", "CrossdcError", "Region", "Topology", "load_topology"]

__version__ = "0.1.0"
