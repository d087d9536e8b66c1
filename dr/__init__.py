"""crossdc's controller package: topology, local stack, status, errors shared by all parts.

pyspark is never imported here: only the reconciliation job loads it.
"""

from dr.errors import ConfigError, CrossdcError, DrError
from dr.topology import Region, Topology, load_topology

__all__ = ["ConfigError", "CrossdcError", "DrError", "Region", "Topology", "load_topology"]

__version__ = "0.1.0"
