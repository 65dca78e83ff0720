"""Many cells: manifests, atomic records, the resumable runner, presets, Slurm and the report."""
