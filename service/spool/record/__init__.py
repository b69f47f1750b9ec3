"""One record of the spool (Contract 1): `meta`, its `.json` (`RecordMeta`, safe names, dtypes), and `writer`, its
writing side (`RecordWriter`). Nothing is imported here: `service.spool` exports both classes."""
