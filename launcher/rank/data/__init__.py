"""Training inputs stored as TFRecord files: the schema, a reader per rank, and a writer; ImageNet's
usual JPEG records read as they are (imagenet.py); BraTS NIfTI folders converted (brats.py)."""
