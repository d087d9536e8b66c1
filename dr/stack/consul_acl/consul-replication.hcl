# consul-replication: the token a secondary datacenter's servers replicate ACLs with
# (acl.tokens.replication), so each datacenter resolves crossdc's tokens itself and keeps
# doing so while the primary datacenter is cut off.
acl = "write"
operator = "write"
service_prefix "" {
  policy = "read"
  intentions = "read"
}
