# crossdc-operator: the `dr` commands an operator runs (status, failover, failback, gate,
# sync status, tail, drills). Reads everything crossdc keeps; writes the requests and the
# gate under crossdc/controller/ (the controller carries a failover out) and, for a forced
# failover without a leader, the primary record itself.
key_prefix "crossdc/" {
  policy = "write"
}
session_prefix "" {
  policy = "read"
}
service_prefix "" {
  policy = "read"
}
query_prefix "" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
