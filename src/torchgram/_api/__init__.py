"""The public functions, each a thin layer over the pipeline (``_api.pipeline``)."""
