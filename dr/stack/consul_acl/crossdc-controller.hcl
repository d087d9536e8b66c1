# crossdc-controller: the DR controller (`dr controller run`), in every region.
# Holds the leader lock (a session per datacenter, tied to its heartbeat check) and, as
# leader, writes the primary record, the fence, the gate, health and lag under crossdc/;
# registers its heartbeat service, the `kafka` instances each region's DNS answers with and
# the `kafka-primary` prepared query that fails over between datacenters.
key_prefix "crossdc/" {
  policy = "write"
}
session_prefix "" {
  policy = "write"
}
service "crossdc-controller" {
  policy = "write"
}
service "kafka" {
  policy = "write"
}
service_prefix "" {
  policy = "read"
}
query "kafka-primary" {
  policy = "write"
}
node_prefix "" {
  policy = "read"
}
