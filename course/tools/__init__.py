"""What a learner or teacher runs: the doctor, the notebook runner, the lab tools, the course map,
the CLI, ``cell_times`` (time each cell of a notebook, live) and the test suite's gate."""
