"""Training inputs stored as TFRecord files: the schema, a reader per rank, and a writer."""
