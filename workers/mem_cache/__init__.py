"""KV memory: the paged KV pool, the per-request slot table, memory sizing, and the prefix caches
(radix tree, null cache). Pure bookkeeping over slot indices, apart from the pool's buffers."""
