"""A checkpoint location and what it holds: db and record names, manifests, the record stores
(local files or one object per record at a URL) with their lock and lease, the stats lines,
the read-only view of a location (``CheckpointDirectory``) and the pure rules over its epochs
(retention, metrics and best-k). The bottom of :mod:`epochal.checkpoint`: imports nothing
above it."""
