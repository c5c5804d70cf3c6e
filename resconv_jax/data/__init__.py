"""Data sets: synthetic theory data, Jena Climate, and their tfds builders."""
