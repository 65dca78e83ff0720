"""One cell: configuration, the quantised-model pipeline, corpora and perplexity."""
