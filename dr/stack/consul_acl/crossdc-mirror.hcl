# crossdc-mirror: the mirror (`dr mirror run`). Watches the primary record in the target's
# and the source's datacenters (which region may be written, at which epoch); writes nothing.
key_prefix "crossdc/" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
