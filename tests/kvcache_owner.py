"""A KVCacheManager plus the token ids its owner keeps: the role the engine's Sequence plays, for tests that
drive the manager directly (append_slots takes the new ids here so that mark_computed can hash them)."""

from __future__ import annotations

from kvcache import KVCacheManager


class OwnedKV(KVCacheManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ids: dict[object, list[int | None]] = {}

    def allocate(self, seq_id, token_ids, keep_free=0, cache_salt=None):
        table = super().allocate(seq_id, token_ids, keep_free=keep_free, cache_salt=cache_salt)
        if table is not None:
            self.ids[seq_id] = list(token_ids)
        return table

    def append_slots(self, seq_id, n, token_ids=None):
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"{len(token_ids)} token ids for {n} slots")
        ok = super().append_slots(seq_id, n)
        if ok:
            self.ids[seq_id] += list(token_ids) if token_ids is not None else [None] * n
        return ok

    def mark_computed(self, seq_id, num_tokens):
        """Hashes up to the first unknown id (the owner learns it later)."""
        ids = self.ids.get(seq_id, [])
        known = ids.index(None) if None in ids else len(ids)
        if num_tokens > known and num_tokens <= len(ids):
            num_tokens = known
        super().mark_computed(seq_id, num_tokens, ids)

    def fork(self, parent_id, child_id):
        copies = super().fork(parent_id, child_id)
        if copies is not None:
            self.ids[child_id] = list(self.ids[parent_id])
        return copies

    def free(self, seq_id):
        super().free(seq_id)
        del self.ids[seq_id]
