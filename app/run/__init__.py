"""The entry points the job scripts and the Python API share (api), and keras.Model.fit's arguments over them (fit)."""
