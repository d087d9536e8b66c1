"""Reading through the proxy (issue 24, docs/consume.md): the pure core, no I/O.

- `acks`: per partition, what was delivered, acked, nacked, is due again or dead; the offset
  to commit (never past an unacknowledged record). Bounded memory (runs, a span limit).
- `assign`: the second rebalance: the partitions this proxy owns for a group spread over the
  client streams attached to it; sticky, minimal moves.
- `source`: which region a topic is read from (its policy rule and the primary), the
  settings a stream gets, and the switch to a new primary as a state machine.

None of these imports grpc or Kafka clients (import-linter contract): the server wiring,
the Kafka group member and the SDK build on them.
"""
