"""infersim simulator: scenario schema, catalogs, policy objects, step-cost models and the SimPy cluster."""
