# consul-dns: each agent's default token (acl.tokens.default), what an anonymous request
# (every DNS lookup) may see: producers resolve crossdc-proxy.service.<dc>.consul and
# kafka-primary.query.consul without a token.
node_prefix "" {
  policy = "read"
}
service_prefix "" {
  policy = "read"
}
query_prefix "" {
  policy = "read"
}
