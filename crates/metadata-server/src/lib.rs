//! `sanfs-mds`: owns the namespace, every file's extent map, the allocator, sessions and
//! grants. Every change is one durable transaction.
