"""Same-node reads: a client reading its sidecar's spool itself. `spool`: the check that it is the same spool and a
safe read of one record (`LocalSpool`); `reads`: one client's use of it (`LocalReads`: on or off, reads, batch
splits, the counts reported). Nothing is imported here; the clients take both from their modules."""
