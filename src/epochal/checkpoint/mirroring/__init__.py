"""The remote mirror of committed epochs: the transfers (``mirror``) and the handler's side of
keeping the mirror in step (``sync``: queue, retries, remote retention, pulls)."""
