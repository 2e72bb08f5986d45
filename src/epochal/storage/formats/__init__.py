"""The db formats behind one backend interface (``base``: ``DbBackend``, the ``db_type``
registry): the native format (``native/``), safetensors, the segment-streaming write loop both
share, and whole-db transfers to and from object storage (``remote``)."""
