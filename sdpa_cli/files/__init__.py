"""Files → named numpy arrays: every format and its safety checks, case files, config files,
atomic writers. Knows nothing of attention."""
