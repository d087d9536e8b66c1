"""The top of the house: the `dr` CLI (`dr.cli`), the local stack (`dr.stack`), status probes
(`dr.status`), the Spark reconciliation job (`dr.reconcile`) and the DR controller.

pyspark is never imported here: only the reconciliation job loads it. The shared vocabulary
(errors, headers, topology, settings, client wrappers) is the `crossdc` kernel.
"""

from dr.errors import DrError

__all__ = ["DrError"]

__version__ = "0.1.0"
