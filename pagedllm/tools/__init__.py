"""Planning, simulation, evaluation and workload generation."""
