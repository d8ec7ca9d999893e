"""delayqueue: each channel's store of deferred and often-retried messages (LMDB).

See README.md. The channel uses `delayqueue.store.DelayStore` from a worker thread.
"""

from delayqueue.store import (DelayedMessage, DelayStore, DelayStoreCorruptError,
                              DelayStoreError)

__all__ = ["DelayedMessage", "DelayStore", "DelayStoreCorruptError", "DelayStoreError"]
