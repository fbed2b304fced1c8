"""The only code that talks to etcd (docs/style.md §5), by responsibility:

- ``keys``: the key layout of docs/etcd-keys.md (``Keys``, ``prefix_end``);
- ``ops``: records, compares, transaction operations and results (``KV``,
  ``Compare``, ``Put``, ``Delete``, ``Get``, ``TxnResult``, ``WatchEvent``);
- ``endpoints``: parsing etcd endpoints and choosing the current member
  (``EndpointRotation``);
- ``channels``: one gRPC channel per member, its options and metadata;
- ``errors``: what etcd's error answers mean (``classify``, ``translate``,
  ``Compacted``);
- ``lease``: keeping a lease alive on one stream (``LeaseKeepAlive``);
- ``client``: the ``Store`` itself (reads, transactions, watches, leases,
  space, compaction, failover between members).

Callers import from ``phalanx.store``, which re-exports the public names;
this package imports nothing at import time, so a module that needs only
the key layout or endpoint parsing loads no grpc.
"""
