"""The native reader's read paths, one module each, siblings that never import one another
(the general fill may hand big segments to the parallel reader; ranged reads decode coded
segments): :mod:`.batch` (many small arrays), :mod:`.inplace` (straight into live memory),
:mod:`.parallel` (big segments over threads), :mod:`.fill` (the general fill), :mod:`.mapped`
(read-only views of a memory map), :mod:`.coded` (compressed segments) and :mod:`.ranges`
(byte ranges of one blob, for partial and resharded loads)."""
