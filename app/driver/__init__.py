"""The driver's steps every backend shares: join or start Ray, check before anything starts, decide a resume,
write the outputs."""
