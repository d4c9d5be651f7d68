"""Client side: what PySpark tasks use to write and read exchanges."""
