"""What runs where the nodes live: the picklable save/load steps (``steps``), the background
saver (``background``), the seed's checkpoint managers that build the tasks (``manager``) and
the tasks that own their results (``handles``), what both managers say to the handler
(``handler_calls``) and the upload builders (``upload``)."""
