"""What a person reads: the console of a run and of a sweep, and a failure told in one line."""
