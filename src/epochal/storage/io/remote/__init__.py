"""Object storage under the formats: any fsspec URL as a byte store (:mod:`.fsspec_store`),
a staged db's upload whole or not at all (:mod:`.uploads`), and compare-and-swap of small
objects (:mod:`.conditional`) for the lease and create-only manifests."""
