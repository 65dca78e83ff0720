"""The cost plan of a run before any load: per-stage memory, disk and time (plan.py, plan_costs.py), the stage
names (stages.py) and the plan against this machine (memory_check.py)."""
