"""Hierarchical aggregation: topology model, tree planner, chunk routes."""
