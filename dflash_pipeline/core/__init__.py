"""The foundation every layer stands on: storage, the key layout, job state, config, job logging, GPU slots."""
