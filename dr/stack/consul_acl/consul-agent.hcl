# consul-agent: each Consul agent's own token (acl.tokens.agent): registers its node and
# keeps its coordinates. Not used by crossdc's components.
node_prefix "" {
  policy = "write"
}
service_prefix "" {
  policy = "read"
}
