"""Failover drills: traffic, faults, the independent count and the report (`dr drill`)."""
