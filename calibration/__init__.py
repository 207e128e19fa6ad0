"""Calibration: profile the executor, fit the simulator's step-cost model, validate sim against real."""
