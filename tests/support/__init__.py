"""Helpers shared by the test suites: hand-built inventories and Kubernetes schema checks."""
