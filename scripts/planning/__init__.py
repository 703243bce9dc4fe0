"""Capacity planning: `tune_ratio` measures P:D splits on a real cluster; `plan_capacity` profiles
a node, simulates splits (simulator, planner, sweep) and checks the model against traces."""
