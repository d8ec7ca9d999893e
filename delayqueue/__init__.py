"""delayqueue: each channel's store of deferred and often-retried messages (LMDB).

See README.md. The channel uses `delayqueue.store.DelayStore` from a worker thread.
"""

from delayqueue.entry import DelayedMessage
from delayqueue.store import DelayStore, DelayStoreCorruptError, DelayStoreError

__all__ = ["DelayedMessage", "DelayStore", "DelayStoreCorruptError", "DelayStoreError"]
