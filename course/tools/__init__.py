"""What a learner or teacher runs: the doctor, the notebook runner, the lab tools, the course map, the CLI,
and the test suite's gate."""
