# crossdc-proxy: the routing proxy (`dr proxy serve`), in every region.
# Reads the primary record and the controller's keys (fence, gate) in its own datacenter and,
# for the write grant, in every other voting one; registers itself as `crossdc-proxy` (with
# its TTL check) so producers find it over DNS; reads the other proxies and the nodes.
key_prefix "crossdc/" {
  policy = "read"
}
service "crossdc-proxy" {
  policy = "write"
}
service_prefix "" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
