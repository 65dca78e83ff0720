"""What a checkpoint is: the architecture adapter (the only place that knows attribute names) and loading."""
