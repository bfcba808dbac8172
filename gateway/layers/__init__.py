"""The gateway's cache layers, one package each, run in order by the pipeline."""
