"""Phalanx: a gang coordinator for GPU training jobs (docs/design.md)."""

import os as _os

# Our processes fork children (subprocess with a preexec_fn, for the
# parent-death signal: phalanx/procs.py) while gRPC threads are busy. gRPC's
# fork handlers then run in the child and break the parent's event engine
# ("epoll_wait error: Bad file descriptor", then an abort). Every fork here is
# followed by exec, so gRPC's fork support is not needed: turn it off. It is
# read when grpc is first imported, so this package must be imported first
# (coordinator/, agent/, chaos/ and tests/ import it in their __init__).
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
