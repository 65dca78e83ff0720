"""The default model and corpus names: the one place they are spelled (imports nothing).

The embedded SmolLM2-135M (:mod:`rope_quant.model.loading`) and the embedded ``pydoc`` corpus
(:mod:`rope_quant.experiment.data`) run everywhere offline; the run configuration, the CLI and the pytest
plugin default to them.
"""

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CORPUS = "pydoc"
