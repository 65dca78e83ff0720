"""One cell: its configuration and the quantised-model pipeline."""
