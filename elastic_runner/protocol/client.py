"""The one base of a store client, the agent's (``agent/store.py``'s ``AgentStore``) and the
worker's (``recovery/store_client.py``'s ``StoreClient``): the attempt's key prefix and its
keys in the store in use."""

from __future__ import annotations

import torch.distributed as dist

from .keys import AttemptKeys, join_key


class AttemptClient:
    """A client of the attempt's recovery store. A subclass provides :attr:`store` (the store
    in use) and :attr:`prefix` (this attempt's keys)."""

    prefix: str
    store: dist.Store

    def key(self, *parts: object) -> str:
        """The attempt's key ``<prefix>/<part>/...``."""
        return join_key(self.prefix, *parts)

    @property
    def attempt(self) -> AttemptKeys:
        """The attempt's keys in the store in use (:mod:`elastic_runner.protocol.keys`)."""
        return AttemptKeys(self.store, self.key)

    def keys_in(self, store: dist.Store) -> AttemptKeys:
        """The attempt's keys in ``store`` (another client of it, or another store: a moved
        one's successor)."""
        return AttemptKeys(store, self.key)
