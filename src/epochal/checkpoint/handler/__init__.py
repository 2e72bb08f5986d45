"""The metadata handler: the protocol (``metadata``) and the directory handler that commits
epochs and decides where to resume (``directory``), with its parts: each node's db entry of a
commit (``commit``), what may be deleted (``cleanup``), whether the next checkpoint fits
(``room``)."""
